"""The ZeRO ladder widget: reproduces the ZeRO paper's published ladder, reaches lab.calc, errors inline."""

import html

import pytest
from widget_support import agg_backend  # noqa: F401 (agg_backend: an autouse fixture, applied by importing it)

pytest.importorskip("ipywidgets")

from lab.calc.memory import static_bytes  # noqa: E402
from lab.calc.params import count_params  # noqa: E402
from lab.config import PRESETS  # noqa: E402
from lab.widgets.zero import ladder, sent_per_rank, zero_ladder  # noqa: E402


def test_default_view_is_the_zero_papers_figure_1():
    """Rajbhandari et al. 2020 (ZeRO), Figure 1: Ψ = 7.5 B, N_d = 64, K = 12 — 120 GB for plain data
    parallelism, 31.4 GB with P_os, 16.6 GB with P_os+g, 1.9 GB with P_os+g+p (ZeRO paper, Figure 1)."""
    widget = zero_ladder()
    assert widget.num_params == 7_500_000_000
    published = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, gb in published.items():
        assert widget.rows[stage]["total"] / 1e9 == pytest.approx(gb, abs=0.05), stage
    assert widget.rows[3]["total"] == 16 * 7_500_000_000 // 64  # 1.875 GB exactly: the paper rounds it
    assert "ZeRO-3 (P_os+g+p): 1.88 GB per GPU" in widget.summary.value
    assert "64.0x less than plain DP" in widget.summary.value


def test_bytes_per_parameter_on_64_and_8_gpus():
    """Playbook, "ZeRO (Zero Redundancy Optimizer)", exercise: 4.1875 / 2.21875 / 0.25 bytes per parameter on
    64 GPUs; 5.5 / 3.75 / 2.0 on 8."""
    n = 64 * 8 * 1000  # divisible by both: no padding
    for dp, expected in ((64, (4.1875, 2.21875, 0.25)), (8, (5.5, 3.75, 2.0))):
        rows = ladder(n, dp)
        assert rows[0]["total"] == 16 * n
        assert tuple(rows[s]["total"] / n for s in (1, 2, 3)) == expected


def test_communication_is_2_psi_then_3_psi():
    """ZeRO paper §7: stages 0-2 move 2Ψ per rank and step (all-reduce = reduce-scatter + all-gather), stage 3
    moves 3Ψ; on a ring, each times (N_d−1)/N_d, in bf16 bytes."""
    n, dp = 1_000_000, 4
    for stage in (0, 1, 2):
        assert sent_per_rank(n, dp, stage) == pytest.approx(2 * n * 2 * 3 / 4)
    assert sent_per_rank(n, dp, 3) == pytest.approx(1.5 * sent_per_rank(n, dp, 2))


def test_every_control_reaches_the_calculator():
    widget = zero_ladder()
    widget.controls["model"].value = "llama3-8b"
    n = count_params(PRESETS["llama3-8b"])
    assert widget.num_params == n
    widget.controls["dp"].value = 8
    widget.controls["precision"].value = "fp32"
    assert widget.rows[2] == {**static_bytes(n, "fp32", zero=2, dp=8),
                              "total": sum(static_bytes(n, "fp32", zero=2, dp=8).values())}
    widget.controls["precision"].value = "mixed"
    before = widget.rows[1]["grads"]
    widget.controls["fp32_grad_accum"].value = True
    assert widget.rows[1]["grads"] == before + 4 * n  # ZeRO-1 does not shard gradients
    widget.controls["stage"].value = 1
    assert widget.summary.value.startswith('<p class="lab-zero-total"><b>ZeRO-1 (P_os)')
    widget.controls["gpu"].value = "b200"
    assert "in one b200" in widget.summary.value


@pytest.mark.parametrize(("control", "value", "message"), [
    ("dp", 0, "N_d=0 must be an integer from 1 to 1,048,576"),
    ("dp", -8, "N_d=-8 must be an integer from 1 to 1,048,576"),
    ("params_b", 0.0, "Ψ=0.0 billion parameters must be a number in (0, 100,000]"),
    ("params_b", float("inf"), "Ψ=inf billion parameters must be a number in (0, 100,000]"),
    ("precision", "fp32", "fp32 grad accumulation needs precision='mixed' (got precision='fp32')"),
])
def test_bad_values_show_one_line_instead_of_the_chart(control, value, message):
    widget = zero_ladder()
    if control == "precision":
        widget.controls["fp32_grad_accum"].value = True
    widget.controls[control].value = value
    assert widget.rows is None and widget.summary.value == ""
    assert html.escape(message) in widget.error.value and widget.error.value.count("<p") == 1
    widget.controls[control].value = {"dp": 64, "params_b": 7.5, "precision": "mixed"}[control]
    assert widget.error.value == "" and widget.rows is not None

