"""What every chapter's grading tests share: grading a solution cell (or a mutant of it) in the sandbox, and the
four tests each chapter's checks must pass.

A chapter's test file describes its exercises and its mutants — the solution cell with one classic mistake, and
the checks that must catch it — and takes the standard tests::

    CHAPTER = Chapter("06_pipeline_parallel.ipynb", EXERCISES, MUTANTS)
    globals().update(chapter_tests(CHAPTER))

which are

* `test_solutions_score_full_marks[secret]`: every exercise's solution scores all its points, with the public
  inputs and with a class secret;
* `test_released_stubs_score_nothing_and_say_not_attempted`: `python -m lab release`'s stubs score 0 and say so;
* `test_mutant_fails_its_check[name]`: a mutant fails exactly the checks named for it (only those run, to keep
  this fast; with `isolated`, every check runs, so that no other check fails too with a hint written for another
  mistake, and each failed check shows its own hint), as check verdicts — never as a dead sandbox — with messages
  that say what came back and what was expected;
* `test_every_exercise_has_a_mutant_and_every_check_catches_one`: a check that goes soft fails here, not in a
  classroom.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pytest

from lab.grading import checks
from lab.grading.checks import CRASH_HINT
from lab.grading.notebook import answer_parts, read
from lab.grading.release import release_notebook
from lab.grading.runner import ExerciseResult, run_exercise

REPO = Path(__file__).resolve().parents[1]
SECRETS = [None, "class-of-2026"]

# name: (exercise, [(old, new) in its solution cell, each found exactly once], names of the checks that must fail)
Mutants = dict[str, tuple[str, list[tuple[str, str]], set[str]]]


@dataclass
class Chapter:
    notebook: str  # its file name in solutions/
    exercises: tuple[str, ...]  # every exercise of the chapter
    mutants: Mutants
    wall_s: float = 60  # a sandbox's budget
    hangs: Collection[str] = ()  # mutants whose ranks wait forever for a message: graded with a third of the budget
    said: tuple[str, ...] = ("returned",)  # a failed check's message has one of these words, and "expected"
    released_stubs: bool = True  # whether to test the released stubs here
    isolated: bool = False  # mutants run every check of their exercise: only theirs may fail

    @property
    def number(self) -> str:
        return self.notebook.split("_")[0]  # "08", "08b"

    @cached_property
    def solutions(self):
        return read(REPO / "solutions" / self.notebook)

    def grade(self, exercise_id: str, replace: list[tuple[str, str]] = (), *, secret: str | None = None,
              only: Collection[str] | None = None, notebook=None, wall_s: float | None = None) -> ExerciseResult:
        """Grade `exercise_id`'s answer cells of `notebook` (the solutions by default) after the cells it requires,
        with each (old, new) of `replace` applied in the one cell that holds `old` (a chapter's problems span a cell
        each), running only the checks named in `only` (all when None)."""
        notebook = self.solutions if notebook is None else notebook
        ex = checks.get(exercise_id)
        if only is not None:
            ex = dataclasses.replace(ex, checks=[c for c in ex.checks if c.name in only])
        parts = [part for i in ex.requires for part in answer_parts(notebook, i)]
        own = answer_parts(notebook, exercise_id)
        for old, new in replace:
            hits = [i for i, (_, source) in enumerate(own) if old in source]
            assert len(hits) == 1 and own[hits[0]][1].count(old) == 1, \
                f"mutant does not apply once: {old!r} in the {exercise_id} solution"
            label, source = own[hits[0]]
            own[hits[0]] = (label, source.replace(old, new))
        return run_exercise(ex, [*parts, *own], secret=secret, wall_s=wall_s or self.wall_s)

    def cell(self, exercise_id: str) -> str:
        """The source of `exercise_id`'s solution cells, one after the other."""
        return "\n".join(source for _, source in answer_parts(self.solutions, exercise_id))


def chapter_tests(chapter: Chapter) -> dict[str, Callable]:
    """The standard tests of `chapter`, by name, for its test module's namespace (see the module's docstring)."""

    @pytest.mark.parametrize("secret", [pytest.param(s, marks=pytest.mark.slow) if s else s for s in SECRETS])
    def test_solutions_score_full_marks(secret):
        for exercise_id in chapter.exercises:
            result = chapter.grade(exercise_id, secret=secret)
            failed = [(c.name, c.message) for c in result.checks if c.status != "passed"]  # in full: pytest cuts
            assert result.points == result.max_points == checks.get(exercise_id).points, \
                f"{exercise_id}: {result.points}/{result.max_points} ({result.reason}); failed: {failed}"

    def test_released_stubs_score_nothing_and_say_not_attempted():
        released = release_notebook(chapter.solutions, chapter.notebook)
        for exercise_id in chapter.exercises:
            result = chapter.grade(exercise_id, notebook=released)
            assert result.points == 0 and result.status == "not attempted", result

    @pytest.mark.parametrize("name", chapter.mutants)
    def test_mutant_fails_its_check(name):
        exercise_id, replace, must_fail = chapter.mutants[name]
        wall_s = chapter.wall_s / 3 if name in chapter.hangs else chapter.wall_s
        result = chapter.grade(exercise_id, replace, only=None if chapter.isolated else must_fail, wall_s=wall_s)
        failed = {c.name: c.message for c in result.checks if c.status == "failed"}
        assert set(failed) == must_fail, f"{name}: expected {must_fail} to fail, failed: {failed} ({result.reason})"
        assert not result.reason and result.points == result.max_points - sum(
            c.max_points for c in result.checks if c.name in must_fail), result  # check verdicts, not a dead sandbox
        own = {c.name: c.hint for c in checks.get(exercise_id).checks}
        assert not chapter.isolated or all(c.hint in (own[c.name], CRASH_HINT) for c in result.checks
                                           if c.name in must_fail), result  # written for this mistake, or a raise
        for message in failed.values():  # says what came back (or what was raised) and what was due
            assert any(word in message for word in chapter.said) and "expected" in message, message

    def test_every_exercise_has_a_mutant_and_every_check_catches_one():
        ours = [ex for ex in checks.load_all().values() if ex.chapter == chapter.number]
        assert {ex.id for ex in ours} == set(chapter.exercises)
        mutated = {exercise_id for exercise_id, _, _ in chapter.mutants.values()}
        caught = {name for _, _, names in chapter.mutants.values() for name in names}
        for ex in ours:
            assert ex.id in mutated, f"{ex.id}: no mutant"
            assert {c.name for c in ex.checks} <= caught, f"{ex.id}: a check that no mutant exercises"

    tests = [test_solutions_score_full_marks, test_mutant_fails_its_check,
             test_every_exercise_has_a_mutant_and_every_check_catches_one]
    if chapter.released_stubs:
        tests.insert(1, test_released_stubs_score_nothing_and_say_not_attempted)
    return {test.__name__: test for test in tests}
