"""Ring collectives from point-to-point messages: reduce-scatter, all-gather, and all-reduce = RS + AG.

The ranks form a ring; at every step each rank sends one chunk to its right neighbour and receives one
from its left, so every link is busy and no rank is a hot spot. For a tensor of B bytes on W ranks:

  reduce-scatter  W−1 steps, each sending B/W   → each rank sends (W−1)/W · B
  all-gather      W−1 steps, each sending B/W   → each rank sends (W−1)/W · B
  all-reduce      = reduce-scatter + all-gather → each rank sends 2(W−1)/W · B, whatever W is

which is why ring all-reduce is bandwidth-optimal, and why ZeRO can split it into its two halves at no
extra cost. Sizes that W does not divide are split into W nearly equal chunks (`torch.tensor_split`).

`ring_all_reduce(..., on_step=f)` calls `f(phase, step, chunks)` after every step, so a notebook can
watch the chunks travel (chapter 02 fills rank r's tensor with 2^r: a chunk's value then spells out which
ranks' contributions it already holds).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from lab.collectives.p2p import REDUCE_OPS, combine, exchange, group_info


def _chunks(flat: torch.Tensor, world: int) -> list[torch.Tensor]:
    return list(torch.tensor_split(flat, world))


OnStep = Callable[[str, int, list[torch.Tensor]], None]


def _ring_reduce_scatter_chunks(chunks: list[torch.Tensor], op: str, group: dist.ProcessGroup | None,
                                on_step: OnStep | None = None) -> None:
    """In place: afterwards chunks[rank] holds the reduction of every rank's chunks[rank]."""
    rank, world, to_global = group_info(group)
    right, left = to_global((rank + 1) % world), to_global((rank - 1) % world)
    inbox = torch.empty(max(c.numel() for c in chunks), dtype=chunks[0].dtype, device=chunks[0].device)
    for step in range(world - 1):
        send = chunks[(rank - step - 1) % world]
        target = chunks[(rank - step - 2) % world]
        received = exchange(send, right, inbox[:target.numel()], left, group)
        combine(target, received, op)
        if on_step:
            on_step("reduce-scatter", step, chunks)


def _ring_all_gather_chunks(chunks: list[torch.Tensor], group: dist.ProcessGroup | None,
                            on_step: OnStep | None = None) -> None:
    """In place: chunks[rank] is this rank's; afterwards every chunks[i] holds rank i's chunk."""
    rank, world, to_global = group_info(group)
    right, left = to_global((rank + 1) % world), to_global((rank - 1) % world)
    for step in range(world - 1):
        send = chunks[(rank - step) % world]
        target = chunks[(rank - step - 1) % world]
        exchange(send, right, target, left, group)  # receive straight into place
        if on_step:
            on_step("all-gather", step, chunks)


def ring_all_reduce(tensor: torch.Tensor, op: str = "sum", group: dist.ProcessGroup | None = None,
                    on_step: OnStep | None = None) -> torch.Tensor:
    """All-reduce `tensor` in place: reduce-scatter around the ring, then all-gather around it."""
    if op not in REDUCE_OPS:
        raise ValueError(f"op={op!r} must be one of {', '.join(map(repr, REDUCE_OPS))}")
    _, world, _ = group_info(group)
    if world == 1:
        return tensor
    # work in place on the tensor's memory when it is contiguous, as torch's all_reduce does
    flat = tensor.detach().view(-1) if tensor.is_contiguous() else tensor.detach().reshape(-1).clone()
    chunks = _chunks(flat, world)
    _ring_reduce_scatter_chunks(chunks, "sum" if op == "avg" else op, group, on_step)
    _ring_all_gather_chunks(chunks, group, on_step)
    if op == "avg":
        flat /= world
    if not tensor.is_contiguous():
        tensor.copy_(flat.view_as(tensor))
    return tensor


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: str = "sum",
                        group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Like `dist.reduce_scatter_single`: `input` holds W equal blocks; rank r gets the reduced block r."""
    rank, world, _ = group_info(group)
    if input.numel() != output.numel() * world:
        raise ValueError(f"input has {input.numel()} elements; it must have world_size*output = "
                         f"{world}*{output.numel()} = {world * output.numel()}")
    if op not in REDUCE_OPS:
        raise ValueError(f"op={op!r} must be one of {', '.join(map(repr, REDUCE_OPS))}")
    chunks = list(input.detach().reshape(-1).clone().chunk(world))
    _ring_reduce_scatter_chunks(chunks, "sum" if op == "avg" else op, group)
    result = chunks[rank] / world if op == "avg" else chunks[rank]
    output.copy_(result.view_as(output))
    return output


def ring_all_gather(output: torch.Tensor, input: torch.Tensor,
                    group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Like `dist.all_gather_single`: `output` is W copies' worth; block r comes from rank r."""
    rank, world, _ = group_info(group)
    if output.numel() != input.numel() * world:
        raise ValueError(f"output has {output.numel()} elements; it must have world_size*input = "
                         f"{world}*{input.numel()} = {world * input.numel()}")
    chunks = list(output.view(-1).chunk(world))
    chunks[rank].copy_(input.reshape(-1))
    _ring_all_gather_chunks(chunks, group)
    return output
