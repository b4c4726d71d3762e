"""bf16 against FP8 GEMMs: when FP8 is faster on a GPU, and how accurate it is (emulated) on the CPU.

    python benchmarks/fp8_gemm.py                  # the GPU lane when torch sees a GPU, else the CPU lane
    python benchmarks/fp8_gemm.py --lane cpu --json out.json
    python benchmarks/fp8_gemm.py --sizes 1024 4096 --no-llama --compile off

FP8 tensor cores run twice the bf16 FLOP/s (H100: 1,979 against 989 TFLOP/s dense) and read half the bytes, but
an FP8 GEMM in training first has to *quantise* its bf16 inputs: one pass for the amax, one to scale and cast
(`lab.precision.fp8.quantize`). Those passes are memory-bound and grow with the inputs (M·K + K·N), the GEMM with
M·K·N, so FP8 only pays once the GEMM is large enough to amortise the casts. Roofline arithmetic (`lab.calc`)
for a square n³ GEMM whose casts move 5 bytes per input element: bf16 takes 2n³/P, FP8 n³/P + 10n²/BW, so FP8
wins above n = 10·P/BW, ten times the bf16 ridge point (~2,950 on an H100, ~2,060 on an H200 with its faster
HBM). FP8 halves the bytes but doubles the peak, so its GEMM turns compute-bound at a similar size (H100: n =
1,182 against 887 for bf16, its bf16 output keeping it a little higher): the ridge alone does not say when FP8
pays; the casts do.

GPU lane: torch.matmul in bf16 against torch._scaled_mm (e4m3 x e4m3, bf16 out) with tensorwise and rowwise
scales, each feature-detected by a tiny probe first (FP8 tensor cores: Ada/Hopper or newer; rowwise scales:
Hopper or newer), over square sizes 256..16384 and Llama MLP shapes (tokens x d_model x d_ff, from lab.config's
presets). Timed with triton.testing.do_bench (median; CUDA events without Triton). Columns: TFLOP/s and % of the
device's dense bf16 / fp8 peak (lab.calc.hardware, device from torch.cuda.get_device_name), the quantisation of
both inputs as its own column (eager `quantize`, and the same function under torch.compile, which fuses its
passes), and the speed-up of FP8 *including* quantisation. Then the crossover of the square sweep — the smallest
size from which FP8 stays faster — measured, beside the roofline's prediction for the same chip.

CPU lane (no GPU): correctness only. Each FP8 recipe of lab.precision.fp8 — tensorwise, rowwise, DeepSeek-V3's
block scaling (1x128 activation tiles, 128x128 weight blocks, 14-bit accumulation promoted every 128) — on small
Gaussian inputs, against the float32 GEMM of the unquantised inputs: SQNR in dB (>= 18 dB, torchao's
bar for an FP8 linear's output) and relative error; torch._scaled_mm where it runs on the CPU, the emulation
everywhere. Their times are CPU emulation (float32 matmuls, Python loops), no claim about speed. Then the
roofline-predicted crossover for H100, H200 and B200, computed, not measured.

Seen on an H200 (torch 2.11, do_bench medians): bf16 at ~70% and FP8 at ~63% of their dense peaks from 4096
up, the FP8 GEMM alone 1.7-1.9x faster; `quantize` eagerly never pays within the sweep (it reads and writes
fp32 copies, ~7% of its roofline time), compiled per shape it reaches ~65% at 16384² but keeps a ~0.28 ms floor
(its host-side finiteness check and graph break), so the measured crossover is 8192 against the roofline's 4096
on the same grid (2,062 exactly). Llama-3-70B's MLP GEMMs (8192 tokens) gain 1.5x with the casts, 1-B's lose.

A missing feature (no torch._scaled_mm, scales it refuses, no Triton, a failing torch.compile) is a row or a
column that says what is missing and why, never a crash. With --json, the rows become records with the device,
torch and triton versions.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.timing import median_ms  # noqa: E402
from lab.calc.hardware import HARDWARE, Accelerator, device_accelerator  # noqa: E402
from lab.calc.roofline import Op, matmul, peak_flops, place, ridge_point  # noqa: E402
from lab.config import ModelConfig  # noqa: E402
from lab.precision.fp8 import Scaling, fp8_matmul, quantize, sqnr  # noqa: E402

SQUARE = (256, 512, 1024, 2048, 4096, 8192, 16384)
LLAMA = (("llama3-1b", 4096), ("llama3-8b", 8192), ("llama3-70b", 8192))  # (lab.config preset, tokens)
GRANULARITIES = ("tensor", "row")  # the scales torch._scaled_mm takes
QUANT_BYTES = 5  # per input element: read bf16 for the amax, read bf16 again and write e4m3 for the cast
QUANT_FLOPS = 3  # per input element: abs/max, multiply by the scale, clamp
SQNR_MIN_DB = 18.0  # torchao's bar for an FP8 linear's output (test/float8/test_base.py)
CPU_CHIPS = ("h100", "h200", "b200")


class Shape(NamedTuple):
    """out (M, N) = a (M, K) @ w (N, K)ᵀ, as F.linear multiplies activations by a weight."""

    name: str
    m: int
    k: int
    n: int

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n


def square_shapes(sizes: Sequence[int]) -> list[Shape]:
    return [Shape(f"square {s}", s, s, s) for s in sizes]


def llama_shapes() -> list[Shape]:
    """The MLP GEMMs of Llama 3 models on one micro-batch: up/gate (tokens, d_model) x (d_model, d_ff) and down
    (tokens, d_ff) x (d_ff, d_model)."""
    shapes = []
    for preset, tokens in LLAMA:
        cfg = ModelConfig.from_preset(preset)
        shapes += [Shape(f"{preset} up", tokens, cfg.d_model, cfg.d_ff),
                   Shape(f"{preset} down", tokens, cfg.d_ff, cfg.d_model)]
    return shapes


# --- the roofline's prediction (lab.calc), no measurement -------------------------------------------------------

def roofline_ops(shape: Shape) -> dict[str, tuple[Op, str]]:
    """The kernels of each path with the dtype whose peak they run at: the bf16 GEMM; the FP8 GEMM (e4m3
    inputs, bf16 output); the quantisation of both bf16 inputs (memory-bound passes of QUANT_BYTES per element)."""
    m, k, n = shape.m, shape.k, shape.n
    return {"bf16": (matmul("bf16 gemm", m, k, n, "bf16"), "bf16"),
            "fp8_gemm": (Op("fp8 gemm", shape.flops, float(m * k + k * n + 2 * m * n), "matmul"), "fp8"),
            "quant": (Op("quantise inputs", float(QUANT_FLOPS * (m * k + k * n)),
                         float(QUANT_BYTES * (m * k + k * n)), "elementwise"), "bf16")}


def roofline_ms(chip: Accelerator, shape: Shape) -> dict[str, float]:
    """Least times (ms) of `roofline_ops` on `chip`."""
    return {key: place(op, chip, dtype).time_s * 1e3 for key, (op, dtype) in roofline_ops(shape).items()}


def _smallest(predicate: Callable[[int], bool], high: int = 1 << 20) -> int:
    """The smallest n in [1, high] for which a predicate that stays true once true holds (bisection)."""
    if not predicate(high):
        raise ValueError(f"no size up to n={high} satisfies the predicate")
    low = 0  # predicate(low) is taken as false
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if predicate(mid) else (mid, high)
    return high


def predicted_crossover(chip: Accelerator, sizes: Sequence[int] = SQUARE) -> dict:
    """The roofline's crossover for square GEMMs on `chip`: the n at which each GEMM turns compute-bound, the
    smallest n where FP8 with its quantisation beats bf16 (10 x the bf16 ridge point when the fp8 peak is twice
    the bf16 one), and that point on the sweep's grid of `sizes` (what the measured crossover is compared with)."""
    def compute_bound(key: str) -> Callable[[int], bool]:
        def test(n: int) -> bool:
            op, dtype = roofline_ops(Shape("", n, n, n))[key]
            return place(op, chip, dtype).bound == "compute"
        return test

    def fp8_wins(n: int) -> bool:
        t = roofline_ms(chip, Shape("", n, n, n))
        return t["fp8_gemm"] + t["quant"] < t["bf16"]

    grid = [s for s in sorted(sizes) if fp8_wins(s)]
    return {"chip": chip.name, "ridge_bf16": ridge_point(chip, "bf16"), "ridge_fp8": ridge_point(chip, "fp8"),
            "compute_bound_n_bf16": _smallest(compute_bound("bf16")),
            "compute_bound_n_fp8": _smallest(compute_bound("fp8_gemm")),
            "crossover_n": _smallest(fp8_wins), "crossover_sweep": grid[0] if grid else None}


