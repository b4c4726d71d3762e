"""Where each parameter lives on the mesh, recorded once, and the gradient arithmetic that reads it.

A parallelism that shards or replicates a parameter says so by attaching a `Placement` to it
(`param.placement`). Three things then read the placement instead of guessing from the module type:

- **materialisation** (`Placement.local`): the parameter's initial value is the slice of the full tensor that
  `lab.model.init_tensor` draws by name, so a model built on `meta` and sharded before it is allocated holds
  exactly the single-process values;
- **partial gradients** (`sum_partial_gradients`): under sequence parallelism a norm weight sees only its rank's
  tokens, and a KV head copied on several TP ranks (GQA with tp > n_kv_heads) sees only each rank's queries:
  their gradients are partial sums over the TP ranks holding the same piece;
- **the global gradient norm** (`clip_grad_norm`): each rank adds up the squares of its local gradients, each
  divided by how many ranks hold the same values (`replicas`), and one all-reduce of that number over the
  world gives the norm of the whole model's gradient, whatever the layout.

Data parallelism (plain, ZeRO or over experts) is not recorded per dimension: its engine knows its group.
The placement only counts the replicas it creates, so that the norm counts every value once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class Placement:
    """One parameter's layout: which piece of the full tensor this rank holds, and how many ranks hold it.

    `tp_dim` is the tensor dimension split into `tp_parts` equal pieces over the tensor-parallel group (None:
    every TP rank holds it whole); this rank holds piece `tp_index`. `tp_parts` is tp for column/row/vocab
    splits, and n_kv_heads for KV heads copied over tp/n_kv_heads ranks each. `tp_partial`: the gradient on
    each rank is a partial sum over the TP ranks holding the same piece. `expert`: an expert's weight, held by
    one rank of each expert-parallel group (its name says which expert) and averaged over `ep_dp` rather than
    dp x cp. `replicas`: ranks of the world holding the same values once gradients are reduced (1 for a shard
    only this rank holds), or None when no layout was applied (then the norm's group holds copies of it).
    """

    tp_dim: int | None = None
    tp_parts: int = 1
    tp_index: int = 0
    tp_partial: bool = False
    expert: bool = False
    replicas: int | None = None

    def full_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.tp_dim is None:
            return tuple(local_shape)
        shape = list(local_shape)
        shape[self.tp_dim] *= self.tp_parts
        return tuple(shape)

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the full tensor (a copy: the full tensor can then be freed)."""
        if self.tp_dim is None:
            return full.clone()
        if full.shape[self.tp_dim] % self.tp_parts:
            raise ValueError(f"dimension {self.tp_dim} of size {full.shape[self.tp_dim]} must be divisible by "
                             f"{self.tp_parts} (tensor-parallel pieces)")
        return full.chunk(self.tp_parts, dim=self.tp_dim)[self.tp_index].clone()


REPLICATED = Placement()


def placement_of(param: torch.Tensor) -> Placement:
    return getattr(param, "placement", REPLICATED)


def place(param: nn.Parameter, placement: Placement) -> nn.Parameter:
    param.placement = placement
    return param


def set_replicas(params: Iterable[nn.Parameter], replicas: int) -> None:
    """Record how many ranks of the world hold each of these values: called once the whole layout is known."""
    for param in params:
        place(param, dataclasses.replace(placement_of(param), replicas=replicas))


@torch.no_grad()
def sum_partial_gradients(params: Iterable[torch.Tensor], tp_group: dist.ProcessGroup | None) -> None:
    """Sum the gradients that are partial over the TP ranks holding the same piece (`tp_partial`).

    All of them in one all-reduce: each parameter contributes `tp_parts` slots, its own piece's gradient in slot
    `tp_index` and zeros elsewhere, so ranks holding other pieces add nothing to it. For a norm weight (one
    piece) that is a plain all-reduce over the TP group."""
    partial = [p for p in params if p.grad is not None and placement_of(p).tp_partial]
    if not partial or tp_group is None or dist.get_world_size(tp_group) == 1:
        return
    slots = []
    for param in partial:
        spot = placement_of(param)
        slot = torch.zeros((spot.tp_parts, param.grad.numel()), dtype=param.grad.dtype, device=param.grad.device)
        slot[spot.tp_index] = param.grad.reshape(-1)
        slots.append(slot.reshape(-1))
    flat = torch.cat(slots)
    dist.all_reduce(flat, group=tp_group)
    for param, summed in zip(partial, flat.split([s.numel() for s in slots]), strict=True):
        param.grad.copy_(summed.view(placement_of(param).tp_parts, -1)[placement_of(param).tp_index].view_as(param))


@torch.no_grad()
def grad_norm(params: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The L2 norm of the whole model's gradient, from the local gradients of every rank of `group` (the world by
    default): each value counted once, however many ranks hold it."""
    params = [p for p in params if p.grad is not None]
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    device = params[0].grad.device if params else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for param in params:
        grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad  # DTensor: its local shard
        total += grad.detach().double().pow(2).sum() / (placement_of(param).replicas or world)
    if world > 1:
        dist.all_reduce(total, group=group)
    return total.sqrt().float()
