"""Every exercise id the course mentions exists: a learner told to run `lab.check("03.bucketed_ddp")` when the
exercise is `03.bucketed_dp` gets an error instead of a grade.

The exercises are defined by the `lab` metadata of the cells in `solutions/` (what `lab release` and the
grader read); the chapters, the exercise notebooks, the solutions and the course's Markdown may only name those.
"""

import functools
import re
from pathlib import Path

import nbformat
import pytest

from lab.grading.notebook import exercise_ids

ROOT = Path(__file__).parents[1]
# "03.bucketed_dp": two digits, a dot, a lower-case name; not part of a longer number or name ("1.03.x", "v03.x")
EXERCISE_ID = re.compile(r"(?<![\w.-])\d\d[a-z]?\.[a-z][a-z0-9_]*\b")
SOURCES = sorted([*ROOT.glob("chapters/*.ipynb"), *ROOT.glob("solutions/*.ipynb"), *ROOT.glob("exercises/*.ipynb"),
                  *ROOT.glob("course/*.md"), ROOT / "README.md"])


@functools.cache
def defined_ids() -> frozenset[str]:
    notebooks = (nbformat.read(path, as_version=4) for path in ROOT.glob("solutions/*.ipynb"))
    return frozenset(i for nb in notebooks for i in exercise_ids(nb))


def text_of(path: Path) -> str:
    if path.suffix == ".ipynb":
        nb = nbformat.read(path, as_version=4)
        return "\n".join([c.source for c in nb.cells] + [str(c.get("metadata", {})) for c in nb.cells])
    return path.read_text()


def test_the_pattern_finds_ids_and_nothing_else():
    text = 'lab.check("03.bucketed_dp"), 01.mfu. Not 0.25 MiB, 16.6 GB, v1.03.x, 02_collectives.ipynb or 12.3.'
    assert EXERCISE_ID.findall(text) == ["03.bucketed_dp", "01.mfu"]


def test_there_are_exercises():
    assert len(defined_ids()) >= 30 and "03.bucketed_dp" in defined_ids()


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_exercise_id_mentioned_exists(path):
    unknown = sorted(set(EXERCISE_ID.findall(text_of(path))) - defined_ids())
    assert not unknown, f"{path.relative_to(ROOT)} names exercises that do not exist: {unknown}"
