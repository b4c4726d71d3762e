"""`python -m lab release`: write the learners' notebooks (`exercises/`) from the single source (`solutions/`).

    python -m lab release                               solutions/*.ipynb -> exercises/
    python -m lab release --check                       exit 1 if exercises/ is out of date (CI)
    python -m lab release --assignment A1 --out DIR     the hand-out of one assignment (its exercises only)

Each `### BEGIN SOLUTION` ... `### END SOLUTION` region becomes a stub that raises
`NotImplementedError("exercise 01.param_count")` (inside the function the learner completes, so the notebook
still runs and `lab.check()` says "not attempted"); outputs are stripped; metadata is kept; locked cells get
their checksum and are made read-only in JupyterLab. The same input always gives the same bytes.

What graded code may import has one source, the exercise's checks (`Exercise.modules` and `Exercise.packages`,
what the sandbox lets in): the release appends it as a last line to each exercise's first statement cell
(`imports_line`), so a statement cannot promise `torch` to an exercise whose sandbox refuses it. Authors write
no such line; the release refuses one it finds.

An exercise may span several answer cells (a chapter's worked problems are one exercise, a cell per problem):
each cell's `points` are its own problems' points, and they add up to the exercise's. A *worked solution* —
a markdown cell with `{"lab": {"exercise": ..., "worked": true}}` — is left out of the release until the
instructor hands it out after the due date:

    python -m lab release --with-worked-solutions --out DIR   the notebooks with the problems' worked solutions
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import nbformat

from lab.grading import assignments as course
from lab.grading import checks, locked
from lab.grading.checks import Exercise
from lab.grading.notebook import BEGIN, END, IMPORTS, checksum, is_answer, is_locked, meta, read, write


def _stub(source: str, exercise_id: str, where: str) -> str:
    """Replace every solution region of an answer cell by a stub at the region's indentation."""
    out, inside, indent, found = [], False, "", False
    for number, line in enumerate(source.splitlines(), 1):
        marker = line.strip()
        if marker == BEGIN:
            if inside:
                raise ValueError(f"{where} line {number}: {BEGIN} inside another solution region")
            inside, indent, found = True, line[: len(line) - len(line.lstrip())], True
            out += [f"{indent}# YOUR CODE HERE", f'{indent}raise NotImplementedError("exercise {exercise_id}")']
        elif marker == END:
            if not inside:
                raise ValueError(f"{where} line {number}: {END} without a {BEGIN} before it")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{where}: {BEGIN} is never closed by {END}")
    if not found:
        raise ValueError(f"{where}: an answer cell of {exercise_id} has no {BEGIN} ... {END} region")
    return "\n".join(out)


def imports_line(exercise: Exercise) -> str:
    """The statement's generated last line: the standard library and every name the exercise's sandbox lets in."""
    names = dict.fromkeys((*exercise.modules, *exercise.packages))
    return f"{IMPORTS} the standard library, {', '.join(f'`{name}`' for name in names)}."


def _state_imports(cell: nbformat.NotebookNode, exercise: Exercise | None, where: str) -> None:
    """End the exercise's first statement cell with `imports_line`; refuse a hand-written one."""
    if exercise is None:
        raise ValueError(f"{where}: a locked cell of an exercise with no checks in lab/grading/checks/")
    if IMPORTS in cell.source:
        raise ValueError(f"{where}: the statement of {exercise.id} says what graded code may import: delete that "
                         f"line, the release writes it from the checks (Exercise.modules and .packages)")
    cell.source = f"{cell.source.rstrip()}\n\n{imports_line(exercise)}"


