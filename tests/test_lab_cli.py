"""`python -m lab`: the doctor's report, command dispatch, one-line errors."""

import subprocess
import sys

import pytest

from lab import doctor
from lab.doctor import Check, format_report, run_checks


def _lab(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lab", *args], capture_output=True, text=True, timeout=300)


def test_doctor_exercises_each_backend(monkeypatch):
    # the compile probe as the doctor starts it, with the "eager" backend: inductor's first compile in a fresh
    # process builds C++ for 20 s of the suite (inductor itself: tests/test_compile.py's CLI test)
    probe = doctor._COMPILE_PROBE.replace("compile_works()", 'compile_works("eager")')
    monkeypatch.setattr(doctor, "_COMPILE_PROBE", probe)
    checks = {c.name: c for c in run_checks()}
    assert checks["gloo"].ok and "all_reduce -> [3.0, 3.0]" in checks["gloo"].detail
    assert {"python", "torch", "cpu", "gloo", "cuda", "notebooks", "triton", "jax", "browser tests",
            "compile"} <= set(checks)
    assert checks["compile"].ok and checks["compile"].detail.startswith("torch.compile works (eager, ")
    for check in checks.values():
        assert check.ok or check.hint, f"{check.name} failed without saying what to do"


def test_report_marks_failures_and_fixes():
    report = format_report([Check("gloo", False, "2-rank all_reduce failed", "check loopback", required=True),
                            Check("jax", False, "not installed", "pip install -e '.[jax]'")])
    assert "[ERR] gloo" in report and "fix: check loopback" in report and "[-- ] jax" in report
    assert report.endswith("Not ready: gloo failed.")


def test_dispatch_and_unknown_command():
    assert "commands:" in _lab("--help").stdout
    done = _lab("frobnicate")
    assert done.returncode == 2
    assert done.stderr.startswith("python -m lab: error: unknown command 'frobnicate'; valid commands: doctor")
    assert len(done.stderr.strip().splitlines()) == 1


def test_calc_params_cli():
    done = _lab("calc", "params", "--model", "llama3-8b")
    assert done.returncode == 0 and "8,030,261,248 parameters" in done.stdout
    bad = _lab("calc", "params", "--model", "gpt-17")
    assert bad.returncode == 2 and "unknown model preset 'gpt-17'" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_gpu_names_never_initialise_cuda(monkeypatch):
    """lab.setup() and the doctor name GPUs through nvidia-smi: after torch.cuda.get_device_name a process can
    no longer fork ranks that use CUDA. Without nvidia-smi they fall back to one "GPU" per device."""
    import torch

    import lab
    from lab import doctor

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: pytest.fail("initialises CUDA"))
    monkeypatch.setattr(doctor.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(FileNotFoundError()))
    assert doctor.gpu_names() == ["GPU", "GPU"]
    lab.setup(quiet=False)
    assert not torch.cuda.is_initialized()


def test_doctor_probes_the_kernels_outside_the_compile_only_mode_and_says_it_is_set(monkeypatch):
    from lab.kernels import runtime

    assert doctor.COMPILE_FOR == runtime.COMPILE_FOR
    monkeypatch.setenv(runtime.COMPILE_FOR, "sm_90a")
    check = doctor._check_triton()
    assert check.ok and "lab.kernels run in Triton's interpreter" in check.detail, check.detail
    assert check.detail.endswith("LAB_KERNELS_COMPILE_FOR=sm_90a is set in this shell, where they are only compiled "
                                 "for sm_90a, never run (lab.kernels.cross_compile's mode): unset it to run them")
