"""The memory calculator widget: every control reaches lab.calc.memory, errors show inline."""

import itertools

import pytest
from widget_support import agg_backend  # noqa: F401 (agg_backend: an autouse fixture, applied by importing it)

pytest.importorskip("ipywidgets")

from lab.calc.memory import estimate_memory  # noqa: E402
from lab.config import PRESETS, ParallelConfig  # noqa: E402
from lab.widgets.memory import memory_calculator  # noqa: E402


def test_default_view_is_the_playbook_8b_example():
    widget = memory_calculator()
    expected = estimate_memory(PRESETS["llama3-8b"], 4096, 1, ParallelConfig(), precision="mixed")
    assert widget.estimate == expected
    assert f"{expected.per_gpu['total'] / 2**30:,.1f} GiB" in widget.summary.value
    assert "does NOT fit in 80 GiB" in widget.summary.value


def test_every_control_changes_the_estimate_it_should():
    widget = memory_calculator()
    breakdowns = [widget.estimate.per_gpu]
    steps = [("seq", 8192), ("mbs", 2), ("fp32_grad_accum", True), ("fp32_grad_accum", False),
             ("precision", "fp32"), ("flash", True), ("recompute", "full"), ("activation_model", "exact"),
             ("activation_model", "korthikanti"), ("tp", 2), ("sp", True), ("pp", 4), ("cp", 2)]
    for name, value in steps:
        widget.controls[name].value = value
        assert widget.error.value == "", (name, widget.error.value)
        breakdowns.append(widget.estimate.per_gpu)
        # (fp32 vs mixed keeps the total: 4+4+8 = 2+2+12 bytes per parameter — only the split moves)
        assert breakdowns[-1] != breakdowns[-2], f"{name}={value} did not change the estimate"
    # data parallelism alone replicates everything: per-GPU memory only drops once ZeRO shards it
    widget.controls["zero"].value = 0
    before = widget.estimate.per_gpu
    widget.controls["dp"].value = 8
    assert widget.estimate.per_gpu == before
    widget.controls["zero"].value = 3
    assert widget.estimate.per_gpu["params"] == -(-before["params"] // 16)  # dp x cp = 8 x 2 replicas
    widget.controls["gpu"].value = "h200"
    assert "141 GiB" in widget.summary.value


def test_invalid_combinations_show_one_line_instead_of_the_bar():
    widget = memory_calculator()
    widget.controls["tp"].value = 64
    assert widget.estimate is None and widget.summary.value == ""
    assert "tp=64 must divide n_heads=32" in widget.error.value
    widget.controls["tp"].value = 1
    assert widget.error.value == "" and widget.estimate is not None


def test_sweeping_the_ranges_never_crashes():
    widget = memory_calculator(model="mixtral-8x7b")
    for tp, pp, ep, zero in itertools.product((1, 2, 8), (1, 4), (1, 8), (0, 3)):
        for name, value in (("tp", tp), ("pp", pp), ("dp", 8), ("ep", ep), ("zero", zero)):
            widget.controls[name].value = value
        assert (widget.estimate is None) != (widget.error.value == "")
