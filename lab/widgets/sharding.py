"""Pictures and live runs of sharded matmuls, in the notation of *How to Scale Your Model* (ch. 3).

The notation, the four cases of C[I, K] = A[I, J] · B[J, K] and the collective each one needs are
`lab.calc.sharding`'s (`matmul_plan`). Here, `draw_sharded` and `draw_matmul` draw which device holds which
block; `run_matmul_case` executes a case on real ranks with `torch.distributed`, applying the collectives
the plan names, and checks the result against the full product. Nothing here imports torch at module level:
pictures stay instant.
"""

from __future__ import annotations

from lab.calc.sharding import Spec, block_owners, check_spec, devices, local_shape, matmul_plan, notation

# ---- pictures -----------------------------------------------------------------------------------------

def draw_sharded(spec: Spec, mesh: dict[str, int], name: str = "A", dims: tuple[str, str] = ("I", "J"),
                 ax=None, shape: tuple[int, int] | None = None):
    """Draw a matrix as its blocks, each coloured by the first device that holds it and labelled with
    every device that does ("d0,1" = devices 0 and 1 hold a copy). Returns the axes."""
    import matplotlib.pyplot as plt

    owners = block_owners(spec, mesh)
    rows, cols = (1 if axis is None else mesh[axis] for axis in spec)
    if ax is None:
        _, ax = plt.subplots(figsize=(2.2, 2.2))
    for (r, c), held_by in owners.items():
        ax.add_patch(plt.Rectangle((c / cols, 1 - (r + 1) / rows), 1 / cols, 1 / rows, facecolor=plt.cm.tab10(
            held_by[0] % 10), alpha=0.45, edgecolor="k", lw=1))
        label = "all" if len(held_by) == len(devices(mesh)) > 1 else "d" + ",".join(map(str, held_by))
        ax.text((c + 0.5) / cols, 1 - (r + 0.5) / rows, label, ha="center", va="center",
                fontsize=8 if len(label) < 8 else 6)
    title = notation(name, dims, spec)
    if shape is not None:
        title += f"\nlocal {local_shape(shape, spec, mesh)} of {tuple(shape)}"
    ax.set_title(title, fontsize=9)
    ax.set(xlim=(0, 1), ylim=(0, 1), aspect="equal")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_xlabel(dims[1], fontsize=8)
    ax.set_ylabel(dims[0], fontsize=8)
    return ax


def draw_matmul(a: Spec, b: Spec, mesh: dict[str, int], reduce_scatter: bool = False):
    """Three panels, A · B -> C, as the local matmul sees them after the plan's input collectives, titled
    with the case and its collectives. Returns the figure."""
    import matplotlib.pyplot as plt

    plan = matmul_plan(a, b, mesh, reduce_scatter)
    fig, axes = plt.subplots(1, 3, figsize=(6.6, 2.6))
    draw_sharded(plan.a, mesh, "A", ("I", "J"), axes[0])
    draw_sharded(plan.b, mesh, "B", ("J", "K"), axes[1])
    draw_sharded(plan.out, mesh, "C", ("I", "K"), axes[2])
    if plan.case == 3:
        axes[2].set_title(axes[2].get_title() + (" (after RS)" if reduce_scatter else " (after AR)"), fontsize=9)
    given = f"{notation('A', ('I', 'J'), a)} · {notation('B', ('J', 'K'), b)}"
    steps = "; ".join(plan.collectives) or "no communication"
    fig.suptitle(f"{given}: case {plan.case} — {steps}", fontsize=10, y=1.04)
    return fig


# ---- the cases on real ranks --------------------------------------------------------------------------

def _matmul_rank(a: Spec, b: Spec, shape: tuple[int, int, int], reduce_scatter: bool) -> dict:
    """One rank of a 1-D mesh "X" over the whole group: hold the shards `a` and `b` say, apply the plan's
    collectives with torch.distributed, multiply locally, and compare this rank's C with the full product."""
    import torch
    import torch.distributed as dist

    from lab.distributed import count_collectives, reduce_scatter_single

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = {"X": world}
    plan = matmul_plan(a, b, mesh, reduce_scatter)
    g = torch.Generator().manual_seed(0)
    n_i, n_j, n_k = shape
    full_a, full_b = torch.randn(n_i, n_j, generator=g), torch.randn(n_j, n_k, generator=g)

    def shard(t: torch.Tensor, spec: Spec) -> torch.Tensor:
        for dim, axis in enumerate(spec):
            if axis is not None:
                t = t.chunk(world, dim)[rank]
        return t.contiguous()

    def gather(t: torch.Tensor, dim: int) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t)
        return torch.cat(parts, dim)

    local_a, local_b = shard(full_a, a), shard(full_b, b)
    with count_collectives() as counts:
        if a[1] is not None and plan.a[1] is None:
            local_a = gather(local_a, 1)
        if b[0] is not None and plan.b[0] is None:
            local_b = gather(local_b, 0)
        if a[0] is not None and plan.a[0] is None:
            local_a = gather(local_a, 0)
        c = local_a @ local_b
        if plan.case == 3 and plan.out[1] == a[1]:  # reduce-scatter along K
            out = torch.empty(c.shape[1] // world, c.shape[0])
            reduce_scatter_single(out, c.t().contiguous())  # splits dim 0: K, once transposed
            c = out.t()
        elif plan.case == 3:
            dist.all_reduce(c)
    expected = shard(full_a @ full_b, plan.out)
    return {"local_c": tuple(c.shape), "max_error": (c - expected).abs().max().item(),
            "calls": dict(counts.calls), "bytes": dict(counts.bytes)}


def run_matmul_case(a: Spec, b: Spec, world_size: int = 4, shape: tuple[int, int, int] = (8, 12, 16),
                    reduce_scatter: bool = False) -> list[dict]:
    """Run A[I, J] · B[J, K] with shardings over mesh axis "X" (size `world_size`) on real ranks. Each
    rank's {"local_c", "max_error" vs the full product's shard, "calls" and "bytes" of its collectives}."""
    from lab.distributed import run

    for spec in (a, b):
        check_spec(spec, {"X": world_size})
    return run(_matmul_rank, world_size, a, b, shape, reduce_scatter, timeout_s=60)
