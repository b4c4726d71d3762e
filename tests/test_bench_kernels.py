"""benchmarks/kernels.py without a GPU: its CPU lane checks kernels by the error-ratio rule and writes JSON, a kernel
module not written yet is a "missing" row, and the GPU lane's verdicts follow the issue's targets."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch
from bench_support import load_benchmark

from lab.calc.hardware import HARDWARE, device_accelerator


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("kernels")


def test_cpu_lane_writes_checked_records(bench, tmp_path):
    out = tmp_path / "kernels.json"
    assert bench.main(["--lane", "cpu", "--kernels", "add", "softmax", "--repeats", "1", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["lane"] == "cpu" and record["torch"] == torch.__version__ and record["triton"]
    assert record["device"].startswith("CPU") and record["kernels_mode"] == "interpreter"
    rows = {r["kernel"]: r for r in record["rows"]}
    assert set(rows) == {"add", "softmax"}
    for row in rows.values():
        assert row["status"] == "ok" and row["error_ratio"] <= 2 and row["kernel_ms"] > 0, row


def test_a_wrong_kernel_fails_the_error_ratio_rule(bench):
    """A softmax over the wrong axis runs fine and must still be a FAIL row, not an ok one."""
    case = dataclasses.replace(bench.CASES[1], torch_op=lambda x: torch.softmax(x, 0))
    row = bench.cpu_row(case, torch.float32, 1)
    assert row["status"] == "FAIL" and row["error_ratio"] > 1e3


def test_a_module_not_written_yet_is_a_missing_row(bench):
    case = dataclasses.replace(bench.CASES[0], name="fused_everything", module="fused_everything")
    assert bench.cpu_row(case, torch.float32, 1)["status"] == "missing"
    case = dataclasses.replace(bench.CASES[0], function="not_there")
    assert bench.cpu_row(case, torch.float32, 1)["status"] == "missing"


def test_work_formulas(bench):
    cases = {c.name: c for c in bench.CASES}
    assert cases["matmul"].work((4096, 4096, 4096), 2) == 2 * 4096**3
    assert cases["softmax"].work((4096, 32768), 2) == 2 * 2 * 4096 * 32768  # read x, write y
    # causal flash forward: 4·B·H·T²·D / 2; backward 2.5 times that
    assert cases["flash_attention fwd"].work((1, 2, 2, 8, 4), 2) == 4 * 2 * 64 * 4 / 2
    assert cases["flash_attention bwd"].work((1, 2, 2, 8, 4), 2) == 2.5 * cases["flash_attention fwd"].work(
        (1, 2, 2, 8, 4), 2)


def test_device_names_map_to_calc_hardware(bench):
    assert device_accelerator("NVIDIA H100 80GB HBM3").name == "NVIDIA H100 SXM"
    assert device_accelerator("NVIDIA H200").name == "NVIDIA H200 SXM"
    assert device_accelerator("NVIDIA A100-SXM4-80GB").name == "NVIDIA A100 80GB SXM"
    assert device_accelerator("NVIDIA H100 PCIe") is None  # not the SXM part's peaks
    assert device_accelerator("Tesla T4") is None


def test_targets_pass_and_miss(bench):
    rows = [{"lane": "gpu", "kernel": "softmax", "kernel_pct_peak": 85.0},
            {"lane": "gpu", "kernel": "matmul", "kernel_rate": 500.0, "torch_rate": 700.0},
            {"lane": "gpu", "kernel": "flash_attention fwd", "status": "missing"}]
    verdicts = {t["kernel"]: t for t in bench.targets(rows)}
    assert verdicts["softmax"]["verdict"] == "PASS"
    assert verdicts["matmul"]["verdict"] == "MISS" and verdicts["matmul"]["value"] == pytest.approx(100 * 5 / 7)
    assert verdicts["flash_attention fwd"]["verdict"] == "n/a"


def test_gpu_lane_logic_walked_on_the_cpu(bench, monkeypatch):
    """The GPU lane cannot run here; its row logic can, with CPU tensors, a small shape and a timer that says 1 ms:
    rates and % of peak then follow from the work formulas and the H100's datasheet numbers alone."""
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)  # Inductor on CPU would take ~10 s
    h100 = HARDWARE["h100"]
    cases = {c.name: c for c in bench.CASES}
    row = bench.gpu_row(cases["softmax"], torch.float32, h100, device="cpu", shape=(64, 1000), timer=lambda _: 1.0)
    assert row["status"] == "ok" and row["error_ratio_small"] <= 2
    gbs = 2 * 4 * 64 * 1000 / 1e-3 / 1e9  # read x, write y, fp32, in 1 ms
    for impl in ("kernel", "torch", "compile"):
        assert row[f"{impl}_rate"] == pytest.approx(gbs)
        assert row[f"{impl}_pct_peak"] == pytest.approx(100 * gbs * 1e9 / 3.35e12)
    row = bench.gpu_row(cases["matmul"], torch.float16, h100, device="cpu", shape=(64, 32, 16), timer=lambda _: 1.0)
    assert "compile_rate" not in row  # cuBLAS either way: no torch.compile column
    assert row["kernel_pct_peak"] == pytest.approx(100 * 2 * 64 * 32 * 16 / 1e-3 / 989.4e12)


def test_interpreter_verdicts_join_the_gpu_rows(bench, monkeypatch):
    """The GPU lane's interpreter-vs-compiled comparison: its CPU lane in a child process with TRITON_INTERPRET=1
    (here run in this process, which is interpreted already: a child would cost ~8 s of imports), the verdicts
    merged into the GPU rows by kernel name."""
    def child(command, env, **_):
        assert command[:2] == [sys.executable, bench.__file__] and env["TRITON_INTERPRET"] == "1"
        assert bench.main(command[2:]) == 0

    monkeypatch.setattr(bench.subprocess, "run", child)
    interpreted = bench.interpreter_lane(["add"], "fp32")
    assert [r["kernel"] for r in interpreted] == ["add"] and interpreted[0]["status"] == "ok"
    rows = [{"lane": "gpu", "kernel": "add", "status": "ok"}, {"lane": "gpu", "kernel": "softmax", "status": "ok"}]
    bench.merge_interpreter(rows, interpreted)
    assert rows[0]["interpreter_status"] == "ok"
    assert rows[0]["interpreter_error_ratio"] == interpreted[0]["error_ratio"]
    assert rows[1]["interpreter_status"] == "not run" and "interpreter_error_ratio" not in rows[1]
