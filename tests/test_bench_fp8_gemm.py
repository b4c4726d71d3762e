"""benchmarks/fp8_gemm.py without a GPU: the CPU lane's records, the crossover of timings, a missing feature as a
row, the roofline's prediction against lab.calc, and the GPU lane's row logic walked on CPU tensors."""

from __future__ import annotations

import json

import pytest
import torch
from bench_support import load_benchmark

from lab.calc.hardware import HARDWARE
from lab.calc.roofline import ridge_point


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("fp8_gemm")


@pytest.fixture(scope="module")
def cpu_record(bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8") / "fp8_gemm.json"
    assert bench.main(["--lane", "cpu", "--repeats", "1", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_cpu_lane_writes_every_recipe_with_its_error(bench, cpu_record):
    assert cpu_record["lane"] == "cpu" and cpu_record["device"].startswith("CPU")
    assert cpu_record["torch"] == torch.__version__ and "triton" in cpu_record
    rows = cpu_record["rows"]
    expected = {(s.name, label) for s in bench.CPU_SHAPES
                for label in ["bf16 (torch.matmul)", *(r[0] for r in bench.RECIPES)]}
    assert {(r["shape"], r["recipe"]) for r in rows} == expected
    for r in rows:
        # torch 2.13's CPU runs _scaled_mm (tensorwise and rowwise scales), so no recipe is missing here
        assert r["status"] == "ok" and r["cpu_emulation_ms"] > 0, r
        # torchao's FP8-linear bar (>= 18 dB); e4m3 on Gaussians gives ~28 dB, bf16 ~50 dB
        assert 18 <= r["sqnr_db"] < (60 if r["recipe"].startswith("bf16") else 35), r
        assert r["rel_error"] == pytest.approx(10 ** (-r["sqnr_db"] / 20), rel=1e-6)
    by = {(r["shape"], r["recipe"]): r for r in rows}
    for shape in bench.CPU_SHAPES:  # _scaled_mm and the exact-accumulation emulation: the same GEMM
        for gran in ("tensorwise", "rowwise"):
            emulated, hardware = by[shape.name, f"fp8 {gran}, emulated"], by[shape.name, f"fp8 {gran}, _scaled_mm"]
            assert emulated["sqnr_db"] == pytest.approx(hardware["sqnr_db"], abs=0.05)
    chips = {p["chip"]: p for p in cpu_record["roofline"]}
    assert set(chips) == {HARDWARE[c].name for c in ("h100", "h200", "b200")}
    assert cpu_record["crossovers"] == []  # nothing measured on a CPU


def test_crossover_is_where_fp8_starts_winning_for_good(bench):
    sizes = [256, 512, 1024, 2048, 4096, 8192]
    bf16 = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]
    # FP8 slower until 2048, then faster: the crossover is 2048, not the first loss (256) nor the last one (1024)
    fp8 = [1.5, 3.0, 5.0, 7.0, 10.0, 17.0]
    assert bench.crossover(sizes, bf16, fp8) == 2048
    # one lucky small size between losses is noise
    assert bench.crossover(sizes, bf16, [0.9, 3.0, 5.0, 7.0, 10.0, 17.0]) == 2048
    # unsorted input, the same answer
    order = [3, 0, 5, 1, 4, 2]
    assert bench.crossover([sizes[i] for i in order], [bf16[i] for i in order], [fp8[i] for i in order]) == 2048
    assert bench.crossover(sizes, bf16, [2 * t for t in bf16]) is None  # never faster
    assert bench.crossover(sizes, bf16, [t / 2 for t in bf16]) == 256  # always faster
    assert bench.crossover(sizes, bf16, [*fp8[:-1], None]) is None  # the largest size not measured
    assert bench.crossover(sizes, bf16, [t * 0.9 for t in bf16[:-1]] + [32.0]) is None  # a tie is no win


def test_measured_crossover_counts_the_quantisation(bench):
    """The GEMM alone wins from 1024; adding the casts moves the crossover to 4096."""
    rows = [{"lane": "gpu", "shape": f"square {n}", "m": n, "bf16_ms": b, "fp8_tensor_ms": g,
             "fp8_tensor_eager_total_ms": g + q, "fp8_row_status": "missing: no rowwise"}
            for n, b, g, q in [(512, 1.0, 1.1, 0.5), (1024, 2.0, 1.2, 1.0), (2048, 4.0, 2.2, 2.0),
                               (4096, 16.0, 8.5, 4.0)]]
    rows.append({"lane": "gpu", "shape": "llama3-8b up", "m": 8192, "bf16_ms": 1.0, "fp8_tensor_ms": 9.0})
    found = {(f["granularity"], f["fp8"]): f["crossover_n"] for f in bench.measured_crossovers(rows, ["eager"])}
    assert found["tensor", "GEMM only"] == 1024
    assert found["tensor", "+ eager quantisation"] == 4096
    assert found["row", "GEMM only"] is None and found["row", "+ eager quantisation"] is None


@pytest.mark.parametrize("chip", ["h100", "h200", "b200"])
def test_roofline_prediction_matches_calc(bench, chip):
    """Square n³: bf16 takes 2n³/Pb once compute-bound, FP8 2n³/Pf plus casts of 5 bytes per element of its two
    inputs, 10n²/BW: FP8 wins from n = 5 / (BW·(1/Pb − 1/Pf)), which is 10·Pb/BW — ten times calc's bf16 ridge
    point — when Pf = 2·Pb. The bf16 GEMM moves 6n² bytes for 2n³ FLOPs (intensity n/3), the FP8 one 4n² (e4m3
    in, bf16 out; intensity n/2)."""
    device = HARDWARE[chip]
    p = bench.predicted_crossover(device)
    ridge, ridge_fp8 = ridge_point(device, "bf16"), ridge_point(device, "fp8")
    assert p["ridge_bf16"] == ridge and p["ridge_fp8"] == ridge_fp8 == pytest.approx(2 * ridge, rel=1e-4)
    bw, pb, pf = device.hbm_bandwidth, device.bf16_flops, device.fp8_flops
    assert p["crossover_n"] == pytest.approx(5 / (bw * (1 / pb - 1 / pf)), abs=1)
    assert p["crossover_n"] == pytest.approx(10 * ridge, abs=2)
    assert p["compute_bound_n_bf16"] == pytest.approx(3 * ridge, abs=1)
    assert p["compute_bound_n_fp8"] == pytest.approx(2 * ridge_fp8, abs=1)
    assert p["crossover_sweep"] == min(n for n in bench.SQUARE if n > 10 * ridge)
    t = bench.roofline_ms(device, bench.Shape("", 8192, 8192, 8192))
    assert t["bf16"] == pytest.approx(2 * 8192**3 / device.bf16_flops * 1e3)
    assert t["fp8_gemm"] == pytest.approx(2 * 8192**3 / device.fp8_flops * 1e3)
    assert t["quant"] == pytest.approx(5 * 2 * 8192**2 / device.hbm_bandwidth * 1e3)


def test_a_missing_scaled_mm_is_a_row_that_says_why(bench, monkeypatch):
    shapes = bench.CPU_SHAPES[:1]
    rows = bench.cpu_rows(shapes, repeats=1, probe=lambda device, gran: None if gran == "tensor" else "no rowwise")
    status = {r["recipe"]: r["status"] for r in rows}
    assert status["fp8 rowwise, _scaled_mm"] == "missing: no rowwise"
    assert status["fp8 tensorwise, _scaled_mm"] == "ok" and status["fp8 rowwise, emulated"] == "ok"
    monkeypatch.delattr(torch, "_scaled_mm")
    assert "has no torch._scaled_mm" in bench.probe_scaled_mm("cpu", "tensor")


def test_probe_reports_a_refusal_and_a_wrong_product(bench, monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("rowwise scaling needs sm_90\nmore detail")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    assert bench.probe_scaled_mm("cpu", "row") == (
        "torch._scaled_mm with rowwise scales on cpu: RuntimeError: rowwise scaling needs sm_90")
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, **kw: torch.zeros(a.shape[0], b.shape[1]))
    assert "wrong product" in bench.probe_scaled_mm("cpu", "tensor")


def test_gpu_row_walked_on_the_cpu(bench):
    """The GPU lane's row logic with CPU tensors and a timer that says 1 ms: rates and % of peak from the FLOPs and
    the H100's datasheet peaks; a granularity the probe found missing is a note in the row."""
    row = bench.gpu_row(bench.Shape("square 64", 64, 64, 64), HARDWARE["h100"],
                        {"tensor": None, "row": "no rowwise here"}, {"eager": bench.quantize}, device="cpu",
                        timer=lambda call: (call(), 1.0)[1])
    tflops = 2 * 64**3 / 1e-3 / 1e12
    assert row["bf16_tflops"] == pytest.approx(tflops)
    assert row["bf16_pct_peak"] == pytest.approx(100 * tflops * 1e12 / 989.4e12)
    assert row["fp8_tensor_pct_peak"] == pytest.approx(100 * tflops * 1e12 / 1978.9e12)
    assert row["fp8_tensor_status"] == "ok" and row["sqnr_fp8_tensor_db"] > 18
    assert row["fp8_tensor_eager_total_ms"] == 2.0 and row["speedup_tensor_eager"] == 0.5
    assert row["fp8_row_status"] == "missing: no rowwise here" and "fp8_row_ms" not in row


def test_quantizer_modes(bench):
    assert list(bench.quantizers("off")) == ["eager"] and bench.quantizers("off")["eager"] is bench.quantize
    with pytest.raises(ValueError, match="compile='jit' must be one of static, dynamic, off"):
        bench.quantizers("jit")
