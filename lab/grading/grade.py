"""`python -m lab grade`: grade a class's notebooks, every exercise in its own sandbox.

    python -m lab grade submissions/ --out grades.csv --totals totals.csv --feedback-dir feedback/ --jobs 4
    python -m lab grade submissions/ --assignment A1 --out grades.csv --submission-times times.csv
    python -m lab grade /autograder/submission --results-json /autograder/results/results.json   (Gradescope)

A SUBMISSION is a notebook or a folder of them (searched recursively), one per student and assignment: without
--assignment each notebook is graded on the assignment its exercises belong to (a course at once, a row per
student and assignment, --totals per student). With --results-json (Gradescope) the one SUBMISSION is a single
student's: the notebook answering most of the assignment is graded, and results.json is written whatever was
uploaded (a zero with the reason when there is nothing to grade). The student id comes
from names the instructor controls, never from the notebook: a notebook given by name is its file name
(without .ipynb); in a folder, a notebook at the top is its file name and one in a sub-folder is that
sub-folder's name (submissions/ada/whatever.ipynb is "ada"). Inputs are random, derived from --seed-secret
(or $LAB_SEED_SECRET, which process listings do not show); without one they are the public inputs learners
see. A notebook that is broken, lacks a cell, edited a locked cell or whose code misbehaves scores 0 on the
exercises concerned, with the reason; every other student is still graded. Whatever could make a grade
wrong (two notebooks of one student for one assignment, submission times that match nobody, no class secret,
no Landlock) is a warning on stderr, and an error with --strict.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lab.grading import assignments as course
from lab.grading import checks, gradescope, report
from lab.grading.checks import Exercise
from lab.grading.confine import isolation
from lab.grading.locked import accepted, from_notebooks
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


def notebooks_in(path: Path) -> list[Path]:
    """The notebooks a SUBMISSION argument names: the file, or those in the folder (not JupyterLab's copies)."""
    if path.is_dir():
        return [p for p in sorted(path.rglob("*.ipynb")) if ".ipynb_checkpoints" not in p.parts]
    if path.is_file():
        return [path]
    raise ValueError(f"{path}: no such file or folder (give notebooks or folders of notebooks)")


def discover(paths: Sequence[Path], warn: Callable[[str], None] | None = None,
             assignment_of: Callable[[Path], str] = lambda path: "") -> list[tuple[str, Path]]:
    """(student id, notebook) for every submission, sorted by id. Two notebooks of one student for one
    assignment (`assignment_of`, when a course is graded at once) are both kept, each as "student/what tells
    them apart" (a warning says so: one student handed in twice?)."""
    found = [(p, path) for path in paths for p in notebooks_in(path)]  # (notebook, what was given)
    if not found:
        raise ValueError(f"no notebooks found in {', '.join(map(str, paths))}")
    warn = warn or (lambda message: print(f"warning: {message}", file=sys.stderr))
    keys = [(_identity(path, given), assignment_of(path)) for path, given in found]
    out = []
    for key, (path, given) in zip(keys, found, strict=True):
        if keys.count(key) > 1:  # "ada/first" for subs/ada/first.ipynb; "ada/subs" for subs/ada.ipynb
            below = path.relative_to(given).with_suffix("").parts[1:] if path != given else ()
            out.append(("/".join([key[0], *below]) if below else f"{key[0]}/{path.parent.name}", path))
        else:
            out.append((key[0], path))
    for sid, work in sorted({k for k in keys if keys.count(k) > 1}):
        named = ", ".join(str(p) for (p, _), k in zip(found, keys, strict=True) if k == (sid, work))
        warn(f"{keys.count((sid, work))} notebooks belong to student {sid!r}{f' for {work}' if work else ''} "
             f"({named}): each is graded under its own path; keep one per student{' and assignment' * bool(work)}")
    return sorted(out)


def owner(student: str) -> str:
    """The student a submission belongs to ("ada" for "ada/first", one of two notebooks `discover` found)."""
    return student.split("/")[0]


def notebook_exercises(path: Path) -> list[str]:
    """The exercises a notebook answers: those its cells name; for a notebook that cannot be read or names none,
    its file name's chapter's (NN_slug.ipynb), so that it still lands in its assignment and scores 0 there with
    the reason."""
    try:
        named = exercise_ids(read(path))
    except NotebookError:
        named = []
    chapters = re.findall(r"^(\d\d[a-z]?)_", path.name)
    return named or [i for i, ex in checks.load_all().items() if ex.chapter in chapters]


def _exercises(work: course.Assignment | None) -> list[Exercise]:
    known = checks.load_all()
    return [known[i] for i in work.exercises] if work else []


def _in_file_order(names: Iterable[str], assignments: dict[str, course.Assignment]) -> list[str]:
    """Assignment names in course/assignments.toml's order, chapters ("ch12") after them: rows and columns
    come out in the same order on every run."""
    names = set(names)
    return [n for n in assignments if n in names] + sorted(names - set(assignments))


Planned = tuple[str, Path | None, course.Assignment | None]  # student, notebook, assignment; None: a zero


def course_plan(paths: Sequence[Path], assignment: course.Assignment | None,
                assignments: dict[str, course.Assignment], warn: Callable[[str], None]) -> list[Planned]:
    """(student, notebook, assignment) for every notebook, by student then assignment: `assignment` for all,
    else the one each notebook answers (`course.covering`), so that a student's chapter notebooks are each
    scored out of their own assignment. A notebook that answers no exercise of the course is left out, with
    a warning."""
    works = {}

    def assignment_of(path: Path) -> str:
        works[path] = assignment or course.covering(notebook_exercises(path), assignments)
        return works[path].name if works[path] and not assignment else ""

    submissions = discover(paths, warn, assignment_of)
    for _, path in submissions:
        if works[path] is None:
            warn(f"{path}: answers no exercise of the course (not a course notebook?): not graded")
    order = _in_file_order((w.name for w in works.values() if w), assignments)
    plan = [(sid, path, works[path]) for sid, path in submissions if works[path]]
    if not plan:
        raise ValueError("no exercise found in the submissions (name them NN_slug.ipynb or pass --assignment)")
    return sorted(plan, key=lambda p: (p[0], order.index(p[2].name)))


def one_submission(paths: Sequence[Path], assignment: course.Assignment | None,
                   assignments: dict[str, course.Assignment]) -> tuple[list[Planned], str]:
    """Gradescope's single submission and what results.json says of it: the notebook that answers most of the
    assignment (`gradescope.pick`), or a zero with the reason when there is none to grade; a broken submission
    must still give the student a results.json."""
    if len(paths) > 1:
        raise ValueError(f"--results-json is Gradescope's per-submission file: give one submission (a notebook or "
                         f"a folder), not {len(paths)}; use --out and --feedback-dir for a class")
    wanted = assignment.exercises if assignment else tuple(checks.load_all())
    chosen = gradescope.pick(paths[0], notebooks_in(paths[0]), wanted)
    if chosen.notebook is None:
        return [(paths[0].stem, None, assignment)], chosen.note
    work = assignment or course.covering(notebook_exercises(chosen.notebook), assignments)
    note = chosen.note if work else f"{chosen.note}\nIt answers no exercise of the course: nothing was graded."
    return [(_identity(chosen.notebook, paths[0]), chosen.notebook if work else None, work)], note


def select_exercises(submissions: Sequence[Path], assignment: course.Assignment | None) -> list[Exercise]:
    """The assignment's exercises, else every exercise of the chapters the submissions answer
    (`notebook_exercises`)."""
    known = checks.load_all()
    if assignment:
        return _exercises(assignment)
    chapters = {i.split(".")[0] for path in submissions for i in notebook_exercises(path)}
    chosen = [ex for ex in known.values() if ex.chapter in chapters]
    if not chosen:
        raise ValueError("no exercise found in the submissions (name them NN_slug.ipynb or pass --assignment)")
    return chosen


def reference_checksums(solutions: Path | None = None) -> dict[str, list[list[str]]]:
    """Each exercise's accepted versions of its locked cells' checksums (a submission's own metadata is not
    trusted): the notebooks' in `solutions`, else every release's recorded in `lab` (`locked.accepted`: a copy
    handed out before an erratum is not an edited one) — the very ones a learner's `python -m lab check` uses."""
    if solutions is None:
        return accepted()
    return {key: [sums] for key, sums in from_notebooks(solutions).items()}


def grade_notebook(path: Path, exercises: Sequence[Exercise], *, student: str = "", secret: str | None = None,
                   wall_s: float = 60.0, locked: dict[str, list[list[str]]] | None = None, hidden: bool = True,
                   protect: Sequence[str] = ()) -> StudentResult:
    """Grade one notebook: each exercise in its own sandbox, each failure confined to its exercise.
    `locked` gives each exercise's accepted versions of its locked cells (`reference_checksums`).
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
        elif locked and ex.id in locked and locked_checksums(nb, ex.id) not in locked[ex.id]:
            result = not_graded(ex, f"a locked cell of {ex.id} was edited or deleted (checksum differs from the "
                                    f"released copy of the notebook)", hidden)
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


def grade_planned(student: str, path: Path | None, work: course.Assignment | None, reason: str = "",
                  **options) -> StudentResult:
    """One planned notebook graded on its assignment's exercises; without a notebook, 0 on each, for `reason`."""
    if path is None:
        return StudentResult(student, "", [not_graded(ex, reason) for ex in _exercises(work)],
                             work.name if work else "")
    result = grade_notebook(path, _exercises(work), student=student, **options)
    result.assignment = work.name
    return result


def grade_all(plan: Sequence[Planned], *, jobs: int = 1, progress: bool = True, **options) -> list[StudentResult]:
    """Grade every planned notebook, `jobs` at a time (each student's sandboxes run one after the other)."""
    from tqdm import tqdm

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(grade_planned, *planned, **options) for planned in plan]
        with tqdm(total=len(futures), desc="grading", unit="student", disable=not progress, file=sys.stderr) as bar:
            results = []
            for future in futures:
                results.append(future.result())
                bar.update()
    return results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lab grade", description=__doc__.split("\n\n")[0])
    parser.add_argument("submissions", nargs="+", type=Path, metavar="SUBMISSION")
    parser.add_argument("--out", type=Path, help="grades CSV: a row per student and assignment, a column per exercise")
    parser.add_argument("--totals", type=Path,
                        help="course totals CSV: a row per student, a column per assignment, the total (a gradebook)")
    parser.add_argument("--results-json", type=Path, help="Gradescope's results.json (one submission)")
    parser.add_argument("--feedback-dir", type=Path, help="an HTML page per student")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per exercise (wall and CPU)")
    parser.add_argument("--jobs", type=int, default=1, help="students graded in parallel")
    parser.add_argument("--seed-secret", default=os.environ.get("LAB_SEED_SECRET"), help="class secret for inputs")
    parser.add_argument("--assignment", help="grade only this assignment (course/assignments.toml); without it, "
                                             "each notebook is graded on the assignment its exercises belong to")
    parser.add_argument("--assignments", type=Path, help="assignments file (default course/assignments.toml)")
    parser.add_argument("--submission-times", type=Path, help="CSV student,submitted_at for the late policy")
    parser.add_argument("--solutions", type=Path, help="notebooks for locked-cell checksums (default: those "
                                                        "`python -m lab release` recorded in lab, as lab check)")
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
        assignments = course.load(args.assignments)
        assignment = course.get(args.assignment, args.assignments) if args.assignment else None
        if args.results_json:
            plan, note = one_submission(args.submissions, assignment, assignments)
        else:
            plan, note = course_plan(args.submissions, assignment, assignments, warn), ""
        times = _submission_times(args.submission_times)
        if args.submission_times and not assignment:
            warn("--submission-times is unused without --assignment (the due date and late policy are the "
                 "assignment's)")
        elif args.submission_times:
            check_times(times, sorted({owner(sid) for sid, _, _ in plan}), args.submission_times, warn)
        if not args.seed_secret:
            warn("no class secret (--seed-secret or $LAB_SEED_SECRET): grading uses the public seed, so learners "
                 "have seen these very inputs and expected values in lab.check's messages and can hard-code them")
        layers = isolation()
        if not layers["landlock_abi"]:
            warn("Landlock is not available: student code can read (and write) files this user can")
        if layers["network"] not in ("namespace", "user namespace"):
            warn("no network namespace can be made here: " + (
                "exercises without ranks are refused internet sockets (seccomp), but multi-rank exercises' code can "
                "reach this machine's loopback services and other hosts" if layers["network"] == "seccomp" else
                "graded code can reach this machine's loopback services and other hosts (an answer could come from "
                "a server); python -m lab doctor says what is missing"))
        locked = reference_checksums(args.solutions)
        if not locked:
            warn(f"no notebooks in --solutions {args.solutions}: locked cells are not checked" if args.solutions else
                 "no locked-cell checksums recorded in lab (run python -m lab release): locked cells are not checked")
    except (ValueError, OSError) as error:
        print(f"python -m lab grade: error: {error}", file=sys.stderr)
        return 2
    warn.flush()
    protect = [str(p) for p in (*args.submissions, args.out, args.totals, args.results_json, args.feedback_dir,
                                args.solutions) if p is not None]
    results = grade_all(plan, jobs=args.jobs, progress=not args.quiet, reason=note, secret=args.seed_secret,
                        wall_s=args.timeout, locked=locked, protect=protect)
    late = {}
    for result in results:
        if assignment and owner(result.student) in times:
            result.late_days, result.multiplier = assignment.late(times[owner(result.student)])
            late[result.student] = assignment.late_words(result.late_days)
    write_outputs(args, results, assignments, late, note)
    return 0


