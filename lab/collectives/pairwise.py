"""Collectives where ranks talk to each other directly: gather, scatter, all-to-all, barrier.

Gather and scatter funnel everything through one root (W−1 messages in, or out). All-to-all is the
MoE primitive: every rank has a different block for every other rank; W−1 rounds in which rank r sends
to r+k and receives from r−k keep every rank sending and receiving once per round. The barrier is a
dissemination barrier: after ⌈log2 W⌉ rounds of "tell the rank 2^k ahead", every rank has heard,
directly or indirectly, from every other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lab.collectives.p2p import exchange, group_info


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0,
           group: dist.ProcessGroup | None = None) -> list[torch.Tensor] | None:
    """Group rank `dst` receives every rank's `tensor` into `gather_list` (in rank order)."""
    rank, world, to_global = group_info(group)
    if rank != dst:
        dist.send(tensor.contiguous(), to_global(dst), group=group)
        return None
    if gather_list is None or len(gather_list) != world:
        raise ValueError(f"gather_list must hold world_size={world} tensors on the destination rank")
    requests = [dist.irecv(gather_list[r], to_global(r), group=group) for r in range(world) if r != rank]
    gather_list[rank].copy_(tensor)
    for request in requests:
        request.wait()
    return gather_list


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0,
            group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Rank r receives `scatter_list[r]` from group rank `src` into `tensor`."""
    rank, world, to_global = group_info(group)
    if rank != src:
        dist.recv(tensor, to_global(src), group=group)
        return tensor
    if scatter_list is None or len(scatter_list) != world:
        raise ValueError(f"scatter_list must hold world_size={world} tensors on the source rank")
    requests = [dist.isend(scatter_list[r].contiguous(), to_global(r), group=group) for r in range(world) if r != rank]
    tensor.copy_(scatter_list[rank])
    for request in requests:
        request.wait()
    return tensor


def all_to_all(outputs: list[torch.Tensor], inputs: list[torch.Tensor],
               group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """outputs[j] on rank i <- inputs[i] of rank j. Blocks may differ in size (the MoE case)."""
    rank, world, to_global = group_info(group)
    if len(inputs) != world or len(outputs) != world:
        raise ValueError(f"inputs and outputs must each hold world_size={world} tensors "
                         f"(got {len(inputs)} and {len(outputs)})")
    outputs[rank].copy_(inputs[rank])
    for shift in range(1, world):
        to, frm = (rank + shift) % world, (rank - shift) % world
        exchange(inputs[to], to_global(to), outputs[frm], to_global(frm), group)
    return outputs


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Return only once every rank of the group has entered the barrier."""
    rank, world, to_global = group_info(group)
    token, shift = torch.zeros(1), 1
    while shift < world:
        exchange(token, to_global((rank + shift) % world), torch.empty(1), to_global((rank - shift) % world), group)
        shift <<= 1
