"""The two things every hand-written collective needs: who am I in this group, and swap one message.

Everything in `lab.collectives` is built from `isend`/`irecv` alone, so a collective's cost is visible as
the messages it sends (count them with `lab.distributed.comm`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

REDUCE_OPS = ("sum", "avg", "max", "min", "product")


def group_info(group: dist.ProcessGroup | None) -> tuple[int, int, Callable[[int], int]]:
    """(my rank in the group, group size, group rank -> global rank), since send/recv take global ranks."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if group is None or group is dist.group.WORLD:
        return rank, world, lambda r: r
    return rank, world, lambda r: dist.get_global_rank(group, r)


def exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int,
             group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Send `send` to `dst` while receiving `recv` from `src` (global ranks); returns `recv`.

    Both are posted before either is waited on: with blocking send/recv every rank would first
    send and nobody would be receiving — a deadlock once messages exceed the transport's buffer.
    """
    requests = [dist.isend(send.contiguous(), dst, group=group), dist.irecv(recv, src, group=group)]
    for request in requests:
        request.wait()
    return recv


def combine(target: torch.Tensor, incoming: torch.Tensor, op: str) -> None:
    """target <- op(target, incoming), in place."""
    if op == "sum":
        target.add_(incoming)
    elif op == "product":
        target.mul_(incoming)
    elif op == "max":
        torch.maximum(target, incoming, out=target)
    elif op == "min":
        torch.minimum(target, incoming, out=target)
    else:
        raise ValueError(f"op={op!r} must be one of {', '.join(map(repr, REDUCE_OPS))}")
