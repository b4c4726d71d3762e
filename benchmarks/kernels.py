"""The kernels of lab.kernels against torch: speed on a GPU, correctness and interpreter timings on the CPU.

    python benchmarks/kernels.py                         # the GPU lane when torch sees a GPU, else the CPU lane
    TRITON_INTERPRET=1 python benchmarks/kernels.py --lane cpu --json out.json   # the CPU lane on a GPU machine
    python benchmarks/kernels.py --kernels softmax matmul --dtype fp16   # fp16: with the interpreter comparison

GPU lane (bf16 by default: the issue's targets are bf16, and so is training): each kernel, the same op in torch
eager and the same op under torch.compile, timed by `triton.testing.do_bench` (median) at a large shape. The
compiled column means what Inductor itself makes of the op: for the element- and row-wise ops, its fused Triton
kernels; for the matmul, which a plain torch.compile hands to cuBLAS, Inductor's own Triton GEMM templates
(`mode="max-autotune-no-cudagraphs"` with `max_autotune_gemm_backends="TRITON"`: each template config compiled
and timed at the shape, cuBLAS left out of the choice: tens of seconds, estimated, not yet measured); for attention,
torch.compile of SDPA (Inductor calls the same flash kernel, so it shows what compile adds or costs around it).
Memory-bound ops report GB/s of the bytes the op must move at least (read its inputs once, write its outputs
once) and % of the device's HBM bandwidth; matmul and attention report TFLOP/s and % of the dense tensor-core peak
of the dtype. Peaks come from `lab.calc.hardware`, the device found by `torch.cuda.get_device_name`.

Several rows time variants of one kernel: "matmul" (the tiled kernel, triton.autotune'd over its configs) and
"matmul persistent" (one program per SM walking the tiles, TMA loads on Hopper) at 4096³; "softmax" at
4096x32768 with the kernel's own choice of one-block or online, "softmax one-block" and "softmax online" forced
at the same shape, "softmax long rows" at a 128k vocabulary's width; "flash_attention bwd" (single pass, fp32
atomic dQ: the default while torch's deterministic algorithms are off) and "flash_attention bwd deterministic"
(the two-kernel backward). Then issue 36's targets, each PASS
or MISS (the exit status is 1 on a MISS): matmul >= 90% of cuBLAS (torch.matmul) at 4096³ bf16, the better of
the tiled and the persistent kernel; softmax >= 100% of torch eager's GB/s at the same shape; flash forward >= 60%
of torch's SDPA flash backend; and, with no target, the flash backward against SDPA's (SDPA's flash backend is
FlashAttention-2; for scale, the FlashAttention-2 paper, Dao 2023, §4.1, measured its CUDA kernel ~2x faster than
FlashAttention in Triton in the backward pass and 1.3-1.5x in the forward, on an A100).
Before timing, the compiled kernels are checked by the error-ratio rule on the CPU lane's small inputs; with
--dtype fp16 or fp32 (the interpreter has no bf16) the CPU lane also runs on those same numbers in a child
process with TRITON_INTERPRET=1: the interpreter-vs-compiled comparison of every kernel.

CPU lane: Triton's interpreter runs each kernel on a small, awkward shape (no powers of two; the forced online
softmax on rows wider than its interpreter chunk, so that its loop runs), checked by the error-ratio rule of
`lab.kernels.accuracy` (error vs a float64 torch reference <= 2x torch's own error in the same dtype), and timed
with `time.perf_counter`. Interpreter times measure the interpreter (numpy per block operation), nothing about a
GPU. A kernel module, function or variant option not written yet is a "missing" row, not a crash.

Both lanes print a table and, with --json, write the rows as records with the device, torch and triton versions.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch._inductor import config as inductor_config  # noqa: E402

import lab.kernels  # noqa: E402  (decides compiled vs interpreter before any kernel module is imported)
from benchmarks.timing import median_ms  # noqa: E402
from lab.calc.hardware import Accelerator, device_accelerator  # noqa: E402
from lab.calc.roofline import peak_flops  # noqa: E402
from lab.kernels.accuracy import error_ratio  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
GPU_DTYPE = "bf16"  # the GPU lane's default: the dtype of issue 36's targets and of training
RATIO = 2.0  # the error-ratio rule
EPS = 1e-5


@dataclass(frozen=True)
class Case:
    """One row: `lab.kernels.<module>.<function>` against `torch_op` (the same op in plain torch, in any dtype:
    float64 gives the reference). `grads` lists the arguments whose gradients are computed: `mode` "bwd" times
    the backward alone (the forward run once beforehand), "fwd+bwd" both (the fused cross-entropy computes its
    gradient in the forward). `work(shape, bytes per element)` is the op's minimum bytes moved (GB/s) or its FLOPs
    (TFLOP/s) in the timed part. `options` go to the kernel and to torch_op alike, `kernel_options` to the kernel
    alone (a variant: `online=True`, `deterministic=True`). `compile_mode` and `compile_config` (Inductor config
    set while the compiled op is built and timed) shape the torch.compile column."""

    name: str
    module: str
    function: str
    inputs: Callable[[tuple, torch.dtype, str], list]
    torch_op: Callable
    work: Callable[[tuple, int], float]
    unit: str  # "GB/s" or "TFLOP/s"
    cpu_shape: tuple
    gpu_shape: tuple
    grads: tuple[int, ...] = ()
    mode: str = "fwd"  # "fwd", "bwd" or "fwd+bwd"
    compile: bool = True  # a torch.compile column on the GPU
    options: dict = field(default_factory=dict)  # keyword arguments of the kernel and of torch_op
    kernel_options: dict = field(default_factory=dict)  # keyword arguments of the kernel only
    compile_mode: str | None = None
    compile_config: dict = field(default_factory=dict)


def _randn(shape: tuple, dtype: torch.dtype, device: str, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Seeded normal values, drawn where they will live (a CPU draw of a GPU-sized tensor takes seconds)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * scale).to(dtype)


def _rows(shape: tuple, dtype: torch.dtype, device: str) -> list:
    return [_randn(shape, dtype, device, 0)]


def _two(shape: tuple, dtype: torch.dtype, device: str) -> list:
    return [_randn(shape, dtype, device, 0), _randn(shape, dtype, device, 1)]


def _norm_inputs(shape: tuple, dtype: torch.dtype, device: str) -> list:
    return [_randn(shape, dtype, device, 0), 1 + _randn(shape[-1:], dtype, device, 1, 0.1), EPS]


def _ce_inputs(shape: tuple, dtype: torch.dtype, device: str) -> list:
    rows, vocab = shape
    targets = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(1)).to(device)
    return [_randn(shape, dtype, device, 0, 2.0), targets]


def _qkv(shape: tuple, dtype: torch.dtype, device: str) -> list:
    B, H, Hkv, T, D = shape
    return [_randn((B, H, T, D), dtype, device, 0), _randn((B, Hkv, T, D), dtype, device, 1),
            _randn((B, Hkv, T, D), dtype, device, 2)]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """torch's attention on its flash backend (the target compares against it: fp16/bf16 on a GPU, and the CPU's
    flash kernel); its math backend only where flash refuses the inputs (float64 references, GQA shapes)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])


