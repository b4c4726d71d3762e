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
_HEADER = ('"""Written by `python -m lab release` from solutions/ (see `lab.grading.locked`): each exercise\'s '
           'locked cells\'\nchecksums, in notebook order. Do not edit."""\n\n')
_EARLIER = ("# Earlier releases' checksums of the exercises whose locked cells changed since (an erratum in a\n"
            "# statement): a learner may hold any released copy, and its locked cells are still the course's own.\n")


def from_notebooks(folder: Path) -> dict[str, list[str]]:
    """Each exercise's locked-cell checksums in the notebooks of `folder` (solutions/ or exercises/ alike: the
    checksum leaves out what the release adds); {} for a folder that is not there."""
    out: dict[str, list[str]] = {}
    for path in sorted(folder.glob("*.ipynb")) if folder.is_dir() else []:
        nb = read(path)
        for exercise_id in exercise_ids(nb):
            out[exercise_id] = locked_checksums(nb, exercise_id)
    return out


def _record_module() -> object | None:
    try:
        return importlib.import_module("lab.grading.locked_cells")
    except ModuleNotFoundError:
        return None


def released() -> dict[str, list[str]]:
    """The checksums the last release recorded in this package ({} before the first)."""
    module = _record_module()
    return {key: list(value) for key, value in getattr(module, "CHECKSUMS", {}).items()}


def _earlier() -> dict[str, list[list[str]]]:
    """The checksums of earlier releases the record keeps (`with_history`), by exercise."""
    return getattr(_record_module(), "EARLIER", {})


def accepted() -> dict[str, list[list[str]]]:
    """Every version of each exercise's locked cells a learner may hold: the last release's, then earlier ones.

    A statement corrected after a notebook was handed out must not turn the copies already handed out into
    "edited" ones: their locked cells are what the course released."""
    earlier = _earlier()
    return {key: [value, *earlier.get(key, [])] for key, value in released().items()}


def with_history(new: dict[str, list[str]], old: dict[str, list[str]],
                 earlier: dict[str, list[list[str]]]) -> dict[str, list[list[str]]]:
    """`earlier` after a release of `new` over `old`: each exercise's previous checksums join its history when they
    change; a version released again (a reverted erratum) is current, not history."""
    out = {key: [list(v) for v in versions] for key, versions in earlier.items()}
    for key, sums in old.items():
        if new.get(key) != sums and sums not in out.setdefault(key, []):
            out[key].append(list(sums))
    for key in new:
        if key in out:
            out[key] = [v for v in out[key] if v != new[key]]
    return {key: versions for key, versions in sorted(out.items()) if versions}


def record(solutions: Path, check_only: bool = False) -> list[Path]:
    """Write `solutions`' checksums to RECORD, keeping the earlier releases' (`with_history`); return [RECORD]
    when it changed (or would, with `check_only`). Only the course's own solutions/ are recorded: a test's or a
    draft's folder must not rewrite the package."""
    if solutions.resolve() != REPO / "solutions":
        return []
    new = from_notebooks(solutions)
    earlier = with_history(new, released(), _earlier())
    text = _HEADER + "CHECKSUMS = " + json.dumps(new, indent=4, sort_keys=True) + "\n"
    if earlier:
        text += "\n" + _EARLIER + "EARLIER = " + json.dumps(earlier, indent=4, sort_keys=True) + "\n"
    if RECORD.exists() and RECORD.read_text(encoding="utf-8") == text:
        return []
    if not check_only:
        RECORD.write_text(text, encoding="utf-8")
    return [RECORD]