def write_outputs(args: argparse.Namespace, results: Sequence[StudentResult],
                  assignments: dict[str, course.Assignment], late: dict[str, str], note: str) -> None:
    """Each output the command line asked for, from the graded results; `late` words each late student's penalty
    and `note` says which notebook of a Gradescope submission was graded."""
    columns: dict[str, list[str]] = {}  # assignment: its exercises, the CSV's columns in the file's order
    for result in results:
        columns.setdefault(result.assignment, [e.id for e in result.exercises])
    ids = [i for name in _in_file_order(columns, assignments) for i in columns[name]]
    if args.out:
        args.out.write_text(report.csv_text(results, ids), encoding="utf-8")
    if args.totals:
        args.totals.write_text(report.totals_csv(results, owner), encoding="utf-8")
    if args.results_json:
        args.results_json.parent.mkdir(parents=True, exist_ok=True)
        args.results_json.write_text(report.results_json(results[0], late.get(results[0].student, ""), note),
                                     encoding="utf-8")
    by_assignment = not (args.assignment or args.results_json)  # a course at once: a page per assignment
    for result in results if args.feedback_dir else []:
        report.write_feedback(args.feedback_dir, result, late.get(result.student, ""), by_assignment=by_assignment)
    if args.quiet:
        return
    if len(results) == 1:
        print(report.text_report(results[0].exercises, f"{results[0].student}: {results[0].path}",
                                 multiplier=results[0].multiplier, late=late.get(results[0].student, "")))
        if note:
            print(note)
        return
    print(report.csv_text(results, ids), end="")
    if by_assignment:
        print(f"\n{report.totals_csv(results, owner)}", end="")
