"""The TP/SP explorer: what tensor (and sequence) parallelism saves in memory and costs in communication.

Pick a model, the TP degree, the sequence length, the micro-batch, sequence parallelism on or off and a GPU
system. For every tp from 1 to 64 the left panel shows one layer's activations per GPU (Korthikanti et al.
2022, 16-bit, attention's s² scores left out as with FlashAttention: `lab.calc.memory.korthikanti_layer_bytes`)
and weights per GPU; the right panel T_comm / T_math of a TP MLP (`lab.calc.sharding.tp_comm_to_compute`) over
NVLink inside a node and over the NICs beyond it, and the arithmetic intensity of each GPU's column matmul
(`lab.calc.roofline.tp_mlp_matmuls`) against the chip's ridge point. The summary gives the chosen tp's numbers.

It opens on Llama 3 70B at tp = 8, 8k tokens, with SP on DGX H100 nodes: the Scaling Book's bound says an
MLP of F = 28,672 stays compute-bound to tp ≈ 13 on NVLink, and to tp ≈ 1.4 on a 400 Gb/s NIC.
A value out of range shows one line naming it instead of the chart.
"""

from __future__ import annotations

import ipywidgets as widgets

from lab.calc import sharding
from lab.calc.hardware import HARDWARE
from lab.calc.memory import korthikanti_layer_bytes
from lab.calc.network import SYSTEMS
from lab.calc.roofline import ridge_point, tp_mlp_matmuls
from lab.config import PRESETS
from lab.layout import tp_problem
from lab.widgets.base import Explorer, selection, show_figure

GB = 1e9
TPS = (1, 2, 4, 8, 16, 32, 64)
SEQS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
MODELS = [name for name, cfg in PRESETS.items() if cfg.attention == "gqa" and not cfg.is_moe]
GPUS = [name for name in SYSTEMS if name in HARDWARE]  # systems with a chip in the hardware table
MAX_BATCH = 1024


def layer_numbers(model: str, tp: int, seq: int, batch: int, sp: bool, gpu: str) -> dict[str, float]:
    """One layer of `model` on one GPU at this tp: activation and weight bytes, bytes TP sends (forward and
    backward), T_comm/T_math of its MLP (NVLink while tp fits in a node, the NIC beyond) and the intensity of
    its column matmul."""
    cfg, system, chip = PRESETS[model], SYSTEMS[gpu], HARDWARE[gpu]
    link = system.intra if tp <= system.gpus_per_node else system.nic
    attention = 2 * cfg.n_heads * cfg.head_dim * cfg.d_model / tp  # wq and wo, split by heads
    weights = 2 * (attention + 3 * cfg.d_model * cfg.d_ff / tp) \
        + sharding.kv_weight_bytes(cfg.d_model, cfg.n_kv_heads, cfg.head_dim, tp)
    return {"activations": korthikanti_layer_bytes(seq, batch, cfg.d_model, cfg.n_heads, tp=tp, sp=sp and tp > 1,
                                                   flash=True),
            "weights": weights,
            "sent": sharding.tp_layer_comm_bytes(batch, seq, cfg.d_model, tp),
            "comm_to_compute": sharding.tp_comm_to_compute(cfg.d_ff, tp, chip.bf16_flops, link.bandwidth),
            "intensity": tp_mlp_matmuls(batch * seq, cfg.d_model, cfg.d_ff, tp)[0].intensity}


def _fits(model: str, tp: int) -> str | None:
    """Why `tp` cannot split `model` (lab.layout's rules, which lab.parallel.tp applies), or None."""
    cfg = PRESETS[model]
    return tp_problem(tp, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff, cfg.vocab_size, of=model)