def release_notebook(nb: nbformat.NotebookNode, name: str = "notebook",
                     only: tuple[str, ...] | None = None, worked: bool = False) -> nbformat.NotebookNode:
    """The learners' version of a solutions notebook; `only` keeps just those exercises' cells, `worked` keeps
    the worked solutions of the problems (after the due date)."""
    known = checks.load_all()
    out = copy.deepcopy(nb)
    out.metadata.pop("widgets", None)
    cells, points, where_first, stated = [], {}, {}, set()
    for index, cell in enumerate(out.cells):
        where, exercise_id = f"{name} cell {index}", meta(cell).get("exercise")
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        if exercise_id is not None and only is not None and exercise_id not in only:
            continue
        if meta(cell).get("worked"):
            if cell.cell_type != "markdown" or exercise_id not in known:
                raise ValueError(f"{where}: a worked solution is a markdown cell of a known exercise "
                                 f"(metadata lab.exercise, worked), not a {cell.cell_type} cell of {exercise_id!r}")
            if not worked:
                continue
        if is_answer(cell):
            if exercise_id not in known:
                raise ValueError(f"{where}: exercise {exercise_id!r} has no checks in lab/grading/checks/")
            cell_points = meta(cell).get("points")
            if not isinstance(cell_points, (int, float)) or isinstance(cell_points, bool) or cell_points <= 0:
                raise ValueError(f"{where}: points={cell_points!r} for {exercise_id} must be a number > 0")
            points[exercise_id] = points.get(exercise_id, 0) + cell_points
            where_first.setdefault(exercise_id, where)
            cell.source = _stub(cell.source, exercise_id, where)
            cell.metadata["deletable"] = False
        elif BEGIN in cell.get("source", "") or END in cell.get("source", ""):
            raise ValueError(f"{where}: solution markers outside an answer cell (metadata lab.exercise, points)")
        if is_locked(cell) and cell.cell_type == "markdown" and exercise_id not in stated:
            _state_imports(cell, known.get(exercise_id), where)
            stated.add(exercise_id)
        if is_locked(cell):
            cell.metadata["lab"]["checksum"] = checksum(cell)
            cell.metadata["editable"], cell.metadata["deletable"] = False, False
        cells.append(cell)
    for exercise_id, total in points.items():
        if abs(total - known[exercise_id].points) > 1e-9:
            raise ValueError(f"{where_first[exercise_id]}: points={total:g} for {exercise_id} but its checks give "
                             f"{known[exercise_id].points:g}: make them agree (its answer cells' points add up)")
    out.cells = cells
    return out


def release(solutions: Path, out: Path, assignment: course.Assignment | None = None,
            check_only: bool = False, worked: bool = False) -> list[Path]:
    """Release every notebook of `solutions` into `out` (with the worked solutions if `worked`); return the paths
    that changed (or would)."""
    paths = sorted(solutions.glob("*.ipynb"))
    if not paths:
        raise ValueError(f"{solutions}: no notebooks to release (expected solutions/NN_slug.ipynb)")
    changed = []
    only = assignment.exercises if assignment else None
    for path in paths:
        nb = read(path)
        if only is not None and not any(is_answer(c) and meta(c)["exercise"] in only for c in nb.cells):
            continue
        released = release_notebook(nb, path.name, only, worked)
        if assignment:
            released.metadata.setdefault("lab", {})["assignment"] = assignment.name
        target = out / path.name
        text = nbformat.writes(released) + "\n"
        if not target.exists() or target.read_text(encoding="utf-8") != text:
            changed.append(target)
            if not check_only:
                write(released, target)
    return changed + locked.record(solutions, check_only)  # what lab check compares locked cells with


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab release", description=__doc__.split("\n\n")[0])
    parser.add_argument("--solutions", type=Path, default=Path("solutions"), help="source notebooks")
    parser.add_argument("--out", type=Path, default=None, help="where to write (default exercises/)")
    parser.add_argument("--assignment", help="release only this assignment's exercises")
    parser.add_argument("--assignments", type=Path, default=None, help="default course/assignments.toml")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if anything would change")
    parser.add_argument("--with-worked-solutions", action="store_true",
                        help="keep the problems' worked solutions (hand them out after the due date; needs --out)")
    args = parser.parse_args(argv)
    try:
        assignment = course.get(args.assignment, args.assignments) if args.assignment else None
        if assignment and args.out is None:
            raise ValueError(f"--assignment {assignment.name} needs --out DIR (exercises/ holds the whole course)")
        if args.with_worked_solutions and args.out is None:
            raise ValueError("--with-worked-solutions needs --out DIR: exercises/ is what learners get before the "
                             "due date")
        changed = release(args.solutions, args.out or Path("exercises"), assignment, args.check,
                          args.with_worked_solutions)
    except ValueError as error:
        print(f"python -m lab release: error: {error}", file=sys.stderr)
        return 2
    for path in changed:
        print(f"{'out of date' if args.check else 'wrote'}: {path}")
    if args.check and changed:
        print("run `python -m lab release` and commit the result", file=sys.stderr)
        return 1
    if not changed:
        print("exercises are up to date")
    return 0
