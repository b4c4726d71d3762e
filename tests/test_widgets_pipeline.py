"""The pipeline explorer: its numbers are lab.calc.bubble's, every control redraws across its range, invalid
combinations show one line inline (no stale chart) and clear again."""

import html
import subprocess
import sys

import pytest
from widget_support import agg_backend  # noqa: F401 (agg_backend: an autouse fixture, applied by importing it)

pytest.importorskip("ipywidgets")

from lab.calc.bubble import bubble_ratio, explore, zb_h1_bubble  # noqa: E402
from lab.calc.schedules import SCHEDULES  # noqa: E402
from lab.widgets.pipeline import pipeline_explorer  # noqa: E402


def _gantt(widget):
    return widget.figure.axes[0]


def _fingerprint(widget) -> tuple:
    """What the figure shows: the title, and every bar of the timeline and of the activations panel."""
    gantt, peaks = widget.figure.axes
    bars = tuple((tuple(map(tuple, path.vertices.round(6).tolist())), tuple(collection.get_facecolors()[i].round(4)))
                 for collection in gantt.collections for i, path in enumerate(collection.get_paths()))
    return widget.figure._suptitle.get_text(), bars, tuple(round(p.get_width(), 6) for p in peaks.patches)


def _labels(widget) -> list[str]:
    return [t.get_text() for t in _gantt(widget).texts]


def test_default_view_is_the_playbook_exercise():
    """Playbook: p = 4, m = 8, t_f = 1, t_b = 2: a 33-unit step, bubble (p-1)/m = 0.375; 1F1B holds p - r."""
    widget = pipeline_explorer()
    sim = widget.simulation
    assert sim.as_dict() == explore("1f1b", 4, 8).as_dict()
    assert sim.makespan == 33 and sim.peak_activations == [4, 3, 2, 1]
    assert "bubble ratio (idle / useful) 0.375" in widget.summary.value
    assert "closed form 0.375" in widget.summary.value and "holds here" in widget.summary.value
    assert "Idle fraction (idle / total) 0.2727" in widget.summary.value
    assert "rank 0: 4, rank 1: 3, rank 2: 2, rank 3: 1" in widget.summary.value
    assert widget.error.value == "" and widget.closed_form["bubble_ratio"] == bubble_ratio(4, 8)
    gantt, peaks = widget.figure.axes
    assert [t.get_text() for t in gantt.get_yticklabels()] == ["rank 0", "rank 1", "rank 2", "rank 3"]
    assert sum(len(c.get_paths()) for c in gantt.collections) == 4 * 2 * 8  # one bar per op: F and B, 8 each
    assert [p.get_width() for p in peaks.patches] == [4, 3, 2, 1]
    assert {f"F{i}" for i in range(8)} | {f"B{i}" for i in range(8)} <= set(_labels(widget))
    assert "time (unit of t_f, t_b, t_w)" == gantt.get_xlabel()
    assert "bubble ratio 0.375 (closed form 0.375)" in widget.figure._suptitle.get_text()


def test_colours_per_micro_batch_and_f_b_w_distinguished():
    widget = pipeline_explorer("zb-h1", pp=4, microbatches=8)
    gantt = _gantt(widget)
    legend = [t.get_text() for t in gantt.get_legend().get_texts()]
    assert legend == ["F forward", "B input grad", "W weight grad", "idle (bubble)"]
    hatched = [c for c in gantt.collections if c.get_hatch()]
    assert hatched and sum(len(c.get_paths()) for c in hatched) == 4 * 8  # every W, and only W, hatched
    assert {f"W{i}" for i in range(8)} <= set(_labels(widget))
    # rank 0's ops of micro-batch 0: F, B, W in three shades of one colour; micro-batch 1 another colour
    colour = {}
    for collection in gantt.collections:
        for path, face in zip(collection.get_paths(), collection.get_facecolors(), strict=True):
            if path.vertices[:, 1].min() == pytest.approx(-0.4):  # rank 0's row: y from -0.4 to 0.4
                colour[round(path.vertices[:, 0].min(), 6)] = tuple(face)
    ops = {str(s.op): colour[round(s.start, 6)] for s in widget.simulation.spans if s.rank == 0}
    assert len({ops["F0"], ops["B0"], ops["W0"], ops["F1"]}) == 4
    assert sum(ops["B0"][:3]) < sum(ops["F0"][:3]) < sum(ops["W0"][:3])  # B darker, W lighter
    widget.controls["schedule"].value = "1f1b"
    assert not any(c.get_hatch() for c in _gantt(widget).collections)
    assert "W weight grad" not in [t.get_text() for t in _gantt(widget).get_legend().get_texts()]


