"""Expert parallelism: the experts of every MoE layer spread over `ep` ranks, tokens sent to them and back.

The router, attention and everything else stay replicated (and data parallel); only the experts are
sharded, rank r of the EP group keeping experts [r·E/ep, (r+1)·E/ep). A layer's forward on each rank:

1. route its own tokens (top-k, capacity) and sort the kept assignments by expert (`lab.model.MoE`);
2. exchange how many rows each rank will send to each expert (an all-to-all of counts, so that every rank
   can size its receive buffer: the split sizes differ from step to step);
3. dispatch: one `all_to_all_single` with uneven splits sends each block of rows to the expert's owner;
4. regroup what arrived (by source rank, then expert) by expert, run each local expert once, put the
   results back in arrival order;
5. combine: the reverse all-to-all returns every row to the rank it came from, where `MoE` weights the
   rows and adds them into their tokens (un-permuting).

Autograd runs the same path backwards: the gradient of an all-to-all is the all-to-all with the splits
swapped. Gradients then need two different averages (`ExpertDataParallel`): replicated parameters over the
data-parallel ranks, as always; an expert's over the ranks that hold the *same* expert (the other EP
groups), divided by dp, because its gradient already sums the contributions of every rank of its group.

DeepSeek-V3's routing bias (`MoE.update_routing_bias`) is replicated state like the router: `balance_routing`
updates it from the load summed over every rank that routes tokens, so that all replicas stay equal.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from lab.collectives.p2p import group_info
from lab.layout import experts_per_rank
from lab.model import MoE, Transformer
from lab.parallel.a2a import all_to_all
from lab.parallel.dp import NaiveDP, gradient_buffer
from lab.parallel.placement import place, placement_of


class ExpertParallelCompute:
    """`MoE.compute` for a rank that holds experts [first, first + local) of the layer: steps 2-5 above."""

    def __init__(self, moe: MoE, group: dist.ProcessGroup | None) -> None:
        self.moe, self.group = moe, group
        self.rank, self.ep, _ = group_info(group)
        self.local = experts_per_rank(moe.n_experts, self.ep)
        self.first = self.rank * self.local

    def __call__(self, inputs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        ep, local = self.ep, self.local
        sending = torch.tensor(counts, device=inputs.device).view(ep, local)  # row j: rows for rank j's experts
        arriving = torch.empty_like(sending)  # row j: rows rank j sends to each of my experts
        dist.all_to_all_single(arriving, sending, group=self.group)
        send, recv = sending.sum(dim=1).tolist(), arriving.sum(dim=1).tolist()
        received = all_to_all(inputs, send, recv, self.group)
        blocks = received.split(arriving.flatten().tolist())  # block s·local + j: from rank s, for my expert j
        outputs = [self.moe.experts[str(self.first + j)](torch.cat([blocks[s * local + j] for s in range(ep)]))
                   for j in range(local)]
        per_source = [out.split(arriving[:, j].tolist()) for j, out in enumerate(outputs)]
        back = torch.cat([per_source[j][s] for s in range(ep) for j in range(local)])
        return all_to_all(back, recv, send, self.group)


def apply_expert_parallel(model: Transformer, group: dist.ProcessGroup | None) -> Transformer:
    """Keep this rank's experts in every MoE layer (in place; on `meta` nothing is allocated), delete the others,
    and route through the all-to-all. The kept experts' placements say `expert`: their gradients are averaged
    over the ranks holding the same experts, and the global norm counts each expert once."""
    rank, ep, _ = group_info(group)
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        local = experts_per_rank(moe.n_experts, ep)
        for e in list(moe.experts):
            if not rank * local <= int(e) < (rank + 1) * local:
                del moe.experts[e]
        for param in moe.experts.parameters():
            place(param, dataclasses.replace(placement_of(param), expert=True))
        moe.compute = ExpertParallelCompute(moe, group)
    return model


def balance_routing(model: nn.Module, rate: float, group: dist.ProcessGroup | None = None) -> None:
    """After an optimizer step: DeepSeek-V3's bias update in every MoE layer, from the load of its last forward
    summed over the ranks of `group` (all the ranks that route their own tokens: DP × EP). Every rank sees the same
    sum, so every replica of the bias takes the same step."""
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        if moe.load is None:
            raise ValueError("balance_routing needs the load of a forward: run the model once first")
        load = moe.load.double()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(load, group=group)
        moe.update_routing_bias(load, rate)


class ExpertDataParallel(NaiveDP):
    """Data parallelism for a model whose experts are expert-parallel: after backward, replicated parameters
    are averaged over the dp ranks (`group`); each expert's gradient is summed over the ranks that hold the same
    expert (`expert_dp_group`: one per EP group) and divided by the dp ranks — the global batch's mean loss."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None,
                 expert_dp_group: dist.ProcessGroup | None, reduce_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(model, group, reduce_dtype)
        self.expert_dp_group = expert_dp_group

    @torch.no_grad()
    def finish(self) -> None:
        for param in self.params:
            grad = gradient_buffer(param, self.reduce_dtype)  # zeros if unused here: every rank takes part
            if placement_of(param).expert:
                if dist.get_world_size(self.expert_dp_group) > 1:
                    dist.all_reduce(grad, group=self.expert_dp_group)
                grad.div_(self.world)
            elif self.world > 1:
                dist.all_reduce(grad, group=self.group)
                grad.div_(self.world)
