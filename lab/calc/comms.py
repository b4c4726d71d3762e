"""The alpha-beta cost model of collectives: time = steps * alpha + bytes on the busiest link / bandwidth.

A message of b bytes costs alpha + b * beta: alpha is the latency (seconds), beta the inverse bandwidth
(seconds per byte). For a tensor of B bytes on W ranks (B is the all-reduce input, the all-gather output, the
reduce-scatter input, the all-to-all input):

  algorithm  operation                     steps          bytes each rank sends
  ring       all_reduce                    2(W-1)         2(W-1)/W * B
  ring       all_gather, reduce_scatter    W-1            (W-1)/W * B
  pairwise   all_to_all                    W-1            (W-1)/W * B
  tree       broadcast, reduce             ceil(log2 W)   B per step (the root's link is the bottleneck)
  tree       all_reduce (reduce + bcast)   2 ceil(log2 W) B per step

Small messages are latency-bound (steps * alpha dominates), large ones bandwidth-bound: the ring's bytes
per rank do not grow with W, the tree's steps grow only like log W. The tree here is the textbook binomial
tree; NCCL's is a pipelined double binary tree, which streams chunks down two trees at once and so keeps
close to full bandwidth for large messages while its latency still grows like log W.

nccl-tests report an *algorithm bandwidth* algbw = B / time and a *bus bandwidth* busbw = algbw * factor
(2(W-1)/W for all-reduce, (W-1)/W for all-gather, reduce-scatter and all-to-all, 1 otherwise): busbw is
what each link actually carried, comparable across W and with the hardware's peak.

Across nodes (a `system` whose W ranks fill W/g nodes of g GPUs), NCCL does not run one ring but several at
once (channels), each leaving a node through a different GPU and its NIC (a *rail*). A ring visits the g GPUs
of a node over NVLink and crosses to the next node once, so the rings together use all of a node's NICs:

  flat ring or tree      one link of bandwidth min(NVLink per GPU, rails * NIC), the NIC's latency per step,
                         rails = min(NICs per node, g): 400 GB/s on DGX H100 (8 x 50 GB/s), not one NIC's 50
  all_to_all             every GPU sends (W-g)/W * B off the node through its share of the NICs
                         (rails * NIC / g: one NIC on DGX H100), and (g-1)/W * B over NVLink, at the same time
  hierarchical all_reduce  reduce-scatter inside the node, g all-reduces of B/g across nodes in parallel (one
                         per rail: each GPU's slice over its own NIC), all-gather inside; the three phases one
                         after the other. Fewer latency steps than the flat ring (g-1 + 2(W/g-1) + g-1 instead
                         of 2(W-1)), so it wins for small messages and many nodes; with a NIC per GPU a
                         flat multi-rail ring wins for large messages on a few nodes.

A system with a `Fabric` (pods of full bisection bandwidth joined at 1:`oversubscription`) prices a group that
spans `pods` pods, with every group of the job running the same collective at once (data parallelism's
gradients: one group per model-parallel rank). A ring ordered pod by pod, as a topology-aware library builds it,
leaves each pod once: of the group's n nodes in a pod, one sends across, so a pod's crossings ask 1/n of what
its NICs inject, and the uplinks give 1/oversubscription of it: the ring slows, by n/oversubscription, only
where a group has fewer nodes in a pod than the oversubscription. An all-to-all sends (P-1)/P of its off-node
bytes to other pods: the uplinks carry them at 1/oversubscription · P/(P-1) of the NICs' rate.

What the model leaves out: congestion in the switches and the fabric's topology beyond pods (leaf/spine, how
rails are wired), NCCL's choice of protocol and algorithm per size, in-switch reductions (NVLink SHARP), stragglers.
On 1 and 2 H100 nodes it lands within a few percent of the playbook's measured all-reduce bus bandwidth
(`network.PLAYBOOK_BUSBW`); from 4 nodes on the measurements fall 2-3x below it.

`zero3_overlap_ratio` weighs a ZeRO-3 all-gather against the compute it must hide behind (the playbook's
appendix "A3: Math for Compute/Communication Overlap"): the measured timelines of `lab.measure.overlap` are
its executed counterpart.
`latency_bandwidth_crossover`, `ring_tree_crossover` and `dp_critical_batch` are the model's thresholds, in
closed form: where latency stops mattering, where the ring overtakes the tree, and how large a data-parallel
batch must be for the gradient all-reduce to hide behind the backward (How to Scale Your Model, ch. 5).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lab.calc.network import SYSTEMS, Link, System

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "send")
ALGORITHMS = ("ring", "tree", "hierarchical")


@dataclass(frozen=True)
class CommCost:
    op: str
    algorithm: str
    ranks: int
    bytes: float
    steps: int
    bytes_sent_per_rank: float
    time_s: float
    link: str  # what the bandwidth term was priced on

    @property
    def algbw(self) -> float:
        return self.bytes / self.time_s if self.time_s else math.inf

    @property
    def busbw(self) -> float:
        return self.algbw * bus_factor(self.op, self.ranks)

    def as_dict(self) -> dict:
        return {"op": self.op, "algorithm": self.algorithm, "ranks": self.ranks, "bytes": self.bytes,
                "steps": self.steps, "bytes_sent_per_rank": self.bytes_sent_per_rank, "time_s": self.time_s,
                "algbw": self.algbw, "busbw": self.busbw, "link": self.link}


def bus_factor(op: str, ranks: int) -> float:
    """nccl-tests' factor from algorithm bandwidth to bus bandwidth."""
    if op == "all_reduce":
        return 2 * (ranks - 1) / ranks
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (ranks - 1) / ranks
    return 1.0