def test_every_control_redraws_across_its_range(monkeypatch):
    """Checked on the figure the widget built: encoding each view's PNG for the output widget, which costs about
    as much again as building the figure, is left to the other tests, which all encode theirs."""
    import matplotlib.pyplot as plt

    monkeypatch.setattr("lab.widgets.pipeline.show_figure", lambda output, fig: plt.close(fig))
    widget = pipeline_explorer()
    seen = {_fingerprint(widget)}

    def step(name, value):
        widget.controls[name].value = value
        assert widget.error.value == "", (name, value, widget.error.value)
        assert widget.controls[name].value == value
        shown = _fingerprint(widget)
        assert shown not in seen, f"{name}={value} did not redraw"
        seen.add(shown)

    for pp in (2, 3, 8, 16):
        step("pp", pp)
        assert len(widget.simulation.busy) == pp and len(_gantt(widget).get_yticks()) == pp
    for m in (1, 5, 16, 64):
        step("microbatches", m)
        assert widget.simulation.schedule.microbatches == m
    assert widget.simulation.peak_activations[0] == 16  # 1F1B on 16 ranks, 64 micro-batches: p in flight
    step("pp", 4)
    for name, values in (("tf", (0.0, 2.5, 4.0)), ("tb", (8.0, 1.0, 3.0)), ("p2p", (0.5, 2.0))):
        for value in values:
            step(name, value)
    assert widget.simulation.as_dict() == explore("1f1b", 4, 64, tf=4.0, tb=3.0, p2p=2.0).as_dict()
    assert "holds when p2p = 0: not here" in widget.summary.value
    widget.controls["p2p"].value = 0.0
    for schedule in ("afab", "zb-h1"):
        step("schedule", schedule)
        assert widget.simulation.schedule.name == schedule
    for tw in (0.0, 1.5, 3.0):  # only the split backward feels t_w
        step("tw", tw)
        if 2 * tw <= 3.0:  # ZB-H1's closed form holds: (p-1)(t_f + t_b - 2 t_w)
            assert max(widget.simulation.idle) == pytest.approx(3 * (4.0 + 3.0 - 2 * tw))
    step("schedule", "interleaved")
    for chunks in (3, 8, 4):
        step("chunks", chunks)
        assert widget.simulation.schedule.chunks == chunks
        assert widget.simulation.bubble_ratio == pytest.approx(bubble_ratio(4, 64, chunks))


def test_schedule_change_brings_chunks_along_with_one_redraw():
    widget = pipeline_explorer()
    calls = []
    original = widget.update
    widget.update = lambda: (calls.append(widget.values()), original())
    widget.controls["schedule"].value = "interleaved"
    assert widget.controls["chunks"].value == 2 and len(calls) == 1 and calls[0]["chunks"] == 2
    assert widget.simulation.schedule.chunks == 2 and widget.error.value == ""
    assert widget.simulation.peak_activations == [5.5, 4.5, 3.5, 2.5]  # Megatron's interleaved warm-up
    assert "B0.1" in _labels(widget)  # chunk 1's backward of micro-batch 0
    widget.controls["chunks"].value = 4
    widget.controls["schedule"].value = "zb-h1"
    assert widget.controls["chunks"].value == 1 and len(calls) == 3
    assert widget.simulation.schedule.name == "zb-h1"
    assert widget.closed_form["idle"] == zb_h1_bubble(4, 1, 2, 1) == max(widget.simulation.idle)
    widget.controls["schedule"].value = "afab"
    assert widget.controls["chunks"].value == 1 and len(calls) == 4
    assert widget.simulation.peak_activations == [8, 8, 8, 8]


