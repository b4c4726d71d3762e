"""Watch a real ring all-reduce, step by step.

`trace_ring_all_reduce(4)` runs `lab.collectives.ring_all_reduce` on 4 real ranks, where rank r's tensor is
filled with 2^r. Each chunk's value is then a bitmask of the ranks whose contributions it holds
(1 + 4 = 5 means "ranks 0 and 2"). `ring_steps(4)` draws the ranks x chunks grid after every step, with a
slider: during reduce-scatter each chunk collects one more rank per step; after W−1 steps every rank owns
one complete chunk; all-gather then copies the complete chunks around the ring.
"""

from __future__ import annotations

import ipywidgets as widgets

from lab.widgets.base import show_figure


def _traced_rank() -> list[tuple[str, int, list[int]]]:
    import torch
    import torch.distributed as dist

    from lab.collectives import ring_all_reduce

    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.full((world,), float(2**rank), dtype=torch.float64)
    states = [("start", 0, [int(v) for v in x.tolist()])]
    ring_all_reduce(x, on_step=lambda phase, step, chunks: states.append(
        (phase, step + 1, [int(c.item()) for c in chunks])))
    return states


def trace_ring_all_reduce(world_size: int = 4) -> list[dict]:
    """Per step: {"phase", "step", "masks": [rank][chunk] bitmask of contributing ranks}."""
    from lab.distributed import run

    if not 2 <= world_size <= 8:
        raise ValueError(f"world_size={world_size} must be between 2 and 8")
    per_rank = run(_traced_rank, world_size, timeout_s=60)
    return [{"phase": per_rank[0][i][0], "step": per_rank[0][i][1], "masks": [states[i][2] for states in per_rank]}
            for i in range(len(per_rank[0]))]


def _ranks_in(mask: int) -> list[int]:
    return [r for r in range(mask.bit_length()) if mask >> r & 1]


def draw_step(trace: list[dict], index: int, ax=None):
    """The ranks x chunks grid after step `index` of `trace`; darker = more contributions."""
    import matplotlib.pyplot as plt

    state = trace[index]
    masks = state["masks"]
    world = len(masks)
    ax = ax or plt.subplots(figsize=(1.3 * world + 1, 0.8 * world + 1))[1]
    counts = [[len(_ranks_in(m)) for m in row] for row in masks]
    ax.imshow(counts, cmap="Blues", vmin=0, vmax=world + 1)
    for r, row in enumerate(masks):
        for c, mask in enumerate(row):
            label = "+".join(map(str, _ranks_in(mask))) if len(_ranks_in(mask)) < world else "all"
            ax.text(c, r, label, ha="center", va="center", fontsize=10,
                    color="white" if counts[r][c] == world else "black")
    ax.set_xticks(range(world), [f"chunk {c}" for c in range(world)])
    ax.set_yticks(range(world), [f"rank {r}" for r in range(world)])
    title = "start: every rank holds only its own data" if state["phase"] == "start" else (
        f"{state['phase']} step {state['step']} of {world - 1}")
    ax.set_title(title, fontsize=10)
    return ax


def ring_steps(world_size: int = 4) -> widgets.VBox:
    """A slider over the 2(W−1) steps of a real ring all-reduce on `world_size` ranks."""
    import matplotlib.pyplot as plt

    trace = trace_ring_all_reduce(world_size)
    slider = widgets.IntSlider(value=0, min=0, max=len(trace) - 1, description="step", continuous_update=False)
    output = widgets.Output()

    def show(index: int) -> None:
        fig, ax = plt.subplots(figsize=(1.3 * world_size + 1, 0.8 * world_size + 1))
        draw_step(trace, index, ax)
        show_figure(output, fig)

    slider.observe(lambda change: show(change["new"]), names="value")
    show(0)
    box = widgets.VBox([slider, output])
    box.trace, box.slider = trace, slider
    return box
