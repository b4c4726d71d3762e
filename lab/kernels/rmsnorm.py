"""RMSNorm, forward and backward, each one pass over the activations.

y = x̂ · w with x̂ = x · r and r = 1 / sqrt(mean(x²) + eps) per row (the statistics in fp32 whatever x's dtype,
x̂ rounded to x's dtype before the weight multiplies it, exactly as `lab.model.rms_norm`).

Eager torch runs it as separate ops (square, mean, rsqrt, multiply, round, multiply by w; casts to fp32 for
fp16 input), each reading its N×D input and writing its output: 7 passes over N×D in fp32, 13 in fp16 with the
casts, and more in the backward. The forward kernel reads x once and writes y once, plus 4 bytes per row: the
row's r, saved for the backward.

The backward needs, with g = dy · w (the gradient reaching x̂):
    dx = r · (g − x̂ · mean(g · x̂))          a reduction along the row, like softmax's backward
    dw = Σ_rows dy · x̂                      a reduction down the columns, across all rows
One kernel computes both: it reads x, dy and r (x̂ = x · r is recomputed, never stored), writes dx, and keeps a
running fp32 sum of dy · x̂ for the rows it owns. Each program then writes its partial dw as one row of a
(programs, D) fp32 buffer, and torch sums those few rows: no atomics, and the sum stays fp32 until the end (a
sum of thousands of fp16 products rounded at every step would lose the small ones).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lab.kernels.runtime import check_input, check_row, row_launch

MAX_PROGRAMS = 256
"""The backward's grid is at most this many programs, each looping over row blocks: the size of the partial-dw
buffer is then (at most 256, D), whatever the number of tokens."""

MAX_DW_ROWS = 64
"""Rows per block in the backward. Its column sum for dw is, in the interpreter, a running sum (numpy adds the
rows one after another), whose rounding error grows with the rows: 512 rows of fp32 gave 3-6x torch's error,
64 rows 1-1.5x. The partials are then summed by torch, pairwise."""


@triton.jit
def _rmsnorm_forward(x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, n_cols, eps,
                     BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols[None, :] < n_cols)
    offsets = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)  # padding is 0: it adds nothing to Σx²
    normed = (x * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)  # rounded as the eager op rounds
    tl.store(y_ptr + offsets, (normed * w[None, :]).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _rmsnorm_backward(x_ptr, w_ptr, rstd_ptr, dy_ptr, dx_ptr, dw_partial_ptr, n_rows, n_cols,
                      BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_COLS], dtype=tl.float32)
    for start in range(pid * BLOCK_ROWS, n_rows, tl.num_programs(0) * BLOCK_ROWS):
        rows = start + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        offsets = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        normed = x * rstd[:, None]
        g = dy * w[None, :]
        dx = rstd[:, None] * (g - normed * (tl.sum(g * normed, axis=1) / n_cols)[:, None])
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * normed, axis=0)  # down the columns: masked rows are 0 and add nothing
    tl.store(dw_partial_ptr + pid * n_cols + cols, dw, mask=col_mask)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        n_cols = x.shape[-1]
        x2 = x.reshape(-1, n_cols).contiguous()
        n_rows = x2.shape[0]
        y = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        block_cols = triton.next_power_of_2(n_cols)
        block_rows, num_warps = row_launch(n_rows, block_cols)
        if n_rows:
            _rmsnorm_forward[(triton.cdiv(n_rows, block_rows),)](
                x2, weight, y, rstd, n_rows, n_cols, eps, BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols,
                num_warps=num_warps)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.x_shape = x.shape
        return y.view(*x.shape[:-1], n_cols)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x2, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = x2.shape
        dy = dy.reshape(n_rows, n_cols).contiguous()
        dx = torch.empty_like(x2)
        block_cols = triton.next_power_of_2(n_cols)
        block_rows, num_warps = row_launch(n_rows, block_cols)
        block_rows = min(block_rows, MAX_DW_ROWS)
        programs = max(1, min(triton.cdiv(n_rows, block_rows), MAX_PROGRAMS))
        dw_partial = torch.zeros(programs, n_cols, dtype=torch.float32, device=x2.device)
        if n_rows:
            _rmsnorm_backward[(programs,)](x2, weight, rstd, dy, dx, dw_partial, n_rows, n_cols,
                                           BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, num_warps=num_warps)
        return dx.view(ctx.x_shape), dw_partial.sum(0).to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x²) + eps) · weight over the last dim, the statistics in fp32: `lab.model.rms_norm`'s
    signature and values (its pure-torch reference), as a fused Triton forward and backward."""
    check_input(x, "x")
    check_input(weight, "weight")
    if x.dim() == 0:
        raise ValueError("x is a scalar: rms_norm normalises the last dim of a tensor")
    check_row(x.shape[-1], "x's last dim")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match x's last dim: it must be "
                         f"({x.shape[-1]},)")
    return _RMSNorm.apply(x, weight, float(eps))
