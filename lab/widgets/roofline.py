"""The roofline explorer: the ops of one Llama block on a chip's roofline, moved by batch, sequence and dtype.

Every point is an op of `lab.calc.roofline.llama_block_ops` (one kernel each, reading its inputs from HBM and
writing its output back) at its arithmetic intensity and the FLOP/s the roofline allows it there; the line is
min(peak, intensity x HBM bandwidth) of the chosen chip and dtype, bending at the ridge point. More tokens
(batch x seq) push the projections right, past the ridge; the norms, RoPE, SwiGLU and residual adds stay at
about one FLOP per byte whatever the size. Switching attention from "naive" (scores written, softmaxed, read
back) to "flash" (one kernel) replaces three memory-bound points by one compute-bound one. The summary gives
the time lower bound of each op, max(FLOPs / peak, bytes / bandwidth), and which ops are memory-bound. A dtype
the chip has no peak for (fp8 on an A100) shows one line instead of the chart.
"""

from __future__ import annotations

import ipywidgets as widgets

from lab.calc.hardware import HARDWARE
from lab.calc.roofline import ATTENTION_CORES, Placement, llama_block_ops, peak_flops, place, ridge_point
from lab.config import PRESETS
from lab.widgets.base import Explorer, check_choices, selection, show_figure

MODELS = [name for name, cfg in PRESETS.items() if cfg.attention == "gqa" and not cfg.is_moe]  # Llama blocks
DTYPES = ("bf16", "fp16", "fp8")
BATCHES = [2**k for k in range(11)]
SEQS = [2**k for k in range(0, 18)]
KIND_COLOURS = {"matmul": "#1565c0", "elementwise": "#c62828"}