def _flat(op: str, nbytes: float, ranks: int, link: Link, algorithm: str) -> CommCost:
    w = ranks
    if op == "send":
        steps, sent = 1, nbytes
    elif algorithm == "tree" and op in ("all_reduce", "broadcast", "reduce"):
        depth = math.ceil(math.log2(w)) if w > 1 else 0
        steps = 2 * depth if op == "all_reduce" else depth
        sent = steps * nbytes  # every step moves the whole message over the critical path
    elif op in ("broadcast", "reduce"):  # pipelined ring: W-1 steps of the whole message, overlapped in chunks
        steps, sent = w - 1, nbytes if w > 1 else 0.0
    else:
        factor = bus_factor(op, w)
        steps = (2 if op == "all_reduce" else 1) * (w - 1)
        sent = factor * nbytes
    return CommCost(op, algorithm, w, nbytes, steps, sent, steps * link.latency + sent / link.bandwidth, link.name)


def rails(spec: System, gpus_per_node: int) -> int:
    """Rings that leave a node at once, each through its own GPU and NIC: min(NICs, GPUs per node)."""
    return min(spec.nics_per_node, gpus_per_node)


def multi_rail_link(spec: System, gpus_per_node: int) -> Link:
    """The one link a flat ring or tree across nodes behaves as. Its `rails` rings share the data and each
    crosses between nodes on its own NIC, so a node's NICs carry it together; NVLink caps it too, since a GPU
    forwards over NVLink in the rings that do not leave the node through it."""
    r = rails(spec, gpus_per_node)
    bandwidth = min(spec.intra.bandwidth, r * spec.nic.bandwidth)
    return Link(f"multi-rail: {r} x {spec.nic.name} and {spec.intra.name}: {bandwidth / 1e9:g} GB/s",
                bandwidth, max(spec.intra.latency, spec.nic.latency), spec.source)


def pod_share(spec: System, ranks: int, gpus_per_node: int, pods: int, op: str = "all_reduce") -> float:
    """The share of its NICs' bandwidth a group's collective keeps where it crosses between pods (1 inside one
    pod, or on a system without a `Fabric`): a ring ordered pod by pod sends 1/n of a pod's traffic across
    (n: the group's nodes in a pod), an all-to-all (P-1)/P of it, and the uplinks carry 1/oversubscription."""
    if spec.fabric is None or pods == 1:
        return 1.0
    if op == "all_to_all":
        return min(1.0, pods / (pods - 1) / spec.fabric.oversubscription)
    return min(1.0, ranks / gpus_per_node / pods / spec.fabric.oversubscription)


def _all_to_all_across(nbytes: float, ranks: int, spec: System, g: int, pods: int = 1) -> CommCost:
    """Every rank sends B/W to every other: (g-1)/W of B stays on the node (NVLink), (W-g)/W of B leaves it
    through the rank's share of the node's NICs (and of the pods' uplinks, `pod_share`). Both run at once; no
    ring shares the NICs out."""
    w = ranks
    per_gpu_nic = rails(spec, g) * spec.nic.bandwidth / g * pod_share(spec, ranks, g, pods, "all_to_all")
    time = (w - 1) * max(spec.intra.latency, spec.nic.latency) + max(
        (g - 1) / w * nbytes / spec.intra.bandwidth, (w - g) / w * nbytes / per_gpu_nic)
    return CommCost("all_to_all", "ring", w, nbytes, w - 1, (w - 1) / w * nbytes, time,
                    f"{spec.nic.name}: {per_gpu_nic / 1e9:g} GB/s per GPU off the node, {spec.intra.name} on it")


