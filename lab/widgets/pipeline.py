"""The pipeline explorer: a schedule played op by op, its bubble, and the activations each stage holds.

Pick a schedule (AFAB, 1F1B, interleaved 1F1B, ZB-H1, DualPipe), the pipeline ranks p, the micro-batches m, the chunks
per rank v (interleaved only) and the op costs: t_f, the forward of one micro-batch through one stage; t_b,
its whole backward; t_w, the weight-gradient part of t_b (ZB-H1 runs B in t_b − t_w and W in t_w later);
and the latency of one send between ranks. `lab.calc.bubble.explore` checks them and simulates the
schedule (`lab.calc.bubble`: the same schedule objects `lab.parallel.pp` executes).

The left panel is the Gantt chart: one row per rank, one bar per op, coloured by micro-batch; F in the
micro-batch's colour, B darker, W lighter and hatched; grey is idle (the bubble). Bars wide enough carry
their op (F3, or F3.1 for chunk 1). The right panel is the peak of activations each rank holds, in
micro-batches of a whole stage: m for AFAB, p − r for 1F1B. The summary gives the bubble ratio
(idle / useful, the playbook's), the idle fraction (idle / total), the makespan and the closed form.

Changing the schedule to interleaved sets v = 2 (from 1), and back to the others sets v = 1. An invalid
combination (m not a multiple of p for interleaved, v > 1 for another schedule, t_w > t_b...) shows the
calculator's one-line error instead of the chart. Torch-free, like `lab.calc`.
"""

from __future__ import annotations

import html

import ipywidgets as widgets

from lab.calc.bubble import Simulation, closed_form, explore
from lab.calc.schedules import SCHEDULES, B, F, W
from lab.widgets.base import Explorer, note, show_figure, slider

MIN_PP, MAX_PP = 2, 16
MAX_MICROBATCHES, MAX_CHUNKS = 64, 8
MAX_LAYERS = 128  # an optional model depth: it must split into equal stages
IDLE = "#e6e6e6"
HATCH = {F: None, B: None, W: "////"}


def microbatch_colours(m: int) -> list:
    """One colour per micro-batch: tab20 up to 20, then a continuous map."""
    import matplotlib.pyplot as plt

    if m <= 20:
        return [plt.get_cmap("tab20")(i) for i in range(m)]
    return [plt.get_cmap("turbo")(0.05 + 0.9 * i / (m - 1)) for i in range(m)]


def _shade(colour, kind: str) -> tuple:
    """F: the colour; B: darker; W: lighter."""
    r, g, b = colour[:3]
    if kind == B:
        return (0.6 * r, 0.6 * g, 0.6 * b, 1.0)
    if kind == W:
        return (r + 0.55 * (1 - r), g + 0.55 * (1 - g), b + 0.55 * (1 - b), 1.0)
    return (r, g, b, 1.0)


def draw_timeline(sim: Simulation, ax=None, fontsize: float = 7):
    """The Gantt chart of a simulation on `ax`: rank 0 on top, time to the right, in the unit of the op costs."""
    import matplotlib.pyplot as plt

    schedule = sim.schedule
    p = schedule.pp
    ax = ax or plt.subplots(figsize=(10, 0.35 * p + 1.5))[1]
    colours = microbatch_colours(schedule.microbatches)
    points_per_unit = _points_per_unit(ax, sim.makespan)
    for rank in range(p):
        for kind in (F, B, W):
            spans = [s for s in sim.spans if s.rank == rank and s.op.kind == kind]
            if not spans:
                continue
            shades = [_shade(colours[s.op.microbatch], kind) for s in spans]
            edges = [_shade(colours[s.op.microbatch], F) if kind == W else "white" for s in spans]
            widths = [0.5 if (s.end - s.start) * points_per_unit > 4 else 0.0 for s in spans]  # no white-out
            ax.broken_barh([(s.start, s.end - s.start) for s in spans], (rank - 0.4, 0.8), facecolors=shades,
                           edgecolors=edges, linewidths=widths, hatch=HATCH[kind])
    _label_ops(sim, ax, fontsize, points_per_unit)
    ax.set_facecolor(IDLE)
    ax.set_xlim(0, sim.makespan)
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)], fontsize=8)
    ax.set_xlabel("time (unit of t_f, t_b, t_w)")
    return ax


def _points_per_unit(ax, makespan: float) -> float:
    """Typographic points per time unit along the axes, from the axes' place in the figure."""
    return ax.get_position().width * ax.figure.get_figwidth() * 72 / makespan


