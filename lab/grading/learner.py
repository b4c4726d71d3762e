"""`lab.check("01.param_count")` in a notebook, and `python -m lab check NOTEBOOK` in a terminal.

In the notebook the answer is what the kernel last ran, not what was last saved: the cell that defined the
exercise's function is found through the function itself (IPython keeps every cell's source in `linecache`),
written to a file and run in the same sandbox the instructor's grader uses, with the same checks — except
the hidden ones, and with public inputs (the grader's come from the class secret). Nothing runs in the
kernel: a learner's endless loop or crash costs a row in the table, not the kernel.

A kernel remembers each verdict by the exact cells it graded: the notebook's closing `lab.check()` re-grades only
the exercises whose cells changed since their own `lab.check("...")` (public inputs make a verdict repeatable),
so "Your score" comes at once instead of grading every exercise twice. Naming an exercise always grades it again.
"""

from __future__ import annotations

import argparse
import copy
import linecache
import sys
import types
from pathlib import Path
from typing import Any

from lab.grading import checks, report
from lab.grading.checks import Exercise
from lab.grading.runner import ExerciseResult, not_graded, note_dependencies, run_exercise

_VERDICTS: dict[tuple, ExerciseResult] = {}  # (exercise, the cells graded, timeout) -> what they scored


class Report:
    """What `lab.check` returns: rendered as an HTML table by Jupyter, as text elsewhere."""

    def __init__(self, results: list[ExerciseResult], title: str, hidden_skipped: float = 0.0) -> None:
        self.results, self.title, self.hidden_skipped = results, title, hidden_skipped

    @property
    def points(self) -> float:
        return sum(r.points for r in self.results)

    @property
    def max_points(self) -> float:
        return sum(r.max_points for r in self.results)

    def _repr_html_(self) -> str:
        return report.html_report(self.results, self.title, hidden_skipped=self.hidden_skipped, output=True)

    def __repr__(self) -> str:
        return report.text_report(self.results, self.title, hidden_skipped=self.hidden_skipped)


def _cell_source(obj: Any) -> str | None:
    """The source of the cell (or file) that defined a function or class."""
    if isinstance(obj, type):
        obj = next((v for v in vars(obj).values() if isinstance(v, types.FunctionType)), None)
    code = getattr(obj, "__code__", None)
    if code is None:
        return None
    lines = linecache.getlines(code.co_filename)
    return "".join(lines) or None


def _kernel_parts(namespace: dict, ex: Exercise, known: dict[str, Exercise]) -> tuple[list, str]:
    """(label, source) of the cells that define `ex`'s functions and those of the exercises it builds on;
    or an explanation of what has not been run yet."""
    parts: list[tuple[str, str]] = []
    for exercise_id in (*ex.requires, ex.id):
        sources = []
        for name in known[exercise_id].entry:
            source = _cell_source(namespace.get(name))
            if source is None:
                return [], f"not attempted: run the cell that defines {name} ({exercise_id}) first"
            sources.append(source)
        parts += [(f"{exercise_id} (your cell)", s) for s in dict.fromkeys(sources)]
    return parts, ""


def _defined_here(namespace: dict, ex: Exercise) -> bool:
    return any(getattr(namespace.get(name), "__module__", None) == "__main__" for name in ex.entry)


def check(exercise: str | None = None, *, timeout: float = 60.0, namespace: dict | None = None) -> Report:
    """Check one exercise, or (no argument) every exercise of the chapters whose functions this notebook
    defines. `namespace` defaults to the notebook's (`__main__`)."""
    namespace = vars(sys.modules["__main__"]) if namespace is None else namespace
    known = checks.load_all()
    if exercise is not None:
        selected = [checks.get(exercise)]
    else:
        chapters = {ex.chapter for ex in known.values() if _defined_here(namespace, ex)}
        selected = [ex for ex in known.values() if ex.chapter in chapters]
    results, hidden = [], 0.0
    for ex in selected:
        parts, why_not = _kernel_parts(namespace, ex, known)
        if why_not:
            result = not_graded(ex, why_not, hidden=False, not_attempted=True)
        else:
            key = (ex.id, tuple(parts), timeout)
            if exercise is not None or key not in _VERDICTS:  # one exercise named: always graded afresh
                _VERDICTS[key] = run_exercise(ex, parts, hidden=False, wall_s=timeout)
            result = copy.deepcopy(_VERDICTS[key])  # note_dependencies below writes into it
        results.append(result)
        hidden += sum(c.points for c in ex.checks if c.hidden)
    note_dependencies(results, known)
    title = f"lab.check({exercise!r})" if exercise else "lab.check(): every exercise of this notebook"
    if not selected:
        title += " — none found: run the exercise cells first, or name one, e.g. lab.check('01.param_count')"
    return Report(results, title, hidden)


def main(argv: list[str] | None = None) -> int:
    """`python -m lab check NOTEBOOK [EXERCISE ...]`: the grader's verdict on a saved notebook — the same
    sandbox, checks and locked-cell checksums (those the release recorded in `lab`) — hidden checks aside."""
    from lab.grading.grade import grade_notebook, reference_checksums, select_exercises

    parser = argparse.ArgumentParser(prog="python -m lab check", description=main.__doc__)
    parser.add_argument("notebook", type=Path)
    parser.add_argument("exercises", nargs="*", help="exercise ids (default: all of the notebook's chapters)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per exercise")
    args = parser.parse_args(argv)
    try:
        if not args.notebook.is_file():
            raise ValueError(f"{args.notebook}: no such notebook")
        selected = [checks.get(i) for i in args.exercises] or select_exercises([args.notebook], None)
    except ValueError as error:
        print(f"python -m lab check: error: {error}", file=sys.stderr)
        return 2
    result = grade_notebook(args.notebook, selected, wall_s=args.timeout, locked=reference_checksums(), hidden=False)
    print(report.text_report(result.exercises, f"{args.notebook}"))
    return 0
