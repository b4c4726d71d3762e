"""`python -m lab grade`: grade a class's notebooks, every exercise in its own sandbox.

    python -m lab grade submissions/ --out grades.csv --feedback-dir feedback/ --jobs 4
    python -m lab grade submissions/ --assignment A1 --out grades.csv --submission-times times.csv
    python -m lab grade /autograder/submission --results-json /autograder/results/results.json   (Gradescope)

A SUBMISSION is a notebook or a folder of them (searched recursively), one per student, any file name; the
student id is `metadata.lab.student` if set, else the file name. Inputs are random, derived from
--seed-secret (or $LAB_SEED_SECRET, which process listings do not show). A notebook that is broken, lacks a
cell, edited a locked cell or whose code misbehaves scores 0 on the exercises concerned, with the reason;
every other student is still graded.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import os
import re
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lab.grading import assignments as course
from lab.grading import checks, report
from lab.grading.checks import Exercise
from lab.grading.confine import isolation
from lab.grading.notebook import NotebookError, answer_parts, exercise_ids, locked_checksums, read, student_id
from lab.grading.runner import ExerciseResult, StudentResult, not_graded, note_dependencies, run_exercise


def discover(paths: Sequence[Path]) -> list[tuple[str, Path]]:
    """(student id, notebook) for every submission, sorted by id; clashing ids get their path instead."""
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            found += sorted(p for p in path.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
        elif path.is_file():
            found.append(path)
        else:
            raise ValueError(f"{path}: no such file or folder (give notebooks or folders of notebooks)")
    if not found:
        raise ValueError(f"no notebooks found in {', '.join(map(str, paths))}")
    ids = []
    for path in found:
        try:
            ids.append(student_id(path, read(path)))
        except NotebookError:
            ids.append(path.stem)
    clashes = {i for i in ids if ids.count(i) > 1}
    return sorted((str(p.with_suffix("")) if i in clashes else i, p) for i, p in zip(ids, found, strict=True))


def select_exercises(submissions: Sequence[Path], assignment: course.Assignment | None) -> list[Exercise]:
    """The assignment's exercises, else every exercise of the chapters the submissions belong to (from the
    file names, NN_slug.ipynb, and the exercises their cells name)."""
    known = checks.load_all()
    if assignment:
        return [known[i] for i in assignment.exercises]
    chapters = set()
    for path in submissions:
        chapters |= set(re.findall(r"^(\d\d)_", path.name))
        try:
            chapters |= {i.split(".")[0] for i in exercise_ids(read(path))}
        except NotebookError:
            pass
    chosen = [ex for ex in known.values() if ex.chapter in chapters]
    if not chosen:
        raise ValueError("no exercise found in the submissions (name them NN_slug.ipynb or pass --assignment)")
    return chosen


def reference_checksums(solutions: Path | None) -> dict[str, list[str]]:
    """Locked cells' checksums from the instructor's solutions (a submission's own metadata is not trusted)."""
    if solutions is None or not solutions.is_dir():
        return {}
    out: dict[str, list[str]] = {}
    for path in sorted(solutions.glob("*.ipynb")):
        nb = read(path)
        for exercise_id in exercise_ids(nb):
            out[exercise_id] = locked_checksums(nb, exercise_id)
    return out


def grade_notebook(path: Path, exercises: Sequence[Exercise], *, student: str = "", secret: str | None = None,
                   wall_s: float = 60.0, locked: dict[str, list[str]] | None = None, hidden: bool = True,
                   protect: Sequence[str] = ()) -> StudentResult:
    """Grade one notebook: each exercise in its own sandbox, each failure confined to its exercise.
    `hidden=False` leaves out hidden checks (what a learner sees)."""
    try:
        nb = read(path)
    except NotebookError as error:
        return StudentResult(student or path.stem, str(path), [not_graded(ex, str(error), hidden) for ex in exercises])
    results: list[ExerciseResult] = []
    for ex in exercises:
        own = answer_parts(nb, ex.id)
        missing = [i for i in ex.requires if not answer_parts(nb, i)]
        if not own:
            result = not_graded(ex, f"no cell with metadata lab.exercise = {ex.id!r} (deleted, or metadata removed)",
                                hidden)
        elif locked and ex.id in locked and locked_checksums(nb, ex.id) != locked[ex.id]:
            result = not_graded(ex, f"a locked cell of {ex.id} was edited or deleted (checksum differs from the "
                                    f"released notebook)", hidden)
        elif missing:
            result = not_graded(ex, f"builds on {', '.join(missing)}, whose cell is missing", hidden)
        else:
            parts = [part for i in (*ex.requires, ex.id) for part in answer_parts(nb, i)]
            result = run_exercise(ex, parts, secret=secret, hidden=hidden, wall_s=wall_s, protect=protect)
        results.append(result)
    note_dependencies(results, {ex.id: ex for ex in exercises})
    return StudentResult(student or student_id(path, nb), str(path), results)


def _submission_times(path: Path | None) -> dict[str, dt.datetime]:
    if path is None:
        return {}
    times = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            try:
                when = dt.datetime.fromisoformat(row["submitted_at"].replace("Z", "+00:00"))
            except (KeyError, ValueError):
                raise ValueError(f"{path}: needs columns student,submitted_at (ISO 8601); got {row}") from None
            times[row["student"]] = when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)
    return times