# --- the crossover of measured (or any) timings -------------------------------------------------------------------

def crossover(sizes: Sequence[int], base_ms: Sequence[float | None], fp8_ms: Sequence[float | None]) -> int | None:
    """The smallest size from which FP8 is faster than the baseline at that size and every larger one (a win at
    one small size between losses is noise, not a crossover); None when FP8 is not faster at the largest size,
    or a timing is missing from there on."""
    rows = sorted(zip(sizes, base_ms, fp8_ms, strict=True))
    found = None
    for size, base, fp8 in reversed(rows):
        if base is None or fp8 is None or not fp8 < base:
            break
        found = size
    return found


# --- feature detection --------------------------------------------------------------------------------------------

def probe_scaled_mm(device: str, granularity: str) -> str | None:
    """None when torch._scaled_mm multiplies e4m3 x e4m3 into bf16 with `granularity` scales on `device` and
    gets a tiny product right; else the reason, one line (no such function, a refusal, a wrong answer)."""
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    m, k, n = 16, 32, 16
    a = torch.ones(m, k, device=device).to(torch.float8_e4m3fn)
    b = torch.ones(n, k, device=device).to(torch.float8_e4m3fn)
    if granularity == "tensor":
        sa, sb = torch.tensor(2.0, device=device), torch.tensor(0.5, device=device)
    else:
        sa, sb = torch.full((m, 1), 2.0, device=device), torch.full((1, n), 0.5, device=device)
    try:
        out = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    except Exception as err:  # RuntimeError, NotImplementedError, or whatever this build raises
        return f"torch._scaled_mm with {granularity}wise scales on {device}: {_first_line(err)}"
    if not torch.equal(out.float().cpu(), torch.full((m, n), float(k))):
        return f"torch._scaled_mm with {granularity}wise scales on {device} runs but gives a wrong product"
    return None


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:160]


