"""Run one exercise's checks against a student's cells. This is the only place where points are decided.

Points come from the checks' own verdicts in this process, never from the student's process: the sandbox
returns plain values, the checks compare them with the reference (`lab.calc`). A call that stops its sandbox
(it hangs, crashes, forks without end) fails its check with the function and, for a hang, the line it was
stopped at; the exercise's other functions are checked on in a fresh sandbox (`Sandboxes`). A cell that fails
when run, or a sandbox whose channel was tampered with, voids the whole exercise with one clear reason.
"""

from __future__ import annotations

import hashlib
import random
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lab.grading.checks import CRASH_HINT, CheckFailed, Exercise
from lab.grading.sandbox import CallError, ExerciseError, Sandbox, SandboxDied

HANG_HINT = "your code did not return: the message names the line it was stopped at — a loop whose condition " \
            "never changes, a wait for something that never comes, or a lock taken again by the code that holds it"
NETWORK_HINT = "graded code runs without a network (only its own loopback): compute the answer in your function"
STOPPED_HINT = "your code ended the process that ran it (a crash, os._exit, or a limit): the message says which"
KERNEL_CRASH_HINT = "Triton's interpreter reads and writes raw memory: a lane past the end of its tensor, or an " \
                    "address built with a wrong stride, lands outside it — every load and store whose lanes can " \
                    "pass the end needs a mask, and every address the strides it was given"
_MEMORY_FAULTS = (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS)  # what a write outside a buffer ends in


@dataclass
class CheckResult:
    name: str
    max_points: float
    points: float
    status: str  # passed, failed, not attempted
    message: str = ""
    hint: str = ""
    hidden: bool = False


@dataclass
class ExerciseResult:
    id: str
    max_points: float
    points: float
    status: str  # passed, partial, failed, not attempted
    reason: str = ""
    checks: list[CheckResult] = field(default_factory=list)
    output: str = ""  # what the student's code printed: shown to learners, never graded


@dataclass
class StudentResult:
    """One student's grade; `multiplier` is the late policy's (1.0 when on time)."""

    student: str
    path: str
    exercises: list[ExerciseResult]
    assignment: str = ""
    late_days: int = 0
    multiplier: float = 1.0

    @property
    def raw(self) -> float:
        return sum(e.points for e in self.exercises)

    @property
    def total(self) -> float:
        return round(self.raw * self.multiplier, 4)

    @property
    def max_points(self) -> float:
        return sum(e.max_points for e in self.exercises)


def seed(secret: str | None, exercise_id: str, check_name: str) -> int:
    """Inputs of a check: the same for every run with the same secret, unguessable without it."""
    text = "\0".join([secret or "public", exercise_id, check_name])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


class CallStopped(Exception):
    """A call into the student's code stopped its sandbox: the check fails with `message` and `hint`."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.message, self.hint = message, hint


def stopped(name: str, died: SandboxDied, packages: Sequence[str]) -> CallStopped:
    """What a check says of `name`'s call that stopped the sandbox: for a hang, the function and line it was
    stopped in; in Triton's interpreter, a memory fault is an access outside a tensor (a lane without a mask)."""
    if died.timed_out:
        at = f" — stopped in {died.function} at {died.where.removeprefix('in ')}" if died.where else ""
        return CallStopped(f"{name}() {died.reason}{at}", HANG_HINT)
    if died.signal in _MEMORY_FAULTS and "triton" in packages:
        return CallStopped(f"{name}() crashed the process (killed by {signal.Signals(died.signal).name}): in "
                           f"Triton's interpreter, a tl.load or tl.store outside its tensor — a lane past the end "
                           f"without a mask, or a wrong stride", KERNEL_CRASH_HINT)
    return CallStopped(f"{name}(): {died.reason}", STOPPED_HINT)