def _attention_flops(shape: tuple, element_bytes: int, passes: int = 4) -> float:
    """q·kᵀ and p·v: 2 x 2·B·H·T²·D forward (FA2's backward: 5 matmuls, 10·B·H·T²·D); half of it under a causal
    mask (FlashAttention's convention for TFLOP/s)."""
    B, H, _, T, D = shape
    del element_bytes  # FLOPs do not depend on it
    return passes * B * H * T * T * D / 2


# Paged KV cache (vLLM's layout): pages of `block` tokens, (num_pages, block, Hkv, D); sequence b's tokens live in
# the pages block_table[b, :ceil(len_b / block)], in order. Decode: one query token per sequence.
def _paged_inputs(shape: tuple, dtype: torch.dtype, device: str) -> list:
    B, H, Hkv, max_len, D, block = shape
    gen = torch.Generator().manual_seed(3)
    lens = torch.randint(max(1, max_len // 2), max_len + 1, (B,), generator=gen)
    pages_per_seq = -(-max_len // block)
    table = torch.randperm(B * pages_per_seq, generator=gen).view(B, pages_per_seq)  # scattered pages
    pages = (B * pages_per_seq, block, Hkv, D)
    return [_randn((B, H, D), dtype, device, 0), _randn(pages, dtype, device, 1), _randn(pages, dtype, device, 2),
            table.to(device=device, dtype=torch.int32), lens.to(device=device, dtype=torch.int32)]


def _paged_torch(q, k_cache, v_cache, block_table, seq_lens) -> torch.Tensor:
    """Gather each sequence's pages into a contiguous K/V, then attend with its one query (no mask)."""
    block, out = k_cache.shape[1], []
    for b, length in enumerate(seq_lens.tolist()):
        pages = block_table[b, : -(-length // block)].long()
        k = k_cache[pages].flatten(0, 1)[:length].transpose(0, 1)  # (Hkv, len, D)
        v = v_cache[pages].flatten(0, 1)[:length].transpose(0, 1)
        out.append(F.scaled_dot_product_attention(q[b][:, None], k, v, enable_gqa=k.shape[0] != q.shape[1])[:, 0])
    return torch.stack(out)


def _paged_bytes(shape: tuple, b: int) -> float:
    B, H, Hkv, max_len, D, _ = shape
    return b * (2 * B * 0.75 * max_len * Hkv * D + 2 * B * H * D)  # K and V of the (mean 3/4 full) caches, q, out


def _matmul_torch(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch's matmul (cuBLAS on a GPU), as a Python function: torch.compile traces Python frames, and
    torch.compile(torch.matmul), a builtin, would run it uncompiled."""
    return a @ b


def _softmax_torch(x: torch.Tensor) -> torch.Tensor:
    """One function for the four softmax rows, so that they share its compiled graphs (`compiled_op`)."""
    return torch.softmax(x, -1)


def _matmul_inputs(shape: tuple, dtype: torch.dtype, device: str) -> list:
    return [_randn(shape[:2], dtype, device, 0), _randn(shape[1:], dtype, device, 1)]


# Inductor's own Triton GEMM: max-autotune compiles and times its template configs at the shape, and with only
# the TRITON backend it cannot fall back to cuBLAS (the eager column already is cuBLAS). Without CUDA graphs:
# do_bench times each call, as it does the kernel's.
INDUCTOR_GEMM = {"compile_mode": "max-autotune-no-cudagraphs",
                 "compile_config": {"max_autotune_gemm_backends": "TRITON"}}
MATMUL = {"inputs": _matmul_inputs, "torch_op": _matmul_torch, "work": lambda s, _: 2 * math.prod(s),
          "unit": "TFLOP/s", "cpu_shape": (100, 72, 90), "gpu_shape": (4096, 4096, 4096), **INDUCTOR_GEMM}
SOFTMAX = {"module": "softmax", "function": "softmax", "inputs": _rows, "torch_op": _softmax_torch,
           "work": lambda s, b: 2 * b * math.prod(s), "unit": "GB/s", "gpu_shape": (4096, 32768)}
FLASH_BWD = {"module": "flash_attention", "function": "flash_attention", "inputs": _qkv, "torch_op": _sdpa,
             "work": lambda s, b: _attention_flops(s, b, passes=10), "unit": "TFLOP/s",
             "cpu_shape": (1, 4, 2, 100, 32), "gpu_shape": (4, 32, 32, 4096, 128), "grads": (0, 1, 2),
             "mode": "bwd"}

CASES = [
    Case("add", "add", "add", _two, lambda x, y: x + y, lambda s, b: 3 * b * math.prod(s), "GB/s", (10_007,),
         (1 << 28,)),
    # softmax: the kernel's own choice at the issue's shape (online at 32768 columns), each kernel forced there,
    # and a vocabulary's width. The CPU lane's online rows are wider than the interpreter's chunk (16384): the
    # chunk loop and its rescale run.
    Case("softmax", cpu_shape=(37, 300), **SOFTMAX),
    Case("softmax one-block", cpu_shape=(37, 300), kernel_options={"online": False}, **SOFTMAX),
    Case("softmax online", cpu_shape=(3, 20_011), kernel_options={"online": True}, **SOFTMAX),
    Case("softmax long rows", cpu_shape=(2, 40_009), **{**SOFTMAX, "gpu_shape": (1024, 131072)}),
    Case("rms_norm fwd", "rmsnorm", "rms_norm", _norm_inputs, lambda x, w, eps: F.rms_norm(x, w.shape, w, eps),
         lambda s, b: b * (2 * math.prod(s) + s[-1]), "GB/s", (37, 300), (16384, 8192)),
    Case("rms_norm bwd", "rmsnorm", "rms_norm", _norm_inputs, lambda x, w, eps: F.rms_norm(x, w.shape, w, eps),
         lambda s, b: b * (3 * math.prod(s) + 2 * s[-1]), "GB/s", (37, 300), (16384, 8192), grads=(0, 1), mode="bwd"),
    Case("swiglu", "swiglu", "swiglu", _two, lambda g, u: F.silu(g) * u, lambda s, b: 3 * b * math.prod(s), "GB/s",
         (37, 300), (16384, 14336)),
    Case("cross_entropy fwd+bwd", "cross_entropy", "cross_entropy", _ce_inputs, F.cross_entropy,
         lambda s, b: 2 * b * math.prod(s), "GB/s", (37, 500), (8192, 128256), grads=(0,), mode="fwd+bwd"),
    Case("matmul", "matmul", "matmul", **MATMUL),
    Case("matmul persistent", "matmul", "matmul_persistent", **MATMUL),
    Case("flash_attention fwd", "flash_attention", "flash_attention", _qkv, _sdpa, _attention_flops, "TFLOP/s",
         (1, 4, 2, 100, 32), (4, 32, 32, 4096, 128)),
    Case("flash_attention bwd", **FLASH_BWD),
    Case("flash_attention bwd deterministic", kernel_options={"deterministic": True}, **FLASH_BWD),
    Case("paged_attention_decode", "paged_attention", "paged_attention_decode", _paged_inputs, _paged_torch,
         _paged_bytes, "GB/s", (3, 4, 2, 45, 32, 16), (32, 32, 8, 4096, 128, 16), compile=False),
]


def load_kernel(case: Case) -> Callable | None:
    """The kernel function with the case's `kernel_options` bound, or None when its module, the function or a
    keyword the variant needs is not written yet."""
    name = f"lab.kernels.{case.module}"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name and name.startswith(err.name) and err.name.startswith("lab.kernels"):
            return None
        raise
    fn = getattr(module, case.function, None)
    if fn is None or not case.kernel_options:
        return fn
    params = inspect.signature(fn).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()) and not set(case.kernel_options) <= set(params):
        return None
    return functools.partial(fn, **case.kernel_options)


def runner(case: Case, fn: Callable, args: list, dy_dtype: torch.dtype | None = None) -> Callable[[], object]:
    """A no-argument call of `fn` on `args` that does what `case.mode` times: the forward (its output), or the
    gradients of the output, weighted by a fixed random dy (rounded to `dy_dtype`, so that a float64 reference
    gets the very numbers the kernel got), with respect to the `grads` arguments."""
    if case.mode == "fwd":
        return lambda: fn(*args, **case.options)
    args = [a.detach().requires_grad_(i in case.grads) if torch.is_tensor(a) and a.is_floating_point() else a
            for i, a in enumerate(args)]
    leaves = [args[i] for i in case.grads]
    out = fn(*args, **case.options)
    dy = _randn(tuple(out.shape), dy_dtype or out.dtype, out.device.type, 7).to(out.dtype)
    if case.mode == "fwd+bwd":
        return lambda: torch.autograd.grad(fn(*args, **case.options), leaves, dy)
    return lambda: torch.autograd.grad(out, leaves, dy, retain_graph=True)


def _tensors(result) -> list[torch.Tensor]:
    return list(result) if isinstance(result, tuple | list) else [result]


def _in(args: list, dtype: torch.dtype) -> list:
    return [a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args]


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:160]


def check(case: Case, fn: Callable, dtype: torch.dtype, device: str) -> dict:
    """The error-ratio rule at the case's small shape on `device`: {"status": "ok" | "FAIL", "error_ratio"} and
    the kernel's and torch's calls for timing. The inputs are drawn on the CPU, so both lanes check the same
    numbers (the GPU lane's ratio is the compiled kernel's, the CPU lane's the interpreter's); the float64
    reference is computed on the CPU (a GPU's flash backend has no float64)."""
    inputs = case.inputs(case.cpu_shape, dtype, "cpu")
    args = [a.to(device) if torch.is_tensor(a) else a for a in inputs]
    kernel = runner(case, fn, args, dtype)
    result = [t.cpu() for t in _tensors(kernel())]
    baseline = runner(case, case.torch_op, args, dtype)
    reference = _tensors(runner(case, case.torch_op, _in(inputs, torch.float64), dtype)())
    ratio = max(error_ratio(r, b.cpu(), ref) for r, b, ref in zip(result, _tensors(baseline()), reference,
                                                                   strict=True))
    return {"status": "ok" if ratio <= RATIO else "FAIL", "error_ratio": ratio, "calls": (kernel, baseline)}


def cpu_row(case: Case, dtype: torch.dtype, repeats: int) -> dict:
    """Correctness by the error-ratio rule and perf_counter timings, kernel (interpreted) and torch, on CPU."""
    row = {"lane": "cpu", "kernel": case.name, "shape": list(case.cpu_shape),
           "dtype": str(dtype).removeprefix("torch.")}
    fn = load_kernel(case)
    if fn is None:
        return {**row, "status": "missing"}
    try:
        checked = check(case, fn, dtype, "cpu")
    except Exception as err:  # a kernel that cannot run is a row saying why
        return {**row, "status": f"error: {_first_line(err)}"}
    kernel, baseline = checked.pop("calls")
    return {**row, **checked, "kernel_ms": median_ms(kernel, repeats), "torch_ms": median_ms(baseline, repeats)}


def _do_bench(call: Callable[[], object]) -> float:
    import triton.testing

    return triton.testing.do_bench(call, return_mode="median")


_COMPILED: dict[tuple[Callable, str | None], Callable] = {}


def compiled_op(op: Callable, mode: str | None) -> Callable:
    """torch.compile(op, mode=mode), once per op and mode: rows that share a torch op (the two matmuls, the
    softmax variants) share its compiled graphs, so Inductor's GEMM autotuning runs once per shape."""
    if (op, mode) not in _COMPILED:
        _COMPILED[op, mode] = torch.compile(op, mode=mode, dynamic=False)
    return _COMPILED[op, mode]


def gpu_row(case: Case, dtype: torch.dtype, chip: Accelerator | None, *, device: str = "cuda",
            shape: tuple | None = None, timer: Callable[[Callable], float] = _do_bench) -> dict:
    """The compiled kernel's error ratio at the small shape, then the median ms (`timer`: do_bench) of the kernel,
    torch and torch.compile at the large `shape` (default: the case's), with rates and % of the chip's peak.
    `device`, `shape` and `timer` let a test walk this on a CPU."""
    shape = shape or case.gpu_shape
    dname = str(dtype).removeprefix("torch.")
    row = {"lane": "gpu", "kernel": case.name, "shape": list(shape), "dtype": dname, "unit": case.unit}
    fn = load_kernel(case)
    if fn is None:
        return {**row, "status": "missing"}
    try:
        checked = check(case, fn, dtype, device)
    except Exception as err:
        return {**row, "status": f"error: {_first_line(err)}"}
    checked.pop("calls")
    row.update(status=checked["status"], error_ratio_small=checked["error_ratio"], small_shape=list(case.cpu_shape))
    args = case.inputs(shape, dtype, device)
    work = case.work(shape, torch.tensor([], dtype=dtype).element_size())
    impls = {"kernel": fn, "torch": case.torch_op}
    if case.compile:
        impls["compile"] = compiled_op(case.torch_op, case.compile_mode)
    for impl, op in impls.items():
        try:  # torch.compile builds at the first call (in `runner` for a backward): under compile_config
            with inductor_config.patch(case.compile_config if impl == "compile" else {}):
                ms = timer(runner(case, op, args))
        except Exception as err:  # one implementation failing leaves the others' numbers
            row[f"{impl}_error"] = _first_line(err)
            continue
        rate = work / (ms * 1e-3) / (1e9 if case.unit == "GB/s" else 1e12)
        row[f"{impl}_ms"], row[f"{impl}_rate"] = ms, rate
        if chip is not None:
            peak = chip.hbm_bandwidth / 1e9 if case.unit == "GB/s" else peak_flops(chip, _calc_dtype(dname)) / 1e12
            row[f"{impl}_pct_peak"] = 100 * rate / peak
    return row


def _calc_dtype(name: str) -> str:
    return {"float16": "fp16", "bfloat16": "bf16", "float32": "bf16"}[name]  # fp32 matmuls: vs the bf16 roof


# (target, the rows whose best counts, what is compared, goal in % or None: reported without a target)
TARGETS = (
    ("matmul", ("matmul", "matmul persistent"), "kernel % of cuBLAS (torch.matmul), tiled or persistent", 90.0),
    ("softmax", ("softmax",), "kernel % of torch eager's GB/s, the kernel's own choice", 100.0),
    ("flash_attention fwd", ("flash_attention fwd",), "kernel % of torch SDPA flash", 60.0),
    ("flash_attention bwd", ("flash_attention bwd",), "kernel % of torch SDPA flash's backward", None),
    ("flash_attention bwd deterministic", ("flash_attention bwd deterministic",),
     "kernel % of torch SDPA flash's backward", None),
)


def targets(rows: list[dict]) -> list[dict]:
    """Issue 36's targets from GPU rows: the kernel's rate as % of torch eager's in the same row (same shape,
    same dtype), the best of the target's rows (a kernel with several variants meets it with its best one),
    PASS / MISS against the goal, "info" where there is no goal, n/a when no row has both numbers. A row whose
    kernel failed the error-ratio rule does not count."""
    by_name = {r["kernel"]: r for r in rows if r.get("lane") == "gpu" and r.get("status") != "FAIL"}
    verdicts = []
    for name, names, what, goal in TARGETS:
        ratios = {n: 100 * by_name[n]["kernel_rate"] / by_name[n]["torch_rate"] for n in names
                  if "kernel_rate" in by_name.get(n, {}) and "torch_rate" in by_name[n]}
        best = max(ratios, key=ratios.get, default=None)
        value = ratios.get(best)
        verdict = "n/a" if value is None else "info" if goal is None else "PASS" if value >= goal else "MISS"
        verdicts.append({"kernel": name, "target": what + ("" if goal is None else f" >= {goal:g}%"),
                         "value": value, "verdict": verdict, "best_row": best})
    return verdicts


def _num(value, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, int | float) else "-"


def print_cpu(rows: list[dict]) -> None:
    print(f"{'kernel':<34}{'shape':<22}{'dtype':<9}{'status':<10}{'err ratio':>10}{'interp ms':>11}{'torch ms':>10}")
    for r in rows:
        status = r["status"] if len(r["status"]) <= 9 else "error"
        print(f"{r['kernel']:<34}{'x'.join(map(str, r['shape'])):<22}{r['dtype']:<9}{status:<10}"
              f"{_num(r.get('error_ratio'), '.2f'):>10}{_num(r.get('kernel_ms'), ',.1f'):>11}"
              f"{_num(r.get('torch_ms'), ',.2f'):>10}")
        if status == "error":
            print(f"    {r['status']}")


def print_gpu_header() -> None:
    print(f"{'kernel':<34}{'status':<8}{'err ratio':>10}{'interp':>8}  {'unit':<8}{'kernel':>9}{'%peak':>7}"
          f"{'torch':>9}{'%peak':>7}{'compile':>9}{'%peak':>7}{'kernel/torch':>14}", flush=True)


def print_gpu_row(r: dict) -> None:
    """One row as soon as it is measured, flushed: a lane stopped by its time limit keeps the rows it printed."""
    if r["status"] not in ("ok", "FAIL"):
        print(f"{r['kernel']:<34}{r['status']}", flush=True)
        return
    cells = "".join(f"{_num(r.get(f'{i}_rate'), ',.1f'):>9}{_num(r.get(f'{i}_pct_peak'), '.0f'):>7}"
                    for i in ("kernel", "torch", "compile"))
    ratio = r["kernel_rate"] / r["torch_rate"] if "kernel_rate" in r and "torch_rate" in r else None
    print(f"{r['kernel']:<34}{r['status']:<8}{_num(r.get('error_ratio_small'), '.2f'):>10}"
          f"{_num(r.get('interpreter_error_ratio'), '.2f'):>8}  {r['unit']:<8}"
          f"{cells}{_num(ratio, '.2f'):>14}")
    for key in ("kernel_error", "torch_error", "compile_error"):
        if key in r:
            print(f"    {key}: {r[key]}")
    sys.stdout.flush()


def print_targets(rows: list[dict]) -> None:
    print()
    for t in targets(rows):  # the verdict last: gpu_lane.py quotes the lines that end in MISS
        best = f" ({t['best_row']})" if t["best_row"] not in (None, t["kernel"]) else ""
        print(f"{t['kernel']:<34}{t['target'] + best:<80}{_num(t['value'], '.1f'):>7}  {t['verdict']}")


def interpreter_lane(kernels: list[str], dtype: str) -> list[dict]:
    """This script's CPU lane in a child process with TRITON_INTERPRET=1 (the mode is fixed when lab.kernels is
    imported): the same kernels on the same small inputs, run by Triton's interpreter."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "interpreter.json"
        command = [sys.executable, __file__, "--lane", "cpu", "--dtype", dtype, "--repeats", "1", "--json", str(out),
                   "--kernels", *kernels]
        subprocess.run(command, env={**os.environ, "TRITON_INTERPRET": "1"}, stdout=subprocess.DEVNULL,
                       timeout=1200, check=False)
        return json.loads(out.read_text())["rows"] if out.exists() else []


def merge_interpreter(rows: list[dict], interpreted: list[dict]) -> None:
    """Add the interpreter's verdict and error ratio to each GPU row: the compiled and the interpreted kernel
    judged on the very same inputs (both lanes draw them on the CPU from the same seeds)."""
    by_name = {r["kernel"]: r for r in interpreted}
    for row in rows:
        other = by_name.get(row["kernel"], {"status": "not run"})
        row["interpreter_status"] = other["status"]
        if "error_ratio" in other:
            row["interpreter_error_ratio"] = other["error_ratio"]


def environment() -> dict:
    import triton

    gpu = torch.cuda.get_device_name() if lab.kernels.MODE == "compiled" else None  # the device kernels run on
    return {"device": gpu or f"CPU ({platform.processor() or platform.machine()})", "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version(), "kernels_mode": lab.kernels.MODE}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lane", choices=("auto", "gpu", "cpu"), default="auto")
    names = list(dict.fromkeys(c.name.split()[0] for c in CASES))
    parser.add_argument("--kernels", nargs="+", choices=names, default=None,
                        help="only these kernels (a row's first word: softmax selects its four rows, matmul both)")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None,
                        help=f"GPU lane: {GPU_DTYPE} (default: the issue's targets), fp16 or fp32 (these two with "
                             "the interpreter comparison); CPU lane: fp32 (default) or fp16")
    parser.add_argument("--repeats", type=int, default=3, help="CPU lane: timed calls per kernel (median)")
    parser.add_argument("--json", type=Path, default=None, help="write the records here")
    parser.add_argument("--no-interpreter", action="store_true",
                        help="GPU lane: skip the CPU lane's interpreter run on the same inputs")
    args = parser.parse_args(argv)
    compiled = lab.kernels.MODE == "compiled"
    lane = ("gpu" if compiled else "cpu") if args.lane == "auto" else args.lane
    if lane == "gpu" and not compiled:
        parser.error(f"--lane gpu needs compiled kernels, and lab.kernels runs in mode {lab.kernels.MODE!r}")
    if lane == "cpu" and compiled:
        parser.error("--lane cpu with a GPU: set TRITON_INTERPRET=1 so that lab.kernels runs in the interpreter")
    if lane == "cpu" and args.dtype == "bf16":
        parser.error("--dtype bf16: Triton's interpreter has no bf16 (lab.kernels.runtime); use fp32 or fp16")
    cases = [c for c in CASES if args.kernels is None or c.name.split()[0] in args.kernels]
    env = environment()
    print(f"{lane} lane on {env['device']}: torch {env['torch']}, triton {env['triton']}, kernels "
          f"{env['kernels_mode']}")
    if lane == "gpu":
        chip = device_accelerator(env["device"])
        print(f"peaks: {chip.source}" if chip else f"no peak for {env['device']!r} in lab.calc.hardware: "
              "% of peak left out")
        dtype = args.dtype or GPU_DTYPE
        compare = not args.no_interpreter and dtype != "bf16"  # the interpreter has no bf16
        # the interpreter first, so that each GPU row prints whole as soon as it is measured
        interpreted = interpreter_lane(sorted({c.name.split()[0] for c in cases}), dtype) if compare else []
        print_gpu_header()
        rows = []
        for case in cases:
            rows.append(gpu_row(case, DTYPES[dtype], chip))
            if compare:
                merge_interpreter(rows[-1:], interpreted)
            print_gpu_row(rows[-1])
        print_targets(rows)
    else:
        rows = [cpu_row(c, DTYPES[args.dtype or "fp32"], args.repeats) for c in cases]
        print_cpu(rows)
    if args.json:
        record = {**env, "lane": lane, "rows": rows, "targets": targets(rows) if lane == "gpu" else []}
        args.json.write_text(json.dumps(record, indent=1))
        print(f"wrote {args.json}")
    missed = lane == "gpu" and any(t["verdict"] == "MISS" for t in targets(rows))
    return 0 if all(r["status"] in ("ok", "missing") for r in rows) and not missed else 1


if __name__ == "__main__":
    sys.exit(main())