def _inverse(scale: torch.Tensor, granularity: str, operand: str) -> torch.Tensor:
    """torch._scaled_mm multiplies by dequantisation scales (1/scale): a's per row (M, 1), w's per column of
    wᵀ (1, N)."""
    inv = scale.float().reciprocal()
    if granularity == "row":
        inv = inv.reshape((-1, 1) if operand == "a" else (1, -1))
    return inv.contiguous()


def scaled_mm(a8: torch.Tensor, sa: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor,
              granularity: str) -> Callable[[], torch.Tensor]:
    """The timed FP8 GEMM: quantised a (M, K) @ w (N, K)ᵀ, bf16 out (what a training step feeds on)."""
    inv_a, inv_w, wt = _inverse(sa, granularity, "a"), _inverse(sw, granularity, "w"), w8.t()
    return lambda: torch._scaled_mm(a8, wt, scale_a=inv_a, scale_b=inv_w, out_dtype=torch.bfloat16)


# --- GPU lane -----------------------------------------------------------------------------------------------------

def _randn(shape: tuple[int, int], device: str, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=gen, device=device) * scale


def bench_ms(call: Callable[[], object]) -> float:
    """Median ms of `call` on the GPU: triton.testing.do_bench (flushes L2 between calls), else CUDA events."""
    try:
        import triton.testing
    except ImportError:
        return _cuda_events_ms(call)
    return triton.testing.do_bench(call, return_mode="median")


def _cuda_events_ms(call: Callable[[], object], repeats: int = 20) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


COMPILE_MODES = ("static", "dynamic", "off")


