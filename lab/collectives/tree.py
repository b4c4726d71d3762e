"""Binomial-tree collectives: latency-optimal for small messages.

A ring needs W−1 steps whatever the size, so for a few bytes its cost is (W−1)·α of pure latency.
A binomial tree doubles the number of informed ranks every step: ⌈log2 W⌉ steps. The price is
bandwidth — the root's link carries the whole message log2 W times — so NCCL and gloo pick trees for
small messages and rings for large ones.

Ranks are renumbered relative to the root (`v = (rank − root) mod W`) so any rank can be the root.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lab.collectives.p2p import REDUCE_OPS, combine, group_info


def tree_broadcast(tensor: torch.Tensor, src: int = 0, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Broadcast `tensor` from group rank `src` in place: step k, ranks v < 2^k send to v + 2^k."""
    rank, world, to_global = group_info(group)
    v = (rank - src) % world
    mask = 1
    while mask < world:
        if v < mask and v + mask < world:
            dist.send(tensor.contiguous(), to_global((v + mask + src) % world), group=group)
        elif mask <= v < 2 * mask:
            dist.recv(tensor, to_global((v - mask + src) % world), group=group)
        mask <<= 1
    return tensor


def tree_reduce(tensor: torch.Tensor, dst: int = 0, op: str = "sum",
                group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Reduce into `tensor` on group rank `dst` (the mirror image of the broadcast).

    Other ranks' `tensor` ends up holding partial results, as with `dist.reduce`.
    """
    if op not in REDUCE_OPS:
        raise ValueError(f"op={op!r} must be one of {', '.join(map(repr, REDUCE_OPS))}")
    rank, world, to_global = group_info(group)
    v = (rank - dst) % world
    mask = 1
    while mask < world:
        if v & mask:  # hand my partial result to my parent and stop
            dist.send(tensor.contiguous(), to_global((v - mask + dst) % world), group=group)
            break
        if v + mask < world:
            incoming = torch.empty_like(tensor)
            dist.recv(incoming, to_global((v + mask + dst) % world), group=group)
            combine(tensor, incoming, "sum" if op == "avg" else op)
        mask <<= 1
    if op == "avg" and rank == dst:
        tensor /= world
    return tensor


def tree_all_reduce(tensor: torch.Tensor, op: str = "sum", group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-reduce in 2⌈log2 W⌉ steps: reduce to rank 0, then broadcast from it."""
    tree_reduce(tensor, 0, op, group)
    return tree_broadcast(tensor, 0, group)
