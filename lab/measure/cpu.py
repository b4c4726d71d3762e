"""What this CPU reaches: the FLOP/s of a matmul and the bytes/s of a large copy, measured here.

The cost models of `lab.calc` price GPUs from their data sheets; a run on CPU ranks needs the same two rooflines
measured instead (`lab sweep` prices CPU layouts with them, `lab serve` sets a decode step against the copy bandwidth).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


@contextmanager
def one_thread() -> Iterator[None]:
    """Time on one thread, as every CPU rank runs: a pool of threads adds its own wake-up cost to each op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` timings after one warm-up: a loaded core can only add time, never remove it."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_flops(m: int, k: int, n: int, repeats: int = 50) -> float:
    """FLOP/s of an (m x k) @ (k x n) fp32 matmul on one thread (every CPU rank runs one): the median timing."""
    with one_thread():
        a, b = torch.randn(m, k), torch.randn(k, n)
        for _ in range(5):
            a @ b
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
    return 2 * m * k * n / statistics.median(times)


@functools.cache
def copy_bandwidth(nbytes: int = 1 << 27) -> float:
    """Bytes per second this CPU moves in a large copy (read + write), the best of 5: its memory roofline.
    Measured once per process."""
    src, dst = torch.empty(nbytes // 4), torch.empty(nbytes // 4)
    return 2 * nbytes / best_seconds(lambda: dst.copy_(src), 5)