def collective_time(op: str, nbytes: float, ranks: int, link: Link | None = None, algorithm: str = "ring",
                    system: str | System | None = None, gpus_per_node: int | None = None,
                    pods: int = 1) -> CommCost:
    """Cost of one collective. Give a `link` (one network for all ranks) or a `system` (a name, "h100", ...,
    or a `System` of your own) whose nodes of `gpus_per_node` GPUs use the fast link inside and their NICs,
    multi-rail, between; on a system with a `Fabric`, `pods` is how many of its pods the group spans
    (`pod_share`)."""
    _validate(op, nbytes, ranks, algorithm, link, system, gpus_per_node)
    if link is not None:
        return _flat(op, nbytes, ranks, link, algorithm)
    spec = system if isinstance(system, System) else SYSTEMS[system]
    g = gpus_per_node or spec.gpus_per_node
    if ranks <= g:
        return _flat(op, nbytes, ranks, spec.intra, algorithm)
    if ranks % g:
        raise ValueError(f"ranks={ranks} must be a multiple of gpus_per_node={g} when it spans nodes")
    if not isinstance(pods, int) or not 1 <= pods <= ranks // g:
        raise ValueError(f"pods={pods!r} must be an integer from 1 to the group's {ranks // g} nodes")
    if op == "all_to_all":
        return _all_to_all_across(nbytes, ranks, spec, g, pods)
    share = pod_share(spec, ranks, g, pods)
    if algorithm != "hierarchical" or op != "all_reduce":
        link = multi_rail_link(spec, g)
        if share < 1:
            link = dataclasses.replace(link, name=f"{link.name}, {share:.0%} of it across pods",
                                       bandwidth=link.bandwidth * share)
        return _flat(op, nbytes, ranks, link, algorithm)
    own_rail = Link(f"{spec.nic.name}, its own rail for each GPU's slice", rails(spec, g) * spec.nic.bandwidth / g
                    * share, spec.nic.latency, spec.source)
    inside_rs = _flat("reduce_scatter", nbytes, g, spec.intra, "ring")
    across = _flat("all_reduce", nbytes / g, ranks // g, own_rail, "ring")
    inside_ag = _flat("all_gather", nbytes, g, spec.intra, "ring")
    parts = (inside_rs, across, inside_ag)
    return CommCost(op, algorithm, ranks, nbytes, sum(p.steps for p in parts),
                    sum(p.bytes_sent_per_rank for p in parts), sum(p.time_s for p in parts),
                    f"{spec.intra.name} inside, {spec.nic.name}: {own_rail.bandwidth / 1e9:g} GB/s per GPU across")


def _validate(op: str, nbytes: float, ranks: int, algorithm: str, link: Link | None, system: str | System | None,
              gpus_per_node: int | None) -> None:
    if op not in OPS:
        raise ValueError(f"op={op!r} must be one of {', '.join(OPS)}")
    if not nbytes >= 0:
        raise ValueError(f"bytes={nbytes!r} must be >= 0")
    if not isinstance(ranks, int) or ranks < 1 or (op == "send" and ranks != 2):
        raise ValueError(f"ranks={ranks!r} must be an integer >= 1" + (" (2 for send)" if op == "send" else ""))
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} must be one of {', '.join(ALGORITHMS)}")
    if (link is None) == (system is None):
        raise ValueError("give exactly one of link= or system=")
    if system is not None and not isinstance(system, System) and system not in SYSTEMS:
        raise ValueError(f"system={system!r} must be one of {', '.join(SYSTEMS)}")
    if gpus_per_node is not None and (not isinstance(gpus_per_node, int) or gpus_per_node < 1):
        raise ValueError(f"gpus_per_node={gpus_per_node!r} must be an integer >= 1")


