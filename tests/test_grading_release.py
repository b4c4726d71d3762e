"""`python -m lab release`: exercises/ is what solutions/ releases, byte for byte; errors name the cell."""

from __future__ import annotations

import copy
from pathlib import Path

import nbformat
import pytest

from lab.grading import assignments as course
from lab.grading import release
from lab.grading.notebook import BEGIN, END, checksum, exercise_ids, is_answer, is_locked, meta, read

REPO = Path(__file__).resolve().parents[1]
SOLUTION = REPO / "solutions" / "01_memory_and_compute.ipynb"


def test_exercises_folder_is_up_to_date():
    stale = release.release(REPO / "solutions", REPO / "exercises", check_only=True)
    assert not stale, f"{[str(p) for p in stale]} out of date: run `python -m lab release` and commit the result"


def test_release_is_deterministic(tmp_path):
    every = sorted(tmp_path / p.name for p in (REPO / "solutions").glob("*.ipynb"))
    assert sorted(release.release(REPO / "solutions", tmp_path)) == every
    first = [p.read_bytes() for p in every]
    assert release.release(REPO / "solutions", tmp_path) == []
    assert [p.read_bytes() for p in every] == first


def test_released_notebook_hides_solutions_and_locks_statements():
    nb = release.release_notebook(read(SOLUTION), SOLUTION.name)
    answers = [c for c in nb.cells if is_answer(c)]
    assert list(dict.fromkeys(meta(c)["exercise"] for c in answers)) == exercise_ids(read(SOLUTION))
    assert len(answers) == sum(is_answer(c) for c in read(SOLUTION).cells)  # the problems: a cell each
    for cell in answers:
        assert BEGIN not in cell.source and END not in cell.source
        assert f'raise NotImplementedError("exercise {meta(cell)["exercise"]}")' in cell.source
        assert "def " in cell.source  # the stub sits inside the function the learner completes
    for cell in (c for c in nb.cells if is_locked(c)):
        assert cell.metadata["lab"]["checksum"] == checksum(cell) and cell.metadata["editable"] is False
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code")


def _one_cell_notebook(source: str, **lab) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(source, id="answer")
    cell.metadata["lab"] = lab
    return nbformat.v4.new_notebook(cells=[cell])


@pytest.mark.parametrize("source, lab, message", [
    (f"def f():\n    {BEGIN}\n    return 1\n", {"exercise": "01.param_count", "points": 4}, "never closed"),
    (f"def f():\n    return 1\n    {END}\n", {"exercise": "01.param_count", "points": 4}, f"{END} without"),
    ("def f():\n    return 1\n", {"exercise": "01.param_count", "points": 4}, "has no ### BEGIN SOLUTION"),
    (f"{BEGIN}\n{BEGIN}\n{END}\n", {"exercise": "01.param_count", "points": 4}, "inside another"),
    (f"{BEGIN}\nx = 1\n{END}\n", {"exercise": "01.param_count", "points": 3}, "points=3 for 01.param_count but"),
    (f"{BEGIN}\nx = 1\n{END}\n", {"exercise": "01.nope", "points": 1}, "'01.nope' has no checks"),
    (f"{BEGIN}\nx = 1\n{END}\n", {}, "solution markers outside an answer cell"),
])
def test_release_errors_name_the_cell_and_the_rule(source, lab, message):
    with pytest.raises(ValueError, match="t.ipynb cell 0") as error:
        release.release_notebook(_one_cell_notebook(source, **lab), "t.ipynb")
    assert message in str(error.value) and "\n" not in str(error.value)


def test_stub_keeps_the_indentation_and_the_rest_of_the_cell():
    source = f"import math\n\ndef f(x):\n    y = 1\n    {BEGIN}\n    return x\n    {END}\n"
    stub = release._stub(source, "01.param_count", "t")
    assert stub == ("import math\n\ndef f(x):\n    y = 1\n    # YOUR CODE HERE\n"
                    '    raise NotImplementedError("exercise 01.param_count")')


def test_assignment_handout_keeps_only_its_exercises(tmp_path):
    toml = tmp_path / "assignments.toml"
    toml.write_text('[A0]\ntitle = "warm-up"\nexercises = ["01.param_count", "01.state_bytes"]\n')
    assert release.main(["--solutions", str(REPO / "solutions"), "--assignment", "A0", "--assignments", str(toml),
                         "--out", str(tmp_path / "handout")]) == 0
    nb = read(tmp_path / "handout" / SOLUTION.name)
    assert exercise_ids(nb) == ["01.param_count", "01.state_bytes"]
    assert {meta(c).get("exercise") for c in nb.cells} == {None, "01.param_count", "01.state_bytes"}
    assert nb.metadata["lab"]["assignment"] == "A0"


