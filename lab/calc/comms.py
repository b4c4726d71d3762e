"""The alpha-beta cost model of collectives: time = steps * alpha + bytes on the busiest link / bandwidth.

For a tensor of B bytes on W ranks (B is the all-reduce input, the all-gather output, the
reduce-scatter input):

  algorithm  operation                     steps          bytes each rank sends
  ring       all_reduce                    2(W-1)         2(W-1)/W * B
  ring       all_gather, reduce_scatter    W-1            (W-1)/W * B
  pairwise   all_to_all                    W-1            (W-1)/W * B
  tree       broadcast, reduce             ceil(log2 W)   B per step (the root's link is the bottleneck)
  tree       all_reduce (reduce + bcast)   2 ceil(log2 W) B per step

Small messages are latency-bound (steps * alpha dominates), large ones bandwidth-bound: the ring's bytes
per rank do not grow with W, the tree's steps grow only like log W.

nccl-tests report an *algorithm bandwidth* algbw = B / time and a *bus bandwidth* busbw = algbw * factor
(2(W-1)/W for all-reduce, (W-1)/W for all-gather, reduce-scatter and all-to-all, 1 otherwise): busbw is
what each link actually carried, comparable across W and with the hardware's peak.

Across nodes a flat ring runs at the speed of its slowest link; the `hierarchical` all-reduce does a
reduce-scatter inside each node (fast link), an all-reduce of 1/g of the data across nodes, and an
all-gather inside the node — the reason tensor parallelism stays inside a node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lab.calc.network import SYSTEMS, Link

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

    @property
    def algbw(self) -> float:
        return self.bytes / self.time_s if self.time_s else math.inf

    @property
    def busbw(self) -> float:
        return self.algbw * bus_factor(self.op, self.ranks)

    def as_dict(self) -> dict:
        return {"op": self.op, "algorithm": self.algorithm, "ranks": self.ranks, "bytes": self.bytes,
                "steps": self.steps, "bytes_sent_per_rank": self.bytes_sent_per_rank, "time_s": self.time_s,
                "algbw": self.algbw, "busbw": self.busbw}


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
    return CommCost(op, algorithm, w, nbytes, steps, sent, steps * link.latency + sent / link.bandwidth)


def collective_time(op: str, nbytes: float, ranks: int, link: Link | None = None, algorithm: str = "ring",
                    system: str | None = None, gpus_per_node: int | None = None) -> CommCost:
    """Cost of one collective. Give a `link` (one network for all ranks) or a `system` name
    ("h100", ...) whose nodes of `gpus_per_node` use the fast link inside and the slow one between."""
    _validate(op, nbytes, ranks, algorithm, link, system)
    if link is not None:
        return _flat(op, nbytes, ranks, link, algorithm)
    spec = SYSTEMS[system]
    g = gpus_per_node or spec.gpus_per_node
    if ranks <= g:
        return _flat(op, nbytes, ranks, spec.intra, algorithm)
    if ranks % g:
        raise ValueError(f"ranks={ranks} must be a multiple of gpus_per_node={g} when it spans nodes")
    if algorithm != "hierarchical" or op != "all_reduce":
        return _flat(op, nbytes, ranks, spec.inter, algorithm)  # a flat ring runs at its slowest link
    inside_rs = _flat("reduce_scatter", nbytes, g, spec.intra, "ring")
    across = _flat("all_reduce", nbytes / g, ranks // g, spec.inter, "ring")
    inside_ag = _flat("all_gather", nbytes, g, spec.intra, "ring")
    parts = (inside_rs, across, inside_ag)
    return CommCost(op, algorithm, ranks, nbytes, sum(p.steps for p in parts),
                    sum(p.bytes_sent_per_rank for p in parts), sum(p.time_s for p in parts))


def _validate(op: str, nbytes: float, ranks: int, algorithm: str, link: Link | None, system: str | None) -> None:
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
    if system is not None and system not in SYSTEMS:
        raise ValueError(f"system={system!r} must be one of {', '.join(SYSTEMS)}")


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
