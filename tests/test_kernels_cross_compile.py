"""lab.kernels.cross_compile: kernels compiled for an H100 (sm_90a) on a machine without a GPU, in a process of
their own (lab.kernels picks its mode at import), by Triton's compiler and the ptxas and cuobjdump it bundles."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from lab.kernels import DEVICE, runtime  # noqa: E402

BIN = Path(importlib.util.find_spec("triton").origin).parent / "backends" / "nvidia" / "bin"
pytestmark = pytest.mark.skipif(not (BIN / "ptxas").exists() or not (BIN / "cuobjdump").exists(),
                                reason=f"this triton wheel bundles no ptxas/cuobjdump under {BIN}")

ROOT = Path(__file__).resolve().parents[1]


def compile_only(args: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """A compile-only process for sm_90a (TRITON_INTERPRET, which this test process set, removed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env[runtime.COMPILE_FOR] = "sm_90a"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(cwd)])
    return subprocess.run([sys.executable, "-W", "ignore", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_the_cli_compiles_a_launcher_and_reports_its_registers(tmp_path):
    out = tmp_path / "rows.json"
    done = compile_only(["-m", "lab.kernels.cross_compile", "--only", "add", "--dtype", "fp16", "--json", str(out)])
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kernel"], r["config"], r["dtype"], r["status"]) for r in rows] == [
        ("_add_kernel", "BLOCK=1024 warps=4 stages=3", "fp16", "ok")]  # the GPU launch config, not the interpreter's
    assert 8 <= rows[0]["registers"] <= 255 and rows[0]["stack_bytes"] == 0
    assert "_add_kernel  BLOCK=1024" in done.stdout


PLANTED = '''
import torch
import triton
import triton.language as tl


@triton.jit
def _dot8_kernel(a_ptr, c_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    a = tl.load(a_ptr + offs[:, None] * BLOCK + offs[None, :])
    tl.store(c_ptr + offs[:, None] * BLOCK + offs[None, :], tl.dot(a, a).to(c_ptr.dtype.element_ty))


def dot8(a: torch.Tensor) -> torch.Tensor:
    c = torch.empty_like(a)
    _dot8_kernel[(1,)](a, c, BLOCK=8)
    return c
'''


def test_a_gpu_only_bug_is_a_failed_row_and_exit_1(tmp_path):
    """A tl.dot over K = 8: the interpreter computes it (numpy has no minimum), sm_90a's compiler refuses it.
    The same process then shows that a compile-only process refuses a launch outside cross_compile."""
    (tmp_path / "planted.py").write_text(PLANTED)
    sys.path.insert(0, str(tmp_path))
    try:
        from planted import dot8  # decorated in this process: interpreted
    finally:
        sys.path.remove(str(tmp_path))
    if runtime.interpreted():
        a = torch.randn(8, 8, dtype=torch.float16, device=DEVICE)
        torch.testing.assert_close(dot8(a).float(), a.float() @ a.float(), rtol=1e-2, atol=1e-2)
    (tmp_path / "run.py").write_text(textwrap.dedent('''
        import sys
        import torch
        from lab.kernels import cross_compile
        from lab.kernels.add import add
        from planted import dot8

        case = cross_compile.Case("planted dot8", "fp16", lambda: dot8(torch.empty(8, 8, dtype=torch.float16)))
        status = cross_compile.main(["--only", "planted", "--json", "rows.json"], extra=[case])
        try:
            add(torch.ones(4), torch.ones(4))
        except RuntimeError as error:
            print(error)
        sys.exit(status)
    '''))
    done = compile_only(["run.py"], cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == (
        "this process only compiles kernels for sm_90a (LAB_KERNELS_COMPILE_FOR is set): unset it to run them")
    (row,) = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert (row["kernel"], row["config"], row["case"]) == ("_dot8_kernel", "BLOCK=8 warps=4 stages=3", "planted dot8")
    assert row["status"].startswith("FAILED: CompilationError: ") and "K >= 16" in row["status"]

