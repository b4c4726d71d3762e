"""The three users: the instructor's `python -m lab grade`, the learner's `lab.check()`, the student's
`python -m lab check`. Solutions score full marks, untouched exercises zero, outputs are deterministic."""

from __future__ import annotations

import csv
import itertools
import json
import linecache
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

import lab
from lab.grading import grade, learner, report
from lab.grading.notebook import answer_parts, is_answer, read
from lab.grading.runner import CheckResult, ExerciseResult

REPO = Path(__file__).resolve().parents[1]
SOLUTION = REPO / "solutions" / "01_memory_and_compute.ipynb"
EXERCISE = REPO / "exercises" / "01_memory_and_compute.ipynb"
_CELLS = itertools.count()  # like IPython, every executed cell gets a file name of its own


def _lab(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lab", *args], capture_output=True, text=True, timeout=300, cwd=REPO)


def test_grade_solutions_gives_full_marks_with_every_output(tmp_path):
    done = _lab("grade", str(SOLUTION), "--out", str(tmp_path / "g.csv"), "--results-json", str(tmp_path / "r.json"),
                "--feedback-dir", str(tmp_path / "fb"), "--seed-secret", "s3cret")
    assert done.returncode == 0, done.stderr
    assert "Score: 39 / 39 points" in done.stdout
    row = next(csv.DictReader((tmp_path / "g.csv").open()))
    assert row["student"] == "01_memory_and_compute" and row["total"] == row["max"] == "39"
    results = json.loads((tmp_path / "r.json").read_text())
    assert results["score"] == 39 and len(results["tests"]) == 37
    assert {t["visibility"] for t in results["tests"]} == {"visible", "after_published"}
    assert "39 / 39" in (tmp_path / "fb" / "01_memory_and_compute.html").read_text()


def test_grade_untouched_exercises_gives_zero_not_attempted_and_says_why_in_the_results_json(tmp_path):
    done = _lab("grade", str(EXERCISE), "--results-json", str(tmp_path / "r.json"), "--seed-secret", "s3cret")
    assert done.returncode == 0, done.stderr
    assert "Score: 0 / 39 points" in done.stdout
    for name in ("param_count", "model_state_bytes", "activation_bytes", "max_micro_batch", "mfu"):
        assert done.stdout.count(f"not attempted: {name} raises NotImplementedError") == 1
    tests = json.loads((tmp_path / "r.json").read_text())["tests"]
    param_count = [t for t in tests if t["name"].startswith("01.param_count")]
    assert param_count and all("not attempted: param_count raises NotImplementedError" in t["output"]
                               for t in param_count)


# The class tests grade ten students twice: an A1 of the chapter's five torch-free exercises keeps that quick (the
# course's A1 also grades chapter 01's torch exercises and its problems, which the tests above grade once).
FIVE = ["01.param_count", "01.state_bytes", "01.activation_bytes", "01.max_micro_batch", "01.mfu"]


@pytest.fixture
def assignments(tmp_path) -> str:
    path = tmp_path / "assignments.toml"
    path.write_text(f'[A1]\ntitle = "five"\nexercises = {FIVE!r}\ndue = 2026-10-09T23:59:00Z\n'
                    'late_penalty_per_day = 0.1\nmax_late_days = 3\n'.replace("'", '"'))
    return str(path)


@pytest.fixture
def landlock_or_not(monkeypatch):
    """--strict refuses to grade without Landlock or a network namespace; these tests are about what --strict lets
    through, so on a kernel without them they stand in for them (the sandbox itself works either way)."""
    real = grade.isolation()
    if not real["landlock_abi"] or real["network"] not in ("namespace", "user namespace"):
        monkeypatch.setattr(grade, "isolation", lambda: {**real, "landlock_abi": real["landlock_abi"] or 1,
                                                         "network": "namespace"})


def test_class_grading_is_deterministic_with_an_assignment_and_late_policy(tmp_path, landlock_or_not, assignments):
    """Ten students (perfect, blank, partial), graded twice with 2 jobs: byte-identical CSVs."""
    subs = tmp_path / "subs"
    subs.mkdir()
    for i in range(4):
        shutil.copy(SOLUTION, subs / f"perfect{i}.ipynb")
        shutil.copy(EXERCISE, subs / f"blank{i}.ipynb")
    partial = read(SOLUTION)
    cell = next(c for c in partial.cells if is_answer(c, "01.state_bytes"))
    cell.source = "def model_state_bytes(*args):\n    return 0\n"
    nbformat.write(partial, subs / "partial.ipynb")
    (subs / "ada").mkdir()  # a folder per student: the folder names the student
    shutil.copy(SOLUTION, subs / "ada" / "whatever.ipynb")
    times = {"perfect0": "2026-10-11T10:00:00Z"} | {s: "2026-10-09T12:00:00Z" for s in
                                                     ["ada", "partial", *(f"{k}{i}" for k in ("perfect", "blank")
                                                                          for i in range(1, 4)), "blank0"]}
    (tmp_path / "times.csv").write_text("student,submitted_at\n" + "".join(f"{k},{v}\n" for k, v in times.items()))
    args = [str(subs), "--jobs", "2", "--quiet", "--assignment", "A1", "--assignments", assignments, "--strict",
            "--seed-secret", "s3cret",
            "--submission-times", str(tmp_path / "times.csv")]
    assert grade.main([*args, "--out", str(tmp_path / "a.csv"), "--feedback-dir", str(tmp_path / "fb")]) == 0
    assert grade.main([*args, "--out", str(tmp_path / "b.csv")]) == 0
    assert (tmp_path / "a.csv").read_bytes() == (tmp_path / "b.csv").read_bytes()
    rows = {r["student"]: r for r in csv.DictReader((tmp_path / "a.csv").open())}
    assert len(rows) == 10 and {r["assignment"] for r in rows.values()} == {"A1"}
    assert rows["ada"]["total"] == "14" and rows["blank0"]["total"] == "0"
    assert rows["partial"]["01.state_bytes"] == rows["partial"]["01.max_micro_batch"] == "0"  # it builds on it
    assert rows["partial"]["total"] == "10"  # 14 − 01.state_bytes (1) − 01.max_micro_batch (3)
    assert rows["perfect0"]["late_days"] == "2" and rows["perfect0"]["total"] == "11.2"
    assert "A1" in (tmp_path / "fb" / "ada.html").read_text()


def test_identity_comes_from_file_names_never_from_notebook_metadata(tmp_path, landlock_or_not, assignments):
    """A notebook that names another student in its metadata changes nobody's identity: the late penalty of the
    student it names still applies, and feedback pages carry student ids, not the instructor's paths."""
    subs = tmp_path / "subs"
    subs.mkdir()
    impostor = read(SOLUTION)
    impostor.metadata["lab"] = {"student": "bob"}
    nbformat.write(impostor, subs / "alice.ipynb")
    shutil.copy(SOLUTION, subs / "bob.ipynb")
    (tmp_path / "times.csv").write_text("student,submitted_at\nalice,2026-10-09T10:00:00Z\n"
                                        "bob,2026-10-12T10:00:00Z\n")  # 3 days late: x0.7
    assert grade.main([str(subs), "--quiet", "--assignment", "A1", "--assignments", assignments, "--strict",
                       "--seed-secret", "s3cret", "--submission-times", str(tmp_path / "times.csv"),
                       "--out", str(tmp_path / "g.csv"), "--feedback-dir", str(tmp_path / "fb")]) == 0
    rows = {r["student"]: r for r in csv.DictReader((tmp_path / "g.csv").open())}
    assert set(rows) == {"alice", "bob"}
    assert (rows["bob"]["late_days"], rows["bob"]["total"]) == ("3", "9.8")
    assert (rows["alice"]["late_days"], rows["alice"]["total"]) == ("0", "14")
    pages = sorted(p.name for p in (tmp_path / "fb").iterdir())
    assert pages == ["alice.html", "bob.html"]
    assert not any(str(tmp_path) in (tmp_path / "fb" / p).read_text() for p in pages)


def _class(tmp_path: Path, *, clash: bool = True, unknown_row: bool = True, no_time: bool = True) -> list[str]:
    """A class of blank notebooks where each thing that could make a grade silently wrong happens once: ada
    handed in two notebooks, the times have a row for a typo (karol), carol has no time."""
    subs = tmp_path / "subs"
    for path in [subs / "ada" / "first.ipynb", subs / "carol.ipynb", *([subs / "ada" / "second.ipynb"] * clash)]:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(EXERCISE, path)
    rows = ["ada", *(["karol"] * unknown_row), *(["carol"] * (not no_time))]
    (tmp_path / "times.csv").write_text("student,submitted_at\n" + "".join(f"{r},2026-10-09T10:00:00Z\n"
                                                                              for r in rows))
    return [str(subs), "--quiet", "--assignment", "A1", "--submission-times", str(tmp_path / "times.csv"),
            "--out", str(tmp_path / "g.csv")]


WARNINGS = {"clash": "2 notebooks belong to student 'ada'", "unknown_row": "row(s) match no submission ('karol')",
            "no_time": "no submission time for 1 student(s) ('carol')", "no_secret": "no class secret"}


def test_what_could_make_a_grade_wrong_is_a_visible_warning(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LAB_SEED_SECRET", raising=False)
    assert grade.main(_class(tmp_path)) == 0
    err = capsys.readouterr().err
    for message in WARNINGS.values():
        assert sum(message in line and line.startswith("warning: ") for line in err.splitlines()) == 1, err
    assert "learners have seen these very inputs and expected values" in err
    rows = {r["student"]: r for r in csv.DictReader((tmp_path / "g.csv").open())}
    assert set(rows) == {"ada/first", "ada/second", "carol"}  # both kept, under their path below subs/


@pytest.mark.parametrize("case", WARNINGS)
def test_strict_refuses_what_would_be_a_warning(case, tmp_path, capsys, monkeypatch):
    """Each case alone: the rest of the class is in order."""
    monkeypatch.delenv("LAB_SEED_SECRET", raising=False)
    args = _class(tmp_path, **{c: c == case for c in ("clash", "unknown_row", "no_time")})
    secret = [] if case == "no_secret" else ["--seed-secret", "s3cret"]
    assert grade.main([*args, *secret, "--strict"]) == 2
    err = capsys.readouterr().err
    assert WARNINGS[case] in err and err.startswith("python -m lab grade: error: "), err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "g.csv").exists()


@pytest.mark.parametrize("args, message", [
    (["nowhere/"], "nowhere: no such file or folder"),
    ([str(SOLUTION), "--assignment", "Z9"], "unknown assignment 'Z9'; valid: A1"),
    ([str(SOLUTION), "--jobs", "0"], "--jobs=0 must be >= 1"),
    ([str(SOLUTION), str(EXERCISE), "--results-json", "r.json"], "--results-json is Gradescope's per-submission"),
    ([str(SOLUTION), "--checks", "missing.py"], "--checks missing.py: no such file"),
])
def test_grade_errors_are_one_line(args, message, capsys):
    assert grade.main(args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def _run_cell(namespace: dict, source: str) -> None:
    """What a kernel does with a cell: IPython keeps each cell's source in linecache, under a name of its own."""
    filename = f"<ipython-input-{next(_CELLS)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)


def _kernel(notebook: Path, skip: str = "") -> dict:
    """A namespace like a kernel's after running every answer cell of `notebook` (but `skip`'s)."""
    namespace = {"__name__": "__main__"}
    for ex in ("01.param_count", "01.state_bytes", "01.activation_bytes", "01.max_micro_batch", "01.mfu"):
        for _, source in answer_parts(read(notebook), ex) if ex != skip else []:
            _run_cell(namespace, source)
    return namespace


def test_learner_check_runs_what_the_kernel_ran():
    namespace = _kernel(SOLUTION)
    one = learner.check("01.param_count", namespace=namespace)
    assert (one.points, one.max_points) == (3, 3)  # the hidden check is not run for learners
    assert "hidden checks worth 1 more" in one._repr_html_() and "Score: 3 / 3 points" in repr(one)
    everything = learner.check(namespace=namespace)  # the kernel ran five exercises' cells: those score in full
    assert everything.points == 13 and {r.id for r in everything.results if r.status == "not attempted"} == \
        {"01.measured_activations", "01.activation_checkpoint", "01.problems"}
    namespace["model_state_bytes"] = _kernel(EXERCISE)["model_state_bytes"]  # the learner re-ran the stub
    mixed = learner.check(namespace=namespace)
    by_id = {r.id: r for r in mixed.results}
    assert by_id["01.state_bytes"].status == "not attempted" and by_id["01.param_count"].status == "passed"
    assert by_id["01.max_micro_batch"].reason == "needs 01.state_bytes, which is not done yet"
    namespace["model_state_bytes"] = _kernel(SOLUTION)["model_state_bytes"]
    _run_cell(namespace, "def param_count(cfg):\n    return 0\n")  # the exercises built on it say where to start
    wrong = {r.id: r for r in learner.check(namespace=namespace).results}
    assert wrong["01.mfu"].reason == "builds on 01.param_count, which is not fully right yet: start there"


def test_learner_check_explains_what_is_missing():
    report_ = learner.check("01.mfu", namespace=_kernel(SOLUTION, skip="01.param_count"))
    assert report_.points == 0 and "run the cell that defines param_count (01.param_count) first" in repr(report_)
    assert "none found" in learner.check(namespace={}).title
    with pytest.raises(ValueError, match="unknown exercise '01.nope'; valid: 01.param_count"):
        lab.check("01.nope")


def test_check_cli_for_a_saved_notebook():
    done = _lab("check", str(EXERCISE), "01.state_bytes")
    assert done.returncode == 0 and "Score: 0 / 1 points" in done.stdout and "not attempted" in done.stdout


def test_reports_escape_what_student_code_could_write():
    check = CheckResult("c", 1, 0, "failed", "<script>alert(1)</script>", "<b>hint</b>", hidden=False)
    result = ExerciseResult("01.x", 1, 0, "failed", "<img src=x onerror=alert(1)>", [check], "<script>")
    page = report.html_report([result], "<title>", output=True)
    assert "<script>" not in page and "<img" not in page and "&lt;script&gt;" in page
    hidden = CheckResult("h", 1, 0, "failed", "expected 42", "try n_kv_heads", hidden=True)
    feedback = report.html_report([ExerciseResult("01.x", 1, 0, "failed", "", [hidden])], "t", hidden_details=False)
    assert "expected 42" not in feedback and "try n_kv_heads" not in feedback  # only whether it passed


def test_returned_and_expected_values_print_at_one_precision():
    """At a precision that shows the difference the check's tolerance sees, the same on both sides."""
    from lab.grading.checks import CheckFailed, expect_allclose, expect_close

    with pytest.raises(CheckFailed, match=r"^f\(\) returned 0\.12345879, expected 0\.1234567$"):
        expect_close(0.1234587891, 0.1234567, "f()")
    with pytest.raises(CheckFailed) as failed:
        expect_allclose([1.0, 0.3012345678], [1.0, 0.3], "g()")
    assert str(failed.value) == "g() returned [1.0, 0.301235] (2 values), expected [1.0, 0.3] (2 values): first " \
                                "difference at element 1, 0.301235 instead of 0.3"


def test_the_closing_check_regrades_only_changed_cells(monkeypatch):
    """`lab.check()` at a notebook's end reuses the verdict of every exercise whose cells are unchanged since its own
    `lab.check("...")` (the same public inputs give the same verdict), and grades again the one that changed; naming
    an exercise always grades it again."""
    namespace = _kernel(SOLUTION)
    graded = []
    real = learner.run_exercise
    monkeypatch.setattr(learner, "run_exercise", lambda ex, *a, **k: graded.append(ex.id) or real(ex, *a, **k))
    monkeypatch.setattr(learner, "_VERDICTS", {})
    assert learner.check("01.state_bytes", namespace=namespace).points == 1
    assert learner.check("01.state_bytes", namespace=namespace).points == 1 and graded == ["01.state_bytes"] * 2
    graded.clear()  # named, an exercise is graded afresh (a learner retrying); the closing check reuses it
    _run_cell(namespace, "def param_count(cfg):\n    return 0\n")
    closing = {r.id: r for r in learner.check(namespace=namespace).results}
    assert graded.count("01.state_bytes") == 0 and graded.count("01.param_count") == 1, graded
    assert closing["01.state_bytes"].points == 1 and closing["01.param_count"].points == 0
    assert closing["01.mfu"].reason.startswith("builds on 01.param_count")  # written into a copy, not the memory
    assert not learner._VERDICTS[next(k for k in learner._VERDICTS if k[0] == "01.mfu")].reason
