"""The memory calculator: what one GPU holds while training a model, for any layout you pick.

Every control feeds `lab.calc.memory.estimate_memory` (the same function the CLI, the exercises and the
tests use); the bar shows parameters, gradients, optimizer states and activations of the fullest GPU
against the chosen GPU's capacity. An invalid combination (tp=3 with 32 heads, ep without experts...) shows
the calculator's one-line error instead of the bar.
"""

from __future__ import annotations

import ipywidgets as widgets

from lab.calc.hardware import HARDWARE
from lab.calc.memory import ACTIVATION_MODELS, PRECISIONS, estimate_memory
from lab.config import PP_SCHEDULES, PRESETS, RECOMPUTE_MODES, ModelConfig, ParallelConfig
from lab.widgets.base import Explorer, show_figure

GiB = 2**30
PARTS = (("params", "#2e7d32"), ("grads", "#1565c0"), ("optimizer", "#f9a825"), ("activations", "#c62828"))
_POWERS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


class MemoryCalculator(Explorer):
    """Controls on the left, the per-GPU breakdown on the right. `update()` recomputes; tests read
    `summary.value`, `error.value` and `estimate`."""

    def __init__(self, model: str = "llama3-8b", seq: int = 4096) -> None:
        dropdown = lambda options, value, description: widgets.Dropdown(  # noqa: E731
            options=options, value=value, description=description, layout=widgets.Layout(width="210px"))
        super().__init__({
            "model": dropdown(list(PRESETS), model, "model"),
            "seq": widgets.SelectionSlider(options=[2**k for k in range(7, 18)], value=seq, description="seq",
                                           continuous_update=False),
            "mbs": widgets.IntSlider(value=1, min=1, max=32, description="micro-batch", continuous_update=False),
            "precision": dropdown(list(PRECISIONS), "mixed", "precision"),
            "fp32_grad_accum": widgets.Checkbox(value=False, description="fp32 grad accumulation"),
            "recompute": dropdown(list(RECOMPUTE_MODES), "none", "recompute"),
            "flash": widgets.Checkbox(value=False, description="flash attention"),
            "activation_model": dropdown(list(ACTIVATION_MODELS), "korthikanti", "activations"),
            "dp": dropdown(_POWERS, 1, "dp"),
            "zero": dropdown([0, 1, 2, 3], 0, "ZeRO"),
            "tp": dropdown(_POWERS[:8], 1, "tp"),
            "sp": widgets.Checkbox(value=False, description="sequence parallel"),
            "pp": dropdown(_POWERS[:8], 1, "pp"),
            "pp_schedule": dropdown(list(PP_SCHEDULES), "1f1b", "schedule"),
            "cp": dropdown(_POWERS[:8], 1, "cp"),
            "ep": dropdown(_POWERS[:9], 1, "ep"),
            "gpu": dropdown(list(HARDWARE), "h100", "GPU"),
        })
        self.estimate = None
        self.children = self.beside(list(self.controls.values()), width="340px")
        self.update()

    def update(self) -> None:
        v = self.values()
        try:
            cfg: ModelConfig = PRESETS[v["model"]]
            parallel = ParallelConfig(dp=v["dp"], zero=v["zero"], tp=v["tp"], sp=v["sp"], pp=v["pp"],
                                      pp_schedule=v["pp_schedule"], cp=v["cp"], ep=v["ep"], recompute=v["recompute"])
            self.estimate = estimate_memory(cfg, v["seq"], v["mbs"], parallel, precision=v["precision"],
                                            fp32_grad_accum=v["fp32_grad_accum"], flash=v["flash"],
                                            activation_model=v["activation_model"])
        except ValueError as err:
            self.estimate = None
            self.show_error(str(err))
            return
        self.error.value = ""
        self._draw(v)

    def _draw(self, v: dict) -> None:
        import matplotlib.pyplot as plt

        per_gpu, capacity = self.estimate.per_gpu, HARDWARE[v["gpu"]].memory_bytes
        total = per_gpu["total"]
        fits = self.estimate.headroom(capacity) >= 0
        fig, ax = plt.subplots(figsize=(6.5, 1.9))
        left = 0.0
        for part, colour in PARTS:
            ax.barh(0, per_gpu[part] / GiB, left=left, color=colour, label=f"{part} {per_gpu[part] / GiB:,.1f}")
            left += per_gpu[part] / GiB
        ax.axvline(capacity / GiB, color="black", linestyle="--", label=f"{v['gpu']} {capacity / GiB:.0f} GiB")
        ax.set_xlim(0, max(total, capacity) / GiB * 1.05)
        ax.set_yticks([])
        ax.set_xlabel("GiB per GPU")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncols=5, fontsize=8, frameon=False)
        show_figure(self.plot, fig)
        verdict = "fits" if fits else "does NOT fit"
        stage = f" (pipeline stage {self.estimate.stage}, the fullest)" if v["pp"] > 1 else ""
        self.summary.value = (
            f'<p class="lab-memory-total"><b>{total / GiB:,.1f} GiB</b> ({total / 1e9:,.1f} GB) per GPU{stage} '
            f"at seq {v['seq']:,} x micro-batch {v['mbs']}: "
            f"{verdict} in {capacity / GiB:.0f} GiB. Model: {_count(self.estimate.num_params)} parameters, "
            f"{_count(self.estimate.params_on_gpu)} on this GPU before ZeRO.</p>")


def _count(n: int) -> str:
    return f"{n / 1e9:,.2f} B" if n >= 1e9 else f"{n / 1e6:,.2f} M" if n >= 1e6 else f"{n:,}"


def memory_calculator(model: str = "llama3-8b", seq: int = 4096) -> MemoryCalculator:
    """The chapter 01 memory calculator widget."""
    return MemoryCalculator(model=model, seq=seq)
