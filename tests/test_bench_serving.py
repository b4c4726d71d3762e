"""benchmarks/serving.py's CPU lane, run once in-process at its default sizes (the tiny model): each of issue 20's
CPU targets met (or, for one, missed for a reason named below), the --json record's shape, the verdict logic, the
latency curve's record (issue 39) and chunked prefill's trade in it, and the GPU lane's row logic walked on the CPU."""

from __future__ import annotations

import json

import pytest
import torch
from bench_support import load_benchmark

# the latency curve cut to two points (budgets 16 and 512 at 40 req/s, 8 sequences) of 12 requests: ~2 s
LATENCY_ARGS = ["--rates", "40", "--latency-seqs", "8", "--budgets", "16", "512", "--latency-requests", "12"]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("serving")


@pytest.fixture(scope="module")
def record(bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("serving") / "serving.json"
    status = bench.main(["--lane", "cpu", "--repeats", "2", "--batching-repeats", "1", "--json", str(out),
                         *LATENCY_ARGS])
    record = json.loads(out.read_text())
    assert status == (0 if all(t["verdict"] == "PASS" for t in record["targets"]) else 1)
    return record


def verdict(record: dict, prefix: str) -> dict:
    (found,) = [t for t in record["targets"] if t["target"].startswith(prefix)]
    return found


def test_json_record_shape(record):
    assert record["lane"] == "cpu" and record["device"].startswith("CPU") and record["clock"] == "process"
    assert {"torch", "python", "threads", "batching", "decode", "prefix", "kv_waste", "targets"} <= set(record)
    assert len(record["targets"]) == 5
    for t in record["targets"]:
        assert set(t) == {"target", "value", "goal", "unit", "verdict"} and t["verdict"] in ("PASS", "MISS"), t
    b = record["batching"]
    for mode in ("static", "continuous"):
        assert set(b[mode]) == {"tokens", "seconds", "tokens_per_s", "steps", "mean_batch"}
    assert [r["tokens"] for r in record["decode"]["rows"]] == [16, 64, 240]


def test_schedule_saves_over_2x_steps(record):
    """The schedule's half of target 1, no clock involved: static waves of 16 (each as long as its longest member)
    take over twice the steps of continuous batching on the same requests, which generate the same tokens (the
    benchmark checks the outputs are equal)."""
    b = record["batching"]
    assert b["static"]["tokens"] == b["continuous"]["tokens"]
    assert b["continuous"]["mean_batch"] > 2 * b["static"]["mean_batch"]
    assert 2 <= b["step_ratio"] <= b["output_lengths"]["ideal_step_ratio"]


# The two timed targets are the benchmark's to judge (measured 2.2x and 1.03x / 2.75x on a quiet CPU): a test
# run shares its cores with others, so here they are held to what no load can reverse.


def test_continuous_batching_is_faster_than_static(record):
    b = record["batching"]
    assert b["continuous"]["tokens_per_s"] > 1.2 * b["static"]["tokens_per_s"], b


def test_decode_per_token_flat_with_cache_growing_without(record):
    d = record["decode"]
    first, last = d["rows"][0], d["rows"][-1]
    cache_growth = last["cache_ms_per_token"] / first["cache_ms_per_token"]
    recompute_growth = last["no_cache_ms_per_token"] / first["no_cache_ms_per_token"]
    # quiet: 1.03x against 2.75x; once, beside the rest of the suite on 2 cores, 1.59x against 1.80x
    assert recompute_growth > cache_growth and last["no_cache_ms_per_token"] > 1.5 * last["cache_ms_per_token"], d


def test_prefix_cache_skips_over_90_percent(record):
    """8 requests of a 512-token prefix + 16 own tokens, blocks of 16: warm, each prefills only its own block
    (32 of its 33 blocks hit); cold, the first computes the prefix in one 512-token step and the other 7 find it
    cached the step after."""
    p = record["prefix"]
    assert p["without_prefill_tokens"] == p["prompt_tokens"] == 8 * 528
    assert p["warm_prefill_tokens"] == 8 * 16 and p["warm_prefix_hits"] == 8 * 512
    assert p["cold_prefill_tokens"] == 528 + 7 * 16 and p["cold_prefix_hits"] == 7 * 512
    assert p["warm_skipped"] == pytest.approx(512 / 528) == pytest.approx(p["warm_bound"])
    assert verdict(record, "prefill tokens skipped")["verdict"] == "PASS"


def test_paged_kv_waste_under_one_block(record):
    w = record["kv_waste"]
    assert w["samples"] > 100
    assert 0 < w["paged_max_tokens"] < w["block_size"]
    assert w["contiguous_mean_tokens"] > 4 * w["paged_mean_tokens"]
    assert verdict(record, "paged KV waste")["verdict"] == "PASS"


def test_workload_and_ideal_ratio(bench):
    lengths = bench.mixed_lengths(1000, seed=1)
    long = [n for n in lengths if n >= bench.LONG[0]]
    assert all(bench.SHORT[0] <= n <= bench.SHORT[1] or bench.LONG[0] <= n <= bench.LONG[1] for n in lengths)
    assert len(long) / len(lengths) == pytest.approx(bench.LONG_SHARE, abs=0.03)
    assert bench.mixed_lengths(50, seed=3) == bench.mixed_lengths(50, seed=3)
    # two waves of 4: [64, 4, 4, 4] waits 64 steps, [8, 8, 8, 8] 8; every slot busy: 108 / 4 = 27 steps
    assert bench.ideal_step_ratio([64, 4, 4, 4, 8, 8, 8, 8], 4) == pytest.approx(72 / 27)


def test_verdicts_at_the_boundaries(bench):
    record = {"batching": {"speedup": 2.0}, "decode": {"cache_ratio": 1.5, "no_cache_ratio": 1.99},
              "prefix": {"prefix_len": 512, "warm_skipped": 0.8999},
              "kv_waste": {"paged_max_blocks": 1.0},
              "gpu": [{"preset": "llama3-1b", "decoder": "graph", "status": "ok", "hbm_fraction": 0.7},
                      {"preset": "llama3-8b", "decoder": "graph", "status": "ok", "hbm_fraction": 0.69},
                      {"preset": "x", "status": "no HBM bandwidth for 'cpu' in lab.calc.hardware"}]}
    got = [(t["target"].split(",")[0], t["verdict"]) for t in bench.targets(record)]
    assert got == [("continuous / static batching", "PASS"), ("decode per token with the cache", "PASS"),
                   ("decode per token without the cache", "MISS"), ("prefill tokens skipped", "MISS"),
                   ("paged KV waste per sequence", "MISS"), ("llama3-1b batch-1 decode (graph)", "PASS"),
                   ("llama3-8b batch-1 decode (graph)", "MISS")]


def test_gpu_lane_walked_on_the_cpu(bench, monkeypatch):
    """The GPU row on CPU tensors (the tiny preset): no HBM bandwidth to compare with, so a status row and no
    verdict; the reference-engine row says vLLM is absent when it is."""
    for decoder in bench.DECODERS:  # the graph decoder runs its static cache eagerly on a CPU
        row = bench.gpu_decode("tiny", prompt_len=4, tokens=(2, 4), repeats=1, device="cpu", dtype=torch.float32,
                               decoder=decoder)
        assert row["context"] == 4 + 3 and row["status"].startswith("no HBM bandwidth") and "hbm_fraction" not in row
        assert row["decoder"] == decoder and bench.targets({"gpu": [row]}) == []
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: None)
    assert bench.reference_engine()["status"].startswith("not installed")