@pytest.mark.parametrize(("setup", "message"), [
    ({"schedule": "interleaved", "microbatches": 6}, "microbatches=6 must be a multiple of pp=4 for the interleaved"),
    ({"schedule": "interleaved", "microbatches": 2}, "microbatches=2 must be a multiple of pp=4 for the interleaved"),
    ({"schedule": "interleaved", "chunks": 1}, "chunks=1 must be >= 2 for the interleaved schedule"),
    ({"schedule": "1f1b", "chunks": 2}, "chunks=2: only the interleaved schedule runs several chunks per rank"),
    ({"schedule": "zb-h1", "tb": 1.0, "tw": 1.5}, "tw=1.5 must be <= tb=1.0: the weight gradients are part of"),
    ({"tf": 0.0, "tb": 0.0, "tw": 0.0}, "tf=0 and tb=0: at least one of the forward and the backward"),
])
def test_invalid_combinations_show_one_line_instead_of_the_chart(setup, message):
    widget = pipeline_explorer()
    good = widget.values()
    for name, value in setup.items():
        widget.controls[name].value = value
    assert widget.simulation is None and widget.closed_form is None and widget.figure is None
    assert widget.summary.value == ""
    assert html.escape(message) in widget.error.value and widget.error.value.count("<p") == 1
    for name in reversed(list(setup)):
        widget.controls[name].value = good[name]
    assert widget.error.value == "" and widget.simulation is not None and widget.figure is not None
    assert widget.simulation.as_dict() == explore("1f1b", 4, 8).as_dict()


def test_zb_h1_closed_form_says_when_it_does_not_hold():
    widget = pipeline_explorer("zb-h1", pp=2, microbatches=2, tf=1.0, tb=1.0, tw=1.0)
    assert widget.closed_form["idle"] == 0 < max(widget.simulation.idle)
    assert "holds when m &gt;= p, tw &lt;= tf, tw &lt;= tb - tw, p2p = 0: not here" in widget.summary.value


@pytest.mark.slow  # ~10 s of a core: extreme sizes past test_every_control_redraws_across_its_range's (make test)
def test_sweeping_the_ranges_never_crashes(monkeypatch):
    """Each (pp, m) is drawn and encoded as the output's PNG; the state on the way there (the new pp with the
    previous m) is drawn, not encoded, which would cost about as much again."""
    import matplotlib.pyplot as plt

    widget = pipeline_explorer()
    for schedule in SCHEDULES:
        widget.controls["schedule"].value = schedule
        for pp, m in ((2, 1), (3, 9), (7, 64), (16, 16), (16, 3)):
            with monkeypatch.context() as figure_only:
                figure_only.setattr("lab.widgets.pipeline.show_figure", lambda output, fig: plt.close(fig))
                widget.controls["pp"].value = pp
            widget.controls["microbatches"].value = m
            assert (widget.simulation is None) != (widget.error.value == "")
            assert (widget.simulation is None) == (widget.figure is None)
            if widget.simulation is not None:
                assert widget.simulation.schedule.pp == pp and widget.simulation.schedule.name == schedule
            else:  # interleaved needs m a multiple of p; dualpipe p even and m even, >= 2p
                assert (schedule == "interleaved" and m % pp) or (schedule == "dualpipe" and (
                    pp % 2 or m % 2 or m < 2 * pp))


def test_bad_constructor_arguments_raise():
    for kwargs, message in (({"schedule": "gpipe"}, "schedule='gpipe' must be one of"),
                            ({"pp": 1}, "pp=1 must be an integer from 2 to 16"),
                            ({"microbatches": 65}, "microbatches=65 must be an integer from 1 to 64"),
                            ({"chunks": 9}, "chunks=9 must be an integer from 1 to 8")):
        with pytest.raises(ValueError, match=message):
            pipeline_explorer(**kwargs)
    assert pipeline_explorer("interleaved", microbatches=8).controls["chunks"].value == 2


def test_importing_the_widget_imports_no_torch():
    code = "import sys, lab.widgets, lab.widgets.pipeline; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_layers_that_do_not_split_into_equal_stages_are_an_inline_error():
    """The issue's "layers not divisible": 30 layers cannot make 4 stages, nor 8 interleaved ones; 32 can."""
    widget = pipeline_explorer()
    widget.controls["layers"].value = 30
    assert "layers=30 must be divisible by the 4 stages" in widget.error.value and widget.simulation is None
    widget.controls["layers"].value = 32
    assert widget.error.value == "" and widget.simulation is not None
    widget.controls["schedule"].value = "interleaved"  # v = 2: 8 virtual stages
    widget.controls["layers"].value = 12
    assert "layers=12 must be divisible by the 8 stages" in widget.error.value
    widget.controls["layers"].value = 0  # no model depth given: nothing to check
    assert widget.error.value == ""
