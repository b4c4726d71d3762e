"""Gradescope: which notebook of a submission to grade, and the autograder's `setup.sh` and `run_autograder`.

    python -m lab gradescope --assignment A1 --out autograder/A1/

A student's upload is a folder that may hold two notebooks (`x.ipynb` and the browser's `x (1).ipynb`), a
wrong chapter's, or none at all; Gradescope shows "autograder failed" unless `results.json` is written, so
`python -m lab grade --results-json` grades the one that answers most of the assignment's exercises and says
so (`pick`), and writes a zero with the reason when there is none.

The autograder image must import every package the assignment's exercises declare (`Exercise.packages`:
Triton for `09.*`, JAX for `02.sharded_matmul`), and no more: `setup.sh` is derived from those declarations
and pyproject.toml's requirement strings, never written by hand. Torch comes as its CPU build (Gradescope has
no GPU, and the default wheel is a multi-GB CUDA build).
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from lab.grading import assignments as course
from lab.grading import checks
from lab.grading.checks import Exercise
from lab.grading.notebook import NotebookError, exercise_ids, read

TORCH_CPU = "https://download.pytorch.org/whl/cpu"
GRADER = ("nbformat",)  # what `python -m lab grade` needs beyond lab's dependencies: its notebook reader
VENV = "/autograder/venv"  # a venv of its own: Ubuntu 24.04's system pip refuses to install (PEP 668)


@dataclass(frozen=True)
class Pick:
    notebook: Path | None  # None: nothing to grade
    note: str  # for results.json: what was graded, what was ignored and why, or why nothing was


def _answers(path: Path, wanted: Collection[str]) -> int:
    """How many of `wanted` the notebook answers; -1 when it cannot be read, so any readable one comes first."""
    try:
        return len(set(exercise_ids(read(path))) & set(wanted))
    except NotebookError:
        return -1


def pick(given: Path, notebooks: Sequence[Path], wanted: Collection[str]) -> Pick:
    """The notebook to grade among `notebooks` (found in `given`): the one answering most of `wanted`; on a tie,
    the newest file (the latest upload), then the first by name."""
    def name(path: Path) -> str:
        return str(path.relative_to(given)) if path != given else path.name

    if not notebooks:
        others = sorted(str(p.relative_to(given)) for p in given.rglob("*") if p.is_file()) if given.is_dir() else []
        found = f" (found: {', '.join(others[:5])}{', ...' if len(others) > 5 else ''})" if others else ""
        return Pick(None, f"No notebook (.ipynb) in the submission{found}: nothing was graded. Upload the notebook "
                          f"file itself, e.g. 01_memory_and_compute.ipynb.")
    answers = {path: _answers(path, wanted) for path in notebooks}
    best = max(sorted(notebooks, key=name), key=lambda p: (answers[p], p.stat().st_mtime))
    lines = [f"Graded {name(best)}: it answers {max(answers[best], 0)} of the {len(wanted)} exercises graded."]
    for path in sorted(notebooks, key=name):
        if path != best:
            tie = " too, but it is older (or, as old, later by name)" if answers[path] == answers[best] else ""
            why = "it cannot be read as a notebook" if answers[path] < 0 else f"it answers {answers[path]} of them{tie}"
            lines.append(f"Ignored {name(path)}: {why}.")
    return Pick(best, "\n".join(lines))


# --- the autograder's scripts ---------------------------------------------------------------------------

def distribution(requirement: str) -> str:
    """A requirement's or an import's distribution name as pip compares them (PEP 503): "tomli_w" and
    "tomli-w>=1.0; ..." are both "tomli-w"."""
    match = re.match(r"[A-Za-z0-9._-]+", requirement.strip())
    if not match:
        raise ValueError(f"{requirement!r} is not a requirement (expected e.g. 'triton>=3.0')")
    return re.sub(r"[-_.]+", "-", match.group()).lower()


def requirements(exercises: Sequence[Exercise], pyproject: Path = course.REPO / "pyproject.toml") -> list[str]:
    """pyproject.toml's requirement strings for what grading `exercises` imports beyond lab's own dependencies
    (which installing the repository brings): the exercises' packages and the grader's notebook reader."""
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    core = {distribution(r) for r in project["dependencies"]}
    optional = {distribution(r): r for extra in project["optional-dependencies"].values() for r in extra
                if not r.startswith(project["name"])}  # "ultrascale-lab[...]": the `all` extra names the others
    out = []
    for ex in [None, *exercises]:
        for package in GRADER if ex is None else ex.packages:
            name = distribution(package)
            if name not in core and name not in optional:
                raise ValueError(f"{ex.id if ex else 'the grader'} needs package {package!r}, which {pyproject.name} "
                                 f"declares nowhere; add it to [project.optional-dependencies]")
            if name not in core and optional[name] not in out:
                out.append(optional[name])
    return out


def torch_requirement(pyproject: Path = course.REPO / "pyproject.toml") -> str:
    """lab's torch requirement ("torch>=2.5"), installed first from the CPU index so that pip keeps that build."""
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    return next(r for r in project["dependencies"] if distribution(r) == "torch")


