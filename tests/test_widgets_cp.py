"""The ring attention explorer: its blocks are lab.parallel.cp's schedule, every control redraws, a sequence the
layout cannot cut shows one line inline and clears again."""

import hashlib
import html
import io
import subprocess
import sys

import pytest
from widget_support import agg_backend, shown  # noqa: F401 (agg_backend: an autouse fixture, applied by importing it)

pytest.importorskip("ipywidgets")

from lab.calc.cp import attention_work, block_work, chunk_ids, num_chunks  # noqa: E402
from lab.widgets.cp import ring_attention_explorer, ring_schedule, source_rank  # noqa: E402


def _png(widget) -> str:
    buffer = io.BytesIO()
    widget.figure.savefig(buffer, format="png", dpi=40)
    return hashlib.sha256(buffer.getvalue()).hexdigest()


def _titles(widget) -> tuple[str, str]:
    return tuple(ax.get_title() for ax in widget.figure.axes)


def test_default_view_is_the_playbooks_contiguous_imbalance():
    """Playbook, "Context Parallelism": cp = 4, causal, contiguous chunks: ranks score 1, 3, 5, 7 of 16 half-blocks."""
    widget = ring_attention_explorer()
    seq, chunk = widget.controls["seq"].value, widget.controls["seq"].value // 4
    assert widget.work == attention_work(seq, 4, "contiguous")
    assert [round(w / (chunk * chunk / 2)) for w in widget.work] == [1, 3, 5, 7]
    assert "max/mean work per rank: 1.750" in widget.summary.value
    assert widget.step_work == [chunk * (chunk + 1) // 2] * 4  # step 0: every rank its own diagonal block
    assert widget.error.value == ""
    assert _titles(widget)[1] == "work per rank: max/mean = 1.75"


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_schedule_is_the_ring(cp, layout, causal):
    """At step i rank r holds the K/V of rank (r - i) mod cp; every block is met exactly once, by the rank
    holding its queries; the work adds up to attention_work."""
    blocks = ring_schedule(cp, layout, causal)
    n = num_chunks(cp, layout)
    assert sorted((b["q"], b["k"]) for b in blocks) == [(q, k) for q in range(n) for k in range(n)]
    for b in blocks:
        assert b["source"] == (b["rank"] - b["step"]) % cp == source_rank(b["rank"], b["step"], cp)
        assert b["q"] in chunk_ids(b["rank"], cp, layout) and b["k"] in chunk_ids(b["source"], cp, layout)
    chunk = 48 * cp // n
    work = [sum(block_work(b["kind"], chunk, chunk) for b in blocks if b["rank"] == r) for r in range(cp)]
    assert work == attention_work(48 * cp, cp, layout, causal)


def test_zigzag_balances_and_no_mask_is_balanced():
    widget = ring_attention_explorer(layout="zigzag")
    assert len(set(widget.work)) == 1 and "max/mean work per rank: 1.000" in widget.summary.value
    widget.controls["layout"].value = "contiguous"
    widget.controls["causal"].value = False
    assert len(set(widget.work)) == 1 and not any(b["kind"] == "skip" for b in widget.blocks)


def test_every_control_redraws_across_its_range(monkeypatch):
    """Each ring step is checked on the figure the widget built (`widget.figure`) without encoding the output
    widget's PNG, which costs about as much again as building the figure: each cp's PNG is encoded once, when cp
    changes, and test_the_chart_is_the_output_widgets_state_and_follows_every_redraw checks what the output holds."""
    import matplotlib.pyplot as plt

    widget = ring_attention_explorer()
    seen = {_png(widget)}
    for cp in range(2, 9):
        widget.controls["cp"].value = cp
        assert widget.controls["step"].max == cp - 1
        assert widget.error.value == "" and len(widget.work) == cp
        with monkeypatch.context() as figure_only:
            figure_only.setattr("lab.widgets.cp.show_figure", lambda output, fig: plt.close(fig))
            _walk_the_steps(widget, cp, seen)
    assert len(seen) == 1 + 2 + 8
    widget.controls["cp"].value = 3  # step was 7: clamped to the new last step
    assert widget.controls["step"].value == 2 and widget.error.value == ""
    before = (_png(widget), widget.summary.value, _titles(widget))
    widget.controls["layout"].value = "zigzag"
    assert "zigzag" in _titles(widget)[0] and len(widget.blocks) == 36
    assert (_png(widget), widget.summary.value) != before[:2]
    widget.controls["causal"].value = False
    assert "no mask" in _titles(widget)[0] and "0 skipped by the mask" in widget.summary.value
    widget.controls["seq"].value = 6000
    assert widget.work == attention_work(6000, 3, "zigzag", causal=False)
    assert "blocks of 1,000 × 1,000 tokens" in widget.summary.value


def _walk_the_steps(widget, cp: int, seen: set) -> None:
    for step in range(cp):
        widget.controls["step"].value = step
        assert f"<b>step {step} of {cp - 1}:</b>" in widget.summary.value
        assert f"step {step} of {cp - 1} solid" in _titles(widget)[0]
        outlined = [p for p in widget.figure.axes[0].patches if p.get_linewidth() > 1]
        assert len(outlined) == sum(b["step"] == step for b in widget.blocks) == cp  # 1 block per rank
        # rank 0 holds the K/V of rank -step mod cp
        assert f"rank 0 ← K/V of rank {(-step) % cp} " in widget.summary.value
        if cp in (2, 8):  # rendering every view costs seconds: enough to show that each one differs
            seen.add(_png(widget))


@pytest.mark.parametrize(("cp", "layout", "seq", "message"), [
    (4, "zigzag", 1001, "seq_len=1001 must be divisible by 2*cp = 8 for the zigzag layout"),
    (3, "contiguous", 1000, "seq_len=1000 must be divisible by cp = 3 for the contiguous layout"),
    (4, "zigzag", 0, "seq=0 must be an integer from 1 to 10,000,000 (tokens)"),
    (4, "contiguous", -8, "seq=-8 must be an integer from 1 to 10,000,000 (tokens)"),
])
def test_bad_seq_shows_one_line_instead_of_the_chart_and_clears(cp, layout, seq, message):
    widget = ring_attention_explorer(cp=cp, layout=layout)
    widget.controls["seq"].value = seq
    assert widget.work is None and widget.blocks is None and widget.summary.value == ""
    assert html.escape(message) in widget.error.value and widget.error.value.count("<p") == 1
    widget.controls["step"].value = 1  # other controls keep showing the error while seq is wrong
    assert html.escape(message) in widget.error.value and widget.work is None
    widget.controls["seq"].value = 1680
    assert widget.error.value == "" and widget.work == attention_work(1680, cp, layout)


def test_a_layout_change_can_make_seq_invalid_and_back():
    widget = ring_attention_explorer(cp=4, seq=1004)  # 4 contiguous chunks of 251: fine
    assert widget.error.value == ""
    widget.controls["layout"].value = "zigzag"  # 8 chunks: not any more
    assert "seq_len=1004 must be divisible by 2*cp = 8 for the zigzag layout" in widget.error.value
    widget.controls["layout"].value = "contiguous"
    assert widget.error.value == "" and widget.work is not None


def test_the_chart_is_the_output_widgets_state_and_follows_every_redraw():
    """The chart is set as the output's state, not captured from a `with output:` block: a capture can be lost
    in JupyterLab (a redraw that never showed, in the browser lane). One PNG each time, a new one per change,
    none while the error line shows."""
    widget = ring_attention_explorer()
    first = shown(widget)
    assert len(first) == 1 and first[0].startswith("iVBORw0KGgo")  # base64 of the PNG signature
    widget.controls["layout"].value = "zigzag"
    second = shown(widget)
    assert len(second) == 1 and second != first
    widget.controls["seq"].value = 1001
    assert shown(widget) == []
    widget.controls["seq"].value = 1680
    assert len(shown(widget)) == 1


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"cp": 9}, "cp=9 must be an integer from 2 to 8"),
    ({"layout": "stripes"}, "layout='stripes' must be one of 'contiguous', 'zigzag'"),
    ({"cp": 2, "step": 2}, "step=2 must be an integer from 0 to cp-1 = 1"),
])
def test_bad_arguments_raise_one_clear_line(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ring_attention_explorer(**kwargs)


def test_importing_the_widget_imports_no_torch():
    """lab.parallel.cp (which imports torch) is imported on first use, not with the module."""
    code = "import sys, lab.widgets, lab.widgets.cp; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
