"""The roofline explorer: every control reaches lab.calc.roofline, the chart follows each redraw, errors inline."""

import html
import subprocess
import sys

import pytest
from widget_support import agg_backend, shown  # noqa: F401 (agg_backend: an autouse fixture, applied by importing it)

pytest.importorskip("ipywidgets")

from lab.calc.roofline import llama_block_ops, place  # noqa: E402
from lab.config import PRESETS  # noqa: E402
from lab.widgets.roofline import roofline_explorer  # noqa: E402


def test_default_view_is_calc_roofline_on_an_h100():
    widget = roofline_explorer()
    expected = [place(op, "h100", "bf16") for op in llama_block_ops(PRESETS["llama3-8b"], 1, 4096, "bf16")]
    assert widget.placements == expected
    # 4,096 tokens: the projections are compute-bound, the naive attention's three kernels memory-bound
    assert "ridge 295 FLOPs/byte" in widget.summary.value
    assert "9 of 13 ops memory-bound" in widget.summary.value
    total = sum(p.time_s for p in expected)
    assert f"block forward ≥ {total * 1e3:,.2f} ms" in widget.summary.value
    assert "softmax 641.0 µs*" in widget.summary.value and "qkv_proj 208.4 µs," in widget.summary.value


def test_every_control_moves_the_points_and_flash_leaves_the_elementwise_ops_below_the_ridge():
    widget = roofline_explorer()
    widget.controls["attention"].value = "flash"
    # one kernel instead of scores, softmax and probs_v: 11 ops, and only the elementwise ones memory-bound
    assert ("6 of 11 ops memory-bound</b>, 10% of the time: attn_norm, rope, attn_residual, ffn_norm, swiglu, "
            "ffn_residual.</p>") in widget.summary.value
    seen = [widget.placements]
    for name, value in (("model", "llama3-70b"), ("gpu", "h200"), ("dtype", "fp8"), ("batch", 8), ("seq", 512)):
        widget.controls[name].value = value
        assert widget.error.value == "" and widget.placements != seen[-1], name
        seen.append(widget.placements)
    cfg = PRESETS["llama3-70b"]
    assert widget.placements == [place(op, "h200", "fp8") for op in llama_block_ops(cfg, 8, 512, "fp8", "flash")]


def test_the_chart_is_the_output_widgets_state_and_follows_every_redraw():
    """One PNG each time (set as the output's state, see lab.widgets.base.show_figure), a new one per change,
    none while the error line shows, one again once the input is valid."""
    widget = roofline_explorer()
    first = shown(widget)
    assert len(first) == 1 and first[0].startswith("iVBORw0KGgo")  # base64 of the PNG signature
    widget.controls["batch"].value = 64
    second = shown(widget)
    assert len(second) == 1 and second != first
    widget.controls["gpu"].value = "a100"
    widget.controls["dtype"].value = "fp8"
    assert shown(widget) == []
    widget.controls["dtype"].value = "fp16"
    assert len(shown(widget)) == 1


@pytest.mark.parametrize(("gpu", "dtype", "message"), [
    ("a100", "fp8", "dtype='fp8' has no peak on NVIDIA A100 80GB SXM; valid: bf16, fp16, int8"),
    ("tpu-v5e", "fp16", "dtype='fp16' has no peak on Google TPU v5e; valid: bf16, int8"),
])
def test_a_dtype_the_chip_lacks_shows_one_line_instead_of_the_chart_and_clears(gpu, dtype, message):
    widget = roofline_explorer(gpu=gpu)
    widget.controls["dtype"].value = dtype
    assert widget.placements is None and widget.summary.value == ""
    assert html.escape(message) in widget.error.value and widget.error.value.count("<p") == 1
    widget.controls["batch"].value = 4  # other controls keep showing the error while the dtype is wrong
    assert widget.placements is None and html.escape(message) in widget.error.value
    widget.controls["dtype"].value = "bf16"
    assert widget.error.value == "" and widget.placements is not None


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"model": "mixtral-8x7b"}, "model='mixtral-8x7b' must be one of 'tiny'"),
    ({"batch": 3}, "batch=3 must be one of 1, 2, 4"),
    ({"dtype": "fp4"}, "dtype='fp4' must be one of 'bf16', 'fp16', 'fp8'"),
])
def test_bad_arguments_raise_one_clear_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        roofline_explorer(**kwargs)


def test_importing_the_widget_imports_no_torch():
    code = "import sys, lab.widgets.roofline; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