def _label_ops(sim: Simulation, ax, fontsize: float, points_per_unit: float) -> None:
    """Write each op on its bar when it fits: 'F3.1', else '3', else nothing."""
    char = 0.62 * fontsize  # points: a digit or capital, roughly
    for s in sim.spans:
        room = (s.end - s.start) * points_per_unit - 2
        full = str(s.op)
        label = full if len(full) * char <= room else str(s.op.microbatch)
        if len(label) * char > room:
            continue
        ax.text((s.start + s.end) / 2, s.rank, label, ha="center", va="center", fontsize=fontsize,
                color="white" if s.op.kind == B else "black", clip_on=True)


def draw_peaks(sim: Simulation, ax) -> None:
    """Peak activations per rank, in micro-batches of a whole stage, as horizontal bars."""
    p = sim.schedule.pp
    ax.barh(range(p), sim.peak_activations, height=0.6, color="#7e57c2")
    top = max(sim.peak_activations) or 1
    for rank, peak in enumerate(sim.peak_activations):
        ax.text(peak + 0.03 * top, rank, f"{peak:.3g}", va="center", fontsize=8)
    ax.set_xlim(0, 1.35 * top)
    ax.set_ylim(p - 0.5, -0.5)
    ax.tick_params(labelleft=False)
    ax.set_xlabel("peak activations\n(micro-batches of a stage)", fontsize=8)


