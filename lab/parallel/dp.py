"""Data parallelism: every rank holds the whole model and a slice of the batch.

After each backward pass the ranks average their gradients, so every replica takes the same optimiser
step and the replicas never drift apart. Averaging the per-rank mean losses' gradients over equal-sized
slices gives exactly the gradient of the mean loss over the whole batch — the reason a data-parallel run
reproduces a single-process run step for step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


@torch.no_grad()
def all_reduce_gradients(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Naive data parallelism: one all-reduce per parameter, after the whole backward pass."""
    world = dist.get_world_size(group)
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=group)
            param.grad.div_(world)
