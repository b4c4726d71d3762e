"""Fused row softmax: one kernel where the op written unfused is five, for rows of any width.

softmax(x)ᵢ = exp(xᵢ − m) / Σⱼ exp(xⱼ − m) over the last dim, with m = maxⱼ xⱼ so that no exp overflows. Written
as separate ops (max, subtract, exp, sum, divide) each op reads its input from memory and writes its output:
about 5 reads and 3 writes of the N×D matrix. Two fused kernels do it with far fewer, chosen by the row width:

One block (rows up to `ONLINE_ABOVE` columns). A program loads whole rows into registers, does all five steps
there and stores the result: 1 read and 1 write, so a memory-bound op runs up to ~4× faster (Triton's tutorial
python/tutorials/02-fused-softmax.py). Launch (`runtime.row_launch`, shared with the other row-wise kernels): a
program owns a [BLOCK_ROWS, BLOCK_COLS] block, BLOCK_COLS the row width rounded up to a power of two (the padding
is masked and set to −inf, so that it adds exp(−inf) = 0 to the sum and never wins the max). On a GPU narrow rows
are packed several to a program so that each program has ~2048 elements; in the interpreter, whose cost is per
program and per block op, one program takes up to 65536 elements (a 128×781 softmax: 1 program instead of 128).

Online (wider rows). A row held whole costs registers in proportion to its width, and past some width the
compiler spills them to memory or fits so few programs on an SM that the loads no longer hide their latency
(the one-block kernel at 4096×32768 fp16 moved 55 % of an H100's HBM bandwidth, torch eager 64 %:
benchmarks/results/2026-11-26-h100-80gb-hbm3-bench-scripts.json; 44 % and 48 % of an H200's in
course/data/ch09/kernels-h200-fp16.json). The online kernel streams a row in chunks of BLOCK_COLS columns,
twice:
    pass 1  a running max m and a running sum s = Σ exp(x − m); when a chunk raises the max to m', the sum so far
            is rescaled, s ← s · exp(m − m') + Σ_chunk exp(x − m') (Milakov & Gimelshein 2018, "Online normalizer
            calculation for softmax", §3; FlashAttention-2's §3.1 and chapter 05's ring attention merge partial
            results by the same rule)
    pass 2  reads the row again and writes exp(x − m) / s
That is 2 reads and 1 write of the row from HBM when the second read hits L2, where the safe softmax done in three
passes (max; sum; normalise) reads it 3 times; rows of any width work (a 128k-vocabulary row too). The second read
hits L2 when the rows in flight fit there: a program rereads its own row right after the first read, and at
4096×32768 fp16 (64 KiB rows, one program per row, 3 resident per SM on 132 SMs) that is ~26 MB, half the 50 MB
L2 of an H100 or H200. Pass 2 walks the chunks last to first, so that what it reads first is what pass 1 read last,
the part of the row most likely still in L2 when the whole row no longer fits (a 131072-wide fp16 row is 256 KiB:
then part of pass 2 comes from HBM, and the kernel moves up to 3 reads, the three-pass count, still without
spilling registers). The backward dx = y · (dy − Σ dy·y) streams likewise: pass 1 sums dy·y over the chunks,
pass 2 (last chunk first) writes dx. Both kernels fuse the backward, and it runs the kernel the forward chose.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lab.kernels.runtime import MAX_ROW, check_input, interpreted, next_power_of_2, row_launch

ONLINE_ABOVE = 1 << 13
"""Rows wider than this many columns take the online kernel. Why 8192: a one-block program holds its row in
registers, BLOCK_COLS / (32 · num_warps) elements per thread, several fp32 values each (x, exp(x − m), addresses),
and `row_launch` gives it 8 warps up to 8192 elements and 16 above. At 16 warps (512 threads) a thread may have at
most 65,536 / 512 = 128 registers, and past that the compiler spills to local memory. Compiled for an H100
(sm_90a) by Triton 3.9 on a machine without a GPU (`triton.compile` with `GPUTarget("cuda", 90, 32)`, the cubin
read by `cuobjdump --dump-resource-usage`), fp16, registers per thread and stack (spill) bytes, forward and
backward (fp32 and bf16 at 8192 columns: the same, 100-127 registers, no stack):
    one block  8192 cols, 8 warps:  forward 100 registers, backward 127, no stack
               16384, 16 warps:     128 and 128 (the cap), 8 and 32 stack bytes: spilling starts
               32768, 16 warps:     128 and 32, 464 and 1728 stack bytes (the recorded 55 % of HBM on an H100)
    online     4096-column chunks, 8 warps: 68 and 60 registers, no stack (fp32, 2048 columns, 4 warps: 66, 56)
