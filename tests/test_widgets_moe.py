"""The capacity explorer: its numbers are lab.model.MoE's own routing, every control reroutes and redraws, an
invalid combination shows one line inline (no stale chart) and clears again; the chapter's two drawings."""

import html
import subprocess
import sys

import pytest
from widget_support import agg_backend  # noqa: F401 (agg_backend: an autouse fixture, applied by importing it)

pytest.importorskip("ipywidgets")

from lab.widgets.moe import draw_dispatch, draw_load_history, moe_explorer, route_tokens  # noqa: E402


def _fingerprint(widget) -> tuple:
    """What the figure shows: the title, every bar (position and height) and the horizontal lines."""
    ax = widget.figure.axes[0]
    bars = tuple((round(p.get_x(), 6), round(p.get_y(), 6), round(p.get_height(), 6)) for p in ax.patches)
    lines = tuple(tuple(line.get_ydata()) for line in ax.lines)
    return ax.get_title(), bars, lines


def test_capacity_keeps_the_first_c_assignments_of_each_expert():
    """MoE.capacity_mask: C = ceil(c·T·k/E); an expert keeps min(wanted, C); every assignment is kept or dropped."""
    for capacity_factor in (0.5, 1.0, 1.25, 2.0):
        r = route_tokens(1000, 8, 2, capacity_factor, skew=1.0)
        assert r.capacity == -(-capacity_factor * 2000 // 8)
        assert r.load == [min(w, r.capacity) for w in r.wanted]
        assert sum(r.load) + r.dropped == sum(r.wanted) == r.assignments == 2000
        assert r.dropped_fraction == r.dropped / 2000
        assert 0 <= r.tokens_without_expert * 2 <= r.dropped
    free = route_tokens(1000, 8, 2, 0.0, skew=1.0)
    assert free.capacity is None and free.dropped == 0 and free.tokens_without_expert == 0
    assert free.load == free.wanted == r.wanted  # same seed: the capacity changes what is kept, not the routing


def test_skew_unbalances_the_router_and_raises_drops_and_aux_loss():
    rows = [route_tokens(4096, 16, 2, 1.0, skew) for skew in (0.0, 0.5, 1.0, 2.0, 3.0)]
    balanced = rows[0]
    assert balanced.imbalance < 1.25 and balanced.aux_loss == pytest.approx(1.0, abs=0.02)
    assert balanced.dropped_fraction < 0.05  # random fluctuations only
    for less, more in zip(rows, rows[1:], strict=False):
        assert less.imbalance < more.imbalance and less.aux_loss < more.aux_loss and less.dropped < more.dropped
    assert rows[-1].wanted[0] == max(rows[-1].wanted)  # expert 0 is the favourite
    assert rows[-1].dropped_fraction > 0.5 and rows[-1].tokens_without_expert > 0


def test_sigmoid_gating_chooses_the_same_experts_with_other_scores():
    """DeepSeek-V3's per-expert sigmoid is monotone in the logit: the same top-k, different weights and aux loss."""
    softmax, sigmoid = route_tokens(512, 8, 2, 1.0, 1.0, "softmax"), route_tokens(512, 8, 2, 1.0, 1.0, "sigmoid")
    assert softmax.wanted == sigmoid.wanted and softmax.load == sigmoid.load
    assert softmax.aux_loss != pytest.approx(sigmoid.aux_loss)


def test_default_view():
    widget = moe_explorer()
    r = widget.routing
    assert (r.tokens, r.n_experts, r.top_k, r.capacity_factor, r.skew, r.gating) == (1024, 8, 2, 1.25, 0.5, "softmax")
    assert r == route_tokens(1024, 8, 2, 1.25, 0.5)
    assert r.capacity == 320 and r.dropped > 0
    assert f"dropped {r.dropped:,} of 2,048 assignments ({r.dropped / 2048:.1%})" in widget.summary.value
    assert "Capacity C = ⌈1.25·1,024·2/8⌉ = 320 assignments per expert" in widget.summary.value
    assert f"aux loss (Switch, 1 = balanced) {r.aux_loss:.4f}" in widget.summary.value
    ax = widget.figure.axes[0]
    assert len(ax.patches) == 2 * 8  # kept and dropped, per expert
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["mean T·k/E = 256", "capacity C = 320", "kept",
                                                                    "dropped"]
    assert [p.get_height() for p in ax.patches[:8]] == r.load
    assert [p.get_height() for p in ax.patches[8:]] == [w - k for w, k in zip(r.wanted, r.load, strict=True)]
    assert widget.error.value == ""


def test_every_control_reroutes_and_redraws():
    widget = moe_explorer()
    seen = {_fingerprint(widget)}

    def step(name, value, new=True):
        widget.controls[name].value = value
        assert widget.error.value == "", (name, value, widget.error.value)
        shown = _fingerprint(widget)
        assert shown not in seen or not new, f"{name}={value} did not redraw"
        seen.add(shown)
        return widget.routing

    for c in (1.0, 2.0, 0.5):
        assert step("capacity_factor", c).capacity == -(-c * 2048 // 8)
    assert step("capacity_factor", 0.0).dropped == 0
    assert "No capacity factor" in widget.summary.value
    assert len(widget.figure.axes[0].lines) == 1  # the mean only: no capacity line
    step("capacity_factor", 1.0, new=False)
    for k in (1, 4, 8):
        assert step("top_k", k).assignments == 1024 * k
    step("top_k", 2, new=False)
    for n in (16, 64, 3):
        r = step("n_experts", n)
        assert len(r.wanted) == n and len(widget.figure.axes[0].patches) == 2 * n
    step("n_experts", 8, new=False)
    for t in (8, 4096, 8192):
        assert step("tokens", t).tokens == t
    step("tokens", 1024, new=False)
    drops = [step("skew", s).dropped for s in (0.0, 1.5, 3.0)]
    assert drops == sorted(drops)
    r = step("gating", "sigmoid")
    assert r.gating == "sigmoid" and r.load == route_tokens(1024, 8, 2, 1.0, 3.0, "softmax").load


def test_top_k_above_n_experts_shows_one_line_instead_of_the_chart():
    widget = moe_explorer(n_experts=4)
    widget.controls["top_k"].value = 6
    assert widget.routing is None and widget.figure is None and widget.summary.value == ""
    assert html.escape("top_k=6 must be <= n_experts=4") in widget.error.value
    assert widget.error.value.count("<p") == 1
    widget.controls["n_experts"].value = 6
    assert widget.error.value == "" and widget.routing.top_k == 6 and widget.figure is not None


def test_bad_arguments_raise():
    for kwargs, message in (({"capacity_factor": -0.5}, r"capacity_factor=-0.5 must be a number from 0 to 2"),
                            ({"top_k": 0}, "top_k=0 must be an integer from 1 to 8"),
                            ({"n_experts": 65}, "n_experts=65 must be an integer from 1 to 64"),
                            ({"tokens": 4}, "tokens=4 must be an integer from 8 to 8192"),
                            ({"skew": float("nan")}, "skew=nan must be a number from 0 to 3"),
                            ({"gating": "relu"}, "gating='relu' must be one of 'softmax', 'sigmoid'")):
        with pytest.raises(ValueError, match=message):
            moe_explorer(**kwargs)
    with pytest.raises(ValueError, match="top_k=3 must be <= n_experts=2"):
        route_tokens(64, 2, 3)


def test_draw_dispatch_labels_the_split_sizes():
    rows = [[3, 0, 5, 1], [2, 2, 0, 7]]  # 2 ranks, 4 experts: rank j owns experts 2j, 2j+1
    ax = draw_dispatch(rows)
    texts = [t.get_text() for t in ax.texts]
    assert "send [3, 6]" in texts and "send [4, 7]" in texts
    assert "rank 0 receives 7" in texts and "rank 1 receives 13" in texts
    with pytest.raises(ValueError, match="ep=3 must divide n_experts=4"):
        draw_dispatch([[1, 2, 3, 4]] * 3)


def test_draw_load_history_one_line_per_expert_and_the_mean():
    ax = draw_load_history([[4, 2, 2], [3, 3, 2]], title="t")
    assert len(ax.lines) == 4 and list(ax.lines[-1].get_ydata()) == [8 / 3, 8 / 3]


def test_importing_the_widget_imports_no_torch():
    code = "import sys, lab.widgets, lab.widgets.moe; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
