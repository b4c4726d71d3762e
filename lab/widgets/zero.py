"""The ZeRO memory ladder: what one GPU holds under each ZeRO stage, and what each stage puts on the wire.

Pick a model size Ψ (any number of parameters, or a preset's exact count), the number of data-parallel
ranks N_d and a stage: the bars show parameters, gradients and optimizer states per GPU for stages 0-3 side
by side, from `lab.calc.memory.static_bytes` — 2Ψ + 2Ψ + KΨ with K = 12 in mixed precision, each term
divided by N_d from the stage that shards it on. The summary adds the bytes each rank sends per step
(`lab.calc.comms`): an all-reduce of the gradients for stages 0-2 (a reduce-scatter + an all-gather is the
same volume), one more all-gather of the parameters for stage 3.

It opens on the ZeRO paper's example (Rajbhandari et al. 2020, Figure 1): Ψ = 7.5 B, N_d = 64, giving
120 / 31.4 / 16.6 / 1.9 GB. A value out of range shows one line naming it instead of the chart.
"""

from __future__ import annotations

import math

import ipywidgets as widgets

from lab.calc.comms import bus_factor
from lab.calc.hardware import HARDWARE
from lab.calc.memory import PRECISIONS, static_bytes
from lab.calc.params import count_params
from lab.config import PRESETS
from lab.widgets.base import Explorer, show_figure

GB = 1e9  # the ZeRO paper's unit: decimal gigabytes
PAPER = "ZeRO paper example (7.5 B)"
PARTS = (("params", "#2e7d32"), ("grads", "#1565c0"), ("optimizer", "#f9a825"))
STAGES = (0, 1, 2, 3)
STAGE_NAMES = {0: "DP", 1: "ZeRO-1 (P_os)", 2: "ZeRO-2 (P_os+g)", 3: "ZeRO-3 (P_os+g+p)"}
MAX_PARAMS_B, MAX_DP = 100_000.0, 1 << 20  # 100 T parameters, a million ranks: beyond any real job


def ladder(num_params: int, dp: int, precision: str = "mixed", fp32_grad_accum: bool = False) -> dict[int, dict]:
    """Bytes per GPU for every stage: {stage: {"params", "grads", "optimizer", "total"}}."""
    rows = {}
    for stage in STAGES:
        parts = static_bytes(num_params, precision, zero=stage, dp=dp, fp32_grad_accum=fp32_grad_accum)
        rows[stage] = {**parts, "total": sum(parts.values())}
    return rows


def sent_per_rank(num_params: int, dp: int, stage: int, precision: str = "mixed") -> float:
    """Bytes one rank sends per step on a ring: 2Ψ·(N_d−1)/N_d of 16-bit gradients for stages 0-2, 3Ψ for
    stage 3 (the parameters are all-gathered twice: before forward and before backward)."""
    weight_bytes, grad_bytes, _ = (b * num_params for b in PRECISIONS[precision])
    volume = bus_factor("all_reduce", dp) * grad_bytes  # = reduce-scatter + all-gather, the same bytes
    return volume + (bus_factor("all_gather", dp) * weight_bytes if stage == 3 else 0.0)