class Sandboxes:
    """An exercise's sandbox, started on first use and again after a call stopped it (a hang, a crash, a limit):
    the stop is that function's verdict, and the checks of the exercise's other functions go on in a fresh
    sandbox. A function once stopped is not called again: each later call fails at once with the same message,
    so N checks of a function that hangs cost one timeout, not N — at most one per function, each sandbox with
    its own `limits.wall_s`."""

    def __init__(self, make: Callable[[], Sandbox], packages: Sequence[str]) -> None:
        self._make, self._packages = make, tuple(packages)
        self._box: Sandbox | None = None
        self._stopped: dict[str, CallStopped] = {}
        self._printed: list[str] = []
        self._tried: list[str] = []  # what closed sandboxes' code tried to reach on the network

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if name in self._stopped:
            raise self._stopped[name]
        if self._box is None:
            box = self._make()
            try:
                box.__enter__()  # closes the box when it cannot start: the cell itself fails (ExerciseError)
            except BaseException:
                self._printed.append(box.output())
                raise
            self._box = box
        try:
            return self._box.call(name, *args, **kwargs)
        except SandboxDied as died:
            self.close()
            self._stopped[name] = stopped(name, died, self._packages)
            raise self._stopped[name] from None

    def close(self) -> None:
        if self._box is not None:
            self._box.close()
            self._printed.append(self._box.output())
            self._tried += self._box.network_tried
            self._box = None

    def network_tried(self) -> list[str]:
        """Every attempt to reach the network (blocked) of the student's code so far, oldest first."""
        return self._tried + (self._box.network_tried if self._box is not None else [])

    def output(self) -> str:
        """The last 4000 characters the student's code printed, over every sandbox the exercise used."""
        return "".join(self._printed)[-4000:]


class Student:
    """What checks call: `student.fn(*args)` runs the exercise's `fn` in the sandbox and returns plain data;
    `student.ranks(fn, world_size, *args)` runs it on `world_size` ranks (through `lab.distributed.run`) and
    returns one value per rank."""

    def __init__(self, box: Sandboxes, entry: Sequence[str]) -> None:
        self._box, self._entry = box, tuple(entry)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in self._entry:
            raise AttributeError(f"a check may call only the exercise's entry points {self._entry}, not {name!r}")
        return lambda *args, **kwargs: self._box.call(name, *args, **kwargs)

    def ranks(self, name: str, world_size: int, *args: Any, deadline_s: float | None = None, **kwargs: Any) -> list:
        """`name(*args, **kwargs)` on each of `world_size` ranks. With `deadline_s`, ranks that wait longer (a
        deadlock) are stopped then, and the CallError names them and the operation each waits in — without it
        a hang costs the rest of the exercise's budget."""
        if name not in self._entry:
            raise AttributeError(f"a check may call only the exercise's entry points {self._entry}, not {name!r}")
        return self._box.call(name, *args, world_size=world_size, deadline_s=deadline_s, **kwargs)


def not_graded(ex: Exercise, reason: str, hidden: bool = True, not_attempted: bool = False) -> ExerciseResult:
    """Zero for every check, for one reason (a missing cell, an edited locked cell, a dead sandbox, ...)."""
    checks = [CheckResult(c.name, c.points, 0, "not attempted" if not_attempted else "failed", reason, c.hint,
                          c.hidden) for c in ex.checks if hidden or not c.hidden]
    return ExerciseResult(ex.id, sum(c.max_points for c in checks), 0, "not attempted" if not_attempted else "failed",
                          reason, checks)


def note_dependencies(results: Sequence[ExerciseResult], exercises: dict[str, Exercise]) -> None:
    """A failing exercise that builds on another failing one says so: fix that one first."""
    points = {r.id: (r.points, r.max_points) for r in results}
    for result in results:
        weak = [i for i in exercises[result.id].requires if i in points and points[i][0] < points[i][1]]
        if weak and result.points < result.max_points and not result.reason:
            result.reason = f"builds on {', '.join(weak)}, which {'is' if len(weak) == 1 else 'are'} not fully " \
                            f"right yet: start there"


