"""lab.inference.latency: per-request TTFT / TPOT / ITL / E2E on hand-built timelines, percentiles against numpy, SLO
attainment and goodput, Poisson arrivals, and the replay's timestamps on a real engine with a cost model of one
second per step (so every stamp is an exact number worked out by hand below).

The classic slips each fail a test here: TTFT counted from admission instead of arrival, the first token counted
in TPOT (E2E / n, or a mean over n gaps), a nearest-rank percentile, a one-token request given TPOT 0, tokens
stamped at the start of their step, a queued request added before the clock reaches its arrival."""

from __future__ import annotations

import numpy as np
import pytest

from lab.config import ModelConfig
from lab.inference.engine import EngineConfig, LLMEngine
from lab.inference.latency import (
    RequestTimes,
    attains,
    goodput,
    percentile,
    poisson_arrivals,
    replay,
    slo_attainment,
    summarize,
)
from lab.inference.sampling import SamplingParams
from lab.model import build_model, materialize


def test_latencies_of_one_request():
    """Arrived at 1.0, queued until 1.5, tokens at 2.0, 2.5 and 3.5: TTFT from arrival (1.0, not the 0.5 after
    admission), TPOT over the two gaps after the first token (0.75, not 2.5 / 3 from arrival)."""
    r = RequestTimes(arrival=1.0, admitted=1.5, tokens=[2.0, 2.5, 3.5])
    assert (r.ttft, r.tpot, r.e2e, r.gaps) == (1.0, 0.75, 2.5, [0.5, 1.0])
    assert r.e2e == pytest.approx(r.ttft + (len(r.tokens) - 1) * r.tpot)
    one = RequestTimes(arrival=0.0, admitted=0.0, tokens=[0.3])
    assert (one.ttft, one.tpot, one.e2e) == (0.3, None, 0.3)


@pytest.mark.parametrize("values", [[4.0, 1.0, 3.0, 2.0], [0.5], [7.0, 7.0, 1.0], list(np.linspace(0, 1, 37) ** 2)])
def test_percentile_is_numpys_linear_interpolation(values):
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)  # rank 2.7: 3 + 0.7 · (4 - 3)


def test_percentile_refuses_bad_input():
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"q=101 must be in \[0, 100\]"):
        percentile([1.0], 101)


def test_summary_leaves_one_token_requests_out_of_tpot():
    requests = [RequestTimes(0.0, 0.0, [1.0, 2.0, 3.0]), RequestTimes(0.0, 0.0, [2.0, 6.0]),
                RequestTimes(1.0, 1.0, [5.0])]
    s = summarize(requests)
    assert s["ttft"]["mean"] == pytest.approx((1 + 2 + 4) / 3) and s["ttft"]["p50"] == 2.0
    assert s["tpot"]["mean"] == pytest.approx(2.5) and s["tpot"]["p90"] == pytest.approx(1 + 0.9 * 3)
    assert s["e2e"]["p99"] == pytest.approx(4 + 0.98 * 2)  # e2e [3, 6, 4]: rank 1.98
    assert s["itl"]["mean"] == pytest.approx(2.0) and s["itl"]["p50"] == 1.0  # gaps [1, 1, 4]: the 4 is not averaged
    assert s["itl"]["p99"] == pytest.approx(1 + 0.98 * 3)
    assert set(s) == {"ttft", "tpot", "itl", "e2e"} and set(s["ttft"]) == {"mean", "p50", "p90", "p99"}
    assert summarize([RequestTimes(0.0, 0.0, [1.0])])["tpot"] == {}


