"""A course graded at once (no --assignment): each student's chapter notebooks are scored out of their own
assignment, with a course total per student that pastes into a gradebook; a late penalty reads as words."""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path

import pytest
from test_grading_cli import landlock_or_not  # noqa: F401 (a fixture)
from test_grading_gradescope import notebook

from lab.grading import grade

REPO = Path(__file__).resolve().parents[1]
SOLUTIONS = REPO / "solutions"
A1, A8 = ["01.param_count", "01.state_bytes"], ["08.layout_memory"]  # 5 and 5 points, fast calculations


@pytest.fixture
def course_file(tmp_path) -> str:
    """Two assignments; chapter 08b's exercises belong to none."""
    path = tmp_path / "assignments.toml"
    path.write_text(f'[A1]\ntitle = "one"\nexercises = {json.dumps(A1)}\ndue = 2026-10-09T23:59:00Z\n'
                    f'late_penalty_per_day = 0.1\nmax_late_days = 3\n\n'
                    f'[A8]\ntitle = "eight"\nexercises = {json.dumps(A8)}\n')
    return str(path)


def _rows(text: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(text)))


@pytest.mark.usefixtures("landlock_or_not")
def test_a_students_chapter_notebooks_are_each_scored_out_of_their_assignment(tmp_path, course_file):
    subs = tmp_path / "subs"
    notebook(subs / "ada" / "01_memory_and_compute.ipynb", A1)
    notebook(subs / "ada" / "08_5d_parallelism.ipynb", A8, SOLUTIONS / "08_5d_parallelism.ipynb")
    notebook(subs / "ada" / "08b_checkpoints_and_failures.ipynb", ["08b.reshard_reads"],
             SOLUTIONS / "08b_checkpoints_and_failures.ipynb")  # in no assignment: chapter 08b's 18 points
    notebook(subs / "bob.ipynb", A1, REPO / "exercises" / "01_memory_and_compute.ipynb")  # blank; nothing else
    args = [str(subs), "--assignments", course_file, "--quiet", "--strict", "--seed-secret", "s3cret"]
    out = [tmp_path / name for name in ("a.csv", "a-totals.csv", "b.csv", "b-totals.csv")]
    feedback = ["--feedback-dir", str(tmp_path / "fb")]
    assert grade.main([*args, "--out", str(out[0]), "--totals", str(out[1]), *feedback]) == 0
    assert grade.main([*args, "--out", str(out[2]), "--totals", str(out[3])]) == 0
    assert (out[0].read_bytes(), out[1].read_bytes()) == (out[2].read_bytes(), out[3].read_bytes())
    rows = [(r["student"], r["assignment"], r["raw"], r["multiplier"], r["total"], r["max"])
            for r in _rows(out[0].read_text())]
    assert rows == [("ada", "A1", "5", "1", "5", "5"), ("ada", "A8", "5", "1", "5", "5"),
                    ("ada", "ch08b", "4", "1", "4", "18"), ("bob", "A1", "0", "1", "0", "5")]
    assert _rows(out[0].read_text())[1]["01.param_count"] == ""  # not part of A8
    assert out[1].read_text() == "student,A1,A8,ch08b,total,max\nada,5,5,4,14,28\nbob,0,0,0,0,28\n"
    assert sorted(p.name for p in (tmp_path / "fb").iterdir()) == ["ada-A1.html", "ada-A8.html", "ada-ch08b.html",
                                                                   "bob-A1.html"]


def test_two_notebooks_for_one_assignment_are_the_warning_case(tmp_path, course_file, capsys):
    subs = tmp_path / "subs"
    notebook(subs / "ada" / "first.ipynb", A1, REPO / "exercises" / "01_memory_and_compute.ipynb")
    shutil.copy(subs / "ada" / "first.ipynb", subs / "ada" / "second.ipynb")
    notebook(subs / "ada" / "08.ipynb", A8, REPO / "exercises" / "08_5d_parallelism.ipynb")  # another assignment
    assert grade.main([str(subs), "--assignments", course_file, "--quiet", "--seed-secret", "s",
                       "--out", str(tmp_path / "g.csv")]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "notebooks belong to" in line]
    assert len(warnings) == 1 and "2 notebooks belong to student 'ada' for A1" in warnings[0], warnings
    rows = [(r["student"], r["assignment"]) for r in _rows((tmp_path / "g.csv").read_text())]
    assert rows == [("ada", "A8"), ("ada/first", "A1"), ("ada/second", "A1")]


@pytest.mark.usefixtures("landlock_or_not")
def test_a_late_penalty_reads_as_words_and_its_columns_are_separate(tmp_path, course_file, capsys):
    subs = tmp_path / "subs"
    for student in ("late", "very_late"):
        notebook(subs / f"{student}.ipynb", A1)
    (tmp_path / "times.csv").write_text("student,submitted_at\nlate,2026-10-11T10:00:00Z\n"
                                        "very_late,2026-10-14T10:00:00Z\n")  # 2 days: x0.8; 5 days: beyond 3
    assert grade.main([str(subs), "--assignment", "A1", "--assignments", course_file, "--strict", "--quiet",
                       "--seed-secret", "s3cret", "--submission-times", str(tmp_path / "times.csv"),
                       "--out", str(tmp_path / "g.csv"), "--feedback-dir", str(tmp_path / "fb")]) == 0
    rows = {r["student"]: (r["raw"], r["late_days"], r["multiplier"], r["total"], r["max"])
            for r in _rows((tmp_path / "g.csv").read_text())}
    assert rows == {"late": ("5", "2", "0.8", "4", "5"), "very_late": ("5", "5", "0", "0", "5")}
    assert "Score: 0 / 5 points (5 days late, beyond the 3 allowed: scored 0)" in \
        (tmp_path / "fb" / "very_late.html").read_text()
    assert "Score: 4 / 5 points (2 days late: 5 x 0.8)" in (tmp_path / "fb" / "late.html").read_text()
    assert grade.main([str(subs / "very_late.ipynb"), "--assignment", "A1", "--assignments", course_file,
                       "--seed-secret", "s3cret", "--submission-times", str(tmp_path / "times.csv")]) == 0
    assert "Score: 0 / 5 points (5 days late, beyond the 3 allowed: scored 0)" in capsys.readouterr().out
