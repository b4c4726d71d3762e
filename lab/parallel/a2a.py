"""A differentiable all-to-all: the one collective both Ulysses (context parallelism) and expert parallelism
move activations with. Its gradient is the same exchange the other way round."""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` with uneven splits along dim 0, differentiable: rows x[sum(send[:j]):...] go to
    rank j, rows from rank j land at out[sum(recv[:j]):...]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup | None):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """Differentiable uneven all-to-all of the rows of `x` (see `_AllToAll`)."""
    return _AllToAll.apply(x, send, recv, group)
