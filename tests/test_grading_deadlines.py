"""A hang costs the function that hangs, not its exercise: each call has its own deadline, the report names the
function and the line it was stopped at, the exercise's other functions keep their points in a fresh sandbox, and
a function stopped once fails its later checks at once (so N checks of a hang cost one timeout, not N).

Deadlines are generous against clearly endless code (a `while True`, a lock that is never released): the verdicts
do not depend on this machine's speed."""

from __future__ import annotations

import time

import psutil
import pytest

from lab.grading.checks import CheckFailed, Exercise
from lab.grading.runner import HANG_HINT, run_exercise
from lab.grading.sandbox import Sandbox

WALL_S = 10  # each sandbox's budget: a call is stopped after about 8 s (the rest is kept to report)


def _pair() -> Exercise:
    """Two functions, `slow` and `double`: a check of each, then one of both (the wrong-answer hints must not show
    for a hang)."""
    ex = Exercise("99.pair", entry=("slow", "double"))

    @ex.check(points=1, hint="slow returns its argument")
    def slow_returns(student, rng):
        """slow(3)"""
        if student.slow(3) != 3:
            raise CheckFailed("slow(3) returned something else, expected 3")

    @ex.check(points=1, hint="double returns twice its argument")
    def double_doubles(student, rng):
        """double(2)"""
        if student.double(2) != 4:
            raise CheckFailed("double(2) returned something else, expected 4")

    @ex.check(points=1, hint="slow and double agree")
    def both(student, rng):
        """slow(4) and double(4)"""
        if (student.double(4), student.slow(4)) != (8, 4):
            raise CheckFailed("returned something else, expected (8, 4)")

    return ex


LOOP = ("def helper(x):\n"
        "    while True: x += 0\n"  # one line: the stack sampled at the deadline can only name this one
        "\n"
        "def slow(x):\n"
        "    return helper(x)\n"
        "\n"
        "def double(x):\n"
        "    return 2 * x\n")
LOCK = ("import threading\n"  # _inner takes the lock slow holds: waits forever
        "LOCK = threading.Lock()\n"
        "\n"
        "def slow(x):\n"
        "    with LOCK:\n"
        "        return _inner(x)\n"
        "\n"
        "def _inner(x):\n"
        "    with LOCK:\n"
        "        return x\n"
        "\n"
        "def double(x):\n"
        "    return 2 * x\n")


@pytest.mark.parametrize("cell, stuck", [(LOOP, "stopped in helper at 99.pair (cell 1) line 2: while True: x += 0"),
                                         (LOCK, "stopped in _inner at 99.pair (cell 1) line 9: with LOCK:")],
                         ids=["endless_loop", "lock_taken_twice"])
def test_a_hang_costs_its_function_only_and_names_its_line(cell, stuck, monkeypatch):
    called = []  # what reached a sandbox: slow once only
    real_call = Sandbox.call
    monkeypatch.setattr(Sandbox, "call", lambda box, fn, *a, **k: called.append(fn) or real_call(box, fn, *a, **k))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    started = time.monotonic()
    result = run_exercise(_pair(), [("99.pair (cell 1)", cell)], wall_s=WALL_S)
    took = time.monotonic() - started
    left = {p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE} - before
    assert not left, f"processes of a stopped sandbox outlived it: {left}"
    slow, double, both = result.checks
    assert double.status == "passed" and result.points == 1 and result.status == "partial", result
    assert not result.reason, result.reason  # check verdicts, not a void exercise
    assert slow.message.startswith("slow() did not finish within") and slow.message.endswith(stuck), slow.message
    assert both.message == slow.message and called.count("slow") == 1  # failed at once: not called again
    assert slow.hint == both.hint == HANG_HINT  # not the wrong-answer hints
    assert took < 2 * WALL_S, f"{took:.1f} s: more than one timeout for one hanging function"


def test_a_function_that_crashes_the_process_costs_only_its_own_checks():
    """A crash (here SIGSEGV) is a death like a hang: its function fails, the other keeps its point."""
    crash = LOOP.replace("    while True: x += 0\n", "    import ctypes\n    ctypes.string_at(0)\n")
    result = run_exercise(_pair(), [("99.pair (cell 1)", crash)], wall_s=WALL_S)
    slow, double, both = result.checks
    assert double.status == "passed" and result.points == 1, result
    assert slow.message == both.message == "slow(): the process crashed (killed by SIGSEGV)", slow.message
