"""The inference explorer: every control reaches lab.calc.inference, the chart follows each redraw, errors inline."""

import html
import subprocess
import sys

import pytest
from widget_support import agg_backend, shown  # noqa: F401 (agg_backend: an autouse fixture, applied by importing it)

pytest.importorskip("ipywidgets")

from lab.calc.inference import decode_step, inference_roofline, max_sequences, prefill_time  # noqa: E402
from lab.widgets.inference import BATCHES, inference_explorer  # noqa: E402


@pytest.fixture(scope="module")
def widget():
    """One explorer for the tests that move its controls (each redraw is a matplotlib figure)."""
    return inference_explorer()


def test_default_view_is_calc_inference_for_llama3_8b_on_an_h100():
    widget = inference_explorer()
    assert widget.step == inference_roofline("llama3-8b", "h100", 1, 4096)
    assert widget.sweep == [inference_roofline("llama3-8b", "h100", b, 4096) for b in BATCHES]
    assert widget.parts == [decode_step("llama3-8b", "h100", b, 4096) for b in BATCHES]
    assert widget.prefill == prefill_time("llama3-8b", "h100", 4096, mfu=1.0)
    assert widget.fit == max_sequences("llama3-8b", "h100", 4096)
    s, summary = widget.step, widget.summary.value
    # batch 1: ~16 GB of weights read for 2 FLOPs per weight, one FLOP per byte; the H100's ridge is 295
    assert f"decode step ≥ {s['step_s'] * 1e3:,.2f} ms" in summary and "<b>memory binds</b>" in summary
    assert f"Intensity <b>{s['intensity']:,.1f} FLOPs/byte</b>" in summary and "ridge 295." in summary
    assert f"<b>{s['tokens_per_s']:,.0f} tokens/s</b>" in summary
    assert f"{widget.fit:,} sequences of 4,096 tokens fit" in summary
    rate = widget.prefill.tokens / widget.prefill.time_s
    assert f"{rate:,.0f} tokens/s: {rate / s['tokens_per_s']:,.1f}x this decode rate" in summary
    assert len(shown(widget)) == 1 and shown(widget)[0].startswith("iVBORw0KGgo")  # base64 of the PNG signature


def test_every_control_moves_the_step_and_lands_on_the_calc(widget):
    seen = [widget.step]
    for name, value in (("model", "llama3-70b"), ("hardware", "h200"), ("tp", 8), ("kv_dtype", "fp8"),
                        ("batch", 64), ("context", 8192)):
        widget.controls[name].value = value
        assert widget.error.value == "" and widget.step != seen[-1], name
        seen.append(widget.step)
    assert widget.step == inference_roofline("llama3-70b", "h200", 64, 8192, tp=8, kv_bytes=1)
    assert widget.fit == max_sequences("llama3-70b", "h200", 8192, tp=8, kv_bytes=1)
    assert widget.prefill == prefill_time("llama3-70b", "h200", 8192, tp=8, mfu=1.0)
    assert "on 8 x h200 (KV in fp8)" in widget.summary.value


def test_the_weight_matmuls_turn_compute_bound_at_the_critical_batch_while_the_kv_keeps_the_step_memory_bound(
        widget):
    """How to Scale Your Model ch. 7: decode's weight matmuls are compute-bound past B_crit = ridge x bytes per
    weight / 2, ~300 on an H100 in bf16; every sequence's own KV cache is read on top, so at long contexts the
    step stays bound by memory however large the batch."""
    with widget.batched():
        for name, value in (("model", "llama3-70b"), ("hardware", "h100"), ("tp", 8), ("kv_dtype", "bf16"),
                            ("context", 8192)):
            widget.controls[name].value = value
    widget.controls["batch"].value = 256
    assert widget.step["bound"] == "memory" and round(widget.step["critical_batch"]) == 295
    widget.controls["batch"].value = 512
    assert widget.step["bound"] == "compute" and "the weight matmuls are compute-bound" in widget.summary.value
    assert "<b>memory binds</b>" in widget.summary.value  # weights + KV read take longer than all the FLOPs
    assert "(<b>this batch does NOT fit</b>)" in widget.summary.value  # 203 sequences of 8,192 fit on 8 H100s
    widget.controls["batch"].value = 1
    widget.controls["context"].value = 128
    assert "does NOT fit" not in widget.summary.value


def test_a_context_the_model_lacks_shows_one_line_instead_of_the_chart_and_clears(widget):
    with widget.batched():
        for name, value in (("hardware", "h100"), ("tp", 1), ("kv_dtype", "bf16"), ("context", 4096)):
            widget.controls[name].value = value
    widget.controls["model"].value = "tiny"
    message = "context=4096 must be <= max_seq_len=256 of 'tiny'"
    assert widget.step is None and widget.summary.value == "" and shown(widget) == []
    assert html.escape(message) in widget.error.value and widget.error.value.count("<p") == 1
    widget.controls["batch"].value = 8  # other controls keep showing the error while the context is wrong
    assert widget.step is None and html.escape(message) in widget.error.value
    widget.controls["context"].value = 128
    assert widget.error.value == "" and widget.step == inference_roofline("tiny", "h100", 8, 128)
    assert len(shown(widget)) == 1
    widget.controls["tp"].value = 8
    assert "tp=8 must divide n_heads=4" in widget.error.value


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"model": "gpt-5"}, "model='gpt-5' must be one of 'tiny'"),
    ({"batch": 3}, "batch=3 must be one of 1, 2, 4"),
    ({"context": 100}, "context=100 must be one of 128, 256"),
    ({"kv_dtype": "fp32"}, "kv_dtype='fp32' must be one of 'bf16', 'fp8', 'int4'"),
    ({"tp": 3}, "tp=3 must be one of 1, 2, 4, 8, 16"),
])
def test_bad_arguments_raise_one_clear_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        inference_explorer(**kwargs)


def test_importing_the_widget_imports_no_torch():
    code = "import sys, lab.widgets.inference; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
