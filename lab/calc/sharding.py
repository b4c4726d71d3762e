"""Sharded matrices in the notation of *How to Scale Your Model* (ch. 3), and the collective a matmul needs.

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

Tensor parallelism is cases 1 and 3 (column- then row-parallel linear); ZeRO-3 is case 2. The rules live
here, torch-free, because two readers need the same answer: the chapter's pictures and live ranks
(`lab.widgets.sharding`) and the check of the sharded-matmul exercise (`lab.grading.checks.ch04`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

Spec = tuple[str | None, str | None]  # one mesh-axis name (or None) per dimension of a matrix


def notation(name: str, dims: tuple[str, str], spec: Spec) -> str:
    """`notation("A", ("I", "J"), ("X", None))` -> "A[I_X, J]"."""
    parts = [dim if axis is None else f"{dim}_{axis}" for dim, axis in zip(dims, spec, strict=True)]
    return f"{name}[{', '.join(parts)}]"


def check_spec(spec: Spec, mesh: dict[str, int]) -> None:
    """One clear ValueError for a spec naming an axis the mesh lacks, or one axis twice."""
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
    check_spec(spec, mesh)
    owners: dict[tuple[int, int], list[int]] = {}
    for index, coords in enumerate(devices(mesh)):
        block = tuple(0 if axis is None else coords[axis] for axis in spec)
        owners.setdefault(block, []).append(index)  # type: ignore[arg-type]
    return owners


def local_shape(shape: tuple[int, int], spec: Spec, mesh: dict[str, int]) -> tuple[int, int]:
    """The shape each device holds: every split dimension divided by its mesh axis's size."""
    check_spec(spec, mesh)
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
        check_spec(a, mesh)
        check_spec(b, mesh)
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
