"""The ring attention explorer: which rank computes which block of the attention matrix, and at which step.

In ring attention the queries stay on their rank and the keys and values travel: at ring step i, rank r
holds the K/V of rank (r − i) mod cp. The sequence is cut into the layout's chunks (`lab.calc.cp`):
cp contiguous chunks, or 2·cp chunks in zig-zag order (rank r holds chunks r and 2·cp−1−r).

The left panel is the global attention matrix, query chunks × key chunks. Each block is coloured by the
rank that computes it (the one holding its queries) and labelled with the ring step at which it does; the
blocks of the selected step are drawn solid and outlined, the others faded. Under a causal mask a block on
the diagonal is a triangle and a block above it is skipped (grey, no work at all). The right panel counts
the query-key pairs each rank scores (`lab.calc.cp.attention_work`), the selected step's share darker.
With a causal mask the contiguous layout leaves the last rank (2·cp−1)/cp times the mean; zig-zag brings
that to 1.

The chunk and block rules are `lab.calc.cp`'s, the torch-free description the code that really runs
(`lab.parallel.cp`, `lab.parallel.ring_attention`) also follows, so `import lab.widgets.cp` stays instant. A
sequence length the layout cannot cut shows their one-line error instead of the chart.
"""

from __future__ import annotations

import ipywidgets as widgets

from lab.calc.cp import LAYOUTS, attention_work, block_kind, block_work, check_sequence, chunk_ids, num_chunks
from lab.widgets.base import Explorer, show_figure

MIN_CP, MAX_CP = 2, 8
MAX_SEQ = 10_000_000  # tokens: beyond any context length in use
DEFAULT_SEQ = 1680  # divisible by 2·cp for every cp from 2 to 8: every choice of the controls is valid
SKIPPED = "#d9d9d9"


def source_rank(rank: int, step: int, cp: int) -> int:
    """The rank whose keys and values `rank` holds at ring `step`: (rank − step) mod cp."""
    return (rank - step) % cp


def ring_schedule(cp: int, layout: str, causal: bool = True) -> list[dict]:
    """Every (query chunk, key chunk) block of ring attention, in the order the ranks meet them:
    {"step", "rank" (computes it: holds the queries), "source" (whose K/V), "q", "k", "kind"}."""
    if not (isinstance(cp, int) and cp >= 1):
        raise ValueError(f"cp={cp!r} must be an integer >= 1")
    chunks = [chunk_ids(r, cp, layout) for r in range(cp)]
    return [{"step": step, "rank": rank, "source": source, "q": q, "k": k, "kind": block_kind(q, k, causal)}
            for step in range(cp) for rank in range(cp) for source in [source_rank(rank, step, cp)]
            for q in chunks[rank] for k in chunks[source]]


def rank_colours(cp: int) -> list:
    import matplotlib.pyplot as plt

    return [plt.get_cmap("tab10")(r % 10) for r in range(cp)]


def draw_kv_positions(holders: list[list[int]], chunks: list[list[int]], ax=None):
    """A steps × ranks grid: cell (step i, rank r) shows whose K/V rank r holds at step i (holders[i][r]),
    coloured by that rank, with the global chunks it carries."""
    import matplotlib.pyplot as plt

    steps, cp = len(holders), len(holders[0])
    ax = ax or plt.subplots(figsize=(1.5 * cp + 1, 0.55 * steps + 1))[1]
    colours = rank_colours(cp)
    for step, row in enumerate(holders):
        for rank, source in enumerate(row):
            ax.add_patch(plt.Rectangle((rank, step), 1, 1, facecolor=colours[source], alpha=0.55, edgecolor="white"))
            label = "chunk " + "+".join(map(str, chunks[source])) if len(chunks[source]) > 1 else (
                f"chunk {chunks[source][0]}")
            ax.text(rank + 0.5, step + 0.5, f"K/V of r{source}\n{label}", ha="center", va="center", fontsize=8)
    ax.set_xlim(0, cp)
    ax.set_ylim(steps, 0)
    ax.set_xticks([r + 0.5 for r in range(cp)], [f"rank {r}\nQ: chunk {'+'.join(map(str, chunks[r]))}"
                                                  for r in range(cp)], fontsize=8)
    ax.set_yticks([i + 0.5 for i in range(steps)], [f"step {i}" for i in range(steps)], fontsize=8)
    ax.tick_params(length=0)
    ax.set_title("whose keys and values each rank holds, step by step", fontsize=10)
    return ax


