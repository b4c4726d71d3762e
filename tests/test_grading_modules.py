"""A sandbox carries only the `lab` modules its exercise lists (`Exercise.modules`): each of them must import no
other part of `lab`, or graded code that calls it dies of a ModuleNotFoundError that is the course's fault, not
the student's (as 08.fix_config's solution did when lab.config began to import lab.calc for a table). `lab.layout`,
which imports nothing, goes into every sandbox."""

from __future__ import annotations

import pytest

from lab.grading import checks
from lab.grading.sandbox import ALWAYS_CARRIED
from tests.test_import_directions import lab_imports, within

GRAPH = lab_imports()


def _carried(modules: tuple[str, ...]) -> list[str]:
    """The modules a sandbox's copy of `lab` holds: each listed module, or every module of a listed package."""
    return [name for name in GRAPH if within(name, modules)]


@pytest.mark.parametrize("exercise_id", sorted(checks.load_all()))
def test_the_modules_a_sandbox_carries_import_only_each_other(exercise_id):
    modules = (*checks.get(exercise_id).modules, *ALWAYS_CARRIED)
    missing = [str(imp) for name in _carried(modules) for imp in GRAPH[name]
               if within(imp.imported, ("lab",)) and imp.imported != "lab" and not within(imp.imported, modules)]
    assert not missing, f"{exercise_id} carries {modules}, but {'; '.join(missing)}"


def test_what_every_sandbox_carries_brings_nothing_along():
    found = [str(imp) for name in _carried(ALWAYS_CARRIED) for imp in GRAPH[name]
             if within(imp.imported, ("lab",)) and not within(imp.imported, ALWAYS_CARRIED)]
    assert not found, f"every sandbox carries {ALWAYS_CARRIED}, but {'; '.join(found)}"
