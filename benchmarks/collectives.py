"""lab's hand-written collectives against torch.distributed's, across message sizes and world sizes.

    python benchmarks/collectives.py                       # gloo on CPU: 1 KB .. 64 MB, 2 and 4 ranks
    python benchmarks/collectives.py --max-mb 4 --world 4  # quicker
    python benchmarks/collectives.py --backend nccl        # GPUs (one per rank)

For every (operation, world size, size) it prints the median time of lab's version and torch's, their
ratio, and the bus bandwidth (nccl-tests' definition: algorithm bandwidth x 2(W-1)/W for all-reduce,
(W-1)/W for all-gather and reduce-scatter). It then fits the alpha-beta model T = steps*alpha + bytes_on_wire*beta to
torch's all-reduce times by least squares and prints measured vs model, so a learner sees where the
latency-bound regime ends.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lab import collectives as lc  # noqa: E402
from lab.dist import run  # noqa: E402

OPS = ("all_reduce", "reduce_scatter", "all_gather")


def _candidates(op: str, numel: int, world: int, device: torch.device):
    """(lab's call, torch's call) for one operation on a message of `numel` fp32 elements."""
    x = torch.ones(numel, device=device)
    if op == "all_reduce":
        return lambda: lc.ring_all_reduce(x), lambda: dist.all_reduce(x)
    shard = numel // world
    full, part = torch.ones(shard * world, device=device), torch.empty(shard, device=device)
    if op == "reduce_scatter":
        return lambda: lc.ring_reduce_scatter(part, full), lambda: dist.reduce_scatter_tensor(part, full)
    return lambda: lc.ring_all_gather(full, part), lambda: dist.all_gather_into_tensor(full, part)


def _time(call, iterations: int, device: torch.device) -> float:
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
        if i:  # the first call warms up connections and caches
            times.append(elapsed.item())
    return statistics.median(times)


def _measure(sizes: list[int], iterations: int, backend: str) -> list[tuple]:
    world = dist.get_world_size()
    device = torch.device("cuda", dist.get_rank()) if backend == "nccl" else torch.device("cpu")
    rows = []
    for op in OPS:
        for nbytes in sizes:
            ours, theirs = _candidates(op, nbytes // 4, world, device)
            rows.append((op, world, nbytes, _time(ours, iterations, device), _time(theirs, iterations, device)))
    return rows


def bus_factor(op: str, world: int) -> float:
    return 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world


def fit_alpha_beta(rows: list[tuple], world: int) -> tuple[float, float]:
    """Least squares for torch's ring all-reduce: T = 2(W-1)·alpha + 2(W-1)/W·B·beta."""
    points = [(2 * (world - 1), bus_factor("all_reduce", world) * b, t) for op, w, b, _, t in rows
              if op == "all_reduce" and w == world]
    a = torch.tensor([[steps, wire] for steps, wire, _ in points], dtype=torch.float64)
    t = torch.tensor([[time_s] for *_, time_s in points], dtype=torch.float64)
    alpha, beta = torch.linalg.lstsq(a, t).solution.flatten().tolist()
    return max(alpha, 0.0), max(beta, 1e-15)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--min-kb", type=float, default=1)
    parser.add_argument("--max-mb", type=float, default=64)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    args = parser.parse_args(argv)
    sizes, size = [], int(args.min_kb * 1024)
    while size <= args.max_mb * 2**20:
        sizes.append(size)
        size *= 4
    rows = []
    for world in args.world:
        rows += run(_measure, world, sizes, args.iterations, args.backend, backend=args.backend, timeout_s=1800)[0]
    print(f"{'op':<15}{'W':>3}{'size':>10}{'lab ms':>10}{'torch ms':>10}{'lab/torch':>11}{'busbw GB/s':>12}")
    for op, world, nbytes, ours, theirs in rows:
        busbw = nbytes / theirs * bus_factor(op, world) / 1e9
        print(f"{op:<15}{world:>3}{_size(nbytes):>10}{ours * 1e3:>10.2f}{theirs * 1e3:>10.2f}"
              f"{ours / theirs:>11.2f}{busbw:>12.2f}")
    for world in args.world:
        alpha, beta = fit_alpha_beta(rows, world)
        print(f"\nalpha-beta fit to torch's all_reduce at W={world}: alpha = {alpha * 1e6:.0f} us per step, "
              f"1/beta = {1 / beta / 1e9:.2f} GB/s")
        print(f"{'size':>10}{'measured ms':>13}{'model ms':>10}")
        for op, w, nbytes, _, theirs in rows:
            if op == "all_reduce" and w == world:
                model = 2 * (world - 1) * alpha + bus_factor(op, world) * nbytes * beta
                print(f"{_size(nbytes):>10}{theirs * 1e3:>13.2f}{model * 1e3:>10.2f}")
    return 0


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MB" if nbytes >= 2**20 else f"{nbytes / 1024:g} KB"


if __name__ == "__main__":
    sys.exit(main())
