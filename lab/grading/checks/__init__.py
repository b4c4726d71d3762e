"""How exercise checks are written: ordinary Python that runs in the grader and calls the student's code.

A chapter's module (`ch01.py`, ...) declares each exercise and its checks::

    PARAM_COUNT = exercise("01.param_count", entry=("param_count",))

    @PARAM_COUNT.check(points=1, hint="K and V have n_kv_heads heads, not n_heads")
    def grouped_query_attention(student, rng):
        '''grouped-query attention: K and V have fewer heads'''
        cfg = random_config(rng, gqa=True)
        expect_equal(student.param_count(cfg), count_params(cfg), f"param_count({describe(cfg)})")

`student.param_count(...)` runs in the sandbox (see `sandbox.py`); `rng` is seeded from the class secret,
the exercise and the check, so hard-coded answers fail and every grading run sees the same inputs. Checks
marked `hidden=True` run only when an instructor grades (Otter's hidden tests). The points of an exercise are
the sum of its checks' points: the notebook's metadata must agree (the release checks), but the grader never
trusts a submission's metadata.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import pkgutil
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from lab.grading.sandbox import CallError, Limits

_ID = re.compile(r"^\d\d[a-z]?\.[a-z][a-z0-9_]*$")
REGISTRY: dict[str, Exercise] = {}


class CheckFailed(AssertionError):
    """A check saw a wrong answer; the message says what was called, what came back and what was expected.
    `hint`, when given, replaces the check's fixed hint: the numbers (or a crash) told what went wrong."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


CRASH_HINT = "your code raised an exception: the message names the cell and the line"


@dataclass(frozen=True)
class Check:
    name: str
    points: float
    fn: Callable[[Any, Any], None]
    hint: str = ""
    hidden: bool = False


@dataclass
class Exercise:
    """One graded exercise: the names its cell must define, what its sandbox may import, its checks.

    `requires` lists exercises whose cells run before this one's (a later exercise may call an earlier
    answer, as the notebook does); `modules` are the `lab` modules copied into the sandbox and `packages`
    the third-party packages it may read (with their dependencies).
    """

    id: str
    entry: tuple[str, ...]
    requires: tuple[str, ...] = ()
    modules: tuple[str, ...] = ("lab.config",)
    packages: tuple[str, ...] = ("tomli_w",)
    memory_mb: int = 1024
    checks: list[Check] = field(default_factory=list)

    @property
    def points(self) -> float:
        return sum(c.points for c in self.checks)

    @property
    def chapter(self) -> str:
        return self.id.split(".")[0]

    def limits(self, wall_s: float) -> Limits:
        return Limits(wall_s=wall_s, cpu_s=max(1, math.ceil(wall_s)), memory_mb=self.memory_mb)

    def check(self, points: float, hint: str = "", hidden: bool = False) -> Callable:
        """Decorator: register `fn(student, rng)` as a check; its name is its docstring's first line."""
        def register(fn: Callable) -> Callable:
            name = (fn.__doc__ or fn.__name__).strip().splitlines()[0]
            if any(c.name == name for c in self.checks):
                raise ValueError(f"{self.id}: two checks are named {name!r}; give each its own docstring")
            self.checks.append(Check(name, points, fn, hint, hidden))
            return fn
        return register


def exercise(exercise_id: str, entry: tuple[str, ...], **options: Any) -> Exercise:
    if not _ID.match(exercise_id):
        raise ValueError(f"exercise id {exercise_id!r} must look like '01.param_count' (chapter.snake_case)")
    REGISTRY[exercise_id] = Exercise(exercise_id, tuple(entry), **options)
    return REGISTRY[exercise_id]


def load_all() -> dict[str, Exercise]:
    """Every exercise of the course: imports `lab.grading.checks.chNN` modules."""
    for module in pkgutil.iter_modules(__path__):
        if re.fullmatch(r"ch\d\d[a-z]?", module.name):
            importlib.import_module(f"{__name__}.{module.name}")
    return REGISTRY


