"""The worked problems of chapters 01–07 (issue 21: "≥ 60 worked problems counted by a test").

Each chapter's exercise notebook ends with a "Problems" section: exercise `NN.problems`, one answer cell, one check
and one worked solution per problem. This counts them and holds the three in step, so that a problem cannot lose its
check (graded for nothing) or its worked solution (nothing to hand out after the due date).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lab.grading import checks
from lab.grading.notebook import is_answer, is_locked, meta, read

REPO = Path(__file__).resolve().parents[1]
CHAPTERS = ("01", "02", "03", "04", "05", "06", "07")


def _problems(chapter: str) -> tuple[list, list, list]:
    """(answer cells, worked-solution cells, checks) of chapter's `NN.problems`."""
    path, = (REPO / "solutions").glob(f"{chapter}_*.ipynb")
    cells = [c for c in read(path).cells if meta(c).get("exercise") == f"{chapter}.problems"]
    exercise = checks.load_all().get(f"{chapter}.problems")
    return ([c for c in cells if is_answer(c)], [c for c in cells if meta(c).get("worked")],
            exercise.checks if exercise else [])


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_problem_has_a_statement_an_answer_a_check_and_a_worked_solution(chapter):
    answers, worked, problem_checks = _problems(chapter)
    assert len(answers) >= 8, f"chapter {chapter}: {len(answers)} problems, expected at least 8"
    assert len(answers) == len(worked) == len(problem_checks), \
        f"chapter {chapter}: {len(answers)} answer cells, {len(worked)} worked solutions, {len(problem_checks)} checks"
    path, = (REPO / "solutions").glob(f"{chapter}_*.ipynb")
    statements = [c for c in read(path).cells if is_locked(c, f"{chapter}.problems") and c.cell_type == "markdown"]
    assert len(statements) >= len(answers), f"chapter {chapter}: a problem without its locked statement"
    for cell in worked:  # a worked solution works the numbers through, not just the formula
        assert any(ch.isdigit() for ch in cell.source) and len(cell.source) > 80, cell.source


def test_at_least_sixty_problems_across_chapters_01_to_07():
    count = sum(len(_problems(chapter)[2]) for chapter in CHAPTERS)
    assert count >= 60, f"{count} worked problems in chapters 01–07, expected at least 60"
