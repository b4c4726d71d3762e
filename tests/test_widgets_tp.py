"""The TP/SP explorer: its numbers are lab.calc's (Korthikanti's 34·sbh/t with SP, the Scaling Book's TP bound,
the model's weights), every control reaches them, and bad input shows one line instead of the chart."""

import html

import pytest
from widget_support import agg_backend  # noqa: F401 (agg_backend: an autouse fixture, applied by importing it)

pytest.importorskip("ipywidgets")

from lab.calc.params import count_params  # noqa: E402
from lab.config import PRESETS  # noqa: E402
from lab.widgets.tp import layer_numbers, tp_explorer  # noqa: E402


def test_default_view_is_llama3_70b_at_tp_8_with_sp():
    """Korthikanti et al. 2022, eq. 4: 34·s·b·h/t bytes a layer with SP (s = 8192, h = 8192, t = 8); the Scaling
    Book's bound F·W/C = 28,672 × 450e9 / 989.4e12 ≈ 13 on NVLink 4."""
    widget = tp_explorer()
    assert widget.numbers["activations"] == 34 * 8192 * 8192 / 8
    assert "TP stays compute-bound on NVLink up to tp ≈ 13.0" in widget.summary.value
    assert "its MLP all-reduce takes 0.54× its matmuls" in widget.summary.value


def test_the_layers_weights_add_up_to_the_model():
    """80 layers × tp GPUs of one layer's weights are Llama 3 70B's parameters without embeddings and norms."""
    cfg = PRESETS["llama3-70b"]
    per_gpu = layer_numbers("llama3-70b", 8, 8192, 1, True, "h100")["weights"]
    blocks = count_params(cfg) - 2 * cfg.vocab_size * cfg.d_model
    assert per_gpu * 8 * cfg.n_layers / 2 == pytest.approx(blocks, rel=1e-3)


def test_every_control_reaches_the_calculator():
    widget = tp_explorer()
    widget.controls["sp"].value = False
    assert widget.numbers["activations"] == 8192 * 8192 * (10 + 24 / 8)  # eq. 2: TP alone
    widget.controls["tp"].value = 16  # beyond a node: the NIC's 50 GB/s instead of NVLink's 450
    assert widget.numbers["comm_to_compute"] == pytest.approx(15 * 989.4e12 / (28672 * 50e9))
    with widget.batched():  # one redraw for two controls
        widget.controls["seq"].value = 4096
        widget.controls["batch"].value = 2
    widget.update()
    assert widget.numbers == layer_numbers("llama3-70b", 16, 4096, 2, False, "h100")
    with widget.batched():
        widget.controls["gpu"].value = "b200"
    widget.controls["model"].value = "llama3-8b"
    assert widget.numbers == layer_numbers("llama3-8b", 16, 4096, 2, False, "b200")
    assert widget.summary.value.startswith('<p class="lab-tp-summary"><b>tp = 16:')


@pytest.mark.parametrize(("control", "value", "message"), [
    ("batch", 0, "micro-batch=0 must be an integer from 1 to 1024"),
    ("model", "smollm-135m", "tp=8 must divide n_heads=9 of smollm-135m"),
])
def test_bad_values_show_one_line_instead_of_the_chart(control, value, message):
    widget = tp_explorer()
    widget.controls[control].value = value
    assert widget.numbers is None and widget.summary.value == ""
    assert html.escape(message) in widget.error.value and widget.error.value.count("<p") == 1
    widget.controls[control].value = {"batch": 1, "model": "llama3-70b"}[control]
    assert widget.error.value == "" and widget.numbers is not None
