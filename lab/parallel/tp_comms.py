"""The four communication operators of tensor and sequence parallelism, each with its conjugate backward.

Megatron-LM names the first two f and g. In a column-parallel then row-parallel pair (an MLP, or attention)
every rank needs the full input x and produces a partial sum of the output:

  op                     forward                      backward
  copy_to_tp      (f)    identity                     all-reduce the gradient
  reduce_from_tp  (g)    all-reduce the partial sums  identity
  gather_sequence        all-gather along the seq dim reduce-scatter the gradient along seq
  scatter_sequence       reduce-scatter along seq     all-gather the gradient along seq

f and g are conjugates (one's forward is the other's backward), and so are the last two. Sequence
parallelism replaces (f, g) by (gather, scatter): the same bytes on the wire — an all-reduce *is* a
reduce-scatter plus an all-gather — but between them the activations of norms and residuals are kept
sharded along the sequence, 1/tp of them per rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lab.distributed import all_gather_single, reduce_scatter_single


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _all_gather_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(B, T/tp, ...) -> (B, T, ...): shards concatenated in rank order along dim 1."""
    world = dist.get_world_size(group)
    local = x.movedim(1, 0).contiguous()
    out = torch.empty((world * local.shape[0], *local.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_single(out, local, group=group)
    # Contiguous once here: otherwise each column linear (wq, wk, wv; w1, w3) flattens the strided view into a
    # copy of its own and saves it for backward, holding 3 (then 2) copies of the gathered activations.
    return out.movedim(0, 1).contiguous()


def _reduce_scatter_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(B, T, ...) summed over ranks -> this rank's (B, T/tp, ...) block."""
    world = dist.get_world_size(group)
    full = x.movedim(1, 0).contiguous()
    if full.shape[0] % world:
        raise ValueError(f"sequence length {full.shape[0]} must be divisible by tp={world} for sequence parallelism")
    out = torch.empty((full.shape[0] // world, *full.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_single(out, full, group=group)
    return out.movedim(0, 1)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group), None


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _GatherSequence.apply(x, group)


def scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _ScatterSequence.apply(x, group)
