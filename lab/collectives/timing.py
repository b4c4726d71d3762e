"""Time collectives on real ranks: lab's hand-written ones against torch.distributed's.

Used by `benchmarks/collectives.py` (the full table) and chapter 02 (a few points on the cost-model plot).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from lab import collectives as lc
from lab.distributed import all_gather_single, reduce_scatter_single

OPS = ("all_reduce", "reduce_scatter", "all_gather")


def _calls(op: str, nbytes: int, device: torch.device) -> tuple[Callable[[], None], Callable[[], None]]:
    """(lab's call, torch's call) for `op` on a message of `nbytes` bytes of fp32."""
    world = dist.get_world_size()
    x = torch.ones(nbytes // 4, device=device)
    if op == "all_reduce":
        return lambda: lc.ring_all_reduce(x), lambda: dist.all_reduce(x)
    shard = nbytes // 4 // world
    full, part = torch.ones(shard * world, device=device), torch.empty(shard, device=device)
    if op == "reduce_scatter":
        return lambda: lc.ring_reduce_scatter(part, full), lambda: reduce_scatter_single(part, full)
    if op == "all_gather":
        return lambda: lc.ring_all_gather(full, part), lambda: all_gather_single(full, part)
    raise ValueError(f"op={op!r} must be one of {', '.join(OPS)}")


def _median_time(call: Callable[[], None], iterations: int, device: torch.device) -> float:
    """Median over iterations of the slowest rank's time (a collective is as slow as its slowest rank)."""
    times = []
    for i in range(iterations + 1):
        dist.barrier()
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i:  # the first call sets up connections and buffers
            times.append(elapsed.item())
    return statistics.median(times)


def time_collectives(ops: tuple[str, ...], sizes: list[int], iterations: int = 5) -> list[dict]:
    """Run on every rank (inside `lab.distributed.run`): one row per (op, size) with lab's and torch's seconds."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    rows = []
    for op in ops:
        for nbytes in sizes:
            ours, theirs = _calls(op, nbytes, device)
            rows.append({"op": op, "ranks": dist.get_world_size(), "bytes": nbytes,
                         "lab_s": _median_time(ours, iterations, device),
                         "torch_s": _median_time(theirs, iterations, device)})
    return rows