def _status(checks: list[CheckResult]) -> str:
    if all(c.status == "passed" for c in checks):
        return "passed"
    if all(c.status == "not attempted" for c in checks):
        return "not attempted"
    return "partial" if any(c.points for c in checks) else "failed"


def run_exercise(ex: Exercise, parts: Sequence[tuple[str, str]], *, secret: str | None = None, hidden: bool = True,
                 wall_s: float = 60.0, protect: Sequence[str] = ()) -> ExerciseResult:
    """Grade `parts` ((label, cell source) in run order: required exercises' cells, then this one's)."""
    checks = [c for c in ex.checks if hidden or not c.hidden]
    box = Sandboxes(lambda: Sandbox(parts, entry=ex.entry, modules=ex.modules, packages=ex.packages,
                                    limits=ex.limits(wall_s), protect=protect), ex.packages)
    results: list[CheckResult] = []
    stubs_hit: list[str] = []
    try:
        student = Student(box, ex.entry)
        for check in checks:
            results.append(_run_check(ex, check, student, box, secret, stubs_hit))
    except ExerciseError as error:
        box.close()
        result = not_graded(ex, error.reason, hidden, error.not_attempted)
        result.output = box.output()
        return result
    finally:
        box.close()
    points = sum(c.points for c in results)
    status = _status(results)
    reason = ""
    if status == "not attempted":  # this exercise's stub, or one it builds on (its checks say which)
        stubs = ", ".join(dict.fromkeys(stubs_hit)) or ", ".join(ex.entry)
        reason = results[0].message or f"not attempted: {stubs} {'raises' if ', ' not in stubs else 'raise'} " \
                                       f"NotImplementedError (write your answer in the cell)"
    return ExerciseResult(ex.id, sum(c.points for c in checks), points, status, reason, results, box.output())


def _run_check(ex: Exercise, check: Any, student: Student, box: Sandboxes, secret: str | None,
               stubs_hit: list[str]) -> CheckResult:
    """One check's verdict, said of the network when the student's code reached for it during the check (the
    sandbox has none, so that was the failure, even where the code caught the error and returned something)."""
    tried = len(box.network_tried())
    result = _check_verdict(ex, check, student, secret, stubs_hit)
    attempts = box.network_tried()[tried:]
    if attempts and result.status == "failed":
        if "blocked: graded code has no network" not in result.message:
            result.message += f" (blocked: graded code has no network, and it tried to {attempts[-1]})"
        result.hint = NETWORK_HINT
    return result


def _check_verdict(ex: Exercise, check: Any, student: Student, secret: str | None,
                   stubs_hit: list[str]) -> CheckResult:
    """A crash of the student's code replaces the check's hint (it was written for a wrong answer, not a crash);
    the student's functions that still raise the released stub go to `stubs_hit`."""
    def verdict(status: str, message: str = "", hint: str | None = None) -> CheckResult:
        points = check.points if status == "passed" else 0
        return CheckResult(check.name, check.points, points, status, message,
                           check.hint if hint is None else hint, check.hidden)

    try:
        check.fn(student, random.Random(seed(secret, ex.id, check.name)))
    except CheckFailed as failure:
        return verdict("failed", str(failure), failure.hint)
    except CallStopped as stop:  # the check's own hint was written for a wrong answer, not for this
        return verdict("failed", stop.message, stop.hint)
    except CallError as error:
        if not error.not_attempted:
            return verdict("failed", str(error), CRASH_HINT if error.where else None)
        other = error.message.removeprefix("NotImplementedError: exercise ")
        if other in (ex.id, error.message):
            stubs_hit += [error.function] if error.function else []
            return verdict("not attempted")
        return verdict("not attempted", f"needs {other}, which is not done yet")
    except ExerciseError:
        raise
    except Exception as error:  # the answer had a shape the check could not use (a str for a number, ...)
        return verdict("failed", f"the check could not use the answer: {type(error).__name__}: {error}")
    return verdict("passed")
