"""Context parallelism: what the causal imbalance costs, and what zig-zag and Ulysses buy back.

    python benchmarks/cp.py                      # gloo on CPU: cp = 2 (one rank per core), seq 2048
    python benchmarks/cp.py --cp 2 4 --seq 4096

For each implementation (ring on contiguous chunks, ring on zig-zag chunks, Ulysses) it prints the median
forward+backward time of causal attention over the whole sequence (the slowest rank's, which is what the
step waits for), each rank's share of the useful query-key pairs (max/mean: 1 is perfect balance), and the
time relative to one process computing the whole attention alone (ideal: 1/cp). Ranks wait for their ring
neighbours, so the rank with the most work sets the pace: contiguous chunks pay for it.

lab's ring computes each block with plain matmuls (every step readable, and the same code on GPU), while the
single process and Ulysses call SDPA's fused kernel: part of the ring's gap to 1/cp is that kernel, not the
ring. Compare the two ring rows with each other for the cost of imbalance.

torch's own `context_parallel` (torch.distributed.tensor.experimental) needs a GPU: on CPU its SDPA
override has no sharding rule for the CPU flash kernel, so there is no torch column here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lab.calc.cp import attention_work, chunk_ids  # noqa: E402
from lab.distributed import run  # noqa: E402
from lab.parallel.cp import layout_of, shard_sequence, ulysses_attention  # noqa: E402
from lab.parallel.ring_attention import ring_attention  # noqa: E402

IMPLS = ("ring", "zigzag", "ulysses")


def _inputs(batch: int, heads: int, seq: int, dim: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(batch, heads, seq, dim, generator=g) for _ in range(4)]


def _attention_time(impl: str, batch: int, heads: int, seq: int, dim: int, iterations: int) -> float:
    """Median over iterations of the slowest rank's forward+backward time (seconds)."""
    rank, cp = dist.get_rank(), dist.get_world_size()
    layout = layout_of(impl)
    q, k, v, dout = (shard_sequence(x, rank, cp, layout, dim=2) for x in _inputs(batch, heads, seq, dim))
    chunks = [chunk_ids(r, cp, layout) for r in range(cp)]
    times = []
    for i in range(iterations + 1):
        q_, k_, v_ = (x.detach().requires_grad_() for x in (q, k, v))
        dist.barrier()
        start = time.perf_counter()
        if impl == "ulysses":
            out = ulysses_attention(q_, k_, v_, None)
        else:
            out = ring_attention(q_, k_, v_, None, chunks, causal=True)
        out.backward(dout)
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i:  # the first iteration warms up allocators and connections
            times.append(elapsed.item())
    return statistics.median(times)


def _single_process_time(batch: int, heads: int, seq: int, dim: int, iterations: int) -> float:
    q, k, v, dout = _inputs(batch, heads, seq, dim)
    times = []
    for _ in range(iterations):
        q_, k_, v_ = (x.detach().requires_grad_() for x in (q, k, v))
        start = time.perf_counter()
        F.scaled_dot_product_attention(q_, k_, v_, is_causal=True).backward(dout)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[2])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core per rank, and the same for the single-process baseline
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    alone = _single_process_time(*shape, args.iterations)
    print(f"causal attention fwd+bwd, batch {args.batch}, {args.heads} heads x {args.head_dim}, seq {args.seq}; "
          f"one process alone (SDPA, 1 thread): {alone * 1e3:.1f} ms")
    print(f"{'cp':>3} {'impl':>8} {'ms (slowest rank)':>18} {'work max/mean':>14} {'vs alone':>9} {'ideal':>6}")
    for cp in args.cp:
        for impl in IMPLS:
            if impl == "ulysses" and args.heads % cp:
                print(f"{cp:>3} {impl:>8}   skipped: cp={cp} does not divide heads={args.heads}")
                continue
            seconds = run(_attention_time, cp, impl, *shape, args.iterations, timeout_s=900)[0]
            if impl == "ulysses":
                balance = 1.0  # every rank runs the whole causal attention for heads/cp heads
            else:
                work = attention_work(args.seq, cp, layout_of(impl))
                balance = max(work) / (sum(work) / cp)
            print(f"{cp:>3} {impl:>8} {seconds * 1e3:>18.1f} {balance:>14.2f} {seconds / alone:>9.2f} "
                  f"{1 / cp:>6.2f}")


if __name__ == "__main__":
    main()
