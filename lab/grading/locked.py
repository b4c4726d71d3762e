"""The locked cells' checksums a notebook is compared with, one source for `python -m lab check` and `grade`.

A learner has no solutions/, yet `python -m lab check` must give the verdict `python -m lab grade` will: so
`python -m lab release` records the checksums of every exercise's locked cells in solutions/ in the package
itself (`locked_cells.py`, written by `record`), and both commands read that record unless an instructor points
`grade --solutions` at notebooks. A module rather than a data file: every install of `lab` carries its modules,
and `release --check` fails when the record is older than solutions/.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from lab.grading.assignments import REPO
from lab.grading.notebook import exercise_ids, locked_checksums, read

RECORD = Path(__file__).with_name("locked_cells.py")
_HEADER = '"""Written by `python -m lab release` from solutions/ (see `lab.grading.locked`): each exercise\'s ' \
          'locked cells\'\nchecksums, in notebook order. Do not edit."""\n\nCHECKSUMS = '


def from_notebooks(folder: Path) -> dict[str, list[str]]:
    """Each exercise's locked-cell checksums in the notebooks of `folder` (solutions/ or exercises/ alike: the
    checksum leaves out what the release adds); {} for a folder that is not there."""
    out: dict[str, list[str]] = {}
    for path in sorted(folder.glob("*.ipynb")) if folder.is_dir() else []:
        nb = read(path)
        for exercise_id in exercise_ids(nb):
            out[exercise_id] = locked_checksums(nb, exercise_id)
    return out


def released() -> dict[str, list[str]]:
    """The checksums the last release recorded in this package ({} before the first)."""
    try:
        module = importlib.import_module("lab.grading.locked_cells")
    except ModuleNotFoundError:
        return {}
    return {key: list(value) for key, value in module.CHECKSUMS.items()}


def record(solutions: Path, check_only: bool = False) -> list[Path]:
    """Write `solutions`' checksums to RECORD; return [RECORD] when it changed (or would, with `check_only`).
    Only the course's own solutions/ are recorded: a test's or a draft's folder must not rewrite the package."""
    if solutions.resolve() != REPO / "solutions":
        return []
    text = _HEADER + json.dumps(from_notebooks(solutions), indent=4, sort_keys=True) + "\n"
    if RECORD.exists() and RECORD.read_text(encoding="utf-8") == text:
        return []
    if not check_only:
        RECORD.write_text(text, encoding="utf-8")
    return [RECORD]
