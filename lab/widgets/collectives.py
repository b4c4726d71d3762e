"""Pictures of collectives: what every rank holds before and after, from a real run on real ranks.

`run_collective("all_gather", 4)` runs torch's version and `lab.collectives`' on 4 ranks, with small
integer tensors that make the data movement easy to follow (rank r holds r·10 + 0, 1, 2, ...), and
returns every rank's tensors before and after each. `draw_collective` draws them side by side.
"""

from __future__ import annotations

COLLECTIVES = ("broadcast", "reduce", "all_reduce", "gather", "all_gather", "scatter", "reduce_scatter",
               "all_to_all")


def _collective_rank(name: str, numel: int) -> dict:
    import torch
    import torch.distributed as dist

    from lab import collectives as lc
    from lab.distributed import all_gather_single, reduce_scatter_single

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.arange(numel, dtype=torch.float32) + 10 * rank
    if name in ("broadcast", "reduce", "all_reduce"):
        before, ours, theirs = mine, mine.clone(), mine.clone()
        {"broadcast": lambda: (lc.tree_broadcast(ours, 0), dist.broadcast(theirs, 0)),
         "reduce": lambda: (lc.tree_reduce(ours, 0), dist.reduce(theirs, 0)),
         "all_reduce": lambda: (lc.ring_all_reduce(ours), dist.all_reduce(theirs))}[name]()
        if name == "reduce" and rank != 0:  # only the destination's result is defined
            ours = theirs = torch.full_like(mine, float("nan"))
    elif name == "gather":
        before = mine
        lists = ([torch.empty(numel) for _ in range(world)] for _ in range(2))
        ours_list, theirs_list = lists
        lc.gather(mine, ours_list if rank == 0 else None, dst=0)
        dist.gather(mine, theirs_list if rank == 0 else None, dst=0)
        ours = torch.cat(ours_list) if rank == 0 else torch.full((world * numel,), float("nan"))
        theirs = torch.cat(theirs_list) if rank == 0 else ours
    elif name == "all_gather":
        before, ours, theirs = mine, torch.empty(world * numel), torch.empty(world * numel)
        lc.ring_all_gather(ours, mine)
        all_gather_single(theirs, mine)
    elif name == "scatter":
        full = torch.arange(world * numel, dtype=torch.float32)
        before = full if rank == 0 else torch.full((world * numel,), float("nan"))
        pieces = list(full.chunk(world)) if rank == 0 else None
        ours, theirs = torch.empty(numel), torch.empty(numel)
        lc.scatter(ours, pieces, src=0)
        dist.scatter(theirs, pieces, src=0)
    elif name == "reduce_scatter":
        before = torch.arange(world * numel, dtype=torch.float32) + 100 * rank
        ours, theirs = torch.empty(numel), torch.empty(numel)
        lc.ring_reduce_scatter(ours, before)
        reduce_scatter_single(theirs, before)
    elif name == "all_to_all":
        before = torch.arange(world * numel, dtype=torch.float32) + 100 * rank
        ours, theirs = torch.empty(world * numel), torch.empty(world * numel)
        lc.all_to_all(list(ours.chunk(world)), list(before.chunk(world)))
        dist.all_to_all_single(theirs, before)
    else:
        raise ValueError(f"name={name!r} must be one of {', '.join(COLLECTIVES)}")
    return {"before": before.tolist(), "lab": ours.tolist(), "torch": theirs.tolist()}


def run_collective(name: str, world_size: int = 4, numel: int = 2) -> list[dict]:
    """Every rank's {"before", "lab", "torch"} tensors (as lists) for collective `name`."""
    from lab.distributed import run

    if name not in COLLECTIVES:
        raise ValueError(f"name={name!r} must be one of {', '.join(COLLECTIVES)}")
    return run(_collective_rank, world_size, name, numel, timeout_s=60)


def draw_collective(name: str, per_rank: list[dict], ax=None):
    """Two panels: what each rank holds before, and after (lab's result)."""
    import math

    import matplotlib.pyplot as plt

    world = len(per_rank)
    width = max(max(len(r["before"]), len(r["lab"])) for r in per_rank)
    fig, axes = plt.subplots(1, 2, figsize=(2 + 1.2 * width, 0.55 * world + 1.2)) if ax is None else (None, ax)
    for panel, key, title in ((axes[0], "before", "before"), (axes[1], "lab", f"after {name}")):
        panel.set_xlim(-0.5, width - 0.5)
        panel.set_ylim(world - 0.5, -0.5)
        for r, values in enumerate(d[key] for d in per_rank):
            for i, v in enumerate(values):
                if math.isnan(v):
                    continue
                panel.add_patch(plt.Rectangle((i - 0.45, r - 0.4), 0.9, 0.8, color=plt.cm.tab10(int(v) // 10 % 10),
                                              alpha=0.35))
                panel.text(i, r, f"{v:g}", ha="center", va="center", fontsize=9)
        panel.set_yticks(range(world), [f"rank {r}" for r in range(world)])
        panel.set_xticks([])
        panel.set_title(title, fontsize=10)
        for side in ("top", "right", "bottom"):
            panel.spines[side].set_visible(False)
    return fig