class ZeroLadder(Explorer):
    """Controls on the left, the four stages' bars on the right (the chosen stage outlined). `update()`
    recomputes; tests read `summary.value`, `error.value`, `rows` and `num_params`."""

    def __init__(self, params_b: float = 7.5, dp: int = 64, stage: int = 3, precision: str = "mixed") -> None:
        layout = widgets.Layout(width="300px")
        super().__init__({
            "model": widgets.Dropdown(options=[PAPER, *PRESETS], value=PAPER, description="model", layout=layout),
            "params_b": widgets.FloatText(value=params_b, description="Ψ (billions)", layout=layout,
                                          style={"description_width": "90px"}),
            "dp": widgets.IntText(value=dp, description="N_d (dp)", layout=layout),
            "stage": widgets.ToggleButtons(options=list(STAGES), value=stage, description="ZeRO stage",
                                           style={"button_width": "40px"}),
            "precision": widgets.Dropdown(options=list(PRECISIONS), value=precision, description="precision",
                                          layout=layout),
            "fp32_grad_accum": widgets.Checkbox(value=False, description="fp32 grad accumulation"),
            "gpu": widgets.Dropdown(options=list(HARDWARE), value="h100", description="GPU", layout=layout),
        })
        self.rows: dict[int, dict] | None = None
        self.num_params = 0
        self.children = self.beside(list(self.controls.values()), width="360px")
        self.update()

    def _on_change(self, change: dict) -> None:
        """A preset writes its exact parameter count into Ψ (which triggers `update`); other controls redraw."""
        if change["owner"] is not self.controls["model"]:
            super()._on_change(change)
        elif change["new"] != PAPER:
            self.controls["params_b"].value = count_params(PRESETS[change["new"]]) / 1e9

    def _validate(self, v: dict) -> str | None:
        params_b, dp = v["params_b"], v["dp"]
        if not (math.isfinite(params_b) and 0 < params_b <= MAX_PARAMS_B):
            return f"Ψ={params_b!r} billion parameters must be a number in (0, {MAX_PARAMS_B:,.0f}]"
        if not 1 <= dp <= MAX_DP:
            return f"N_d={dp!r} must be an integer from 1 to {MAX_DP:,} (the number of data-parallel ranks)"
        if v["fp32_grad_accum"] and v["precision"] != "mixed":
            return f"fp32 grad accumulation needs precision='mixed' (got precision={v['precision']!r})"
        return None

    def update(self) -> None:
        v = self.values()
        problem = self._validate(v)
        if problem:
            self.rows, self.num_params = None, 0
            self.show_error(problem)
            return
        self.num_params = round(v["params_b"] * 1e9)
        self.rows = ladder(self.num_params, v["dp"], v["precision"], v["fp32_grad_accum"])
        self.error.value = ""
        self._draw(v)

    def _draw(self, v: dict) -> None:
        import matplotlib.pyplot as plt

        capacity = HARDWARE[v["gpu"]].memory_bytes
        fig, ax = plt.subplots(figsize=(6.5, 3.0))
        for stage, row in self.rows.items():
            bottom = 0.0
            for part, colour in PARTS:
                ax.bar(stage, row[part] / GB, bottom=bottom, color=colour, label=part if stage == 0 else None,
                       edgecolor="black" if stage == v["stage"] else "none", linewidth=1.5)
                bottom += row[part] / GB
            ax.text(stage, bottom, f"{bottom:,.1f}", ha="center", va="bottom", fontsize=9)
        ax.axhline(capacity / GB, color="black", linestyle="--", linewidth=1,
                   label=f"{v['gpu']} {capacity / 2**30:,.0f} GiB = {capacity / GB:,.1f} GB")
        ax.set_xticks(list(STAGES), [STAGE_NAMES[s] for s in STAGES], fontsize=8)
        ax.set_ylabel("GB per GPU (10⁹ bytes)")
        ax.set_title(f"Ψ = {self.num_params / 1e9:,.3g} B parameters, N_d = {v['dp']}", fontsize=10)
        ax.legend(fontsize=8, loc="upper right")
        show_figure(self.plot, fig)
        row, stage = self.rows[v["stage"]], v["stage"]
        fits = "fits" if row["total"] <= capacity else "does NOT fit"
        ratio = "3Ψ" if stage == 3 else "2Ψ"
        width = PRECISIONS[v["precision"]][1]
        self.summary.value = (
            f'<p class="lab-zero-total"><b>{STAGE_NAMES[stage]}: {row["total"] / GB:,.2f} GB per GPU</b> '
            f'(params {row["params"] / GB:,.2f} + grads {row["grads"] / GB:,.2f} + optimizer '
            f'{row["optimizer"] / GB:,.2f}), {fits} in one {v["gpu"]} ({capacity / GB:,.1f} GB) before activations; '
            f"{self.rows[0]['total'] / row['total']:,.1f}x less than plain DP. Each rank sends "
            f"{sent_per_rank(self.num_params, v['dp'], stage, v['precision']) / GB:,.2f} GB per step "
            f"({ratio}·(N_d−1)/N_d values of {width} bytes).</p>")


def zero_ladder(params_b: float = 7.5, dp: int = 64, stage: int = 3, precision: str = "mixed") -> ZeroLadder:
    """The chapter 03 ZeRO memory-ladder widget, opening on the ZeRO paper's 7.5 B / 64-GPU example."""
    return ZeroLadder(params_b=params_b, dp=dp, stage=stage, precision=precision)