class PipelineExplorer(Explorer):
    """Controls on the left; the timeline and the activations per rank on the right. `update()` redraws; tests
    read `simulation`, `closed_form`, `figure`, `summary.value` and `error.value`."""

    def __init__(self, schedule: str = "1f1b", pp: int = 4, microbatches: int = 8, chunks: int | None = None,
                 tf: float = 1.0, tb: float = 2.0, tw: float = 1.0, p2p: float = 0.0) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r} must be one of {', '.join(map(repr, SCHEDULES))}")
        chunks = (2 if schedule == "interleaved" else 1) if chunks is None else chunks
        for name, value, low, high in (("pp", pp, MIN_PP, MAX_PP), ("microbatches", microbatches, 1, MAX_MICROBATCHES),
                                       ("chunks", chunks, 1, MAX_CHUNKS)):
            if not (isinstance(value, int) and low <= value <= high):
                raise ValueError(f"{name}={value!r} must be an integer from {low} to {high}")
        super().__init__({
            "schedule": widgets.ToggleButtons(options=list(SCHEDULES), value=schedule, description="schedule",
                                              style={"button_width": "80px"}),
            "pp": slider(widgets.IntSlider, pp, MIN_PP, MAX_PP, 1, "pp (ranks)"),
            "microbatches": slider(widgets.IntSlider, microbatches, 1, MAX_MICROBATCHES, 1, "micro-batches"),
            "chunks": slider(widgets.IntSlider, chunks, 1, MAX_CHUNKS, 1, "chunks (interleaved)"),
            "tf": slider(widgets.FloatSlider, tf, 0.0, 4.0, 0.25, "t_f forward"),
            "tb": slider(widgets.FloatSlider, tb, 0.0, 8.0, 0.25, "t_b backward"),
            "tw": slider(widgets.FloatSlider, tw, 0.0, 4.0, 0.25, "t_w (part of t_b)"),
            "p2p": slider(widgets.FloatSlider, p2p, 0.0, 2.0, 0.05, "p2p latency"),
            "layers": slider(widgets.IntSlider, 0, 0, MAX_LAYERS, 1, "layers (0: any)"),
        })
        self.simulation: Simulation | None = None
        self.closed_form: dict | None = None
        self.figure = None
        explained = note("t_f: forward of one micro-batch through one stage; t_b: its whole backward; t_w: the "
                         "weight-gradient part of t_b (split off by zb-h1). Times in any one unit.")
        self.children = self.beside([*self.controls.values(), explained], width="360px")
        self.update()

    def _on_change(self, change: dict) -> None:
        if change["owner"] is self.controls["schedule"]:
            chunks = self.controls["chunks"]
            with self.batched():  # one redraw for the schedule and the chunks it brings along
                if change["new"] == "interleaved" and chunks.value == 1:
                    chunks.value = 2
                elif change["new"] != "interleaved" and chunks.value > 1:
                    chunks.value = 1
        super()._on_change(change)

    def update(self) -> None:
        v = self.values()
        try:
            sim = explore(v["schedule"], v["pp"], v["microbatches"], v["chunks"], v["tf"], v["tb"], v["tw"], v["p2p"])
            stages = sim.schedule.virtual_stages
            if v["layers"] and v["layers"] % stages:
                raise ValueError(f"layers={v['layers']} must be divisible by the {stages} stages a micro-batch goes "
                                 f"through (every stage the same number of layers)")
            closed = closed_form(v["schedule"], v["pp"], v["microbatches"], v["chunks"], v["tf"], v["tb"], v["tw"],
                                 v["p2p"])
        except ValueError as err:
            self.simulation = self.closed_form = self.figure = None
            self.show_error(str(err))
            return
        self.simulation, self.closed_form = sim, closed
        self.error.value = ""
        self._draw(v)
        self._summarise(v)

    def _summarise(self, v: dict) -> None:
        sim, closed = self.simulation, self.closed_form
        p, m, chunks = v["pp"], v["microbatches"], sim.schedule.chunks
        holds = "holds here" if closed["exact"] else f"holds when {closed['exact_when']}: not here"
        peaks = ", ".join(f"rank {r}: {peak:g}" for r, peak in enumerate(sim.peak_activations))
        self.summary.value = (
            f'<p class="lab-pp-bubble"><b>bubble ratio (idle / useful) {sim.bubble_ratio:.4g}</b>; '
            f"closed form {closed['bubble_ratio']:.4g} from {html.escape(closed['formula'])} ({html.escape(holds)}). "
            f"Idle fraction (idle / total) {sim.idle_fraction:.4g}; makespan {sim.makespan:.4g} time units for "
            f"{m} micro-batches on p = {p} ranks{f' with v = {chunks} chunks each' if chunks > 1 else ''} "
            f"({max(sim.idle):.4g} idle and {max(sim.busy):.4g} busy per rank); "
            f"{sim.p2p_messages:,} point-to-point messages.</p>"
            f'<p class="lab-pp-activations"><b>peak activations per rank</b> (micro-batches of a whole stage): '
            f"{peaks}.</p>")

    def _draw(self, v: dict) -> None:
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch

        sim, p = self.simulation, v["pp"]
        height = 0.3 * p + 1.9  # inches: rows, plus 0.8 above (title, legend) and 0.75 below (axis labels)
        fig, (gantt, peaks) = plt.subplots(1, 2, figsize=(11, height), sharey=True,
                                           gridspec_kw={"width_ratios": [5, 1], "wspace": 0.04})
        fig.subplots_adjust(left=0.07, right=0.98, top=1 - 0.8 / height, bottom=0.75 / height)
        draw_timeline(sim, gantt, fontsize=7 if p <= 8 else 6)
        draw_peaks(sim, peaks)
        grey = (0.55, 0.55, 0.55, 1.0)
        handles = [Patch(facecolor=_shade(grey, F), label="F forward"),
                   Patch(facecolor=_shade(grey, B), label="B input grad" if sim.schedule.split_backward
                         else "B backward"),
                   *([Patch(facecolor=_shade(grey, W), edgecolor=grey, hatch=HATCH[W], label="W weight grad")]
                     if sim.schedule.split_backward else []),
                   Patch(facecolor=IDLE, edgecolor="#bbbbbb", label="idle (bubble)")]
        gantt.legend(handles=handles, loc="lower left", bbox_to_anchor=(0, 1.0), ncols=4, fontsize=8, frameon=False)
        chunks = f", v={sim.schedule.chunks}" if sim.schedule.chunks > 1 else ""
        fig.suptitle(f"{v['schedule']}: p={p}, m={v['microbatches']}{chunks} — bubble ratio {sim.bubble_ratio:.3g} "
                     f"(closed form {self.closed_form['bubble_ratio']:.3g}), idle fraction {sim.idle_fraction:.3g}, "
                     f"makespan {sim.makespan:.4g}", fontsize=10, x=0.07, ha="left")
        self.figure = fig
        show_figure(self.plot, fig)


def pipeline_explorer(schedule: str = "1f1b", pp: int = 4, microbatches: int = 8, chunks: int | None = None,
                      tf: float = 1.0, tb: float = 2.0, tw: float = 1.0, p2p: float = 0.0) -> PipelineExplorer:
    """The chapter 06 widget: a pipeline schedule's timeline, bubble and activations per rank."""
    return PipelineExplorer(schedule=schedule, pp=pp, microbatches=microbatches, chunks=chunks, tf=tf, tb=tb,
                            tw=tw, p2p=p2p)
