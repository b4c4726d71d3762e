"""Classroom assignments (`course/assignments.toml`): which exercises each grades, when it is due, what
lateness costs. Points are not repeated here: they are the checks' own (see `lab.grading.checks`)."""

from __future__ import annotations

import datetime as dt
import math
import sys
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from lab.grading import checks

REPO = Path(__file__).resolve().parents[2]
_KEYS = {"title", "exercises", "due", "late_penalty_per_day", "max_late_days"}


@dataclass(frozen=True)
class Assignment:
    name: str
    title: str
    exercises: tuple[str, ...]
    due: dt.datetime | None = None
    late_penalty_per_day: float = 0.0  # fraction of the total lost per started day
    max_late_days: int | None = None  # later than this scores 0

    def late(self, submitted: dt.datetime) -> tuple[int, float]:
        """(started days late, multiplier of the total) for a submission at `submitted`."""
        if self.due is None or submitted <= self.due:
            return 0, 1.0
        days = math.ceil((submitted - self.due) / dt.timedelta(days=1))
        if self.max_late_days is not None and days > self.max_late_days:
            return days, 0.0
        return days, max(0.0, 1.0 - days * self.late_penalty_per_day)

    def late_words(self, days: int) -> str:
        """The lateness as a student reads it ("5 days late, beyond the 3 allowed"): a bare multiplier of 0
        reads like a grading bug."""
        if days <= 0:
            return ""
        late = f"{days} day{'s' if days != 1 else ''} late"
        beyond = self.max_late_days is not None and days > self.max_late_days
        return f"{late}, beyond the {self.max_late_days} allowed" if beyond else late


def default_path() -> Path:
    here = Path("course/assignments.toml")
    return here if here.exists() else REPO / "course" / "assignments.toml"


def load(path: str | Path | None = None) -> dict[str, Assignment]:
    path = Path(path) if path else default_path()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ValueError(f"{path}: cannot read the assignments ({error})") from None
    known = checks.load_all()
    assignments = {}
    for name, table in data.items():
        unknown = set(table) - _KEYS if isinstance(table, dict) else {"(not a table)"}
        if unknown:
            raise ValueError(f"{path}: [{name}] has unknown key(s) {', '.join(sorted(unknown))}; "
                             f"allowed: {', '.join(sorted(_KEYS))}")
        exercises = tuple(table.get("exercises", ()))
        for exercise_id in exercises:
            if exercise_id not in known:
                raise ValueError(f"{path}: [{name}] lists unknown exercise {exercise_id!r}; valid: {', '.join(known)}")
            for required in known[exercise_id].requires:
                if required not in exercises:
                    raise ValueError(f"{path}: [{name}] has {exercise_id}, which builds on {required}: add it too")
        due = table.get("due")
        if due is not None and not isinstance(due, dt.datetime):
            raise ValueError(f"{path}: [{name}] due={due!r} must be a TOML date-time like 2026-10-02T23:59:00Z")
        if isinstance(due, dt.datetime) and due.tzinfo is None:
            due = due.replace(tzinfo=dt.timezone.utc)
        assignments[name] = Assignment(name, str(table.get("title", name)), exercises, due,
                                       float(table.get("late_penalty_per_day", 0.0)), table.get("max_late_days"))
    return assignments


def get(name: str, path: str | Path | None = None) -> Assignment:
    assignments = load(path)
    if name not in assignments:
        raise ValueError(f"unknown assignment {name!r}; valid: {', '.join(assignments) or '(none defined)'}")
    return assignments[name]


def covering(exercise_ids: Collection[str], assignments: Mapping[str, Assignment]) -> Assignment | None:
    """The assignment a notebook answers: the one holding most of its exercises (the first in the file on a tie).
    A notebook whose exercises belong to no assignment gets its chapter as one ("ch12", no due date), so that
    grading a course without --assignment scores each notebook out of what it answers, not out of every
    chapter found in the class; None when it answers no exercise at all."""
    ids = set(exercise_ids)
    best = max(assignments.values(), key=lambda a: len(ids & set(a.exercises)), default=None)
    if best is not None and ids & set(best.exercises):
        return best
    chapters = sorted(i.split(".")[0] for i in ids)
    if not chapters:
        return None
    chapter = max(chapters, key=chapters.count)
    return Assignment(f"ch{chapter}", f"Chapter {chapter}",
                      tuple(i for i, ex in checks.load_all().items() if ex.chapter == chapter))
