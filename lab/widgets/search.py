"""The config explorer: the playbook's three-step procedure (its chapter "Finding the Best Training
Configuration") run by `lab.calc.search` as you type.

Pick a model preset, the cluster (GPUs, GPUs per node, the accelerator, whose network comes with it), the
sequence length and the global batch in tokens. The search enumerates every layout (dp with ZeRO 0-3, tp with
sp, pp with its schedule, cp, ep, recomputation, micro-batch and gradient accumulation), drops those that do
not fit or that lab.train does not run, models the step time of the others and ranks them by tokens/s.

The widget shows the ranked table (top N), the memory of each of those layouts on its fullest GPU
(parameters, gradients, optimizer states, activations, against the GPU's memory), the time split of the
selected one (compute, exposed communication by parallelism, pipeline bubble), and the families that no
layout of survived, with the reason. Changing only the selected layout or N redraws without searching again.

An input out of range shows one line naming it and the valid range instead of the results. Torch-free, like
`lab.calc`: a search of thousands of layouts takes about a second.
"""

from __future__ import annotations

import html

import ipywidgets as widgets

from lab.calc.hardware import HARDWARE
from lab.calc.network import SYSTEMS
from lab.calc.search import Candidate, SearchResult, search
from lab.config import PRESETS
from lab.widgets.base import Explorer, note, show_figure

GiB = 2**30
MAX_GPUS = 16_384  # the largest world the dry run builds; Llama 3 405B trained on 16,384 H100s
MAX_GPUS_PER_NODE = 72  # an NVL72 rack: the largest NVLink domain sold
MAX_SEQUENCES = 4096  # per global batch: Llama 3 405B's 16 M tokens are 2,048 sequences of 8,192
MAX_TOP = 20
MEMORY_PARTS = (("params", "#2e7d32"), ("grads", "#1565c0"), ("optimizer", "#f9a825"), ("activations", "#8e24aa"))
# the time split: compute, then each parallelism's exposed communication, then the bubble
TIME_PARTS = (("compute", "compute", "#43a047"), ("tp", "exposed TP", "#e53935"), ("cp", "exposed CP", "#fb8c00"),
              ("ep", "exposed EP", "#6d4c41"), ("pp", "exposed PP sends", "#8e24aa"),
              ("dp", "exposed DP/ZeRO", "#1e88e5"), ("bubble", "bubble", "#9e9e9e"))
# accelerators with a network in lab.calc.network: the search prices the collectives on it
HARDWARE_WITH_NETWORK = tuple(name for name in HARDWARE if name in SYSTEMS)


def _time_cell(c: Candidate) -> str:
    t = c.time
    return f"{t.total:,.3g} s ({t.compute:,.3g} / {t.comms:,.2g} / {t.bubble:,.2g})"


