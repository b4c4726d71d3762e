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

from lab.layout import check_count, kv_heads_per_rank

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


# --- tensor parallelism's arithmetic ---------------------------------------------------------------------------
# Back-of-envelope numbers for Megatron-style TP (column- then row-parallel), used by the chapter and by the
# checks of its worked problems (`04.problems`). Bandwidths are bytes/s one way per GPU, FLOP/s dense peaks.


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name}={value!r} must be > 0")


def _degree(tp: int) -> None:
    check_count("tp", tp)


def tp_max_degree(d_ff: float, peak_flops: float, bandwidth: float, n_axes: int = 1) -> float:
    """The largest TP degree Y that stays compute-bound: Y < n_axes · F / (C/W).

    How to Scale Your Model ch. 5: per MLP, each chip computes 4·B·D·F/Y FLOPs (T_math = 4BDF/(Y·C)) and moves
    the activations, 4·B·D bytes in bf16 (T_comm = 4BD/W); compute-bound iff F/(Y·C) > 1/W. The batch cancels:
    more tokens mean more FLOPs and more bytes alike. On TPU v5p (C/W = 2,550), F = 28,672 gives ~11."""
    _positive(d_ff=d_ff, peak_flops=peak_flops, bandwidth=bandwidth, n_axes=n_axes)
    return n_axes * d_ff * bandwidth / peak_flops


def tp_comm_to_compute(d_ff: float, tp: int, peak_flops: float, bandwidth: float) -> float:
    """T_comm / T_math of one TP MLP's forward with bf16 activations: (tp − 1) · C / (F · W).

    The two matmuls take 4·T·D·F/tp FLOPs per GPU; the ring all-reduce of the T·D output (2 bytes a value) sends
    2·(tp − 1)/tp · 2·T·D bytes per GPU. T and D cancel: only the hidden width per GPU, F/tp, sets the ratio —
    above 1 the all-reduce (which waits for the matmul) takes longer than the matmul."""
    _degree(tp)
    _positive(d_ff=d_ff, peak_flops=peak_flops, bandwidth=bandwidth)
    return (tp - 1) * peak_flops / (d_ff * bandwidth)


def tp_layer_comm_bytes(batch: int, seq: int, d_model: int, tp: int, bytes_per_value: float = 2) -> float:
    """Bytes each GPU sends per transformer layer, forward and backward, under TP (ring algorithms).

    Four all-reduces of the (b, s, h) activation per layer: g after attention and after the MLP in forward, f
    before each in backward. A ring all-reduce sends 2·(tp − 1)/tp of the payload per GPU. Sequence parallelism
    replaces each by an all-gather and a reduce-scatter, (tp − 1)/tp each: the same bytes."""
    _degree(tp)
    _positive(batch=batch, seq=seq, d_model=d_model, bytes_per_value=bytes_per_value)
    return 4 * 2 * (tp - 1) / tp * batch * seq * d_model * bytes_per_value


def sp_activation_saving(seq: int, batch: int, d_model: int, tp: int) -> float:
    """Bytes of one layer's activations that sequence parallelism saves on each GPU (16-bit activations).

    Korthikanti et al. (2022), eqs. 2 and 4: TP alone keeps s·b·h·(10 + 24/t) bytes per layer (the norms'
    inputs, the dropout masks and outputs stay whole on every rank) and SP keeps 34·s·b·h/t; the difference,
    10·s·b·h·(1 − 1/t), is what the token-wise parts cost when every rank holds all tokens."""
    _degree(tp)
    _positive(seq=seq, batch=batch, d_model=d_model)
    return 10 * seq * batch * d_model * (1 - 1 / tp)


def vocab_ce_saving(vocab: int, bytes_per_logit: float = 2) -> float:
    """How many times fewer bytes vocab-parallel cross-entropy moves than all-gathering the logits first.

    Gathering receives (tp − 1)/tp · T·V·b bytes per GPU; the vocab-parallel loss all-reduces three float32
    numbers per token (the max, the sum of exponentials, the target's logit): 3 rings of 2·(tp − 1)/tp · 4·T
    bytes. tp and T cancel: V·b / 24."""
    _positive(vocab=vocab, bytes_per_logit=bytes_per_logit)
    return vocab * bytes_per_logit / 24


def partial_sum_bytes(rows: int, cols: int, ranks: int, bytes_per_value: float, reduce_scatter: bool = False) -> float:
    """Bytes each device sends to combine the partial sums of C[I, K] from A[I, J_X] · B[J_X, K] (case 3).

    A ring all-reduce of the I·K result sends 2·(X − 1)/X of it per device; a reduce-scatter, which leaves
    C[I, K_X] sharded, only (X − 1)/X — half, which is why sequence parallelism reduce-scatters."""
    _degree(ranks)
    _positive(rows=rows, cols=cols, bytes_per_value=bytes_per_value)
    return (1 if reduce_scatter else 2) * (ranks - 1) / ranks * rows * cols * bytes_per_value


def kv_weight_bytes(d_model: int, n_kv_heads: int, head_dim: int, tp: int, bytes_per_value: float = 2) -> float:
    """Bytes of one layer's Wk and Wv on each TP rank with grouped-query attention.

    tp ≤ n_kv_heads: the KV heads split, n_kv/tp per rank. tp > n_kv_heads: every rank still holds one whole KV
    head (the one its query heads read), copied on tp/n_kv ranks — TP stops shrinking K and V there."""
    _degree(tp)
    _positive(d_model=d_model, n_kv_heads=n_kv_heads, head_dim=head_dim, bytes_per_value=bytes_per_value)
    return 2 * d_model * head_dim * kv_heads_per_rank(n_kv_heads, tp) * bytes_per_value
