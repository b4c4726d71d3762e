"""Gradescope: a submission that holds two notebooks, a broken one or none still gets a results.json that says what
was graded; the autograder's setup.sh installs every package the assignment's exercises import, and no network is
reached here (the scripts are only written and parsed)."""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import json
import os
import shlex
import subprocess
from pathlib import Path

import nbformat
import pytest
from test_grading_cli import landlock_or_not  # noqa: F401 (a fixture)

from lab.grading import assignments as course
from lab.grading import checks, grade, gradescope
from lab.grading.checks import Exercise
from lab.grading.notebook import meta, read

REPO = Path(__file__).resolve().parents[1]
SOLUTION = REPO / "solutions" / "01_memory_and_compute.ipynb"
TWO = ["01.param_count", "01.state_bytes"]  # 5 points of fast calculation exercises


def notebook(path: Path, exercises: list[str], source: Path = SOLUTION) -> Path:
    """`source`'s cells of `exercises` only (answers, statements, checks): a small hand-made submission."""
    nb = copy.deepcopy(read(source))
    nb.cells = [c for c in nb.cells if meta(c).get("exercise") in exercises]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


@pytest.fixture
def a1(tmp_path) -> str:
    path = tmp_path / "assignments.toml"
    path.write_text(f'[A1]\ntitle = "two"\nexercises = {json.dumps(TWO)}\n')
    return str(path)


def _autograde(submission: Path, a1: str, tmp_path: Path) -> dict:
    """What run_autograder runs, with --strict; results.json must exist afterwards, whatever the submission."""
    out = tmp_path / "results" / "results.json"
    assert grade.main([str(submission), "--assignment", "A1", "--assignments", a1, "--results-json", str(out),
                       "--quiet", "--strict", "--seed-secret", "s3cret"]) == 0
    return json.loads(out.read_text())


@pytest.mark.usefixtures("landlock_or_not")
def test_of_two_notebooks_the_one_answering_most_is_graded_and_both_are_named(tmp_path, a1):
    sub = tmp_path / "submission"
    notebook(sub / "x (1).ipynb", TWO)  # all of A1, but older
    newer = notebook(sub / "x.ipynb", ["01.state_bytes"])
    os.utime(sub / "x (1).ipynb", (1_000_000, 1_000_000))
    results = _autograde(sub, a1, tmp_path)
    assert results["score"] == 5 and sum(t["max_score"] for t in results["tests"]) == 5
    assert "Graded x (1).ipynb: it answers 2 of the 2 exercises" in results["output"]
    assert "Ignored x.ipynb: it answers 1 of them." in results["output"]
    notebook(sub / "x (1).ipynb", TWO, REPO / "exercises" / "01_memory_and_compute.ipynb")  # blank, older
    notebook(newer, TWO)  # same exercises, newer: the latest upload counts
    os.utime(sub / "x (1).ipynb", (1_000_000, 1_000_000))
    results = _autograde(sub, a1, tmp_path)
    assert results["score"] == 5 and "Graded x.ipynb" in results["output"], results["output"]
    assert "Ignored x (1).ipynb: it answers 2 of them too, but it is older" in results["output"]


@pytest.mark.usefixtures("landlock_or_not")
def test_no_notebook_or_a_broken_one_scores_zero_with_the_reason(tmp_path, a1):
    sub = tmp_path / "submission"
    sub.mkdir()
    (sub / "answers.pdf").write_bytes(b"%PDF")
    results = _autograde(sub, a1, tmp_path)
    assert results["score"] == 0 and sum(t["max_score"] for t in results["tests"]) == 5
    assert "No notebook (.ipynb) in the submission (found: answers.pdf)" in results["output"]
    assert all("No notebook" in t["output"] for t in results["tests"])
    (sub / "x.ipynb").write_text("{not json")
    results = _autograde(sub, a1, tmp_path)
    assert results["score"] == 0 and "Graded x.ipynb" in results["output"]
    assert all("x.ipynb: not a valid notebook" in t["output"] for t in results["tests"])


def test_bad_command_line_is_still_one_line_and_no_results(tmp_path, a1, capsys):
    out = tmp_path / "results.json"
    assert grade.main([str(tmp_path / "nowhere"), "--assignment", "A1", "--assignments", a1,
                       "--results-json", str(out)]) == 2
    err = capsys.readouterr().err
    assert "nowhere: no such file or folder" in err and len(err.strip().splitlines()) == 1 and not out.exists()


# --- setup.sh --------------------------------------------------------------------------------------------

def _installed(setup: str) -> set[str]:
    """The distributions a setup.sh's pip lines install: their requirements, and the repository's own dependencies
    where it installs /autograder/source."""
    project = gradescope.tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = set()
    for line in setup.splitlines():
        if "pip install" in line and not line.startswith("#"):
            words = shlex.split(line)
            args = iter(words[words.index("install") + 1:])
            for word in args:
                if word == "--index-url":
                    next(args)
                elif word == "/autograder/source":
                    names |= {gradescope.distribution(r) for r in project["dependencies"]}
                elif not word.startswith("-"):
                    names.add(gradescope.distribution(word))
    return names


@pytest.mark.parametrize("name", list(course.load()))
def test_setup_sh_installs_every_package_the_assignments_exercises_import(name, tmp_path):
    """Each declared package imports here (the course environment), and the distribution it imports from is one
    setup.sh installs; torch is the CPU build. Both scripts are valid shell, executable and reproducible."""
    setup, run = gradescope.write_autograder(course.get(name), tmp_path)
    installed = _installed(setup.read_text())
    owners = importlib.metadata.packages_distributions()
    for exercise_id in course.get(name).exercises:
        for package in checks.get(exercise_id).packages:
            assert importlib.util.find_spec(package), f"{exercise_id}: {package} does not import here"
            dists = {gradescope.distribution(d) for d in owners[package]}
            assert dists & installed, f"{name}: {exercise_id} imports {package} ({dists}); setup.sh has {installed}"
    assert "nbformat" in installed  # the grader reads notebooks
    assert f"'torch>=2.5' --index-url {gradescope.TORCH_CPU}" in setup.read_text()
    assert f"--assignment {name} " in run.read_text()
    for path in (setup, run):
        assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0, path.read_text()
        assert os.access(path, os.X_OK)
    before = setup.read_bytes(), run.read_bytes()
    gradescope.write_autograder(course.get(name), tmp_path)
    assert (setup.read_bytes(), run.read_bytes()) == before


def test_a_package_pyproject_does_not_declare_is_refused():
    ex = Exercise("99.nowhere", ("f",), packages=("tomli_w", "pandas"))
    with pytest.raises(ValueError, match="99.nowhere needs package 'pandas', which pyproject.toml declares nowhere"):
        gradescope.requirements([ex])


def test_gradescope_command(tmp_path, capsys):
    assert gradescope.main(["--assignment", "A9", "--out", str(tmp_path / "A9")]) == 0
    assert "'triton>=3.0'" in (tmp_path / "A9" / "setup.sh").read_text() and "git archive" in capsys.readouterr().out
    assert gradescope.main(["--assignment", "Z9", "--out", str(tmp_path / "Z9")]) == 2
    err = capsys.readouterr().err
    assert "unknown assignment 'Z9'; valid: A1" in err and len(err.strip().splitlines()) == 1
