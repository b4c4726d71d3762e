"""`python -m lab grade`: grade a class's notebooks, every exercise in its own sandbox.

    python -m lab grade submissions/ --out grades.csv --feedback-dir feedback/ --jobs 4
    python -m lab grade submissions/ --assignment A1 --out grades.csv --submission-times times.csv
    python -m lab grade /autograder/submission --results-json /autograder/results/results.json   (Gradescope)

A SUBMISSION is a notebook or a folder of them (searched recursively), one per student. The student id comes
from names the instructor controls, never from the notebook: a notebook given by name is its file name
(without .ipynb); in a folder, a notebook at the top is its file name and one in a sub-folder is that
sub-folder's name (submissions/ada/whatever.ipynb is "ada"). Inputs are random, derived from --seed-secret
(or $LAB_SEED_SECRET, which process listings do not show); without one they are the public inputs learners
see. A notebook that is broken, lacks a cell, edited a locked cell or whose code misbehaves scores 0 on the
exercises concerned, with the reason; every other student is still graded. Whatever could make a grade
wrong (two notebooks of one student, submission times that match nobody, no class secret, no Landlock) is a
warning on stderr, and an error with --strict.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import os
import re
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lab.grading import assignments as course
from lab.grading import checks, report
from lab.grading.checks import Exercise
from lab.grading.confine import isolation
from lab.grading.notebook import NotebookError, answer_parts, exercise_ids, locked_checksums, read
from lab.grading.runner import ExerciseResult, StudentResult, not_graded, note_dependencies, run_exercise


class Warnings:
    """What could make a grade wrong, said on stderr once the command line is known to be valid (so that an
    error stays one line); with `strict`, the first one is an error instead."""

    def __init__(self, strict: bool = False) -> None:
        self.strict, self.said = strict, []

    def __call__(self, message: str) -> None:
        if self.strict:
            raise ValueError(f"{message} (--strict)")
        self.said.append(message)

    def flush(self) -> None:
        for message in self.said:
            print(f"warning: {message}", file=sys.stderr)
        self.said.clear()


def _identity(path: Path, given: Path) -> str:
    """A notebook's student id from names the instructor controls: the file given by name, else the first
    folder below the given one, else (at the top of the given folder) the file name."""
    if path == given:
        return path.stem
    relative = path.relative_to(given)
    return relative.parts[0] if len(relative.parts) > 1 else path.stem


def discover(paths: Sequence[Path], warn: Callable[[str], None] | None = None) -> list[tuple[str, Path]]:
    """(student id, notebook) for every submission, sorted by id. Two notebooks of one student are both kept,
    each as "student/what tells them apart" (a warning says so: one student handed in twice?)."""
    found: list[tuple[Path, Path]] = []  # (notebook, what was given)
    for path in paths:
        if path.is_dir():
            found += [(p, path) for p in sorted(path.rglob("*.ipynb")) if ".ipynb_checkpoints" not in p.parts]
        elif path.is_file():
            found.append((path, path))
        else:
            raise ValueError(f"{path}: no such file or folder (give notebooks or folders of notebooks)")
    if not found:
        raise ValueError(f"no notebooks found in {', '.join(map(str, paths))}")
    warn = warn or (lambda message: print(f"warning: {message}", file=sys.stderr))
    ids = [_identity(path, given) for path, given in found]
    out = []
    for sid, (path, given) in zip(ids, found, strict=True):
        if ids.count(sid) > 1:  # "ada/first" for subs/ada/first.ipynb; "ada/subs" for subs/ada.ipynb
            below = path.relative_to(given).with_suffix("").parts[1:] if path != given else ()
            out.append(("/".join([sid, *below]) if below else f"{sid}/{path.parent.name}", path))
        else:
            out.append((sid, path))
    for sid in sorted({i for i in ids if ids.count(i) > 1}):
        named = ", ".join(str(p) for (p, _), i in zip(found, ids, strict=True) if i == sid)
        warn(f"{ids.count(sid)} notebooks belong to student {sid!r} ({named}): each is graded under its own "
             f"path; keep one per student")
    return sorted(out)


def owner(student: str) -> str:
    """The student a submission belongs to ("ada" for "ada/first", one of two notebooks `discover` found)."""
    return student.split("/")[0]


def select_exercises(submissions: Sequence[Path], assignment: course.Assignment | None) -> list[Exercise]:
    """The assignment's exercises, else every exercise of the chapters the submissions belong to (from the
    file names, NN_slug.ipynb, and the exercises their cells name)."""
    known = checks.load_all()
    if assignment:
        return [known[i] for i in assignment.exercises]
    chapters = set()
    for path in submissions:
        chapters |= set(re.findall(r"^(\d\d[a-z]?)_", path.name))
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
    return StudentResult(student or path.stem, str(path), results)


def _submission_times(path: Path | None) -> dict[str, dt.datetime]:
    if path is None:
        return {}
    times = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            try:
                student = row["student"].strip()
                when = dt.datetime.fromisoformat(row["submitted_at"].replace("Z", "+00:00"))
            except (KeyError, ValueError, AttributeError):
                raise ValueError(f"{path}: needs columns student,submitted_at (ISO 8601); got {row}") from None
            times[student] = when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)
    return times


def check_times(times: dict[str, dt.datetime], students: Sequence[str], source: Path,
                warn: Callable[[str], None]) -> None:
    """Every row of the submission times names a student, and every student has a time: a typo in either
    would silently cost or spare a late penalty."""
    unknown = sorted(set(times) - set(students))
    if unknown:
        warn(f"{source}: {len(unknown)} row(s) match no submission ({', '.join(map(repr, unknown[:5]))}"
             f"{', ...' if len(unknown) > 5 else ''}); students are {', '.join(map(repr, students[:5]))}"
             f"{', ...' if len(students) > 5 else ''}")
    missing = [s for s in students if s not in times]
    if missing:
        warn(f"{source}: no submission time for {len(missing)} student(s) ({', '.join(map(repr, missing[:5]))}"
             f"{', ...' if len(missing) > 5 else ''}): they are graded as on time")


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
    parser.add_argument("--strict", action="store_true",
                        help="refuse to grade where a warning would be given (for scripted, unattended grading)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warn = Warnings(args.strict)
    try:
        if args.jobs < 1 or args.timeout <= 0:
            raise ValueError(f"--jobs={args.jobs} must be >= 1 and --timeout={args.timeout:g} must be > 0")
        for path in args.checks:
            checks.load_file(path)
        assignment = course.get(args.assignment, args.assignments) if args.assignment else None
        submissions = discover(args.submissions, warn)
        if args.results_json and len(submissions) > 1:
            raise ValueError(f"--results-json is Gradescope's per-submission file, but {len(submissions)} students "
                             f"were found; use --out and --feedback-dir for a class")
        exercises = select_exercises([p for _, p in submissions], assignment)
        times = _submission_times(args.submission_times)
        if args.submission_times and not assignment:
            warn("--submission-times is unused without --assignment (the due date and late policy are the "
                 "assignment's)")
        elif args.submission_times:
            check_times(times, sorted({owner(sid) for sid, _ in submissions}), args.submission_times, warn)
        if not args.seed_secret:
            warn("no class secret (--seed-secret or $LAB_SEED_SECRET): grading uses the public seed, so learners "
                 "have seen these very inputs and expected values in lab.check's messages and can hard-code them")
        if not isolation()["landlock_abi"]:
            warn("Landlock is not available: student code can read (and write) files this user can")
        locked = reference_checksums(args.solutions)
        if not locked:
            warn(f"no notebooks in --solutions {args.solutions}: locked cells are not checked")
    except (ValueError, OSError) as error:
        print(f"python -m lab grade: error: {error}", file=sys.stderr)
        return 2
    warn.flush()
    protect = [str(p) for p in (*args.submissions, args.out, args.results_json, args.feedback_dir, args.solutions)
               if p is not None]
    results = grade_all(submissions, exercises, jobs=args.jobs, progress=not args.quiet, secret=args.seed_secret,
                        wall_s=args.timeout, locked=locked, protect=protect)
    for result in results:
        result.assignment = assignment.name if assignment else ""
        if assignment and owner(result.student) in times:
            result.late_days, result.multiplier = assignment.late(times[owner(result.student)])
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