def test_latency_record(record):
    """Section 5's record: per request TTFT, TPOT and E2E, percentiles in order, each point's knobs as asked."""
    lat = record["latency"]
    assert lat["base"] == {"rate": 40.0, "max_num_seqs": 8, "budget": 512} and set(lat["sweeps"]) == {
        "rate", "max_num_seqs", "budget"}
    assert [p["max_num_batched_tokens"] for p in lat["sweeps"]["budget"]] == [16, 512]
    for point in lat["sweeps"]["budget"]:
        assert len(point["per_request_ms"]) == point["requests"] == 12
        for name in ("ttft", "tpot", "itl", "e2e"):
            assert point[name]["p50"] <= point[name]["p90"] <= point[name]["p99"], (name, point[name])
        for r in point["per_request_ms"]:
            assert 0 < r["ttft"] <= r["e2e"] and r["e2e"] == pytest.approx(r["ttft"] + (r["tokens"] - 1) * r["tpot"])
        assert 0 <= point["slo_attainment"] <= 1 and point["tokens_per_s"] > 0
    # the same seeded workload at every point: the arrivals (and so the requests) agree
    arrivals = [[r["arrival"] for r in p["per_request_ms"]] for p in lat["sweeps"]["budget"]]
    assert arrivals[0] == arrivals[1]


def test_chunked_prefill_trades_ttft_for_inter_token_gaps(record):
    """A budget of 16 tokens cuts a 32-256-token prompt into 2-16 steps: its first token comes later (TTFT p90
    measured 7-12x the 512 budget's), while no running decode waits behind a whole prompt (the p99 inter-token gap
    2.0-5.0x smaller at 512's expense); held here to what a loaded machine cannot reverse."""
    trade = record["latency"]["budget_trade"]
    assert trade["ttft_p90_ratio"] > 2 and trade["itl_p99_ratio"] > 1.2, trade
