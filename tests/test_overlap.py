"""The overlap timeline (lab.measure.overlap) on real gloo ranks, and appendix A3's ZeRO-3 condition."""

from __future__ import annotations

import functools

import pytest

from lab.calc.comms import zero3_overlap_ratio
from lab.config import ModelConfig
from lab.distributed import run
from lab.measure.overlap import KINDS as ENGINE_KINDS
from lab.measure.overlap import Span, make_engine, plot_timelines, step_timeline
from lab.model import build_model, materialize
from lab.parallel.dp import BucketedDP

CONFIG = ModelConfig.from_preset("tiny", n_layers=3)
BUCKET_MB = 0.05
KINDS = ("naive", "bucketed", "zero3", "zero3-no-prefetch")


def _all_kinds() -> dict[str, dict]:
    return {kind: step_timeline(kind, CONFIG, batch=4, seq_len=16, bucket_mb=BUCKET_MB, steps=2) for kind in KINDS}


@functools.cache
def timelines() -> dict[str, dict]:
    return run(_all_kinds, 2)[0]


def _spans(kind: str, lane: str, label: str | None = None) -> list[Span]:
    return [s for s in map(lambda t: Span(*t), timelines()[kind]["spans"])
            if s.lane == lane and (label is None or s.label == label)]


def test_compute_spans_follow_the_model():
    """One forward span per block in order, then one backward span per block in reverse, then the embedding's."""
    for kind in KINDS:
        labels = [s.label for s in _spans(kind, "compute")]
        blocks = [str(i) for i in range(CONFIG.n_layers)]
        assert labels == [f"fwd L{b}" for b in blocks] + [f"bwd L{b}" for b in reversed(blocks)] + ["bwd embedding"]
        for s in _spans(kind, "compute"):
            assert 0 <= s.start <= s.end <= timelines()[kind]["step_s"], (kind, s)


def test_naive_communicates_after_backward_and_bucketed_during_it():
    """Naive: one blocking all-reduce per parameter, all after backward (all of it exposed). Bucketed: one
    all-reduce per bucket, every one but the last launched before the backward pass ends."""
    model = materialize(build_model(CONFIG))
    n_params, n_buckets = len(list(model.parameters())), len(BucketedDP(model, None, BUCKET_MB).buckets)
    assert n_buckets > 1
    backward_end = {k: max(s.end for s in _spans(k, "compute")) for k in KINDS}
    naive = _spans("naive", "comm", "all_reduce")
    assert len(naive) == n_params and min(s.start for s in naive) >= backward_end["naive"]
    assert timelines()["naive"]["exposed_s"] == pytest.approx(sum(s.end - s.start for s in naive))
    bucketed = sorted(_spans("bucketed", "comm", "all_reduce"), key=lambda s: s.start)
    assert len(bucketed) == n_buckets
    assert all(s.start < backward_end["bucketed"] for s in bucketed[:-1])
    assert all(s.start <= s.end for s in bucketed)


@pytest.mark.parametrize("kind", ["zero3", "zero3-no-prefetch"])
def test_zero3_gathers_twice_and_reduce_scatters_once_per_unit(kind):
    units = CONFIG.n_layers + 1  # every block, and the root (embedding, final norm, output layer)
    assert len(_spans(kind, "comm", "all_gather_single")) == 2 * units
    assert len(_spans(kind, "comm", "reduce_scatter_single")) == units
    assert all(s.lane == "wait" for s in _spans(kind, "wait"))


def test_zero3_overlap_ratio_is_appendix_a3():
    """Playbook A3: t_comm/t_compute = 1/(2·seq·mbs) · (DP−1)/DP · peak_flops/peak_bw, counted in elements
    (bytes_per_param=1); its exercise: seq 4096, mbs 1, DP 64 gives (63/64)/8192 · F/B."""
    flops, bandwidth = 989e12, 50e9
    a3 = zero3_overlap_ratio(4096, 64, flops, bandwidth, bytes_per_param=1)
    assert a3 == pytest.approx((63 / 64) / 8192 * flops / bandwidth)
    assert zero3_overlap_ratio(4096, 64, flops, bandwidth) == pytest.approx(2 * a3)  # bf16: twice the bytes
    assert zero3_overlap_ratio(4096, 1, flops, bandwidth) == 0.0  # one rank gathers nothing
    with pytest.raises(ValueError, match="tokens=0 must be > 0"):
        zero3_overlap_ratio(0, 8, flops, bandwidth)


def _engines() -> dict[str, tuple[str, bool | None]]:
    """Each kind's engine class and, for ZeRO, whether it prefetches: a rank function (ZeRO needs the group)."""
    engines = {kind: make_engine(kind, materialize(build_model(CONFIG), seed=0)) for kind in ENGINE_KINDS}
    return {kind: (type(engine).__name__, getattr(engine, "prefetch", None)) for kind, engine in engines.items()}


def test_each_kind_is_a_training_runs_engine_and_only_no_prefetch_stops_prefetching():
    """make_engine builds through lab.parallel.zero.make_data_parallel, as a run does; the one kind a run never
    builds, ZeRO-3 without prefetching, differs from ZeRO-3 in that alone."""
    assert run(_engines, 2)[0] == {
        "naive": ("NaiveDP", None), "overlapped": ("OverlappedDP", None), "bucketed": ("BucketedDP", None),
        "zero1": ("Zero", True), "zero2": ("Zero", True), "zero3": ("Zero", True), "zero3-no-prefetch": ("Zero", False)}


def test_bad_kind_and_plot(monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    with pytest.raises(ValueError, match="kind='zero4' must be one of 'naive'"):
        make_engine("zero4", materialize(build_model(CONFIG)))
    ax = plot_timelines({k: timelines()[k] for k in ("naive", "bucketed")})
    assert [t.get_text() for t in ax.get_yticklabels()] == ["naive: compute", "naive: comm", "bucketed: compute",
                                                            "bucketed: comm"]
