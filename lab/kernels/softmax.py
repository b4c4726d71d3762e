"""Fused row softmax: one read and one write of the matrix, where the op written unfused moves it eight times.

softmax(x)ᵢ = exp(xᵢ − m) / Σⱼ exp(xⱼ − m) over the last dim, with m = maxⱼ xⱼ so that no exp overflows. Written
as separate ops (max, subtract, exp, sum, divide) each op reads its input from memory and writes its output:
about 5 reads and 3 writes of the N×D matrix. The kernel loads a block of whole rows into registers, does all
five steps there and stores the result: 1 read and 1 write, so a memory-bound op runs up to ~4× faster
(torch's own `torch.softmax` is fused too: this is what its kernel does).

The backward is fused the same way: dx = y · (dy − Σ dy·y) reads y and dy and writes dx, one pass.

Launch (`runtime.row_launch`, shared with the other row-wise kernels): a program owns a [BLOCK_ROWS, BLOCK_COLS] block,
BLOCK_COLS the row width rounded up to a power of two (the padding is masked, and set to −inf, so that it adds
exp(−inf) = 0 to the sum and never wins the max). On a GPU narrow rows are packed several to a program so that
each program has ~2048 elements to work on; in the interpreter, whose cost is per program and per block op, one
program takes up to 65536 elements (a 128×781 softmax: 1 program instead of 128).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lab.kernels.runtime import check_input, check_row, row_launch


@triton.jit
def _softmax_forward(x_ptr, y_ptr, n_rows, n_cols, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offsets = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    # padding columns: -inf never wins the max and adds exp(-inf) = 0 to the sum. (Padding rows stay 0: -inf
    # there would compute -inf - -inf = nan, harmless since never stored, but a warning in the interpreter.)
    x = tl.where(cols[None, :] < n_cols, x, -float("inf"))
    x = x - tl.max(x, axis=1)[:, None]
    numerator = tl.exp(x)
    y = numerator / tl.sum(numerator, axis=1)[:, None]
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_backward(y_ptr, dy_ptr, dx_ptr, n_rows, n_cols, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offsets = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    y = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    dx = y * (dy - tl.sum(dy * y, axis=1)[:, None])
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _launch(kernel, n_cols: int, out: torch.Tensor, *tensors: torch.Tensor) -> None:
    n_rows = out.numel() // n_cols
    block_cols = triton.next_power_of_2(n_cols)
    block_rows, num_warps = row_launch(n_rows, block_cols)
    kernel[(triton.cdiv(n_rows, block_rows),)](*tensors, out, n_rows, n_cols, BLOCK_ROWS=block_rows,
                                               BLOCK_COLS=block_cols, num_warps=num_warps)


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        y = torch.empty_like(x)
        if x.numel():
            _launch(_softmax_forward, x.shape[-1], y, x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch.empty_like(y)
        if y.numel():
            _launch(_softmax_backward, y.shape[-1], dx, y, dy)
        return dx


def softmax_reference(x: torch.Tensor) -> torch.Tensor:
    """The pure-torch op the kernel must match."""
    return torch.softmax(x, dim=-1)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of x (any leading shape), in x's dtype, computed in fp32; differentiable."""
    check_input(x, "x")
    if x.dim() == 0:
        raise ValueError("x is a scalar: softmax needs at least one dim")
    check_row(x.shape[-1], "x's last dim")
    return _Softmax.apply(x)
