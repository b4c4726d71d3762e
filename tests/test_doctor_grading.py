"""`python -m lab doctor`'s grading section: what confinement the sandbox gets on this machine, said as it is."""

from __future__ import annotations

import pytest

from lab import doctor
from lab.grading import confine, sandbox
from lab.grading.sandbox import ExerciseError


def _by_name(checks: list[doctor.Check]) -> dict[str, doctor.Check]:
    return {c.name: c for c in checks}


def test_the_section_reports_this_machine():
    checks = _by_name(doctor._check_grading())
    assert list(checks) == list(doctor.GRADING)
    layers = confine.isolation()
    assert checks["landlock"].ok == (layers["landlock_abi"] >= 6)
    assert (f"ABI {layers['landlock_abi']}" in checks["landlock"].detail) == bool(layers["landlock_abi"])
    assert checks["pids cgroup"].ok == layers["pids_cgroup"]
    assert checks["network"].ok == (layers["network"] in ("namespace", "user namespace"))
    assert checks["sandbox"].ok and checks["sandbox"].required and "answered in" in checks["sandbox"].detail
    for check in checks.values():
        assert check.ok or check.hint, f"{check.name} failed without saying what to do"
    report = doctor.format_report(doctor._check_grading())
    assert "Grading sandbox (lab.check, python -m lab grade)" in report.splitlines()[1]


@pytest.mark.parametrize("abi, ok, words", [(0, False, "not available: student code can read and write"),
                                            (4, False, "may signal"), (6, True, "cannot signal the grader")])
def test_landlock_levels(abi, ok, words, monkeypatch):
    monkeypatch.setattr(confine, "isolation", lambda: {"landlock_abi": abi, "pids_cgroup": False, "root": True,
                                                       "network": "namespace"})
    checks = _by_name(doctor._check_grading())
    assert checks["landlock"].ok == ok and words in checks["landlock"].detail, checks["landlock"]
    assert not checks["pids cgroup"].ok and "RLIMIT_NPROC does not bind root" in checks["pids cgroup"].detail


@pytest.mark.parametrize("layer, ok, words", [
    ("namespace", True, "namespace of its own (made as root)"),
    ("user namespace", True, "namespace of its own (through a user namespace)"),
    ("seccomp", False, "multi-rank exercises' code can reach this machine's loopback"),
    ("", False, "graded code has the network")])
def test_network_levels(layer, ok, words, monkeypatch):
    monkeypatch.setattr(confine, "isolation", lambda: {"landlock_abi": 7, "pids_cgroup": True, "root": True,
                                                       "network": layer})
    check = _by_name(doctor._check_grading())["network"]
    assert check.ok == ok and words in check.detail, check
    assert ok or ("refuses with --strict" in check.detail and "user namespaces" in check.hint)


def test_a_sandbox_that_cannot_start_is_an_error(monkeypatch):
    def broken(self):
        raise ExerciseError("internal error: the sandbox could not start (OSError: landlock_restrict_self failed)")

    monkeypatch.setattr(sandbox.Sandbox, "start", broken)
    check = _by_name(doctor._check_grading())["sandbox"]
    assert not check.ok and check.required and "landlock_restrict_self failed" in check.detail and check.hint
    assert "Not ready: sandbox failed." in doctor.format_report([check])
