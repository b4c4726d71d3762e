"""The kernels' accuracy tests give the same verdict on any CPU: at 1 and 2 threads, and with torch's kernels
built for the plainest instruction set (`default`) and for AVX2, whatever this machine's widest is. torch's own
error, the baseline of the error-ratio rule, moves with the summation order those choose; a verdict that moved
with it (softmax's backward at 2.4x torch's error on an AVX-512 CPU; attention's dq, exactly 0 with one key, under
`default`) would be red on one learner's laptop and green on another's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ACCURACY_TESTS = ("tests/test_kernels_rowwise.py", "tests/test_kernels_attention.py", "tests/test_kernels_matmul.py")


def _has_avx2() -> bool:
    try:
        return " avx2 " in f" {Path('/proc/cpuinfo').read_text().replace(chr(10), ' ')} "
    except OSError:
        return False


# Two corners, not all four (each run takes 10-14 s): with the suite's own run of these tests (this machine's widest
# instructions, one thread under xdist) each thread count and each instruction set is covered.
@pytest.mark.slow  # a second pass of the accuracy tests the fast suite runs once at this machine's own settings
@pytest.mark.parametrize(("capability", "threads"), [("default", 2), ("avx2", 1)])
def test_the_accuracy_tests_pass_at_any_width_and_thread_count(capability, threads):
    if capability == "avx2" and not _has_avx2():
        pytest.skip("this CPU has no AVX2")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "ATEN_CPU_CAPABILITY": capability}
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ACCURACY_TESTS],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
