"""What this CPU reaches: the FLOP/s of a matmul and the bytes/s of a large copy, measured here.

The cost models of `lab.calc` price GPUs from their data sheets; a run on CPU ranks needs the same two rooflines
measured instead (`lab sweep` prices CPU layouts with them, `lab serve` sets a decode step against the copy bandwidth).
"""

from __future__ import annotations

import functools
import statistics
import time

import torch


def matmul_flops(m: int, k: int, n: int, repeats: int = 50) -> float:
    """FLOP/s of an (m x k) @ (k x n) fp32 matmul on one thread (every CPU rank runs one): the median timing."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(m, k), torch.randn(k, n)
        for _ in range(5):
            a @ b
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return 2 * m * k * n / statistics.median(times)


@functools.cache
def copy_bandwidth(nbytes: int = 1 << 27) -> float:
    """Bytes per second this CPU moves in a large copy (read + write), the best of 5: its memory roofline.
    Measured once per process."""
    src, dst = torch.empty(nbytes // 4), torch.empty(nbytes // 4)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best
