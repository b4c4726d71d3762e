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

`cross_node_comm_compute_ratio` counts only what crosses the nodes' NICs, and models DeepSeek-V3's two answers
(technical report, §3.2.2 and §3.3.3): node-limited routing with forwarding, where a token's row crosses the
network once per node it reaches (to the GPU of the same index there, then over NVLink to the experts), at most
`max_nodes` of them, instead of once per expert; and a dispatch sent in FP8 while the combine stays in BF16.

The same ratio on one flat network of given bandwidth and latency (`comm_compute_ratio_on`) gives the EP degree
beyond which the all-to-alls outlast the experts' compute (`ep_where_comm_dominates`). The rest sizes a layout:
how many rows each expert gets (`rows_per_expert`), what capacity drops under a skewed router
(`dropped_assignments`), the experts' bytes per GPU (`expert_bytes_per_gpu`) and the parameters a token touches
(`active_params`). Parameter and FLOP counts of whole MoE models are in `lab.calc.params` / `lab.calc.flops`.
"""

from __future__ import annotations

import math

from lab.calc.comms import collective_time
from lab.calc.hardware import get_accelerator
from lab.calc.network import Link
from lab.layout import expert_capacity, experts_per_rank


def _check(name: str, value: int, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")


def _positive(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{name}={value!r} must be a number > 0")


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


def comm_compute_ratio_on(tokens: int, top_k: int, d_model: int, d_ff_expert: int, ep: int, bandwidth: float,
                          flops: float, latency: float = 0.0, dtype_bytes: int = 2) -> float:
    """`comm_compute_ratio` on one flat network: each GPU sends at `bandwidth` bytes/s, `latency` s a message,
    and computes at `flops` FLOP/s. Without latency the tokens cancel: 2·β·F·(ep − 1) / (9·f·W·ep)."""
    for name, value in (("bandwidth", bandwidth), ("flops", flops)):
        _positive(name, value)
    if latency < 0:
        raise ValueError(f"latency={latency!r} must be >= 0 seconds")
    _check("ep", ep)
    link = Link("given", bandwidth, latency, "the problem's numbers")
    one = collective_time("all_to_all", tokens * top_k * d_model * dtype_bytes, ep, link=link)
    return 4 * one.time_s / (routed_expert_flops(tokens, top_k, d_model, d_ff_expert) / flops)


def nodes_reached(top_k: int, n_experts: int, nodes: int, max_nodes: int | None = None) -> float:
    """Expected number of distinct nodes a token's top_k experts live on, experts spread evenly over `nodes`
    and chosen uniformly: nodes·(1 − C(E − E/nodes, k)/C(E, k)), capped at `max_nodes` (node-limited routing
    picks the max_nodes best nodes first, then the top_k experts among theirs). DeepSeek-V3 (256 experts, top 8,
    8 nodes): 5.29 unrestricted, 4 when limited to 4."""
    for name, value in (("top_k", top_k), ("n_experts", n_experts), ("nodes", nodes)):
        _check(name, value)
    if n_experts % nodes or top_k > n_experts:
        raise ValueError(f"nodes={nodes} must divide n_experts={n_experts} and top_k={top_k} be at most it")
    free = math.comb(n_experts - n_experts // nodes, top_k) / math.comb(n_experts, top_k)
    reached = nodes * (1 - free)
    if max_nodes is not None:
        _check("max_nodes", max_nodes)
        reached = min(reached, max_nodes)
    return reached


def cross_node_comm_compute_ratio(top_k: int, d_model: int, d_ff_expert: int, n_experts: int, ep: int,
                                  gpus_per_node: int = 8, nic_bandwidth: float = 50e9, flops: float | None = None,
                                  max_nodes: int | None = None, dispatch_bytes: float = 2,
                                  combine_bytes: float = 2) -> float:
    """Time on a GPU's own NIC (`nic_bandwidth` bytes/s, 50 GB/s: one 400 Gb/s NIC per GPU) of one MoE layer's
    cross-node all-to-alls, forward and backward, over the routed experts' compute at `flops` (default: an
    H100's dense bf16 peak); bandwidth only, so the tokens cancel. The EP group spans ep/gpus_per_node nodes
    and a token is as likely to be on any of them.

    `max_nodes=None` is the plain model: every row whose expert lives on another node crosses the network,
    top_k·(nodes − 1)/nodes rows per token. With `max_nodes` a row crosses once per remote node reached
    (`nodes_reached`·(nodes − 1)/nodes; the forwarding over NVLink is left out, faster and overlapped). Rows in the
    dispatch direction (forward dispatch, and the gradients the backward sends to the experts) take
    `dispatch_bytes` per value, those in the combine direction (forward combine, backward dispatch) `combine_bytes`.
    DeepSeek-V3's setting, max_nodes=4 with FP8 dispatch and BF16 combine: ≈ 1.4 against ≈ 3.8 plain in bf16."""
    for name, value in (("top_k", top_k), ("d_model", d_model), ("d_ff_expert", d_ff_expert), ("ep", ep),
                        ("gpus_per_node", gpus_per_node)):
        _check(name, value)
    for name, value in (("nic_bandwidth", nic_bandwidth), ("dispatch_bytes", dispatch_bytes),
                        ("combine_bytes", combine_bytes)):
        _positive(name, value)
    if ep % gpus_per_node:
        raise ValueError(f"ep={ep} must be a multiple of gpus_per_node={gpus_per_node} (whole nodes)")
    nodes = ep // gpus_per_node
    flops = get_accelerator("h100").peak_flops("bf16") if flops is None else flops
    _positive("flops", flops)
    remote = (nodes - 1) / nodes
    if max_nodes is None:
        rows = top_k * remote
    else:
        rows = nodes_reached(top_k, n_experts, nodes, max_nodes) * remote
    wire = rows * d_model * 2 * (dispatch_bytes + combine_bytes) / nic_bandwidth  # 2: forward and backward
    return wire / (routed_expert_flops(1, top_k, d_model, d_ff_expert) / flops)


