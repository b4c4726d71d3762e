"""Rank functions that must be importable by name: `start_method="spawn"` starts fresh interpreters, which
find `fn` by importing its module. Kept free of test-only imports so that each spawned rank starts fast."""

import torch
import torch.distributed as dist


def all_reduce_rank(offset: float, scale: float = 1.0) -> float:
    """sum over ranks of (rank + 1), times `scale`, plus `offset`."""
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return value.item() * scale + offset


def all_reduce_on_gpu() -> float:
    """sum over ranks of (rank + 1), computed with NCCL on this rank's GPU."""
    value = torch.ones(1, device="cuda") * (dist.get_rank() + 1)
    dist.all_reduce(value)
    return value.item()