class TPExplorer(Explorer):
    """Controls on the left, memory and communication against tp on the right. Tests read `summary.value`,
    `error.value` and `numbers` (the chosen tp's `layer_numbers`, None on bad input)."""

    def __init__(self, model: str = "llama3-70b", tp: int = 8, seq: int = 8192, batch: int = 1, sp: bool = True,
                 gpu: str = "h100") -> None:
        layout = widgets.Layout(width="300px")
        super().__init__({
            "model": widgets.Dropdown(options=MODELS, value=model, description="model", layout=layout),
            "tp": selection(list(TPS), tp, "tp", layout),
            "seq": selection(list(SEQS), seq, "sequence", layout),
            "batch": widgets.IntText(value=batch, description="micro-batch", layout=layout),
            "sp": widgets.Checkbox(value=sp, description="sequence parallelism"),
            "gpu": widgets.Dropdown(options=GPUS, value=gpu, description="GPUs", layout=layout),
        })
        self.numbers: dict[str, float] | None = None
        self.children = self.beside(list(self.controls.values()), width="340px")
        self.update()

    def update(self) -> None:
        v = self.values()
        problem = _fits(v["model"], v["tp"])
        if not 1 <= v["batch"] <= MAX_BATCH:
            problem = f"micro-batch={v['batch']!r} must be an integer from 1 to {MAX_BATCH}"
        if problem:
            self.numbers = None
            self.show_error(problem)
            return
        self.numbers = layer_numbers(v["model"], v["tp"], v["seq"], v["batch"], v["sp"], v["gpu"])
        self.error.value = ""
        self._draw(v)

    def _draw(self, v: dict) -> None:
        import matplotlib.pyplot as plt

        tps = [t for t in TPS if _fits(v["model"], t) is None]
        rows = [layer_numbers(v["model"], t, v["seq"], v["batch"], v["sp"], v["gpu"]) for t in tps]
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.3))
        left.plot(tps, [r["activations"] / GB for r in rows], "o-", label="activations (SP)" if v["sp"] else
                  "activations (TP only)")
        left.plot(tps, [r["weights"] / GB for r in rows], "s--", label="bf16 weights")
        left.set(ylabel="GB per GPU, one layer", title=f"{v['model']}, s = {v['seq']:,}, b = {v['batch']}")
        right.plot(tps, [r["comm_to_compute"] for r in rows], "o-", color="C3", label="T_comm / T_math (MLP)")
        right.axhline(1, color="C3", linestyle=":", linewidth=1)
        right.set_yscale("log")
        twin = right.twinx()
        twin.plot(tps, [r["intensity"] for r in rows], "s--", color="C2", label="column matmul FLOPs/byte")
        twin.axhline(ridge_point(v["gpu"]), color="C2", linestyle=":", linewidth=1)
        twin.set_ylabel("FLOPs / byte", color="C2")
        right.set(ylabel="comm / compute", title=f"{SYSTEMS[v['gpu']].name}: NVLink to "
                                                   f"{SYSTEMS[v['gpu']].gpus_per_node}, NICs beyond")
        for ax in (left, right):
            ax.set_xscale("log", base=2)
            ax.set_xticks(tps, tps)
            ax.minorticks_off()
            ax.set_xlabel("tp")
            ax.axvline(v["tp"], color="gray", alpha=0.4, linewidth=6)
            ax.legend(fontsize=8, loc="upper left" if ax is right else "upper right")
        twin.legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        show_figure(self.plot, fig)
        n, cfg, chip = self.numbers, PRESETS[v["model"]], HARDWARE[v["gpu"]]
        bound = sharding.tp_max_degree(cfg.d_ff, chip.bf16_flops, SYSTEMS[v["gpu"]].intra.bandwidth)
        self.summary.value = (
            f'<p class="lab-tp-summary"><b>tp = {v["tp"]}: {n["activations"] / GB:,.2f} GB of activations and '
            f'{n["weights"] / GB:,.2f} GB of weights per GPU and layer</b>; TP sends {n["sent"] / GB:,.2f} GB per '
            f'GPU and layer (forward + backward), its MLP all-reduce takes {n["comm_to_compute"]:.2f}× its matmuls; '
            f'each GPU\'s column matmul does {n["intensity"]:,.0f} FLOPs/byte (ridge {ridge_point(v["gpu"]):,.0f}). '
            f"TP stays compute-bound on NVLink up to tp ≈ {bound:.1f} (F·W/C).</p>")


def tp_explorer(model: str = "llama3-70b", tp: int = 8, seq: int = 8192, batch: int = 1, sp: bool = True,
                gpu: str = "h100") -> TPExplorer:
    """The chapter 04 TP/SP explorer, opening on Llama 3 70B at tp = 8 on DGX H100 nodes."""
    return TPExplorer(model=model, tp=tp, seq=seq, batch=batch, sp=sp, gpu=gpu)