def load_file(path: str | Path) -> list[Exercise]:
    """Exercises from a check module outside the package (e.g. hidden tests an instructor keeps private)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--checks {path}: no such file (a Python module of exercise checks)")
    before = dict(REGISTRY)
    spec = importlib.util.spec_from_file_location(f"lab_checks_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return [ex for key, ex in REGISTRY.items() if before.get(key) is not ex]


def get(exercise_id: str) -> Exercise:
    exercises = load_all()
    if exercise_id not in exercises:
        chapter = [k for k in exercises if k.split(".")[0] == exercise_id.split(".")[0]]
        raise ValueError(f"unknown exercise {exercise_id!r}; valid: {', '.join(chapter or exercises)}")
    return exercises[exercise_id]


# --- helpers for writing checks -----------------------------------------------------------------------

def describe(value: Any) -> str:
    """A short, reproducible spelling of an argument: configs show only the fields that matter."""
    if dataclasses.is_dataclass(value):
        fields = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                  "tie_embeddings")
        return f"ModelConfig({', '.join(f'{k}={getattr(value, k)!r}' for k in fields)})"
    return repr(value)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _equal(got: Any, expected: Any) -> bool:
    if isinstance(expected, list):
        return isinstance(got, list) and len(got) == len(expected) and all(map(_equal, got, expected))
    return _number(got) and (not isinstance(got, float) or got.is_integer()) and got == expected


def digits(tol: float) -> int:
    """Significant digits that show a difference of relative size `tol` (at least 6)."""
    return max(6, math.ceil(-math.log10(tol)) + 2) if tol > 0 else 17


def shown(value: Any, places: int = 6) -> str:
    """A value for a message, floats at `places` significant digits: "returned ..., expected ..." print both
    sides at one precision, so that equal-looking numbers are equal and different ones look different."""
    if isinstance(value, float):  # exact when that is short (0.0, 1.5, 1e-05), else rounded
        return repr(value) if not math.isfinite(value) or float(f"{value:.{places}g}") == value else \
            f"{value:.{places}g}"
    if isinstance(value, list):
        return "[" + ", ".join(shown(v, places) for v in value) + "]"
    return repr(value)


class Mistake(NamedTuple):
    """A classic mistake that multiplies a whole answer by `factor` (e.g. a sum over dp ranks instead of their
    mean: `factor` = dp, `name` = "dp"): seen in the numbers, it is named in the message and `hint` is shown."""

    factor: float
    name: str
    hint: str


def factor_of(got: Any, expected: list[float], rel: float = 1e-5) -> float | None:
    """k when `got` = k·`expected` value by value (k ≠ 1, to `rel` of the largest value), else None."""
    if not (isinstance(got, list) and len(got) == len(expected) and expected and all(map(_number, got))):
        return None
    big = max(range(len(expected)), key=lambda i: abs(expected[i]))
    if expected[big] == 0 or not all(map(math.isfinite, got)):
        return None
    k = got[big] / expected[big]
    if math.isclose(k, 1.0, rel_tol=rel):
        return None
    tol = rel * abs(k * expected[big])
    return k if all(abs(g - k * e) <= tol for g, e in zip(got, expected, strict=True)) else None


def recognise(got: Any, expected: list[float], mistakes: Sequence[Mistake],
              rel: float = 1e-5) -> tuple[str, str | None]:
    """(a note for the message, the mistake's hint) when `got` is one of `mistakes`' multiples of `expected`
    (to `rel`), else ("", None)."""
    k = factor_of(got, expected, rel)
    for mistake in mistakes if k is not None else ():
        if math.isclose(k, mistake.factor, rel_tol=max(rel, 1e-4)):
            return f" — exactly {k:.4g} times the expected values ({mistake.name} = {mistake.factor:.4g})", \
                mistake.hint
    return "", None


def expect_equal(got: Any, expected: int | list, what: str) -> None:
    """An exact integer answer, or a list of them (an integral float is accepted: 1.2e10 bytes is whole)."""
    if not _equal(got, expected):
        raise CheckFailed(f"{what} returned {got!r}, expected {expected!r}")


def expect_close(got: Any, expected: float, what: str, rel: float = 1e-6, mistakes: Sequence[Mistake] = ()) -> None:
    if not _number(got) or not math.isclose(got, expected, rel_tol=rel):
        note, hint = recognise([got], [expected], mistakes)
        raise CheckFailed(f"{what} returned {shown(got, digits(rel))}, expected {shown(float(expected), digits(rel))}"
                          f"{note}", hint)


# --- helpers for checks that run torch or ranks: floats, drivers' dicts, crashes, messages ---------------------
# torch is imported inside the functions: `lab.check` loads every chapter's checks, the grader imports this.

RANKS = {"modules": ("lab.config", "lab.distributed"), "packages": ("tomli_w", "torch"), "memory_mb": 4096}
TORCH = {"modules": ("lab.config",), "packages": ("tomli_w", "torch"), "memory_mb": 2048}
POINT_TO_POINT = ("send", "isend", "recv", "irecv")


def preview(values: list, places: int = 6) -> str:
    """The first few values of a list and its length, for a message."""
    first = ", ".join(shown(v, places) for v in values[:4])
    return f"[{first}{', ...' if len(values) > 4 else ''}] ({len(values)} values)"


def close(got: Any, expected: float, tol: float) -> bool:
    """|got − expected| ≤ tol·(1 + |expected|); an infinite `expected` only exactly; NaN never."""
    if not _number(got):
        return False
    if math.isinf(expected):
        return got == expected
    return abs(got - expected) <= tol * (1 + abs(expected))  # False for NaN and inf


def expect_number(got: Any, expected: float, what: str, tol: float = 1e-9, mistakes: Sequence[Mistake] = ()) -> None:
    if not close(got, expected, tol):
        note, hint = recognise([got], [expected], mistakes)
        raise CheckFailed(f"{what} returned {shown(got, digits(tol))}, expected {shown(float(expected), digits(tol))}"
                          f"{note}", hint)


def expect_allclose(got: Any, expected: list[float], what: str, tol: float = 1e-4,
                    mistakes: Sequence[Mistake] = ()) -> None:
    """A list of numbers equal to `expected` within tol·(1 + |expected|) each (see `close`: ±inf only where it
    is due, NaN never). An answer that is one of `mistakes`' multiples of `expected` says which."""
    places = digits(tol)
    if not isinstance(got, list) or len(got) != len(expected):
        size = f"{len(got)} values" if isinstance(got, list) else repr(got)[:80]
        raise CheckFailed(f"{what} returned {size}, expected {preview(expected, places)}")
    for index, (g, e) in enumerate(zip(got, expected, strict=True)):
        if not close(g, e, tol):
            note, hint = recognise(got, expected, mistakes)
            raise CheckFailed(f"{what} returned {preview(got, places)}, expected {preview(expected, places)}: "
                              f"first difference at element {index}, {shown(g, places)} instead of "
                              f"{shown(float(e), places)}{note}", hint)


def expect_dict(got: Any, what: str) -> dict:
    """What a driver returns: a dict."""
    if not isinstance(got, dict):
        raise CheckFailed(f"{what} returned {got!r:.200}, expected the driver's dict")
    return got


def per_rank(results: Any, world: int, what: str) -> list[dict]:
    """What `student.ranks(...)` returns for a driver: one dict per rank."""
    if not isinstance(results, list) or len(results) != world or not all(isinstance(r, dict) for r in results):
        raise CheckFailed(f"{what} returned {results!r:.200}, expected the driver's dict from each of {world} ranks")
    return results


def where_ranks_waited(error: CallError) -> str:
    """Where each rank of a multi-rank call that hung waited ("rank 0 failed in send #1 to rank 1 on world; ..."),
    each rank once, from the flight recorder's "collectives:" lines the sandbox keeps after the first line; "" if
    none were recorded."""
    diagnosis = error.message.partition("\n")[2]
    return "; ".join(dict.fromkeys(wait for line in diagnosis.splitlines() if line.startswith("collectives: ")
                                   for wait in line.removeprefix("collectives: ").split("; ")))


def explain(error: CallError, call: str, expected: str) -> CheckFailed:
    """A call that raised (a rank that crashed or waited forever, a shape that did not fit) as a failed check
    that says what was due; an answer left as released stays "not attempted"."""
    if error.not_attempted:
        raise error
    where = f" ({error.where})" if error.where else ""
    first, waits = error.message.partition("\n")[0], where_ranks_waited(error)
    return CheckFailed(f"{call} raised {first[:300]}{where}{f' — {waits} —' if waits else ''}, expected {expected}",
                       CRASH_HINT if error.where else None)


def driver(what: str, expected: str, fn: Callable, *args: Any) -> dict:
    """`fn(*args)`, a driver of the exercise cell (`student.name`): the dict it returns. A call that raised fails
    the check with `explain`, which says what was `expected`."""
    try:
        got = fn(*args)
    except CallError as error:
        raise explain(error, what, expected) from None
    return expect_dict(got, what)


def expect_raises(error: str, what: str, fn: Callable, *args: Any, why: str = "") -> None:
    """`fn(*args)`, a call into the student's code (`student.name`), must raise `error` (e.g. "ValueError");
    `what` spells the call, `why` says why it must raise."""
    try:
        got = fn(*args)
    except CallError as raised:
        if raised.not_attempted:
            raise
        if not raised.message.startswith(error):
            where = f" ({raised.where})" if raised.where else ""
            raise CheckFailed(f"{what} raised {raised.message}{where}, expected a {error}") from None
        return
    raise CheckFailed(f"{what} returned {got!r:.120}, expected a {error}" + (f" ({why})" if why else ""))


def point_to_point_sent(got: dict, rank: int, what: str) -> list[int]:
    """[messages, bytes] a rank sent, from a driver's `calls` and `bytes` (`count_collectives`); fails if the
    rank called anything but point-to-point operations."""
    calls, nbytes = got.get("calls") or {}, got.get("bytes") or {}
    others = {op: n for op, n in calls.items() if op not in POINT_TO_POINT and n}
    if others:
        raise CheckFailed(f"{what}: rank {rank}'s collectives returned {others}, expected point-to-point messages "
                          f"only (dist.send / dist.recv or dist.isend / dist.irecv)")
    return [calls.get("isend", 0) + calls.get("send", 0), nbytes.get("isend", 0) + nbytes.get("send", 0)]


def generator(seed: int):
    """The torch generator the drivers draw from (`torch.Generator().manual_seed(seed)`)."""
    import torch

    return torch.Generator().manual_seed(seed)
