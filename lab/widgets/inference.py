"""The inference explorer: one decode step on a chip's roofline, moved by batch size and context length.

Every number comes from `lab.calc.inference`: `inference_roofline` at each batch of the sweep (the step's
arithmetic intensity, its memory time — weights and KV cache read once from HBM — its compute time at peak, the
step time and which roof the weight matmuls sit on, tokens/s), `prefill_time` for a prompt of the chosen length
(the compute-bound phase, at 100 % MFU so that both phases sit at their roofs) and `max_sequences` for how many
sequences of that length fit beside the weights.

The left chart is the decode step's time against the batch: the memory time barely moves at small batch (the
weights are read once whatever the batch) while the compute time grows in proportion. Reading the weights and
the weight matmuls (`decode_step`'s terms, dashed) cross at the critical batch; the KV cache, which every
sequence adds to the bytes and no batching amortises, keeps the whole step memory-bound at long contexts.
The right chart is what that buys: decode tokens/s grow with the batch until the weight matmuls turn
compute-bound, and only there approach the rate of prefill, which is compute-bound from the start. An input the
calculator refuses (a context longer than the model's, a tp that does not divide the model's heads) shows the
calculator's one line instead of the charts.
"""

from __future__ import annotations

import ipywidgets as widgets

from lab.calc.hardware import HARDWARE
from lab.calc.inference import (
    STORAGE_BYTES,
    DecodeStep,
    Prefill,
    decode_step,
    inference_roofline,
    max_sequences,
    prefill_time,
)
from lab.config import PRESETS
from lab.widgets.base import Explorer, check_choices, selection, show_figure

KV_DTYPES = ("bf16", "fp8", "int4")
BATCHES = [2**k for k in range(13)]  # 1 .. 4,096 sequences decoding together
CONTEXTS = [2**k for k in range(7, 18)]  # 128 .. 131,072 tokens of context per sequence
TPS = [1, 2, 4, 8, 16]
XLIM = (0.8, 5000)  # the batch axis, a little wider than BATCHES so that the end markers show whole


