"""Pictures and rules of sharded matrices, in the notation of *How to Scale Your Model* (ch. 3).

`A[I_X, J]` says: the rows (dimension I) of A are split over mesh axis X, the columns are whole, and
every device along the other mesh axes holds a copy. A spec here is one entry per dimension, as in JAX's
`PartitionSpec`: a mesh-axis name, or None for "not split" — `("X", None)` is `A[I_X, J]`.

A matmul C[I, K] = A[I, J] · B[J, K] over sharded operands falls into one of four cases, and the case
decides the collective (`matmul_plan`):

  1. neither operand is split along the contracting dim J: no communication;
  2. one is (or both are, over different axes): all-gather it along J first;
  3. both are, over the same axis: multiply locally, the results are partial sums, all-reduce them
     (or reduce-scatter them, leaving C sharded);
  4. I and K are split over the same axis: each device has only matching diagonal blocks, so all-gather
     one operand first.

Tensor parallelism is cases 1 and 3 (column- then row-parallel linear); ZeRO-3 is case 2. `draw_sharded`
and `draw_matmul` draw which device holds which block; `run_matmul_case` executes a case on real ranks
with `torch.distributed`, applying the collectives the plan names, and checks the result against the full
product. Nothing here imports torch at module level: pictures stay instant.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

Spec = tuple[str | None, str | None]  # one mesh-axis name (or None) per dimension of a matrix


def notation(name: str, dims: tuple[str, str], spec: Spec) -> str:
    """`notation("A", ("I", "J"), ("X", None))` -> "A[I_X, J]"."""
    parts = [dim if axis is None else f"{dim}_{axis}" for dim, axis in zip(dims, spec, strict=True)]
    return f"{name}[{', '.join(parts)}]"


def _check(spec: Spec, mesh: dict[str, int]) -> None:
    used = [axis for axis in spec if axis is not None]
    for axis in used:
        if axis not in mesh:
            raise ValueError(f"mesh axis {axis!r} is not in the mesh {dict(mesh)}")
    if len(used) != len(set(used)):
        raise ValueError(f"spec {spec} uses a mesh axis twice: a mesh axis can split one dimension only")


def devices(mesh: dict[str, int]) -> list[dict[str, int]]:
    """Every device's coordinates, numbered row-major over the mesh axes in the order given."""
    names = list(mesh)
    return [dict(zip(names, coords, strict=True)) for coords in itertools.product(*(range(mesh[n]) for n in names))]


def block_owners(spec: Spec, mesh: dict[str, int]) -> dict[tuple[int, int], list[int]]:
    """Which devices hold each block of a matrix sharded as `spec`: {(row block, col block): [devices]}.
    The matrix is cut into mesh[axis] blocks along each split dimension (1 block along a whole one);
    a block held by several devices is replicated over the mesh axes the spec does not use."""
    _check(spec, mesh)
    owners: dict[tuple[int, int], list[int]] = {}
    for index, coords in enumerate(devices(mesh)):
        block = tuple(0 if axis is None else coords[axis] for axis in spec)
        owners.setdefault(block, []).append(index)  # type: ignore[arg-type]
    return owners


def local_shape(shape: tuple[int, int], spec: Spec, mesh: dict[str, int]) -> tuple[int, int]:
    """The shape each device holds: every split dimension divided by its mesh axis's size."""
    _check(spec, mesh)
    for size, axis in zip(shape, spec, strict=True):
        if axis is not None and size % mesh[axis]:
            raise ValueError(f"dimension of size {size} is not divisible by mesh axis {axis}={mesh[axis]}")
    return tuple(size // (1 if axis is None else mesh[axis]) for size, axis in zip(shape, spec, strict=True))


@dataclass(frozen=True)
class MatmulPlan:
    """How to compute C[I, K] = A[I, J] · B[J, K] for the given shardings."""

    case: int  # 1-4, as in How to Scale Your Model ch. 3
    before: tuple[str, ...]  # collectives on the inputs, e.g. ("all-gather A over X along J",)
    after: tuple[str, ...]  # collectives on the output, e.g. ("all-reduce C over X",)
    a: Spec  # the shardings the local matmul actually uses
    b: Spec
    out: Spec

    @property
    def collectives(self) -> tuple[str, ...]:
        return self.before + self.after

    def describe(self) -> str:
        a, b = notation("A", ("I", "J"), self.a), notation("B", ("J", "K"), self.b)
        c = notation("C", ("I", "K"), self.out)
        steps = "; ".join(self.collectives) or "no communication"
        return f"case {self.case}: {steps}; local {a} · {b} -> {c}"


def matmul_plan(a: Spec, b: Spec, mesh: dict[str, int] | None = None, reduce_scatter: bool = False) -> MatmulPlan:
    """The case and the collectives of A[I, J] · B[J, K] with A sharded as `a` and B as `b`.

    Case 3 all-reduces the partial sums, or with `reduce_scatter=True` reduce-scatters them along K (the
    output then leaves K split over the axis: what sequence parallelism does along the sequence). In case 4
    either operand could be gathered; the plan gathers A, which keeps the output split like B's columns (the
    choice XLA makes for a plain `jnp.matmul` on CPU)."""
    if mesh is not None:
        _check(a, mesh)
        _check(b, mesh)
    (ai, aj), (bj, bk) = a, b
    if aj is not None and aj == bj:  # case 3: both contracting dims split over the same axis
        if ai == aj or bk == aj:
            raise ValueError(f"{a} · {b}: a mesh axis splits two dimensions of one operand")
        if reduce_scatter and bk is None:
            return MatmulPlan(3, (), (f"reduce-scatter C over {aj} along K",), a, b, (ai, aj))
        return MatmulPlan(3, (), (f"all-reduce C over {aj}",), a, b, (ai, bk))
    before: list[str] = []
    case = 1
    if aj is not None:
        before.append(f"all-gather A over {aj} along J")
        aj, case = None, 2
    if bj is not None:
        before.append(f"all-gather B over {bj} along J")
        bj, case = None, 2
    if ai is not None and ai == bk:  # case 4: the output would need one axis on both of its dimensions
        before.append(f"all-gather A over {ai} along I")
        ai = None
        case = 4 if case == 1 else case
    return MatmulPlan(case, tuple(before), (), (ai, aj), (bj, bk), (ai, bk))


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

    from lab.dist import count_collectives

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
            dist.reduce_scatter_tensor(out, c.t().contiguous())  # splits dim 0: K, once transposed
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
    from lab.dist import run

    for spec in (a, b):
        _check(spec, {"X": world_size})
    return run(_matmul_rank, world_size, a, b, shape, reduce_scatter, timeout_s=60)