def grade_all(submissions: Sequence[tuple[str, Path]], exercises: Sequence[Exercise], *, jobs: int = 1,
              progress: bool = True, **options) -> list[StudentResult]:
    """Grade every submission, `jobs` at a time (each student's sandboxes run one after the other)."""
    from tqdm import tqdm

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(grade_notebook, path, exercises, student=sid, **options) for sid, path in submissions]
        with tqdm(total=len(futures), desc="grading", unit="student", disable=not progress, file=sys.stderr) as bar:
            results = []
            for future in futures:
                results.append(future.result())
                bar.update()
    return results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lab grade", description=__doc__.split("\n\n")[0])
    parser.add_argument("submissions", nargs="+", type=Path, metavar="SUBMISSION")
    parser.add_argument("--out", type=Path, help="grades CSV: a row per student, a column per exercise")
    parser.add_argument("--results-json", type=Path, help="Gradescope's results.json (one submission)")
    parser.add_argument("--feedback-dir", type=Path, help="an HTML page per student")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per exercise (wall and CPU)")
    parser.add_argument("--jobs", type=int, default=1, help="students graded in parallel")
    parser.add_argument("--seed-secret", default=os.environ.get("LAB_SEED_SECRET"), help="class secret for inputs")
    parser.add_argument("--assignment", help="grade only this assignment (course/assignments.toml)")
    parser.add_argument("--assignments", type=Path, help="assignments file (default course/assignments.toml)")
    parser.add_argument("--submission-times", type=Path, help="CSV student,submitted_at for the late policy")
    parser.add_argument("--solutions", type=Path, default=course.REPO / "solutions",
                        help="solutions/ for locked-cell checksums (default: this checkout's)")
    parser.add_argument("--checks", type=Path, action="append", default=[], help="extra check module (hidden tests)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no table")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.jobs < 1 or args.timeout <= 0:
            raise ValueError(f"--jobs={args.jobs} must be >= 1 and --timeout={args.timeout:g} must be > 0")
        for path in args.checks:
            checks.load_file(path)
        assignment = course.get(args.assignment, args.assignments) if args.assignment else None
        submissions = discover(args.submissions)
        if args.results_json and len(submissions) > 1:
            raise ValueError(f"--results-json is Gradescope's per-submission file, but {len(submissions)} students "
                             f"were found; use --out and --feedback-dir for a class")
        exercises = select_exercises([p for _, p in submissions], assignment)
        times = _submission_times(args.submission_times)
    except (ValueError, OSError) as error:
        print(f"python -m lab grade: error: {error}", file=sys.stderr)
        return 2
    if not isolation()["landlock_abi"]:
        print("warning: Landlock is not available: student code can read files this user can read",
              file=sys.stderr)
    locked = reference_checksums(args.solutions)
    if not locked:
        print(f"warning: no notebooks in --solutions {args.solutions}: locked cells are not checked", file=sys.stderr)
    protect = [str(p) for p in (*args.submissions, args.out, args.results_json, args.feedback_dir, args.solutions)
               if p is not None]
    results = grade_all(submissions, exercises, jobs=args.jobs, progress=not args.quiet, secret=args.seed_secret,
                        wall_s=args.timeout, locked=locked, protect=protect)
    for result in results:
        result.assignment = assignment.name if assignment else ""
        if assignment and result.student in times:
            result.late_days, result.multiplier = assignment.late(times[result.student])
    ids = [ex.id for ex in exercises]
    if args.out:
        args.out.write_text(report.csv_text(results, ids, results[0].assignment), encoding="utf-8")
    if args.results_json:
        args.results_json.parent.mkdir(parents=True, exist_ok=True)
        args.results_json.write_text(report.results_json(results[0]), encoding="utf-8")
    for result in results if args.feedback_dir else []:
        report.write_feedback(args.feedback_dir, result)
    if not args.quiet:
        if len(results) == 1:
            print(report.text_report(results[0].exercises, f"{results[0].student}: {results[0].path}",
                                     multiplier=results[0].multiplier))
        else:
            print(report.csv_text(results, ids, results[0].assignment), end="")
    return 0