def test_attainment_needs_both_bounds_and_goodput_the_highest_rate():
    fast_start = RequestTimes(0.0, 0.0, [0.1, 0.5, 0.9])  # TTFT 0.1, TPOT 0.4
    slow_start = RequestTimes(0.0, 0.0, [0.6, 0.7, 0.8])  # TTFT 0.6, TPOT 0.1
    one = RequestTimes(0.0, 0.0, [0.2])
    assert [attains(r, 0.5, 0.2) for r in (fast_start, slow_start, one)] == [False, False, True]
    assert slo_attainment([fast_start, slow_start, one], 0.7, 0.4) == 1.0
    assert slo_attainment([fast_start, slow_start, one], 0.5, 0.2) == pytest.approx(1 / 3)
    assert goodput([1, 2, 4, 8], [1.0, 0.95, 0.9, 0.5]) == 4
    assert goodput([1, 2], [0.5, 0.1]) == 0.0


def test_poisson_arrivals_are_seeded_and_have_the_rate():
    arrivals = poisson_arrivals(4000, rate=8.0, seed=3)
    assert arrivals == poisson_arrivals(4000, rate=8.0, seed=3) != poisson_arrivals(4000, rate=8.0, seed=4)
    gaps = np.diff([0.0, *arrivals])
    assert (gaps > 0).all() and gaps.mean() == pytest.approx(1 / 8, rel=0.05)
    assert gaps.std() == pytest.approx(gaps.mean(), rel=0.08)  # exponential: standard deviation = mean
    with pytest.raises(ValueError, match=r"rate=0 > 0"):
        poisson_arrivals(3, 0)


@pytest.fixture(scope="module")
def tiny():
    return materialize(build_model(ModelConfig.from_preset("tiny")), seed=0).eval()


def test_replay_stamps_tokens_at_the_end_of_their_step(tiny):
    """One sequence at a time, a token budget of 16, each step costing one second. Request 0 arrives at 0.2 with 40
    prompt tokens: the clock jumps to 0.2, the prefill runs in chunks of 16, 16 and 8 (its first token at 3.2),
    then one decode (4.2). Request 1 arrives at 0.5, waits for the slot, is admitted at 4.2 and prefills 4 tokens
    in one step: tokens at 5.2 and 6.2, TTFT 4.7 from its arrival (1.0 from its admission). Request 2 arrives at
    20, long after the engine went idle: the clock jumps there."""
    engine = LLMEngine(tiny, EngineConfig(num_blocks=32, block_size=8, max_num_seqs=1, max_num_batched_tokens=16))
    prompts = [list(range(40)), [1, 2, 3, 4], [5, 6]]
    params = [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2), SamplingParams(max_tokens=3)]
    got = replay(engine, [0.2, 0.5, 20.0], prompts, params, step_seconds=lambda record: 1.0)
    assert [r.arrival for r in got] == [0.2, 0.5, 20.0]
    assert [r.admitted for r in got] == pytest.approx([0.2, 4.2, 20.0])
    assert [r.tokens for r in got] == [pytest.approx(t) for t in ([3.2, 4.2], [5.2, 6.2], [21.0, 22.0, 23.0])]
    assert [r.ttft for r in got] == pytest.approx([3.0, 4.7, 1.0])
    assert [r.tpot for r in got] == pytest.approx([1.0, 1.0, 1.0])


def test_replay_adds_a_request_only_once_the_clock_reaches_it(tiny):
    """Two sequences may run together, but request 1 arrives at 1.5, mid-way through request 0's decode: it joins
    the step that starts at 2.0, not the first one (which would give it a first token before it arrived)."""
    engine = LLMEngine(tiny, EngineConfig(num_blocks=32, block_size=8, max_num_seqs=2, max_num_batched_tokens=16))
    got = replay(engine, [0.0, 1.5], [[1, 2, 3], [4, 5]], [SamplingParams(max_tokens=4)] * 2,
                 step_seconds=lambda record: 1.0)
    assert got[0].tokens == [1.0, 2.0, 3.0, 4.0] and got[1].admitted == 2.0 and got[1].tokens[0] == 3.0
    assert all(t >= r.arrival for r in got for t in r.tokens)
    with pytest.raises(ValueError, match="increasing order"):
        replay(engine, [1.0, 0.5], [[1], [2]], [SamplingParams(max_tokens=1)] * 2)