So the one-block kernel stops at the widest row that compiles without spilling. A count, not a timing:
`softmax(x, online=...)` forces either kernel so that the GPU benchmark can place the crossover."""

GPU_CHUNK_BYTES = 8192
"""Bytes of a row per chunk of the online kernel on a GPU: 4096 16-bit or 2048 fp32 columns. `row_launch` gives
such a chunk 8 or 4 warps, 16 fp32 values per thread after the upcast: 56-68 registers and no spills (see
`ONLINE_ABOVE`), so that 3 programs fit an SM, and each thread's loads are 16-byte vectors."""

INTERPRETED_CHUNK = 1 << 14
"""Columns per chunk of the online kernel in Triton's interpreter, whose cost is per block op: large chunks, few
loop steps. (The tests make it smaller than their rows so that the loop and the rescale run.)"""


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


@triton.jit
def online_max_and_sum(x_ptr, row_start, row_mask, n_cols, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """Pass 1 of an online softmax over BLOCK_ROWS rows (`row_start`: each row's first offset; `row_mask`: the
    rows that exist), streamed in chunks of BLOCK_COLS columns: the row max m and s = Σ exp(x − m), the sum
    rescaled by exp(m − m') whenever a chunk raises the max to m'. The softmax's online kernel and the fused
    cross-entropy both start with it."""
    m = tl.full([BLOCK_ROWS], -float("inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_COLS):
        cols = start + tl.arange(0, BLOCK_COLS)
        mask = row_mask[:, None] & (cols[None, :] < n_cols)
        x = tl.load(x_ptr + row_start[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.where(cols[None, :] < n_cols, x, -float("inf"))  # the tail adds exp(-inf) = 0
        m_new = tl.maximum(m, tl.max(x, axis=1))
        # while a row has seen only -inf (a first chunk of masked-out logits), m_new is -inf and
        # exp(-inf - -inf) would be nan for good: shift by 0 instead (exp(-inf - 0) = 0 adds nothing)
        shift = tl.where(m_new == -float("inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift[:, None]), axis=1)
        m = m_new
    return m, s


@triton.jit
def _softmax_online_forward(x_ptr, y_ptr, n_rows, n_cols, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    m, s = online_max_and_sum(x_ptr, rows.to(tl.int64) * n_cols, rows < n_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)
    row_mask = rows[:, None] < n_rows
    row_start = rows[:, None].to(tl.int64) * n_cols
    # pass 2: the row again, last chunk first (the most recently read: in L2), normalised by the final m and s
    n_chunks = tl.cdiv(n_cols, BLOCK_COLS)
    for i in range(0, n_chunks):
        cols = (n_chunks - 1 - i) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        mask = row_mask & (cols[None, :] < n_cols)
        x = tl.load(x_ptr + row_start + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.exp(x - m[:, None]) / s[:, None]
        tl.store(y_ptr + row_start + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_online_backward(y_ptr, dy_ptr, dx_ptr, n_rows, n_cols, BLOCK_ROWS: tl.constexpr,
                             BLOCK_COLS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows[:, None] < n_rows
    row_start = rows[:, None].to(tl.int64) * n_cols
    # pass 1: Σ dy·y over the whole row (padding loads 0 and adds nothing)
    dot = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_COLS):
        cols = start + tl.arange(0, BLOCK_COLS)
        mask = row_mask & (cols[None, :] < n_cols)
        y = tl.load(y_ptr + row_start + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row_start + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dot += tl.sum(dy * y, axis=1)
    # pass 2: dx = y · (dy - Σ dy·y), last chunk first (the most recently read: in L2)
    n_chunks = tl.cdiv(n_cols, BLOCK_COLS)
    for i in range(0, n_chunks):
        cols = (n_chunks - 1 - i) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        mask = row_mask & (cols[None, :] < n_cols)
        y = tl.load(y_ptr + row_start + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row_start + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dx = y * (dy - dot[:, None])
        tl.store(dx_ptr + row_start + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


def online_chunk(n_cols: int, dtype: torch.dtype) -> int:
    """Columns per chunk of the online kernel: `GPU_CHUNK_BYTES` of the row on a GPU, `INTERPRETED_CHUNK` columns
    in the interpreter, or the whole row (rounded up to a power of two) when it is narrower."""
    chunk = INTERPRETED_CHUNK if interpreted() else GPU_CHUNK_BYTES // dtype.itemsize
    return min(next_power_of_2(n_cols), chunk)


def _launch(kernel, block_cols: int, out: torch.Tensor, *tensors: torch.Tensor) -> None:
    """One program per BLOCK_ROWS rows, each taking its rows whole (block_cols >= the width) or chunk by chunk."""
    n_cols = out.shape[-1]
    n_rows = out.numel() // n_cols
    block_rows, num_warps = row_launch(n_rows, block_cols)
    kernel[(triton.cdiv(n_rows, block_rows),)](*tensors, out, n_rows, n_cols, BLOCK_ROWS=block_rows,
                                               BLOCK_COLS=block_cols, num_warps=num_warps)


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, online: bool) -> torch.Tensor:
        x = x.contiguous()
        y = torch.empty_like(x)
        if x.numel():
            n_cols = x.shape[-1]
            if online:
                _launch(_softmax_online_forward, online_chunk(n_cols, x.dtype), y, x)
            else:
                _launch(_softmax_forward, next_power_of_2(n_cols), y, x)
        ctx.save_for_backward(y)
        ctx.online = online
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, None]:
        (y,) = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch.empty_like(y)
        if y.numel():
            n_cols = y.shape[-1]
            if ctx.online:
                _launch(_softmax_online_backward, online_chunk(n_cols, y.dtype), dx, y, dy)
            else:
                _launch(_softmax_backward, next_power_of_2(n_cols), dx, y, dy)
        return dx, None


def softmax_reference(x: torch.Tensor) -> torch.Tensor:
    """The pure-torch op the kernel must match."""
    return torch.softmax(x, dim=-1)


def softmax(x: torch.Tensor, *, online: bool | None = None) -> torch.Tensor:
    """Softmax over the last dim of x (any leading shape), in x's dtype, computed in fp32; differentiable.
    `online`: None picks by the row width (the one-block kernel up to `ONLINE_ABOVE` columns, the online kernel
    above), True or False forces one (the one-block kernel takes rows of at most `runtime.MAX_ROW` columns)."""
    check_input(x, "x")
    if x.dim() == 0:
        raise ValueError("x is a scalar: softmax needs at least one dim")
    width = x.shape[-1]
    if width < 1:
        raise ValueError(f"x's last dim {width} is out of range: softmax takes rows of at least 1 column")
    if online is None:
        online = width > ONLINE_ABOVE
    if not online and width > MAX_ROW:
        raise ValueError(f"x's last dim {width} is out of range for online=False: the one-block kernel takes 1 to "
                         f"{MAX_ROW} columns (online=True or None takes any width)")
    return _Softmax.apply(x, online)