def ep_where_comm_dominates(tokens: int, top_k: int, d_model: int, d_ff_expert: int, bandwidth: float, flops: float,
                            latency: float, dtype_bytes: int = 2) -> int:
    """The smallest EP degree at which a layer's 4 all-to-alls take at least as long as its routed experts'
    compute (`comm_compute_ratio_on` >= 1). The ratio grows with ep — (ep − 1) messages, (ep − 1)/ep of the rows
    off the rank — so doubling, then bisecting, finds it; with latency > 0 it always exists."""
    _positive("latency", latency)

    def dominates(ep: int) -> bool:
        return comm_compute_ratio_on(tokens, top_k, d_model, d_ff_expert, ep, bandwidth, flops, latency,
                                     dtype_bytes) >= 1

    high = 2
    while not dominates(high):
        high *= 2
    low = high // 2  # does not dominate (or is 1: a single rank sends nothing)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if dominates(middle) else (middle, high)
    return high


def rows_per_expert(tokens_per_gpu: int, top_k: int, n_experts: int, ep: int) -> float:
    """Rows one expert computes per layer under uniform routing: the ep ranks of its EP group each route
    tokens_per_gpu·top_k assignments over the n_experts, so ep·tokens·top_k/n_experts. Expert parallelism is
    what keeps an expert's matmul large as experts multiply (a GPU computes tokens·top_k rows whatever ep)."""
    for name, value in (("tokens_per_gpu", tokens_per_gpu), ("top_k", top_k), ("n_experts", n_experts), ("ep", ep)):
        _check(name, value)
    return tokens_per_gpu * top_k / experts_per_rank(n_experts, ep)


def dropped_assignments(tokens: int, top_k: int, n_experts: int, capacity_factor: float, hot_share: float) -> float:
    """Assignments dropped by capacity ceil(c·tokens·top_k/n_experts) when one expert gets `hot_share` of the
    tokens·top_k assignments and the other n_experts − 1 share the rest equally."""
    for name, value in (("tokens", tokens), ("top_k", top_k), ("n_experts", n_experts)):
        _check(name, value)
    _positive("capacity_factor", capacity_factor)
    if not 0 <= hot_share <= 1:
        raise ValueError(f"hot_share={hot_share!r} must be in [0, 1]")
    assignments = tokens * top_k
    capacity = expert_capacity(tokens, top_k, n_experts, capacity_factor)
    hot, cold = hot_share * assignments, (1 - hot_share) * assignments / (n_experts - 1) if n_experts > 1 else 0.0
    return max(0.0, hot - capacity) + (n_experts - 1) * max(0.0, cold - capacity)


def expert_bytes_per_gpu(moe_layers: int, n_experts: int, d_model: int, d_ff_expert: int, ep: int,
                         bytes_per_param: float) -> float:
    """Bytes of the routed experts one GPU holds at expert parallelism ep: its n_experts/ep SwiGLU experts
    (3·d·f parameters each) in every MoE layer, at `bytes_per_param` (2 for bf16 weights, 16 or so with
    gradients and Adam's states)."""
    for name, value in (("moe_layers", moe_layers), ("n_experts", n_experts), ("d_model", d_model),
                        ("d_ff_expert", d_ff_expert), ("ep", ep)):
        _check(name, value)
    _positive("bytes_per_param", bytes_per_param)
    return moe_layers * experts_per_rank(n_experts, ep) * 3 * d_model * d_ff_expert * bytes_per_param


def active_params(total_params: int, moe_layers: int, n_experts: int, top_k: int, d_model: int,
                  d_ff_expert: int) -> int:
    """Parameters one token touches: all of them but the routed experts it was not sent to, n_experts − top_k
    SwiGLU experts (3·d·f each) in each MoE layer (shared experts and the router are always active)."""
    for name, value in (("total_params", total_params), ("moe_layers", moe_layers), ("n_experts", n_experts),
                        ("top_k", top_k), ("d_model", d_model), ("d_ff_expert", d_ff_expert)):
        _check(name, value)
    if top_k > n_experts:
        raise ValueError(f"top_k={top_k} must be at most n_experts={n_experts}")
    return total_params - moe_layers * (n_experts - top_k) * 3 * d_model * d_ff_expert