class RingAttentionExplorer(Explorer):
    """Controls on top; below them the attention matrix and the work per rank. `update()` redraws;
    tests read `summary.value`, `error.value`, `blocks`, `work`, `step_work` and `figure`."""

    def __init__(self, cp: int = 4, layout: str = "contiguous", causal: bool = True, step: int = 0,
                 seq: int = DEFAULT_SEQ) -> None:
        if not (isinstance(cp, int) and MIN_CP <= cp <= MAX_CP):
            raise ValueError(f"cp={cp!r} must be an integer from {MIN_CP} to {MAX_CP}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r} must be one of {', '.join(map(repr, LAYOUTS))}")
        if not (isinstance(step, int) and 0 <= step < cp):
            raise ValueError(f"step={step!r} must be an integer from 0 to cp-1 = {cp - 1}")
        wide, narrow = widgets.Layout(width="330px"), widgets.Layout(width="210px")
        super().__init__({
            "cp": widgets.IntSlider(value=cp, min=MIN_CP, max=MAX_CP, description="cp", continuous_update=False,
                                    layout=wide),
            "step": widgets.IntSlider(value=step, min=0, max=cp - 1, description="ring step",
                                      continuous_update=False, layout=wide),
            "layout": widgets.ToggleButtons(options=list(LAYOUTS), value=layout, description="layout",
                                            style={"button_width": "110px"}),
            "causal": widgets.Checkbox(value=causal, description="causal mask", layout=narrow),
            "seq": widgets.IntText(value=seq, description="seq (tokens)", layout=narrow,
                                   style={"description_width": "90px"}),
        })
        self.blocks: list[dict] | None = None
        self.work: list[int] | None = None
        self.step_work: list[int] | None = None
        self.figure = None
        c = self.controls  # two rows of controls above the (wide) figure
        rows = [widgets.HBox([c["cp"], c["step"]]), widgets.HBox([c["layout"], c["causal"], c["seq"]])]
        self.children = [*rows, self.plot, self.summary, self.error]
        self.update()

    def _on_change(self, change: dict) -> None:
        if change["owner"] is self.controls["cp"]:
            with self.batched():  # a lower max clamps the step, which would redraw once too often
                self.controls["step"].max = change["new"] - 1
        super()._on_change(change)

    def _validate(self, v: dict) -> str | None:
        seq = v["seq"]
        if not (isinstance(seq, int) and 1 <= seq <= MAX_SEQ):
            return f"seq={seq!r} must be an integer from 1 to {MAX_SEQ:,} (tokens)"
        try:
            check_sequence(seq, v["cp"], v["layout"])
        except ValueError as err:
            return str(err)
        return None

    def update(self) -> None:
        v = self.values()
        problem = self._validate(v)
        if problem:
            self.blocks = self.work = self.step_work = None
            self.show_error(problem)
            return
        cp, step = v["cp"], v["step"]
        chunk = v["seq"] // num_chunks(cp, v["layout"])
        self.blocks = ring_schedule(cp, v["layout"], v["causal"])
        self.work = attention_work(v["seq"], cp, v["layout"], v["causal"])
        self.step_work = [sum(block_work(b["kind"], chunk, chunk) for b in self.blocks
                              if b["step"] == step and b["rank"] == r) for r in range(cp)]
        self.error.value = ""
        self._draw(v, chunk)
        self._summarise(v, chunk)

    def _summarise(self, v: dict, chunk: int) -> None:
        cp, step = v["cp"], v["step"]
        mean = sum(self.work) / cp
        worst = max(range(cp), key=lambda r: self.work[r])
        held = ", ".join(f"rank {r} ← K/V of rank {source_rank(r, step, cp)} "
                         f"(chunk {'+'.join(map(str, chunk_ids(source_rank(r, step, cp), cp, v['layout'])))})"
                         for r in range(cp))
        skipped = sum(b["kind"] == "skip" for b in self.blocks)
        self.summary.value = (
            f'<p class="lab-cp-step"><b>step {step} of {cp - 1}:</b> {held}.</p>'
            f'<p class="lab-cp-balance"><b>max/mean work per rank: {max(self.work) / mean:.3f}</b> '
            f"(rank {worst} scores {max(self.work):,} query-key pairs, the mean is {mean:,.0f}; "
            f"this step: {', '.join(f'{w:,}' for w in self.step_work)}). "
            f"{len(self.blocks)} blocks of {chunk:,} × {chunk:,} tokens, {skipped} skipped by the mask.</p>")

    def _draw(self, v: dict, chunk: int) -> None:
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch


        cp, step, n = v["cp"], v["step"], num_chunks(v["cp"], v["layout"])
        colours = rank_colours(cp)
        fig, (matrix, bars) = plt.subplots(1, 2, figsize=(10.5, 4.6), gridspec_kw={"width_ratios": [1.15, 1]})
        owner = {b["q"]: b["rank"] for b in self.blocks}
        font = 9 if n <= 8 else 7
        for b in self.blocks:
            q, k, now = b["q"], b["k"], b["step"] == step
            edge = {"edgecolor": "black" if now else "white", "linewidth": 1.6 if now else 0.5}
            if b["kind"] == "skip":
                matrix.add_patch(plt.Rectangle((k, q), 1, 1, facecolor=SKIPPED, linestyle="--" if now else "-",
                                               **edge))
                continue
            colour, alpha = colours[b["rank"]], 1.0 if now else 0.25
            if b["kind"] == "diagonal":  # queries see keys up to their own position: the lower triangle
                matrix.add_patch(plt.Rectangle((k, q), 1, 1, facecolor=SKIPPED, edgecolor="white", linewidth=0.5))
                matrix.add_patch(plt.Polygon([(k, q), (k, q + 1), (k + 1, q + 1)], facecolor=colour, alpha=alpha,
                                             **edge))
                where = (k + 0.33, q + 0.7)
            else:
                matrix.add_patch(plt.Rectangle((k, q), 1, 1, facecolor=colour, alpha=alpha, **edge))
                where = (k + 0.5, q + 0.5)
            matrix.text(*where, str(b["step"]), ha="center", va="center", fontsize=font,
                        fontweight="bold" if now else "normal", color="black" if now else "#555555")
        matrix.set_xlim(0, n)
        matrix.set_ylim(n, 0)
        matrix.set_aspect("equal")
        ticks = [c + 0.5 for c in range(n)]
        matrix.set_xticks(ticks, [str(c) for c in range(n)], fontsize=font)
        matrix.set_yticks(ticks, [f"{c} (r{owner[c]})" for c in range(n)], fontsize=font)
        matrix.tick_params(length=0)
        matrix.set_xlabel(f"key chunk ({chunk:,} tokens each)")
        matrix.set_ylabel("query chunk (rank that holds it)")
        matrix.set_title(f"{v['layout']}, {'causal' if v['causal'] else 'no mask'}: step {step} of {cp - 1} "
                         f"solid (numbers = ring step)", fontsize=10)

        ranks = list(range(cp))
        bars.bar(ranks, self.work, color=colours, alpha=0.3)
        bars.bar(ranks, self.step_work, color=colours)
        mean = sum(self.work) / cp
        bars.axhline(mean, color="black", linestyle="--", linewidth=1)
        bars.set_ylim(0, 1.3 * max(self.work))
        bars.set_xticks(ranks, [f"rank {r}" for r in ranks], fontsize=8)
        bars.set_ylabel("query-key pairs scored")
        bars.set_title(f"work per rank: max/mean = {max(self.work) / mean:.2f}", fontsize=10)
        bars.legend(handles=[Patch(facecolor="grey", alpha=0.3, label="whole ring"),
                             Patch(facecolor="grey", label=f"at step {step}"),
                             Line2D([], [], color="black", linestyle="--", linewidth=1, label="mean")],
                    fontsize=8, loc="upper left", ncols=3)
        fig.tight_layout()
        self.figure = fig
        show_figure(self.plot, fig)


def ring_attention_explorer(cp: int = 4, layout: str = "contiguous", causal: bool = True, step: int = 0,
                            seq: int = DEFAULT_SEQ) -> RingAttentionExplorer:
    """The chapter 05 widget: ring attention's blocks, who computes them at which step, and the work per rank."""
    return RingAttentionExplorer(cp=cp, layout=layout, causal=causal, step=step, seq=seq)