def quantizers(compile_: str) -> dict[str, Callable]:
    """How the inputs get quantised: lab's `quantize` eagerly (one kernel per torch op, plus a host sync for its
    finiteness check), and the same function under torch.compile (its amax and its scale-clamp-cast each fused
    into a kernel or two). "static" compiles per shape (the recompile limit raised so that no shape silently
    falls back to eager); "dynamic" compiles once for all shapes, but Inductor then does the tensorwise amax
    as an unsplit reduction: ~100x slower at 16384² on an H200 (15.5 ms against 0.16 ms), so its tensorwise
    column measures that, not the cast."""
    if compile_ not in COMPILE_MODES:
        raise ValueError(f"compile={compile_!r} must be one of {', '.join(COMPILE_MODES)}")
    found: dict[str, Callable] = {"eager": quantize}
    if compile_ == "static":
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, 256)
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 1024)
        found["compiled"] = torch.compile(quantize, dynamic=False)
    elif compile_ == "dynamic":
        found["compiled"] = torch.compile(quantize, dynamic=True)
    return found


def gpu_row(shape: Shape, chip: Accelerator | None, missing: dict[str, str | None], quants: dict[str, Callable],
            *, device: str = "cuda", timer: Callable[[Callable], float] = bench_ms) -> dict:
    """One shape: bf16 and FP8 (each granularity `missing` has None for) GEMM times, quantisation times, rates,
    % of peak, speed-ups, and the SQNR of each output against the float32 GEMM. `device` and `timer` let a
    test walk this on a CPU."""
    row: dict = {"lane": "gpu", "shape": shape.name, "m": shape.m, "k": shape.k, "n": shape.n,
                 "gflop": shape.flops / 1e9}
    a = _randn((shape.m, shape.k), device, 0)
    w = _randn((shape.n, shape.k), device, 1, shape.k ** -0.5)
    reference = a @ w.t()  # float32 (TF32 is off by default for matmuls)
    a16, w16 = a.bfloat16(), w.bfloat16()
    row["sqnr_bf16_db"] = sqnr(reference, a16 @ w16.t())
    row["bf16_ms"] = timer(lambda: a16 @ w16.t())
    _rates(row, "bf16", row["bf16_ms"], shape, chip, "bf16")
    for gran in GRANULARITIES:
        if missing[gran] is not None:
            row[f"fp8_{gran}_status"] = f"missing: {missing[gran]}"
            continue
        scaling = Scaling("e4m3", gran)
        try:
            a8, sa = quantize(a16, scaling)
            w8, sw = quantize(w16, scaling)
            gemm = scaled_mm(a8, sa, w8, sw, gran)
            row[f"sqnr_fp8_{gran}_db"] = sqnr(reference, gemm())
            row[f"fp8_{gran}_ms"] = timer(gemm)
        except Exception as err:  # a refusal at this shape is this cell's news, not the run's end
            row[f"fp8_{gran}_status"] = f"error: {_first_line(err)}"
            continue
        row[f"fp8_{gran}_status"] = "ok"
        _rates(row, f"fp8_{gran}", row[f"fp8_{gran}_ms"], shape, chip, "fp8")
        for name, quant in quants.items():
            try:
                ms = timer(lambda q=quant, s=scaling: (q(a16, s), q(w16, s)))
            except Exception as err:
                row[f"quant_{name}_{gran}_error"] = _first_line(err)
                continue
            total = row[f"fp8_{gran}_ms"] + ms
            row[f"quant_{name}_{gran}_ms"] = ms
            if chip is not None:  # how close the casts come to their memory-bound least time
                row[f"quant_{name}_{gran}_pct_roofline"] = 100 * roofline_ms(chip, shape)["quant"] / ms
            row[f"fp8_{gran}_{name}_total_ms"] = total
            row[f"speedup_{gran}_{name}"] = row["bf16_ms"] / total
        row[f"speedup_{gran}_gemm"] = row["bf16_ms"] / row[f"fp8_{gran}_ms"]
    return row