class RooflineExplorer(Explorer):
    """Controls on the left, the roofline with the block's ops on the right. `update()` recomputes; tests read
    `summary.value`, `error.value` and `placements` (None while the error line shows)."""

    def __init__(self, model: str = "llama3-8b", gpu: str = "h100", dtype: str = "bf16", batch: int = 1,
                 seq: int = 4096, attention: str = "naive") -> None:
        check_choices(("model", model, MODELS), ("gpu", gpu, list(HARDWARE)), ("dtype", dtype, DTYPES),
                      ("batch", batch, BATCHES), ("seq", seq, SEQS),
                      ("attention", attention, ATTENTION_CORES))
        narrow = widgets.Layout(width="300px")
        super().__init__({
            "model": widgets.Dropdown(options=MODELS, value=model, description="model", layout=narrow),
            "gpu": widgets.Dropdown(options=list(HARDWARE), value=gpu, description="device", layout=narrow),
            "dtype": widgets.ToggleButtons(options=list(DTYPES), value=dtype, description="dtype",
                                           style={"button_width": "60px"}),
            "batch": selection(BATCHES, batch, "batch", narrow),
            "seq": selection(SEQS, seq, "seq (tokens)", narrow),
            "attention": widgets.ToggleButtons(options=list(ATTENTION_CORES), value=attention,
                                               description="attention", style={"button_width": "80px"}),
        })
        self.placements: list[Placement] | None = None
        self.children = self.beside(list(self.controls.values()), width="330px")
        self.update()

    def update(self) -> None:
        v = self.values()
        try:
            ops = llama_block_ops(PRESETS[v["model"]], v["batch"], v["seq"], v["dtype"], v["attention"])
            self.placements = [place(op, v["gpu"], v["dtype"]) for op in ops]
        except ValueError as err:
            self.placements = None
            self.show_error(str(err))
            return
        self.error.value = ""
        self._draw(v)
        self._summarise(v)

    def _summarise(self, v: dict) -> None:
        total = sum(p.time_s for p in self.placements)
        memory = [p for p in self.placements if p.bound == "memory"]
        share = sum(p.time_s for p in memory) / total
        per_op = ", ".join(f"{p.op.name} {_us(p.time_s)}{'*' if p.bound == 'memory' else ''}"
                           for p in self.placements)
        self.summary.value = (
            f'<p class="lab-roofline-total"><b>block forward ≥ {_us(total)}</b> on {v["gpu"]} in {v["dtype"]} '
            f"({v['batch']} x {v['seq']:,} tokens, {v['attention']} attention; ridge "
            f"{ridge_point(v['gpu'], v['dtype']):,.0f} FLOPs/byte). <b>{len(memory)} of {len(self.placements)} "
            f"ops memory-bound</b>, {share:.0%} of the time: {', '.join(p.op.name for p in memory) or 'none'}.</p>"
            f'<p class="lab-roofline-ops">time lower bound per op (* memory-bound): {per_op}.</p>')

    def _draw(self, v: dict) -> None:
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter

        chip = HARDWARE[v["gpu"]]
        peak, ridge = peak_flops(chip, v["dtype"]), ridge_point(chip, v["dtype"])
        xs = [p.op.intensity for p in self.placements]
        low, high = min(min(xs), ridge) / 10, max(max(xs), ridge) * 4
        fig, ax = plt.subplots(figsize=(7, 4.4))
        ax.plot([low, ridge, high], [low * chip.hbm_bandwidth / 1e12, peak / 1e12, peak / 1e12], color="black",
                linewidth=1.5, label=f"{chip.name}, {v['dtype']}")
        ax.axvline(ridge, color="grey", linestyle=":", linewidth=1)
        ax.text(ridge, peak / 1e12 * 1.15, f"ridge {ridge:,.0f}", ha="center", fontsize=8, color="grey")
        for kind, colour in KIND_COLOURS.items():
            mine = [p for p in self.placements if p.op.kind == kind]
            ax.scatter([p.op.intensity for p in mine], [p.attainable / 1e12 for p in mine], color=colour, s=30,
                       zorder=3, label=kind)
        for i, group in enumerate(_neighbours(self.placements)):  # one label per cluster of nearby points
            x, y = group[0].op.intensity, group[0].attainable / 1e12
            on_slope = group[0].bound == "memory"
            ax.annotate("\n".join(p.op.name for p in group), (x, y), fontsize=7, textcoords="offset points",
                        xytext=(-6, 6) if on_slope else (6 - 40 * (i % 2), -8),
                        ha="right" if on_slope else "left", va="bottom" if on_slope else "top")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.minorticks_off()  # a log axis draws ~9 minor ticks a decade: most of the redraw's time
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.set_xlim(low, high)
        ax.set_ylim(low * chip.hbm_bandwidth / 1e12, peak / 1e12 * 2)
        ax.set_xlabel("arithmetic intensity (FLOPs / HBM byte)")
        ax.set_ylabel("attainable TFLOP/s")
        ax.set_title(f"{v['model']} block, {v['batch']} x {v['seq']:,} tokens, {v['attention']} attention",
                     fontsize=10)
        ax.legend(loc="lower right", fontsize=8)
        show_figure(self.plot, fig)


def _neighbours(placements: list[Placement], factor: float = 1.3) -> list[list[Placement]]:
    """Placements sorted by intensity, cut where the next is more than `factor` times further right."""
    ordered = sorted(placements, key=lambda p: p.op.intensity)
    groups = [[ordered[0]]]
    for p in ordered[1:]:
        if p.op.intensity > groups[-1][-1].op.intensity * factor or p.bound != groups[-1][-1].bound:
            groups.append([])
        groups[-1].append(p)
    return groups


def _us(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:,.1f} µs"


def roofline_explorer(model: str = "llama3-8b", gpu: str = "h100", dtype: str = "bf16", batch: int = 1,
                      seq: int = 4096, attention: str = "naive") -> RooflineExplorer:
    """The chapter 09 roofline widget."""
    return RooflineExplorer(model=model, gpu=gpu, dtype=dtype, batch=batch, seq=seq, attention=attention)