@pytest.mark.parametrize("text, message", [
    ('[A]\nexercises = ["01.nope"]\n', "unknown exercise '01.nope'"),
    ('[A]\nexercises = ["01.mfu"]\n', "01.mfu, which builds on 01.param_count"),
    ('[A]\nexercises = []\ndue = "friday"\n', "due='friday' must be a TOML date-time"),
    ('[A]\nexercises = []\npoints = 3\n', "unknown key(s) points"),
])
def test_assignments_file_errors(tmp_path, text, message):
    (tmp_path / "a.toml").write_text(text)
    with pytest.raises(ValueError, match="a.toml") as error:
        course.load(tmp_path / "a.toml")
    assert message in str(error.value)


def test_late_policy():
    a1 = course.get("A1")
    assert a1.late(a1.due) == (0, 1.0)
    assert a1.late(a1.due + course.dt.timedelta(hours=30)) == (2, pytest.approx(0.8))
    assert a1.late(a1.due + course.dt.timedelta(days=4)) == (4, 0.0)


def test_release_cli(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert release.main(["--check"]) == 0 and "up to date" in capsys.readouterr().out
    broken = copy.deepcopy(read(SOLUTION))
    next(c for c in broken.cells if is_answer(c)).metadata["lab"]["points"] = 99
    nbformat.write(broken, tmp_path / SOLUTION.name)
    assert release.main(["--solutions", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m lab release: error: ") and len(err.strip().splitlines()) == 1
    assert release.main(["--assignment", "A1"]) == 2 and "needs --out" in capsys.readouterr().err


def test_entry_names_are_unique_across_exercises():
    """`lab.check()` finds a notebook's chapters by the functions it defines: an entry name shared by two
    exercises (chapter 09's matmul driver was once `run_matmul`, chapter 02's entry) makes a notebook count as
    both chapters."""
    from lab.grading import checks

    owners: dict[str, str] = {}
    for exercise in checks.load_all().values():
        for name in exercise.entry:
            assert name not in owners, f"entry {name!r} of {exercise.id} is also {owners[name]}'s"
            owners[name] = exercise.id


def _problems_notebook(first_points: float, second_points: float) -> nbformat.NotebookNode:
    """01.param_count (4 points) answered over two cells, each followed by its worked solution."""
    cells = []
    for name, points in (("a", first_points), ("b", second_points)):
        source = f"def {name}():\n    {BEGIN}\n    return 1\n    {END}\n"
        answer = nbformat.v4.new_code_cell(source, id=f"answer-{name}")
        answer.metadata["lab"] = {"exercise": "01.param_count", "points": points}
        worked = nbformat.v4.new_markdown_cell(f"{name}: one, because ...", id=f"worked-{name}")
        worked.metadata["lab"] = {"exercise": "01.param_count", "worked": True}
        cells += [answer, worked]
    return nbformat.v4.new_notebook(cells=cells)


def test_worked_solutions_are_released_only_when_asked():
    nb = _problems_notebook(1, 3)
    before = release.release_notebook(nb, "t.ipynb")
    assert [c.cell_type for c in before.cells] == ["code", "code"]
    assert all("NotImplementedError" in c.source for c in before.cells)
    after = release.release_notebook(nb, "t.ipynb", worked=True)
    assert [c.cell_type for c in after.cells] == ["code", "markdown", "code", "markdown"]
    worked = [c.source for c in after.cells if c.cell_type == "markdown"]
    assert worked == ["a: one, because ...", "b: one, because ..."]


def test_points_of_an_exercise_over_several_cells_add_up():
    with pytest.raises(ValueError, match=r"t.ipynb cell 0: points=5 for 01.param_count but its checks give 4"):
        release.release_notebook(_problems_notebook(2, 3), "t.ipynb")
    bad = _problems_notebook(1, 3)
    bad.cells[1] = nbformat.v4.new_code_cell("x = 1", id="worked-code")
    bad.cells[1].metadata["lab"] = {"exercise": "01.param_count", "worked": True}
    with pytest.raises(ValueError, match="t.ipynb cell 1: a worked solution is a markdown cell"):
        release.release_notebook(bad, "t.ipynb")


def test_release_cli_with_worked_solutions(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert release.main(["--with-worked-solutions"]) == 2 and "needs --out DIR" in capsys.readouterr().err
    assert release.main(["--with-worked-solutions", "--out", str(tmp_path)]) == 0
    worked = [c for path in sorted((REPO / "solutions").glob("*.ipynb")) for c in read(path).cells
              if meta(c).get("worked")]
    released = [c for path in sorted(tmp_path.glob("*.ipynb")) for c in read(path).cells if meta(c).get("worked")]
    assert [c.source for c in released] == [c.source for c in worked]
    assert not [c for path in (REPO / "exercises").glob("*.ipynb") for c in read(path).cells if meta(c).get("worked")]


def test_every_exercise_is_graded_by_exactly_one_assignment():
    """An exercise left out of course/assignments.toml is never handed out or graded in a class; one in two
    assignments is graded twice."""
    from lab.grading import checks

    listed = [exercise_id for a in course.load().values() for exercise_id in a.exercises]
    assert sorted(set(checks.load_all()) - set(listed)) == []
    assert len(listed) == len(set(listed)), sorted({e for e in listed if listed.count(e) > 1})
