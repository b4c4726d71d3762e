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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab.grading.sandbox import Limits

_ID = re.compile(r"^\d\d\.[a-z][a-z0-9_]*$")
REGISTRY: dict[str, Exercise] = {}


class CheckFailed(AssertionError):
    """A check saw a wrong answer; the message says what was called, what came back and what was expected."""


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
        if re.fullmatch(r"ch\d\d", module.name):
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


def expect_equal(got: Any, expected: int | list, what: str) -> None:
    """An exact integer answer, or a list of them (an integral float is accepted: 1.2e10 bytes is whole)."""
    if not _equal(got, expected):
        raise CheckFailed(f"{what} returned {got!r}, expected {expected!r}")


def expect_close(got: Any, expected: float, what: str, rel: float = 1e-6) -> None:
    if not _number(got) or not math.isclose(got, expected, rel_tol=rel):
        raise CheckFailed(f"{what} returned {got!r}, expected {expected:.6g}")
