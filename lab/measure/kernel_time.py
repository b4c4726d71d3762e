"""Where a GPU step's time goes: its kernels' time by category, from a profile or a recorded trace.

MFU says how much of the peak a step reached, not why it missed the rest. Summing the device time of its kernels by
what they do answers that: time in matmuls runs on tensor cores; attention is its own kernels; every elementwise
kernel and every copy or dtype cast reads and writes whole activations at memory bandwidth and does next to no
arithmetic — the time `torch.compile`'s fusion removes (issue 36: 58.5% of the H100 step of Llama 3.2 1B). The
categories, first match wins:

* `communication`: NCCL's kernels;
* `attention`: flash / memory-efficient / cuDNN SDPA kernels, flex attention, lab's Triton flash and paged kernels;
* `matmul`: cuBLAS (nvjet, gemm, gemv, xmma, split-K reduction), CUTLASS, Triton and Inductor matmul templates,
  lab's Triton matmul; on a CPU profile, ATen's matmul ops;
* `copy+cast`: copies and dtype conversions (`direct_copy_kernel`, `bfloat16_copy_kernel`, concatenation), and an
  Inductor kernel that fuses nothing but casts and copies (Inductor names a kernel after every op it fuses); one
  category, since a cast is a copy that changes the dtype and the two share kernels;
* `elementwise`: ATen's elementwise and `multi_tensor_apply` kernels (the foreach optimizer is elementwise
  work over many tensors), fills, Inductor's pointwise kernels, lab's Triton SwiGLU and add;
* `other`: reductions (norms, softmax, the loss), indexing, sorting, embedding backward, Inductor's fused
  reductions (`triton_red_`, `triton_per_`: a fused RMSNorm's name lists `_to_copy`, but its work is a reduction).

Kernel names come from torch.profiler's Chrome trace (`launch.trace_events`, the reader behind
`launch.read_kernel_trace`) or from its `key_averages()` rows.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from lab.measure.launch import trace_events

CATEGORIES = ("matmul", "attention", "elementwise", "copy+cast", "communication", "other")

_RULES = (
    ("communication", r"nccl"),
    ("attention", r"flash|fmha|sdpa|attention|attn|flex|cudnn::fusion|^_(fwd|bwd_dkdv|bwd_dq)_kernel$"
                  r"|^_bwd_preprocess$|paged_decode"),
    ("matmul", r"gemm|gemv|nvjet|cutlass|xmma|splitkreduce|cublas|matmul|triton_tem"
               r"|^aten::(mm|addmm|bmm|linear|_scaled_mm)$"),
    ("copy+cast", r"^(?!triton_).*(copy|catarray)"
                  r"|^triton_poi_fused_(_to_copy|clone|cat|copy)(_(_to_copy|clone|cat|copy))*_\d+$"),
    ("elementwise", r"elementwise|multi_tensor_apply|foreach|fill|^triton_poi_|^_swiglu_|^_add_kernel$"),
)


def kernel_category(name: str) -> str:
    """The category (one of CATEGORIES) of a kernel, from its name."""
    return next((category for category, pattern in _RULES if re.search(pattern, name, re.IGNORECASE)), "other")


def time_by_category(kernels: Iterable[tuple[str, float]]) -> dict[str, float]:
    """Total time per category of (kernel name, time) pairs, every category present, in CATEGORIES' order."""
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for name, seconds in kernels:
        totals[kernel_category(name)] += seconds
    return totals


def shares(totals: dict[str, float]) -> dict[str, float]:
    """Each category's fraction of the kernel time (they sum to 1)."""
    busy = sum(totals.values())
    if not busy > 0:
        raise ValueError(f"kernel time {busy!r}: expected > 0 (a profile or trace with GPU kernels)")
    return {category: seconds / busy for category, seconds in totals.items()}


def trace_time_by_category(path: str | Path) -> dict[str, float]:
    """Seconds per category of the kernels of a Chrome trace written by torch.profiler (`.json` or `.json.gz`)."""
    kernels = [(e["name"], e["dur"] * 1e-6) for e in trace_events(path) if e.get("cat") == "kernel"]
    if not kernels:
        raise ValueError(f"{path} holds no kernel events: expected a trace recorded with CUDA activity")
    return time_by_category(kernels)