class InferenceExplorer(Explorer):
    """Controls on the left, the decode step against the batch on the right. `update()` recomputes; tests read
    `summary.value`, `error.value`, `step` (`inference_roofline` at the chosen batch), `sweep` (one per batch of
    `BATCHES`), `parts` (`decode_step` per batch: its weights and KV terms apart), `prefill` and `fit` (None while
    the error line shows)."""

    def __init__(self, model: str = "llama3-8b", hardware: str = "h100", batch: int = 1, context: int = 4096,
                 tp: int = 1, kv_dtype: str = "bf16") -> None:
        check_choices(("model", model, list(PRESETS)), ("hardware", hardware, list(HARDWARE)),
                      ("batch", batch, BATCHES), ("context", context, CONTEXTS), ("tp", tp, TPS),
                      ("kv_dtype", kv_dtype, KV_DTYPES))
        narrow = widgets.Layout(width="300px")
        super().__init__({
            "model": widgets.Dropdown(options=list(PRESETS), value=model, description="model", layout=narrow),
            "hardware": widgets.Dropdown(options=list(HARDWARE), value=hardware, description="chip", layout=narrow),
            "tp": widgets.Dropdown(options=TPS, value=tp, description="tp (chips)", layout=narrow),
            "kv_dtype": widgets.ToggleButtons(options=list(KV_DTYPES), value=kv_dtype, description="KV dtype",
                                              style={"button_width": "60px"}),
            "batch": selection(BATCHES, batch, "batch", narrow),
            "context": selection(CONTEXTS, context, "context", narrow),
        })
        self.step: dict | None = None
        self.sweep: list[dict] | None = None
        self.parts: list[DecodeStep] | None = None
        self.prefill: Prefill | None = None
        self.fit: int | None = None
        self.children = self.beside(list(self.controls.values()), width="330px")
        self.update()

    def update(self) -> None:
        v = self.values()
        kv_bytes = STORAGE_BYTES[v["kv_dtype"]]
        args = (v["model"], v["hardware"])
        try:
            self.sweep = [inference_roofline(*args, b, v["context"], v["tp"], kv_bytes) for b in BATCHES]
            self.parts = [decode_step(*args, b, v["context"], v["tp"], kv_bytes) for b in BATCHES]
            self.prefill = prefill_time(*args, v["context"], v["tp"], mfu=1.0)
            self.fit = max_sequences(*args, v["context"], v["tp"], kv_bytes)
        except ValueError as err:
            self.step = self.sweep = self.parts = self.prefill = self.fit = None
            self.show_error(str(err))
            return
        self.step = self.sweep[BATCHES.index(v["batch"])]
        self.error.value = ""
        self._draw(v)
        self._summarise(v)

    def _summarise(self, v: dict) -> None:
        s, chips = self.step, f"{v['tp']} x {v['hardware']}" if v["tp"] > 1 else v["hardware"]
        memory, compute = s["latency_bound_s"], s["compute_s"]
        binds = "memory" if memory >= compute else "compute"
        prefill_rate = self.prefill.tokens / self.prefill.time_s
        fits = f"{self.fit:,} sequences of {v['context']:,} tokens fit beside the weights in HBM"
        if v["batch"] > self.fit:
            fits += " (<b>this batch does NOT fit</b>)"
        self.summary.value = (
            f'<p class="lab-inference-step"><b>decode step ≥ {_ms(s["step_s"])}</b>: batch {v["batch"]:,} at '
            f"{v['context']:,} tokens of context on {chips} (KV in {v['kv_dtype']}). Memory time {_ms(memory)} "
            f"(weights + KV read once), compute time {_ms(compute)}: <b>{binds} binds</b>; the weight matmuls "
            f"are {s['bound']}-bound. Intensity <b>{s['intensity']:,.1f} FLOPs/byte</b> against the chip's "
            f"ridge {s['ridge']:,.0f}.</p>"
            f'<p class="lab-inference-rate"><b>{s["tokens_per_s"]:,.0f} tokens/s</b> '
            f"({s['tokens_per_s_per_chip']:,.0f} per chip, {1 / s['step_s']:,.1f} per sequence). Critical batch "
            f"{s['critical_batch']:,.0f}; {fits}.</p>"
            f'<p class="lab-inference-prefill">prefill of one {v["context"]:,}-token prompt: '
            f"{_ms(self.prefill.time_s)} at peak, {prefill_rate:,.0f} tokens/s: "
            f"{prefill_rate / s['tokens_per_s']:,.1f}x this decode rate.</p>")

    def _draw(self, v: dict) -> None:
        import matplotlib.pyplot as plt

        ms = lambda key: [row[key] * 1e3 for row in self.sweep]  # noqa: E731
        crit = self.step["critical_batch"]
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
        left.loglog(BATCHES, ms("latency_bound_s"), color="#1565c0", label="memory time (weights + KV)")
        left.loglog(BATCHES, ms("compute_s"), color="#c62828", label="compute time (at peak)")
        left.loglog(BATCHES, ms("step_s"), color="black", linewidth=2.2, alpha=0.6, label="step time")
        left.loglog(BATCHES, [p.weights_s * 1e3 for p in self.parts], color="#1565c0", linestyle="--",
                    label="  weights read")
        left.loglog(BATCHES, [p.linear_s * 1e3 for p in self.parts], color="#c62828", linestyle="--",
                    label="  weight matmuls")
        left.plot([v["batch"]], [self.step["step_s"] * 1e3], "o", color="black", zorder=3)
        left.set(xlabel="batch (sequences decoding together)", ylabel="ms per decode step",
                 title=f"{v['model']}, {v['context']:,} tokens of context", xlim=XLIM)
        right.loglog(BATCHES, [row["tokens_per_s"] for row in self.sweep], color="black", label="decode")
        right.axhline(self.prefill.tokens / self.prefill.time_s, color="#2e7d32", linestyle="--",
                      label="prefill (one prompt, at peak)")
        right.plot([v["batch"]], [self.step["tokens_per_s"]], "o", color="black", zorder=3)
        right.set(xlabel="batch (sequences decoding together)", ylabel="tokens/s (all chips)",
                  title=f"{v['tp']} x {HARDWARE[v['hardware']].name}", xlim=XLIM)
        for ax in (left, right):
            ax.axvline(crit, color="grey", linestyle=":", linewidth=1)
            if self.fit is not None and self.fit < BATCHES[-1]:
                ax.axvspan(max(self.fit, XLIM[0]), XLIM[1], color="grey", alpha=0.12, linewidth=0,
                           label="does not fit in HBM")
            ax.minorticks_off()
        left.legend(fontsize=7, loc="upper left")
        right.legend(fontsize=7, loc="lower right")
        left.text(crit, left.get_ylim()[0], f" critical batch {crit:,.0f}", fontsize=7, color="grey",
                  va="bottom", rotation=90)
        fig.tight_layout()
        show_figure(self.plot, fig)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:,.1f} µs"


def inference_explorer(model: str = "llama3-8b", hardware: str = "h100", batch: int = 1, context: int = 4096,
                       tp: int = 1, kv_dtype: str = "bf16") -> InferenceExplorer:
    """The chapter 11 widget: a decode step's bound and throughput against batch and context, beside prefill."""
    return InferenceExplorer(model=model, hardware=hardware, batch=batch, context=context, tp=tp, kv_dtype=kv_dtype)
