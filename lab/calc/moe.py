"""Mixture of experts on paper: what expert parallelism moves over the network. Torch-free.

An MoE layer under expert parallelism runs two all-to-alls forward (dispatch the routed token rows to the
experts' ranks, combine the results back) and two backward (their gradients, the same sizes the other way),
plus a small all-to-all of per-expert counts so that receivers can size their buffers. A rank hands the
dispatch every row it routes (tokens · top_k kept assignments, including those for its own experts, which
never leave it) and the combine every row its experts computed — what `count_collectives` counts as
all_to_all_single. On the wire go the rows whose expert lives on another rank: (ep - 1)/ep of them under
uniform routing.

Their time (`all_to_all_seconds`) comes from `lab.calc.comms`: inside a node over NVLink; across nodes each GPU
sends the rows for other nodes through its own share of the node's NICs (one 50 GB/s NIC per H100 on a DGX),
since an all-to-all, unlike a ring, cannot spread one GPU's traffic over the other GPUs' NICs.
`comm_compute_ratio` divides that by the routed experts' FLOPs. Its bandwidth part is about 2·β·F / (9·f·W)
for large ep, independent of the tokens (W: a GPU's bandwidth off the node, F: FLOP/s, f: an expert's hidden
size); the latency part (ep - 1 messages per all-to-all) grows with ep.

Parameter and FLOP counts of MoE models (total vs active) are in `lab.calc.params` / `lab.calc.flops`.
"""

from __future__ import annotations

from lab.calc.comms import collective_time
from lab.calc.hardware import get_accelerator


def _check(name: str, value: int, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")


def layer_all_to_all_bytes(rows_to: list[int], rows_from: list[int], own_rank: int, d_model: int, n_experts: int,
                           dtype_bytes: int = 2) -> dict[str, int]:
    """Bytes one rank hands to the all-to-alls of one MoE layer, forward and backward, for an observed routing:
    `rows_to[j]` kept assignments of its tokens whose expert lives on EP rank j, `rows_from[j]` rows rank j
    sends to this rank's experts. Dispatch hands over this rank's rows, combine the rows its experts
    computed; backward the same two sizes the other way round. The per-expert counts are int64."""
    for name, value in (("d_model", d_model), ("n_experts", n_experts), ("dtype_bytes", dtype_bytes)):
        _check(name, value)
    if len(rows_to) != len(rows_from) or not 0 <= own_rank < len(rows_to):
        raise ValueError(f"rows_to and rows_from must both list the {len(rows_to)} EP ranks, and own_rank={own_rank} "
                         f"be one of them")
    row = d_model * dtype_bytes
    dispatch, combine = sum(rows_to) * row, sum(rows_from) * row
    counts = n_experts * 8
    leaving = (sum(rows_to) - rows_to[own_rank] + sum(rows_from) - rows_from[own_rank]) * row
    return {"counts": counts, "dispatch": dispatch, "combine": combine, "forward": counts + dispatch + combine,
            "backward": dispatch + combine, "on_wire_forward": leaving}


def expected_all_to_all_bytes(tokens: int, top_k: int, d_model: int, ep: int, dtype_bytes: int = 2) -> float:
    """Bytes one rank sends to other ranks per MoE layer, forward and backward, under uniform routing:
    4 all-to-alls (dispatch, combine, and their gradients) of tokens·top_k·(ep-1)/ep rows of d_model values."""
    for name, value in (("tokens", tokens), ("top_k", top_k), ("d_model", d_model), ("ep", ep),
                        ("dtype_bytes", dtype_bytes)):
        _check(name, value)
    return 4 * tokens * top_k * (ep - 1) / ep * d_model * dtype_bytes


def all_to_all_seconds(tokens: int, top_k: int, d_model: int, ep: int, system: str = "h100",
                       dtype_bytes: int = 2, gpus_per_node: int | None = None) -> float:
    """Time of one MoE layer's 4 all-to-alls (dispatch, combine and their gradients), each handing over
    tokens·top_k rows of d_model values per rank, under uniform routing, on `system`'s links."""
    for name, value in (("tokens", tokens), ("top_k", top_k), ("d_model", d_model), ("ep", ep),
                        ("dtype_bytes", dtype_bytes)):
        _check(name, value)
    one = collective_time("all_to_all", tokens * top_k * d_model * dtype_bytes, ep, system=system,
                          gpus_per_node=gpus_per_node)
    return 4 * one.time_s


def routed_expert_flops(tokens: int, top_k: int, d_model: int, d_ff_expert: int) -> float:
    """Forward and backward FLOPs of one layer's routed experts: 6 per weight (3·d·f of a SwiGLU expert) for
    each of the tokens·top_k assignments."""
    for name, value in (("tokens", tokens), ("top_k", top_k), ("d_model", d_model), ("d_ff_expert", d_ff_expert)):
        _check(name, value)
    return 6 * tokens * top_k * 3 * d_model * d_ff_expert


def comm_compute_ratio(tokens: int, top_k: int, d_model: int, d_ff_expert: int, ep: int, system: str = "h100",
                       gpu: str = "h100", dtype_bytes: int = 2, efficiency: float = 1.0) -> float:
    """All-to-all time over the routed experts' compute time for one MoE layer (no overlap); `efficiency`
    scales the GPU's bf16 peak."""
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency={efficiency!r} must be in (0, 1]")
    compute_s = routed_expert_flops(tokens, top_k, d_model, d_ff_expert) / (
        get_accelerator(gpu).peak_flops("bf16") * efficiency)
    return all_to_all_seconds(tokens, top_k, d_model, ep, system, dtype_bytes) / compute_s
