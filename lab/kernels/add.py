"""Vector add: the smallest Triton kernel, and the pattern every other kernel of the chapter repeats.

A launch starts a grid of *programs*; program `pid` owns the block of elements [pid·BLOCK, (pid+1)·BLOCK). It
computes their addresses (`x_ptr + offsets`), loads them, adds and stores. The last block usually runs past the
end of the tensor, so every load and store carries a mask (`offsets < n`): on a GPU an unmasked tail reads or
writes someone else's memory; in the interpreter it is not even detected, and can corrupt the process's heap.

There is nothing to fuse in one add (2 reads and 1 write per element, as torch's own add), so this kernel only
teaches the launch. Its block size shows the two lanes: on a GPU, 1024 elements per program (4 warps of 32
threads, 8 elements each); in the interpreter, whose cost is per program and per block operation, one program
takes up to 65536 elements at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lab.kernels.runtime import check_input, flat_block


@triton.jit
def _add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + y, mask=mask)


def add_reference(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The pure-torch op the kernel must match."""
    return x + y


def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + y for two tensors of the same shape and dtype (any shape: the kernel sees them flat)."""
    check_input(x, "x")
    if y.shape != x.shape or y.dtype != x.dtype:
        raise ValueError(f"y is {str(y.dtype).removeprefix('torch.')} {tuple(y.shape)}: it must have x's shape "
                         f"{tuple(x.shape)} and dtype {str(x.dtype).removeprefix('torch.')}")
    x, y = x.contiguous(), y.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        block = flat_block(n)
        _add_kernel[(triton.cdiv(n, block),)](x, y, out, n, BLOCK=block, num_warps=4)
    return out
