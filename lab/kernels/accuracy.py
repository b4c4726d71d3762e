"""The error-ratio rule: a kernel is as accurate as torch when its error is at most a small multiple of torch's.

A fixed tolerance is either too loose for fp32 or too tight for fp16. Instead both the kernel and torch's own op
are run in the same dtype and compared with a float64 reference computed from the same inputs: the kernel passes
when its largest error is at most `ratio` (2 by default) times torch's largest error, or at most `FLOOR_ULPS`
units of roundoff of the dtype at the reference's scale (its largest magnitude, however small: a loss gradient of
1/N is held to its own scale, not to 1), whichever is larger.

The floor is what makes the rule hold on any machine. When torch's own error is a few ulps, a ratio of two tiny
errors is noise: the same softmax backward measured 2.0e-7 for torch and 4.9e-7 for the kernel on an AVX-512 CPU
(2.4x, 6 ulps at the gradient's scale) where other CPUs sum in another order and pass. An output that went through
one row reduction (a softmax's denominator, a norm's mean square, a dot product) summed as a tree of n <= 1024
terms carries up to log2(n) = 10 roundings of the sum, plus a few of the elementwise ops around it: 16 ulps bounds
that for a correct kernel, and stays some 10^4 times below what a real mistake gives (a dropped mask, a missing
rescaling: errors of 1e-3 and more).
"""

from __future__ import annotations

import torch

from lab.kernels.runtime import DEVICE

FLOOR_ULPS = 16  # see the module docstring: a tree reduction of <= 1024 terms and the ops around it


def max_error(result: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest absolute difference, in float64; inf where one is NaN/inf and the other is not."""
    result, reference = result.detach().double(), reference.detach().double()
    if result.shape != reference.shape:
        raise ValueError(f"shape {tuple(result.shape)} differs from the reference's {tuple(reference.shape)}")
    if result.numel() == 0:
        return 0.0
    diff = (result - reference).abs()
    both_same = (result == reference) | (result.isnan() & reference.isnan())
    diff = torch.where(both_same, torch.zeros_like(diff), diff)
    return float(diff.nan_to_num(nan=float("inf")).max())


def error_ratio(result: torch.Tensor, baseline: torch.Tensor, reference: torch.Tensor,
                scale: float | None = None) -> float:
    """max|result - reference| / max(max|baseline - reference|, FLOOR_ULPS roundoff units of result's dtype at
    `scale`, by default the reference's largest magnitude). `baseline` is torch's own op in the kernel's dtype;
    `reference` is computed in float64. Give `scale` where the reference is 0 by cancellation (attention's dq with
    one key): the roundoff is then that of the terms that cancelled, which the result alone cannot show."""
    finfo = torch.finfo(result.dtype) if result.is_floating_point() else torch.finfo(torch.float64)
    if scale is None:
        scale = float(reference.detach().double().abs().max()) if reference.numel() else 0.0
    floor = max(FLOOR_ULPS * finfo.eps * scale, finfo.tiny)  # at the reference's scale: gradients of 1e-3 count
    return max_error(result, reference) / max(max_error(baseline, reference), floor)


def assert_error_ratio(name: str, result: torch.Tensor, baseline: torch.Tensor, reference: torch.Tensor,
                       ratio: float = 2.0, scale: float | None = None) -> None:
    """Fail with one line that names the op, the shape, the dtype and both errors when the rule is broken."""
    got = error_ratio(result, baseline, reference, scale)
    if not got <= ratio:
        raise AssertionError(
            f"{name} {str(result.dtype).removeprefix('torch.')} {tuple(result.shape)}: error "
            f"{max_error(result, reference):.3g} is {got:.3g}x torch's own {max_error(baseline, reference):.3g} "
            f"(allowed {ratio:g}x, or {FLOOR_ULPS} ulps at the reference's scale)")


def dot_product_ratio(dtype: torch.dtype) -> float:
    """The ratio allowed to ops made of long dot products (matmul, attention): the rule's 2x, except in fp32 on a
    GPU, where the kernel's tiles and cuBLAS add in different orders (measured up to 2.7x on an H200 at K=100, the
    kernel still within fp32's roundoff): 4x there."""
    return 4.0 if dtype == torch.float32 and DEVICE == "cuda" else 2.0