def _rates(row: dict, key: str, ms: float, shape: Shape, chip: Accelerator | None, dtype: str) -> None:
    row[f"{key}_tflops"] = shape.flops / (ms * 1e-3) / 1e12
    if chip is not None and (dtype == "bf16" or chip.fp8_flops is not None):
        row[f"{key}_pct_peak"] = 100 * row[f"{key}_tflops"] * 1e12 / peak_flops(chip, dtype)


def measured_crossovers(rows: list[dict], quants: Sequence[str]) -> list[dict]:
    """The square sweep's crossover for each granularity: the FP8 GEMM alone, and with each quantiser's casts."""
    square = [r for r in rows if r["shape"].startswith("square") and r.get("lane") == "gpu"]
    sizes, base = [r["m"] for r in square], [r["bf16_ms"] for r in square]
    found = []
    for gran in GRANULARITIES:
        for what, key in [("GEMM only", f"fp8_{gran}_ms"),
                          *((f"+ {q} quantisation", f"fp8_{gran}_{q}_total_ms") for q in quants)]:
            found.append({"granularity": gran, "fp8": what,
                          "crossover_n": crossover(sizes, base, [r.get(key) for r in square])})
    return found


# --- CPU lane -----------------------------------------------------------------------------------------------------

CPU_SHAPES = (Shape("square 256", 256, 256, 256), Shape("smollm-135m down, 32 tokens", 32, 1536, 576))
RECIPES = (  # (label, a's scaling, w's scaling, fp8_matmul backend, fp8_matmul keywords)
    ("fp8 tensorwise, emulated", Scaling("e4m3", "tensor"), Scaling("e4m3", "tensor"), "emulate", {}),
    ("fp8 tensorwise, _scaled_mm", Scaling("e4m3", "tensor"), Scaling("e4m3", "tensor"), "scaled_mm", {}),
    ("fp8 rowwise, emulated", Scaling("e4m3", "row"), Scaling("e4m3", "row"), "emulate", {}),
    ("fp8 rowwise, _scaled_mm", Scaling("e4m3", "row"), Scaling("e4m3", "row"), "scaled_mm", {}),
    ("fp8 1x128 / 128x128 blocks, emulated", Scaling("e4m3", "tile"), Scaling("e4m3", "block"), "emulate", {}),
    ("fp8 blocks, never promoted", Scaling("e4m3", "tile"), Scaling("e4m3", "block"), "emulate",
     {"promote_every": None}),
)


