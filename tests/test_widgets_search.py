"""The config explorer: shows lab.calc.search's ranking, follows every control, errors inline in one line."""

import html
import re

import pytest
from widget_support import agg_backend  # noqa: F401 (agg_backend: an autouse fixture, applied by importing it)

pytest.importorskip("ipywidgets")

from lab.calc.search import search  # noqa: E402
from lab.widgets.search import MAX_GPUS, MAX_SEQUENCES, config_explorer  # noqa: E402


def _rows(widget) -> list[str]:
    return re.findall(r"<tr[^>]*><td>\d+</td><td>([^<]*)</td>", widget.table.value)


def test_the_table_is_the_searchs_ranking():
    widget = config_explorer()  # llama3-8b on one node of 8 H100s, 1 M tokens of 4,096-token sequences
    expected = search("llama3-8b", 8, 8, "h100", 4096, 2**20).top(10)
    assert [c.layout for c in widget.result.top(10)] == [c.layout for c in expected]
    assert _rows(widget) == [html.escape(c.layout) for c in expected]
    best = expected[0]
    assert widget.selected.layout == best.layout and widget.controls["layout"].value == 0
    assert f"Best: {best.layout}, mbs {best.mbs} × grad-accum {best.grad_accum}: {best.tokens_per_s:,.0f} tokens/s" \
        in widget.summary.value
    assert f"MFU {best.mfu:.1%}" in widget.summary.value
    assert "global batch 256 sequences × 4,096 = 1,048,576 tokens" in widget.summary.value
    assert widget.error.value == ""


def test_more_gpus_change_the_top_layout():
    """Llama 3 8B with 1 M tokens a step: FSDP over the node's 8 GPUs, then over all 256 (TorchTitan trains
    the 8B with FSDP alone: benchmarks/llama3_h100_202412_torchtitan.md); the widget's top is the search's at each
    size."""
    widget = config_explorer()
    before = widget.selected.layout
    assert before == "dp8 zero3"
    widget.controls["gpus"].value = 256
    after = search("llama3-8b", 256).top(1)[0]
    assert widget.selected.layout == after.layout != before
    assert widget.summary.value.count(f"Best: {html.escape(after.layout)},") == 1
    assert widget.controls["layout"].value == 0  # a new ranking selects its best layout again


def test_selecting_a_layout_redraws_without_searching_again():
    widget = config_explorer()
    result = widget.result
    widget.controls["layout"].value = 2
    third = result.top(10)[2]
    assert widget.result is result and widget.selected is third
    t = third.time
    assert (f"Selected #3 {html.escape(third.layout)}: step {t.total:,.3g} s = compute {t.compute:,.3g} s + "
            f"exposed comms {t.comms:,.3g} s + bubble {t.bubble:,.3g} s") in widget.summary.value
    selected_row = re.search(r'<tr style="background[^>]*><td>(\d+)</td>', widget.table.value)
    assert selected_row.group(1) == "3"
    widget.controls["top"].value = 2  # the selection no longer shown: back to the best
    assert len(_rows(widget)) == 2 and widget.selected is result.top(1)[0] and widget.result is result


def test_every_input_reaches_the_search():
    widget = config_explorer()
    with widget.batched():
        widget.controls["model"].value = "llama3-1b"
        widget.controls["seq"].value = 2048
        widget.controls["global_batch_tokens"].value = 2**19
        widget.controls["hardware"].value = "a100"
    widget.controls["gpus_per_node"].value = 4
    r = widget.result
    assert (r.model.name, r.gpus, r.gpus_per_node, r.hardware, r.seq, r.global_batch) == \
        ("llama3-1b", 8, 4, "a100", 2048, 256)
    assert "/ 80</td>" in widget.table.value  # GiB of an A100 80GB


def test_rejected_families_are_listed_with_their_reason():
    widget = config_explorer(model="llama3-405b")  # 405 B parameters x 16 bytes do not fit 8 x 80 GiB
    assert widget.selected is None and widget.result.candidates == []
    assert "No layout of llama3-405b fits 8 h100 GPUs" in widget.summary.value
    assert widget.table.value == ""
    families = widget.result.rejected_families()
    assert len(families) > 1
    assert f"{len(families)} families with no layout that fits or runs" in widget.rejected.value
    for family, why in families.items():
        reason, message = why.main_reason()
        assert f"<li><b>{family}</b>: {reason} ({why.total} layouts): {html.escape(message)}</li>" \
            in widget.rejected.value
    assert "<b>dp8</b>: memory" in widget.rejected.value and "GiB per GPU &gt; 80 GiB" in widget.rejected.value


@pytest.mark.parametrize(("control", "value", "message"), [
    ("gpus", 0, f"GPUs=0 must be an integer from 1 to {MAX_GPUS:,}"),
    ("gpus", 12, "gpus=12 must be a multiple of gpus_per_node=8 (whole nodes) or fit in one node"),
    ("gpus_per_node", 0, "GPUs per node=0 must be an integer from 1 to 72"),
    ("seq", 200_000, "sequence=200000 must be from 1 to 131,072 tokens (max_seq_len of llama3-8b)"),
    ("global_batch_tokens", 100, "global batch=100 tokens must be from 4,096 to "
                                 f"{MAX_SEQUENCES * 4096:,} (1 to {MAX_SEQUENCES:,} sequences of 4,096 tokens)"),
])
def test_bad_values_show_one_line_instead_of_the_results(control, value, message):
    widget = config_explorer()
    good = widget.controls[control].value
    widget.controls[control].value = value
    assert widget.result is None and widget.selected is None
    assert widget.summary.value == widget.table.value == widget.rejected.value == ""
    assert html.escape(message) in widget.error.value and widget.error.value.count("<p") == 1
    assert "Traceback" not in widget.error.value
    widget.controls[control].value = good
    assert widget.error.value == "" and widget.selected.layout == "dp8 zero3"
