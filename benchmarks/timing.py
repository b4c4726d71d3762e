"""Timing that several benchmarks share; what belongs here is a helper two or more of them would otherwise copy.

The benchmarks are scripts (run by path, or loaded by their tests from the file): each puts the repository root on
`sys.path` and imports this module as `benchmarks.timing`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_ms(call: Callable[[], object], repeats: int) -> float:
    """The median wall time of `repeats` calls of `call`, in ms, by `time.perf_counter`: the median, so that one
    call slowed by another process on a shared CPU core does not move the figure."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3
