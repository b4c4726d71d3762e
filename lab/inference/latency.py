"""Latency as a user meets it: when each token of a request arrives, and what the percentiles of a workload say.

What belongs here: the bookkeeping between an engine's steps and a latency report, free of any model and of torch
(the grader and the benchmark import it): Poisson arrivals, the replay that feeds requests to an engine as its
clock reaches their arrival and stamps every generated token, the three per-request latencies, percentiles, and
SLO attainment. The engine itself (`lab.inference.engine`) knows nothing of time but its steps.

The three numbers, as vLLM's serving benchmark (`benchmarks/benchmark_serving.py`) and DistServe (Zhong et al.,
OSDI 2024, §1) define them:

* TTFT, time to first token: from the request's *arrival* (not its admission into a batch: the time it queued is
  part of what the user waits) to its first generated token. Prefill, and the queue before it, set it.
* TPOT, time per output token (inter-token latency): the mean gap between consecutive tokens *after* the first,
  (last - first) / (n - 1). Decode steps set it; a request of one token has none.
* E2E, end-to-end latency: from arrival to the last token, TTFT + (n - 1) · TPOT.
* ITL, inter-token latency (Sarathi-Serve's TBT, time between tokens): every single gap between consecutive tokens,
  pooled over the requests. TPOT averages a request's gaps, so one long stall (a decode that waited for another
  request's prefill) hides in it; the p99 of the gaps shows it.

A service level objective (SLO) bounds TTFT and TPOT; a request *attains* it when both of its own latencies are
within their bounds, and DistServe's goodput is the highest request rate at which a target share of requests
(90% in its experiments) attains the SLO: throughput that users can feel, not tokens per second at any latency.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine imports torch; this module only drives it
    from lab.inference.engine import LLMEngine, StepRecord
    from lab.inference.sampling import SamplingParams

PERCENTILES = (50, 90, 99)


@dataclass
class RequestTimes:
    """One request's clock readings: its arrival, the start of the first step that ran it (`admitted`: the time
    it queued before is admitted - arrival) and the time each of its generated tokens was emitted."""

    arrival: float
    admitted: float | None = None
    tokens: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        """Arrival to first token: the queue and the prefill."""
        return self.tokens[0] - self.arrival

    @property
    def tpot(self) -> float | None:
        """The mean gap between tokens after the first (None for a one-token request): the decode's pace."""
        n = len(self.tokens)
        return (self.tokens[-1] - self.tokens[0]) / (n - 1) if n > 1 else None

    @property
    def gaps(self) -> list[float]:
        """The time between each token and the next, after the first."""
        return [b - a for a, b in zip(self.tokens, self.tokens[1:], strict=False)]

    @property
    def e2e(self) -> float:
        """Arrival to last token."""
        return self.tokens[-1] - self.arrival


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between the closest ranks (numpy.percentile's default,
    which vLLM's benchmark reports): rank q / 100 · (n - 1) of the sorted values."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q={q} must be in [0, 100]")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (rank - low) * (ordered[high] - ordered[low])


def summarize(requests: Sequence[RequestTimes], percentiles: Sequence[float] = PERCENTILES) -> dict:
    """Mean and percentiles of TTFT, TPOT, ITL and E2E over the requests, in seconds ({"ttft": {"mean", "p50", ...},
    ...}). One-token requests have no TPOT and are left out of its statistics, as vLLM's benchmark leaves them."""
    columns = {"ttft": [r.ttft for r in requests], "tpot": [r.tpot for r in requests if r.tpot is not None],
               "itl": [gap for r in requests for gap in r.gaps], "e2e": [r.e2e for r in requests]}
    return {name: {"mean": sum(v) / len(v), **{f"p{q:g}": percentile(v, q) for q in percentiles}} if v else {}
            for name, v in columns.items()}


def attains(request: RequestTimes, ttft_slo: float, tpot_slo: float) -> bool:
    """Whether one request met both bounds (a one-token request has no TPOT to miss)."""
    return request.ttft <= ttft_slo and (request.tpot is None or request.tpot <= tpot_slo)


def slo_attainment(requests: Sequence[RequestTimes], ttft_slo: float, tpot_slo: float) -> float:
    """The share of requests whose own TTFT and TPOT are both within the SLO."""
    return sum(attains(r, ttft_slo, tpot_slo) for r in requests) / len(requests)


def goodput(rates: Sequence[float], attainments: Sequence[float], target: float = 0.9) -> float:
    """DistServe's goodput from a rate sweep: the highest request rate whose SLO attainment reaches `target`
    (0.0 when none does)."""
    return max((r for r, a in zip(rates, attainments, strict=True) if a >= target), default=0.0)


def poisson_arrivals(count: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (seconds from 0) of `count` requests of a Poisson process of `rate` requests per second:
    independent exponential gaps of mean 1 / rate, as vLLM's benchmark draws them (`--request-rate`)."""
    if count < 1 or not rate > 0:
        raise ValueError(f"count={count} must be >= 1 and rate={rate} > 0 requests/s")
    rng, now, out = random.Random(seed), 0.0, []
    for _ in range(count):
        now += rng.expovariate(rate)
        out.append(now)
    return out


def replay(engine: LLMEngine, arrivals: Sequence[float], prompts: Sequence[list[int]],
           params: Sequence[SamplingParams], clock: Callable[[], float] = time.perf_counter,
           step_seconds: Callable[[StepRecord], float] | None = None) -> list[RequestTimes]:
    """Serve timed requests through `engine` and stamp every token. A virtual clock starts at 0: a request is
    added once the clock has reached its arrival, each step advances the clock by what the step cost (measured
    with `clock`, or `step_seconds(step record)` for a cost model), and the tokens a step generated are emitted
    at its end. An idle engine jumps to the next arrival instead of sleeping, so the replay takes only the
    steps' own time, and a busy shared machine stretches it less when `clock` is the process's CPU time."""
    if not len(arrivals) == len(prompts) == len(params):
        raise ValueError(f"{len(arrivals)} arrivals, {len(prompts)} prompts and {len(params)} SamplingParams: "
                         "one of each per request")
    if any(b < a for a, b in zip(arrivals, arrivals[1:], strict=False)):
        raise ValueError("arrivals must be in increasing order")
    times: dict[int, RequestTimes] = {}
    now, pending = 0.0, 0
    while pending < len(arrivals) or engine.has_unfinished():
        while pending < len(arrivals) and arrivals[pending] <= now:
            times[engine.add_request(prompts[pending], params[pending])] = RequestTimes(arrivals[pending])
            pending += 1
        if not engine.has_unfinished():
            now = arrivals[pending]
            continue
        start = clock()
        engine.step()
        record = engine.timeline[-1]
        began, now = now, now + (clock() - start if step_seconds is None else step_seconds(record))
        for seq_id, _ in record.ran:
            request = times[seq_id]
            request.admitted = began if request.admitted is None else request.admitted
            request.tokens += [now] * (engine.sequences[seq_id].num_generated - len(request.tokens))
    return list(times.values())