def fit_alpha_beta(points: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Least-squares (alpha, beta) from measured (steps, bytes_on_wire, seconds): t = steps*alpha + bytes*beta.

    Solved with the 2x2 normal equations, so it needs no numerical library; negative estimates (noise on a
    busy machine) are clipped to tiny positive values.
    """
    if len(points) < 2:
        raise ValueError(f"need at least 2 measurements to fit alpha and beta, got {len(points)}")
    saa = sum(s * s for s, _, _ in points)
    sab = sum(s * b for s, b, _ in points)
    sbb = sum(b * b for _, b, _ in points)
    sat = sum(s * t for s, _, t in points)
    sbt = sum(b * t for _, b, t in points)
    det = saa * sbb - sab * sab
    if det == 0:
        raise ValueError("the measurements must differ in size to separate alpha from beta")
    alpha = (sat * sbb - sbt * sab) / det
    beta = (saa * sbt - sab * sat) / det
    return max(alpha, 0.0), max(beta, 1e-15)


def zero3_overlap_ratio(tokens: int, dp: int, peak_flops: float, bandwidth: float, bytes_per_param: float = 2) -> float:
    """t_comm / t_compute for one block under ZeRO-3 (the playbook's appendix A3, "Math for
    Compute/Communication Overlap"): ≤ 1 means the next block's all-gather can hide behind this block's forward.

    A block of P parameters: its all-gather moves bytes_per_param·P·(dp−1)/dp bytes through each rank's
    link, its forward costs 2·P·tokens FLOPs (tokens = seq_len × micro-batch). P cancels:
        ratio = bytes_per_param · (dp − 1)/dp · peak_flops / (2 · tokens · bandwidth).
    A3 prints 1/(2·seq·mbs) · (dp−1)/dp · peak_flops/peak_bw: the same with bytes_per_param=1 (A3 counts
    elements and calls them bytes); bf16 parameters (2 bytes) need twice the tokens to hide."""
    for name, value in (("tokens", tokens), ("dp", dp), ("peak_flops", peak_flops), ("bandwidth", bandwidth),
                        ("bytes_per_param", bytes_per_param)):
        if not value > 0:
            raise ValueError(f"{name}={value!r} must be > 0")
    return bytes_per_param * (dp - 1) / dp * peak_flops / (2 * tokens * bandwidth)


def latency_bandwidth_crossover(op: str, ranks: int, link: Link, algorithm: str = "ring") -> float:
    """The message size (bytes) at which a collective's latency term equals its bandwidth term.

    Below it the collective is latency-bound (more, smaller messages cost the same: bucket them), above it
    bandwidth-bound. steps·alpha = (sent/B)·B/bandwidth gives B* = steps·alpha·bandwidth / (sent/B); for a ring
    all-reduce 2(W−1)·alpha = 2(W−1)/W·B/bandwidth, so B* = W·alpha·bandwidth: the crossover grows with W."""
    unit = collective_time(op, 1.0, ranks, link, algorithm)
    if unit.bytes_sent_per_rank == 0:
        raise ValueError(f"ranks={ranks} sends nothing for {op}: the crossover needs ranks >= 2")
    return unit.steps * link.latency * link.bandwidth / unit.bytes_sent_per_rank


def ring_tree_crossover(ranks: int, link: Link) -> float:
    """The all-reduce size (bytes) above which the ring beats the (binomial) tree; 0 when it always does.

    Tree: 2L(alpha + B/bandwidth) with L = ceil(log2 W); ring: 2(W−1)·alpha + 2(W−1)/W·B/bandwidth. The tree
    saves 2(W−1−L) latencies and pays 2(L − (W−1)/W)·B/bandwidth more, so they are equal at
        B = alpha·bandwidth·(W − 1 − L) / (L − (W − 1)/W)."""
    if not isinstance(ranks, int) or ranks < 2:
        raise ValueError(f"ranks={ranks!r} must be an integer >= 2")
    depth = math.ceil(math.log2(ranks))
    saved_steps = ranks - 1 - depth
    return max(0.0, link.latency * link.bandwidth * saved_steps / (depth - (ranks - 1) / ranks))


def dp_critical_batch(peak_flops: float, bandwidth: float, dp: int) -> float:
    """The smallest global batch (tokens) for which data parallelism is compute-bound: B > dp·C/W.

    How to Scale Your Model ch. 5: per layer (an MLP of D×F and F×D weights), the backward computes
    8·B·D·F/dp FLOPs on each of dp chips (T_math = 8BDF/(dp·C)) while all-reducing 2 bf16 gradients of D·F
    (T_comm = 8DF/W, the all-reduce costing about twice its bytes): compute-bound iff B/dp > C/W. Parameters,
    layers and precision cancel; on TPU v5p (C = 4.59e14 FLOP/s, W = 1.8e11 B/s) it is 2,550 tokens per chip."""
    for name, value in (("peak_flops", peak_flops), ("bandwidth", bandwidth), ("dp", dp)):
        if not value > 0:
            raise ValueError(f"{name}={value!r} must be > 0")
    return dp * peak_flops / bandwidth