def setup_sh(assignment: course.Assignment, exercises: Sequence[Exercise]) -> str:
    packages = sorted({p for ex in exercises for p in ex.packages})
    extra = " ".join(shlex.quote(r) for r in requirements(exercises))
    return f"""#!/usr/bin/env bash
# Gradescope's setup.sh for assignment {assignment.name}, written by
# `python -m lab gradescope --assignment {assignment.name}`: do not edit, write it again.
# Its exercises import {', '.join(packages)}; the grader reads notebooks with nbformat.
set -euo pipefail
apt-get update
apt-get install -y python3 python3-venv
python3 -m venv {VENV}
{VENV}/bin/pip install --no-cache-dir {shlex.quote(torch_requirement())} --index-url {TORCH_CPU}
{VENV}/bin/pip install --no-cache-dir /autograder/source {extra}
"""


def run_autograder(assignment: course.Assignment) -> str:
    return f"""#!/usr/bin/env bash
# Gradescope's run_autograder for assignment {assignment.name}, written by
# `python -m lab gradescope --assignment {assignment.name}`. It writes results.json even for a submission
# without a notebook (a zero with the reason); --strict refuses to grade without the class secret, Landlock
# or a network namespace (python -m lab doctor says which this machine gives).
set -u
cd /autograder/source
LAB_SEED_SECRET="$(cat /autograder/source/secret.txt)" exec {VENV}/bin/python -m lab grade \\
    /autograder/submission --assignment {shlex.quote(assignment.name)} \\
    --results-json /autograder/results/results.json --quiet --strict
"""


def write_autograder(assignment: course.Assignment, out: Path) -> list[Path]:
    """`setup.sh` and `run_autograder` for `assignment` in `out`, executable; the same bytes on every run."""
    known = checks.load_all()
    exercises = [known[i] for i in assignment.exercises]
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in (("setup.sh", setup_sh(assignment, exercises)), ("run_autograder", run_autograder(assignment))):
        path = out / name
        path.write_text(text, encoding="utf-8")
        path.chmod(0o755)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab gradescope", description=__doc__.split("\n\n")[0])
    parser.add_argument("--assignment", required=True, help="the assignment (course/assignments.toml)")
    parser.add_argument("--assignments", type=Path, help="assignments file (default course/assignments.toml)")
    parser.add_argument("--out", type=Path, required=True, help="folder for setup.sh and run_autograder")
    args = parser.parse_args(argv)
    try:
        written = write_autograder(course.get(args.assignment, args.assignments), args.out)
    except (ValueError, OSError) as error:
        print(f"python -m lab gradescope: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(map(str, written))}. The autograder zip is this repository with them and your class "
          f"secret at its root:\n  cp ~/.lab-secret {args.out}/secret.txt && git archive --format=zip -o "
          f"{args.assignment}.zip HEAD && (cd {args.out} && zip -q {Path.cwd() / f'{args.assignment}.zip'} setup.sh "
          f"run_autograder secret.txt)")
    return 0