class ConfigExplorer(Explorer):
    """Controls on the left; on the right the chart (memory bars of the top layouts, the time split of the
    selected one), the summary, the ranked table and the rejected families. Tests read `result`,
    `selected`, `summary.value`, `table.value`, `rejected.value` and `error.value`."""

    def __init__(self, model: str = "llama3-8b", gpus: int = 8, gpus_per_node: int = 8, hardware: str = "h100",
                 seq: int = 4096, global_batch_tokens: int = 2**20, top: int = 10) -> None:
        wide = widgets.Layout(width="330px")
        style = {"description_width": "150px"}
        super().__init__({
            "model": widgets.Dropdown(options=list(PRESETS), value=model, description="model", layout=wide,
                                      style=style),
            "gpus": widgets.IntText(value=gpus, description="GPUs", layout=wide, style=style),
            "gpus_per_node": widgets.IntText(value=gpus_per_node, description="GPUs per node", layout=wide,
                                             style=style),
            "hardware": widgets.Dropdown(options=list(HARDWARE_WITH_NETWORK), value=hardware,
                                         description="hardware", layout=wide, style=style),
            "seq": widgets.IntText(value=seq, description="sequence (tokens)", layout=wide, style=style),
            "global_batch_tokens": widgets.IntText(value=global_batch_tokens, description="global batch (tokens)",
                                                   layout=wide, style=style),
            "top": widgets.IntSlider(value=top, min=1, max=MAX_TOP, description="top N", continuous_update=False,
                                     layout=wide, style=style),
            "layout": widgets.Dropdown(options=[], description="selected", layout=wide, style=style),
        })
        self.table, self.rejected = widgets.HTML(), widgets.HTML()
        self.result: SearchResult | None = None
        self.selected: Candidate | None = None
        self._searched: tuple | None = None  # the inputs `result` answers
        left = [*self.controls.values(),
                note("The search ranks every layout that fits by modelled tokens/s (lab.calc.search). Pick one "
                     "in <i>selected</i> to see where its step time goes.")]
        column = widgets.VBox(left, layout=widgets.Layout(width="350px", flex="0 0 auto"))
        self.children = [widgets.HBox([column, widgets.VBox([self.plot, self.summary, self.table, self.rejected,
                                                            self.error])])]
        self.update()

    def show_error(self, message: str) -> None:
        self.result = self.selected = None
        self._searched = None
        self.table.value = self.rejected.value = ""
        with self.batched():
            self.controls["layout"].options = []
        super().show_error(message)

    def _validate(self, v: dict) -> str | None:
        gpus, per_node, seq, tokens = v["gpus"], v["gpus_per_node"], v["seq"], v["global_batch_tokens"]
        if not 1 <= gpus <= MAX_GPUS:
            return f"GPUs={gpus} must be an integer from 1 to {MAX_GPUS:,}"
        if not 1 <= per_node <= MAX_GPUS_PER_NODE:
            return f"GPUs per node={per_node} must be an integer from 1 to {MAX_GPUS_PER_NODE}"
        max_seq = PRESETS[v["model"]].max_seq_len
        if not 1 <= seq <= max_seq:
            return f"sequence={seq} must be from 1 to {max_seq:,} tokens (max_seq_len of {v['model']})"
        if not seq <= tokens <= MAX_SEQUENCES * seq:
            return (f"global batch={tokens:,} tokens must be from {seq:,} to {MAX_SEQUENCES * seq:,} "
                    f"(1 to {MAX_SEQUENCES:,} sequences of {seq:,} tokens)")
        return None

    def update(self) -> None:
        v = self.values()
        problem = self._validate(v)
        if problem:
            self.show_error(problem)
            return
        key = tuple(v[name] for name in ("model", "gpus", "gpus_per_node", "hardware", "seq", "global_batch_tokens"))
        if key != self._searched:
            try:
                self.result = search(v["model"], v["gpus"], v["gpus_per_node"], v["hardware"], v["seq"],
                                     v["global_batch_tokens"])
            except ValueError as err:  # the search's own checks, e.g. GPUs not whole nodes
                self.show_error(str(err))
                return
            self._searched = key
            with self.batched():  # a new ranking: select its best layout
                self.controls["layout"].options = []
        top = self.result.top(v["top"])
        options = [(f"#{i + 1} {c.layout} · mbs {c.mbs}", i) for i, c in enumerate(top)]
        layout = self.controls["layout"]
        if list(layout.options) != options:
            with self.batched():
                chosen = layout.value if layout.value is not None and layout.value < len(top) else 0
                layout.options = options
                layout.value = chosen if options else None
        self.selected = top[layout.value] if top else None
        self.error.value = ""
        self._show(top, v)

    def _show(self, top: list[Candidate], v: dict) -> None:
        r = self.result
        capacity = HARDWARE[v["hardware"]].memory_bytes
        batch = f"{r.global_batch:,} sequences × {r.seq:,} = {r.tokens_per_step:,} tokens"
        if not top:
            self.plot.outputs = ()
            self.summary.value = (f'<p class="lab-search-best"><b>No layout of {r.model.name} fits {r.gpus} '
                                  f'{v["hardware"]} GPUs</b> with a global batch of {batch}: see why below.</p>')
            self.table.value = ""
        else:
            best, c = top[0], self.selected
            self.summary.value = (
                f'<p class="lab-search-best"><b>Best: {html.escape(best.layout)}, mbs {best.mbs} × grad-accum '
                f'{best.grad_accum}: {best.tokens_per_s:,.0f} tokens/s, MFU {best.mfu:.1%}</b> '
                f'({len(r.candidates):,} layouts fit of the {len(r.families):,} families enumerated; global batch '
                f'{batch}; searched in {r.elapsed_s:.2f} s). {r.ties} '
                f'{"layout ties" if r.ties == 1 else "layouts tie"} with it: their tokens/s ranges (the '
                f'calibration\'s spread) reach its {best.tokens_per_s_range[0]:,.0f}.</p>'
                f'<p class="lab-search-selected">Selected #{self.controls["layout"].value + 1} '
                f'{html.escape(c.layout)}: step {c.time.total:,.3g} s = compute {c.time.compute:,.3g} s + exposed '
                f'comms {c.time.comms:,.3g} s + bubble {c.time.bubble:,.3g} s; '
                f'{c.memory.per_gpu["total"] / GiB:,.1f} GiB of {capacity / GiB:,.0f} GiB on its fullest GPU.</p>')
            self.table.value = self._table(top, capacity)
            self._draw(top, capacity, v)
        self.rejected.value = self._rejected()

    def _table(self, top: list[Candidate], capacity: int) -> str:
        head = ("<tr><th>#</th><th>layout</th><th>mbs</th><th>grad-accum</th><th>memory (GiB)</th><th>MFU</th>"
                "<th>tokens/s</th><th>step (compute / comms / bubble)</th></tr>")
        rows = []
        for i, c in enumerate(top):
            style = ' style="background:#fff3c4;font-weight:bold"' if c is self.selected else ""
            rows.append(f"<tr{style}><td>{i + 1}</td><td>{html.escape(c.layout)}</td><td>{c.mbs}</td>"
                        f"<td>{c.grad_accum}</td><td>{c.memory.per_gpu['total'] / GiB:,.1f} / "
                        f"{capacity / GiB:,.0f}</td><td>{c.mfu:.1%}</td><td>{c.tokens_per_s:,.0f}</td>"
                        f"<td>{_time_cell(c)}</td></tr>")
        return (f'<table class="lab-search-table" style="font-size:85%"><thead>{head}</thead>'
                f'<tbody>{"".join(rows)}</tbody></table>')

    def _rejected(self) -> str:
        families = self.result.rejected_families()
        if not families:
            return '<p class="lab-search-rejected">Every family enumerated has a layout that fits.</p>'
        items = []
        for family, why in sorted(families.items(), key=lambda item: (-item[1].total, item[0])):
            reason, example = why.main_reason()
            items.append(f"<li><b>{html.escape(family)}</b>: {reason} ({why.total} layouts): "
                         f"{html.escape(example)}</li>")
        return (f'<details class="lab-search-rejected"><summary>{len(families)} '
                f'{"family" if len(families) == 1 else "families"} with no layout that fits or runs</summary>'
                f'<ul style="font-size:85%">{"".join(items)}</ul></details>')

    def _draw(self, top: list[Candidate], capacity: int, v: dict) -> None:
        import matplotlib.pyplot as plt

        fig, (mem, split) = plt.subplots(1, 2, figsize=(10, 1.8 + 0.25 * len(top)), width_ratios=(3, 2),
                                         layout="constrained")
        labels = [f"#{i + 1}" for i in range(len(top))]
        for i, c in enumerate(top):
            left = 0.0
            for part, colour in MEMORY_PARTS:
                width = c.memory.per_gpu[part] / GiB
                mem.barh(i, width, left=left, color=colour, label=part if i == 0 else None,
                         edgecolor="black" if c is self.selected else "none", linewidth=1.5)
                left += width
        mem.axvline(capacity / GiB, color="black", linestyle="--", linewidth=1,
                    label=f"{v['hardware']} {capacity / GiB:,.0f} GiB")
        mem.set_yticks(range(len(top)), labels, fontsize=8)
        mem.invert_yaxis()
        mem.set_xlabel("GiB on the fullest GPU (2³⁰ bytes)")
        mem.set_title("memory per layout", fontsize=10)

        t = self.selected.time.as_dict()
        left = 0.0
        for key, label, colour in TIME_PARTS:
            if t[key] > 0:
                split.barh(0, t[key], left=left, color=colour, label=f"{label} {t[key]:,.3g} s")
                left += t[key]
        split.set_yticks([])
        split.set_xlabel("seconds per step")
        split.set_title(f"#{self.controls['layout'].value + 1}: where the step goes", fontsize=10)
        handles = [h for ax in (mem, split) for h in ax.get_legend_handles_labels()[0]]
        fig.legend(handles=handles, fontsize=7, loc="outside lower center", ncol=6)
        show_figure(self.plot, fig)


def config_explorer(model: str = "llama3-8b", gpus: int = 8, gpus_per_node: int = 8, hardware: str = "h100",
                    seq: int = 4096, global_batch_tokens: int = 2**20, top: int = 10) -> ConfigExplorer:
    """The chapter 08 config explorer, opening on Llama 3 8B on one node of eight H100s, 1 M tokens a step."""
    return ConfigExplorer(model=model, gpus=gpus, gpus_per_node=gpus_per_node, hardware=hardware, seq=seq,
                          global_batch_tokens=global_batch_tokens, top=top)