def cpu_inputs(shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian activations and a weight of the usual 1/sqrt(K) size, as the GPU lane draws them."""
    return _randn((shape.m, shape.k), "cpu", 0), _randn((shape.n, shape.k), "cpu", 1, shape.k ** -0.5)


def cpu_rows(shapes: Sequence[Shape] = CPU_SHAPES, repeats: int = 3,
             probe: Callable[[str, str], str | None] = probe_scaled_mm) -> list[dict]:
    """Each recipe on each shape against the float32 GEMM of the unquantised inputs (bf16 for scale), with
    CPU emulation times. A _scaled_mm recipe the probe finds missing on this CPU is a row saying why."""
    rows = []
    for shape in shapes:
        a, w = cpu_inputs(shape)
        reference = a @ w.t()
        base = {"lane": "cpu", "shape": shape.name, "m": shape.m, "k": shape.k, "n": shape.n}
        calls = {"bf16 (torch.matmul)": lambda a=a, w=w: (a.bfloat16() @ w.bfloat16().t()).float()}
        for label, sa, sw, backend, options in RECIPES:
            reason = probe("cpu", sa.granularity) if backend == "scaled_mm" else None
            if reason is not None:
                rows.append({**base, "recipe": label, "status": f"missing: {reason}"})
                continue
            calls[label] = lambda a=a, w=w, sa=sa, sw=sw, backend=backend, options=options: fp8_matmul(
                *quantize(a, sa), *quantize(w, sw), sa, sw, backend=backend, **options)
        for label, call in calls.items():
            try:
                out = call()
            except Exception as err:
                rows.append({**base, "recipe": label, "status": f"error: {_first_line(err)}"})
                continue
            db = sqnr(reference, out)
            rel = float((out.double() - reference.double()).norm() / reference.double().norm())
            rows.append({**base, "recipe": label, "status": "ok" if db >= SQNR_MIN_DB else "FAIL", "sqnr_db": db,
                         "rel_error": rel, "cpu_emulation_ms": median_ms(call, repeats)})
    return rows


# --- output -------------------------------------------------------------------------------------------------------

def _num(value, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, int | float) else "-"


def print_cpu(rows: list[dict], predictions: list[dict]) -> None:
    print(f"{'shape':<30}{'recipe':<38}{'status':<8}{'SQNR dB':>8}{'rel err':>10}"
          f"{'CPU emulation ms (not a speed claim)':>38}")
    for r in rows:
        status = r["status"] if r["status"] in ("ok", "FAIL") else r["status"].split(":")[0]
        print(f"{r['shape']:<30}{r['recipe']:<38}{status:<8}{_num(r.get('sqnr_db'), '.1f'):>8}"
              f"{_num(r.get('rel_error'), '.2e'):>10}{_num(r.get('cpu_emulation_ms'), '.2f'):>38}")
        if status not in ("ok", "FAIL"):
            print(f"    {r['status']}")
    print("\nroofline prediction (lab.calc, square n³ GEMMs, casts of 5 B per input element; not measured)")
    print_predictions(predictions)


def print_predictions(predictions: list[dict]) -> None:
    print(f"{'chip':<22}{'ridge bf16':>11}{'ridge fp8':>10}{'bound n bf16':>13}{'bound n fp8':>12}"
          f"{'FP8 wins from n':>16}{'on the sweep':>13}")
    for p in predictions:
        print(f"{p['chip']:<22}{p['ridge_bf16']:>11.0f}{p['ridge_fp8']:>10.0f}{p['compute_bound_n_bf16']:>13}"
              f"{p['compute_bound_n_fp8']:>12}{p['crossover_n']:>16}{_num(p['crossover_sweep'], 'd'):>13}")


def print_gpu(rows: list[dict], quants: Sequence[str], found: list[dict], prediction: dict | None) -> None:
    head = f"{'shape':<22}{'bf16 ms':>9}{'TF/s':>6}{'%pk':>5}"
    for gran in GRANULARITIES:
        head += f" |{gran + ' fp8 ms':>15}{'TF/s':>6}{'%pk':>5}" + "".join(f"{'q ' + q:>12}" for q in quants) \
            + f"{'x gemm':>7}" + "".join(f"{'x +' + q[:4]:>8}" for q in quants)
    print(head)
    for r in rows:
        line = f"{r['shape']:<22}{r['bf16_ms']:>9.3f}{r['bf16_tflops']:>6.0f}{_num(r.get('bf16_pct_peak'), '.0f'):>5}"
        notes = []
        for gran in GRANULARITIES:
            if r[f"fp8_{gran}_status"] != "ok":
                line += f" |{'-':>15}{'-':>6}{'-':>5}" + f"{'-':>12}" * len(quants) + f"{'-':>7}" + \
                    f"{'-':>8}" * len(quants)
                notes.append(f"    {gran}: {r[f'fp8_{gran}_status']}")
                continue
            line += (f" |{r[f'fp8_{gran}_ms']:>15.3f}{r[f'fp8_{gran}_tflops']:>6.0f}"
                     f"{_num(r.get(f'fp8_{gran}_pct_peak'), '.0f'):>5}")
            line += "".join(f"{_num(r.get(f'quant_{q}_{gran}_ms'), '.3f'):>12}" for q in quants)
            line += f"{r[f'speedup_{gran}_gemm']:>7.2f}"
            line += "".join(f"{_num(r.get(f'speedup_{gran}_{q}'), '.2f'):>8}" for q in quants)
            notes += [f"    {gran} {q} quantisation: {r[f'quant_{q}_{gran}_error']}" for q in quants
                      if f"quant_{q}_{gran}_error" in r]
        print(line)
        for note in notes:
            print(note)
    print("\n(q: ms to quantise both inputs; x: bf16 time / FP8 time, GEMM only and with the quantisation)")
    print("\ncrossover of the square sweep: smallest n from which FP8 stays faster than bf16")
    for f in found:
        print(f"  {f['granularity'] + 'wise':<11}{f['fp8']:<28}measured n = {_num(f['crossover_n'], 'd')}")
    square = [r for r in rows if r["shape"].startswith("square")]
    if square and prediction:
        last = max(square, key=lambda r: r["m"])
        cells = [f"{gran} {q} {r:.0f}%" for gran in GRANULARITIES for q in quants
                 if (r := last.get(f"quant_{q}_{gran}_pct_roofline")) is not None]
        print(f"  quantisation at {last['shape']}, % of its roofline time (5 B per element): {', '.join(cells)}")
    if prediction:
        print(f"  roofline ({prediction['chip']}): FP8 with its casts wins from n = {prediction['crossover_n']} "
              f"(on the sweep: {_num(prediction['crossover_sweep'], 'd')}); compute-bound from n = "
              f"{prediction['compute_bound_n_bf16']} (bf16), {prediction['compute_bound_n_fp8']} (fp8)")


def environment(lane: str) -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    env = {"torch": torch.__version__, "triton": triton_version, "python": platform.python_version()}
    if lane == "gpu":
        major, minor = torch.cuda.get_device_capability()
        return {"device": torch.cuda.get_device_name(), "capability": f"sm_{major}{minor}", **env}
    return {"device": f"CPU ({platform.processor() or platform.machine()})", **env}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lane", choices=("auto", "gpu", "cpu"), default="auto")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SQUARE), help="GPU lane: square sizes n")
    parser.add_argument("--no-llama", action="store_true", help="GPU lane: skip the Llama MLP shapes")
    parser.add_argument("--compile", choices=COMPILE_MODES, default="static",
                        help="GPU lane: the torch.compile'd quantisation column per shape (static), once for all "
                             "shapes (dynamic) or none (off)")
    parser.add_argument("--repeats", type=int, default=3, help="CPU lane: timed calls per recipe (median)")
    parser.add_argument("--json", type=Path, default=None, help="write the records here")
    args = parser.parse_args(argv)
    if any(s < 16 or s % 16 for s in args.sizes):
        parser.error(f"--sizes {args.sizes}: each must be a multiple of 16 (cuBLASLt's FP8 rule), >= 16")
    lane = ("gpu" if torch.cuda.is_available() else "cpu") if args.lane == "auto" else args.lane
    if lane == "gpu" and not torch.cuda.is_available():
        parser.error("--lane gpu: torch sees no CUDA device")
    env = environment(lane)
    print(f"{lane} lane on {env['device']}: torch {env['torch']}, triton {env['triton']}")
    if lane == "gpu":
        chip = device_accelerator(env["device"])
        print(f"peaks: {chip.source}" if chip else f"no peak for {env['device']!r} in lab.calc.hardware: "
              "% of peak and the roofline prediction left out")
        missing = {gran: probe_scaled_mm("cuda", gran) for gran in GRANULARITIES}
        quants = quantizers(args.compile)
        shapes = square_shapes(args.sizes) + ([] if args.no_llama else llama_shapes())
        rows = []
        for shape in shapes:
            rows.append(gpu_row(shape, chip, missing, quants))
            torch.cuda.empty_cache()
            print(f"  {shape.name}: bf16 {rows[-1]['bf16_ms']:.3f} ms, speed-ups "
                  f"{ {k: round(v, 2) for k, v in rows[-1].items() if k.startswith('speedup')} }", flush=True)
        found = measured_crossovers(rows, list(quants))
        predictions = [predicted_crossover(chip, args.sizes)] if chip and chip.fp8_flops else []
        print_gpu(rows, list(quants), found, predictions[0] if predictions else None)
    else:
        rows, found = cpu_rows(repeats=args.repeats), []
        predictions = [predicted_crossover(HARDWARE[c]) for c in CPU_CHIPS]
        print_cpu(rows, predictions)
    if args.json:
        record = {**env, "lane": lane, "rows": rows, "crossovers": found, "roofline": predictions}
        args.json.write_text(json.dumps(record, indent=1))
        print(f"wrote {args.json}")
    return 0 if all(r.get("status", "ok") != "FAIL" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
