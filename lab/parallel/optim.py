"""The optimizer step's two pieces that every layout shares: AdamW over a rank's local tensors, and clipping by
the global gradient norm.

Neither belongs to a data-parallel engine: the engines reduce gradients, and the training loop builds one
optimizer over whatever each rank updates — whole parameters, TP shards, ZeRO's pieces — so that mixed precision
(master weights, loss scaling) has one place to live.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from lab.parallel.placement import grad_norm


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float,
                   group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Scale the gradients so that their global norm is at most `max_norm` (0: no clipping); return the norm.
    The arithmetic of `torch.nn.utils.clip_grad_norm_`, with the norm taken over every rank (`grad_norm`)."""
    params = list(params)
    norm = grad_norm(params, group)
    if max_norm > 0 and math.isfinite(max_norm):
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for param in params:
            if param.grad is not None:
                param.grad.mul_(scale.to(param.grad.dtype))
    return norm


BETAS, EPS = (0.9, 0.95), 1e-8  # lab.train's AdamW


def adamw(params: Iterable[torch.Tensor], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW as `lab.train` uses it, over whatever tensors a rank updates (whole parameters, TP shards, ZeRO
    pieces). Weight decay pulls matrices towards zero; it is not applied to vectors (norm weights), whose scale
    carries meaning: a tensor decays if it is, or is a piece of (`param.decays`, set by ZeRO), a matrix.

    The multi-tensor ("foreach") implementation: each of the update's arithmetic steps is one `torch._foreach_*` op
    over all the tensors of a group, not one op per tensor — on a GPU, a handful of kernel launches per step instead
    of ~10 per tensor; on the CPU, the per-tensor loop's numbers bit for bit (tests/test_step_bytes.py). torch's
    fused kernel (`fused=True`, one launch) would need `lab.checkpoint` to restore the step count on the tensor's
    device, as `Optimizer.load_state_dict` does for it."""
    params = list(params)
    decay = [p for p in params if getattr(p, "decays", p.dim() >= 2)]
    no_decay = [p for p in params if not getattr(p, "decays", p.dim() >= 2)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=BETAS, eps=EPS, foreach=True)
