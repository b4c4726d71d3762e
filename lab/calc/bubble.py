"""The pipeline bubble, simulated and in closed form.

`simulate` plays a `Schedule` (lab.calc.schedules) as a discrete-event simulation: every rank runs its ops
in order, each op as soon as the rank is free and its input exists — a forward needs the previous virtual
stage's forward of the same micro-batch, a backward the next stage's backward (the last stage: its own
forward), a W its own B — plus `p2p` seconds whenever that input comes from another rank. The time model:

    t_f  forward of one micro-batch through one stage (a rank's layers when not interleaved)
    t_b  its whole backward (input and weight gradients); usually about 2·t_f
    t_w  the weight-gradient part of t_b: split schedules run B in t_b - t_w and W in t_w

With v chunks per rank each chunk op takes 1/v of these. When the virtual stages hold different numbers of layers
(`lab.layout.stage_layers`: Llama 3's lighter first and last stage), `simulate(..., layers=counts)` makes these an
average stage's times and scales each stage's ops by its layers over the average.

Two ways to state the bubble, both reported: `bubble_ratio` = idle / useful time per rank (the playbook's
r_bubble: (p-1)/(v·m) for AFAB, 1F1B and interleaved 1F1B, whatever t_f and t_b, without latency) and
`idle_fraction` = idle / makespan ((p-1)/(m+p-1) for AFAB and 1F1B). Idle time counts from the step's start to the
makespan on every rank. The closed forms assume equal stages.
Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from lab.calc.schedules import B, F, Op, Schedule, W, make_schedule
from lab.layout import check_count, pp_chunks


@dataclass(frozen=True)
class Span:
    rank: int
    op: Op
    start: float
    end: float


@dataclass
class Simulation:
    schedule: Schedule
    spans: list[Span]
    makespan: float
    busy: list[float]  # per rank
    peak_activations: list[float]  # per rank: micro-batches' worth of a whole stage held at once
    p2p_messages: int
    durations: dict[str, float] = field(default_factory=dict)

    @property
    def idle(self) -> list[float]:
        return [self.makespan - b for b in self.busy]

    @property
    def bubble_ratio(self) -> float:
        """Idle over useful time on the busiest rank's pipeline (all ranks do the same work)."""
        return max(self.idle) / max(self.busy)

    @property
    def interior_idle(self) -> list[float]:
        """Per rank, the idle time between its first op's start and its last op's end: the bubble a schedule
        leaves inside the step, without the fill offsets at its two ends (zero for ZB-H2's parallelogram)."""
        return [max(s.end for s in self.spans if s.rank == r) - min(s.start for s in self.spans if s.rank == r)
                - self.busy[r] for r in range(self.schedule.pp)]

    @property
    def idle_fraction(self) -> float:
        return sum(self.idle) / (self.makespan * len(self.busy))

    def as_dict(self) -> dict:
        return {"schedule": self.schedule.name, "pp": self.schedule.pp, "microbatches": self.schedule.microbatches,
                "chunks": self.schedule.chunks, "bubble_ratio": self.bubble_ratio,
                "idle_fraction": self.idle_fraction, "makespan": self.makespan, "idle": self.idle,
                "peak_activations": self.peak_activations, "p2p_messages": self.p2p_messages}


def op_durations(tf: float, tb: float, tw: float, share: float = 1.0) -> dict[str, float]:
    """Time of one op over `share` of a stage: F, B (the whole backward), "Bsplit" (a backward whose weight
    gradients a later W computes: t_b - t_w) and W."""
    for name, value in (("tf", tf), ("tb", tb), ("tw", tw)):
        if not (isinstance(value, int | float) and 0 <= value < math.inf):
            raise ValueError(f"{name}={value!r} must be a finite number >= 0")
    if tf == tb == 0:
        raise ValueError("tf=0 and tb=0: at least one of the forward and the backward must take time")
    if tw > tb:
        raise ValueError(f"tw={tw} must be <= tb={tb}: the weight gradients are part of the backward")
    return {F: tf * share, B: tb * share, "Bsplit": (tb - tw) * share, W: tw * share}


def _dependency(schedule: Schedule, rank: int, op: Op) -> tuple[Op, int] | None:
    """(the op this one waits for, the rank running it), or None when it waits for nothing but its rank."""
    stage, last = schedule.virtual_stage(rank, op.chunk), schedule.virtual_stages - 1
    if op.kind == F:
        if stage == 0:
            return None
        prev_rank, prev_chunk = schedule.rank_of(stage - 1, op.chunk)
        return Op(F, op.microbatch, prev_chunk), prev_rank
    if op.kind == B:
        if stage == last:
            return Op(F, op.microbatch, op.chunk), rank
        next_rank, next_chunk = schedule.rank_of(stage + 1, op.chunk)
        return Op(B, op.microbatch, next_chunk), next_rank
    return Op(B, op.microbatch, op.chunk), rank


def simulate(schedule: Schedule, tf: float = 1.0, tb: float = 2.0, tw: float = 1.0, p2p: float = 0.0,
             layers: Sequence[int] | None = None) -> Simulation:
    """Play `schedule` with these op costs; raises ValueError if the schedule deadlocks. `layers`: the layer
    count of each virtual stage, when they differ; an op of stage s then takes layers[s] / their mean of its cost
    (tf, tb and tw being an average stage's)."""
    if not (isinstance(p2p, int | float) and 0 <= p2p < math.inf):
        raise ValueError(f"p2p={p2p!r} must be a finite number >= 0")
    costs = op_durations(tf, tb, tw, schedule.stage_share)
    deferred = {(r, op.microbatch, op.chunk) for r, ops in enumerate(schedule.ops) for op in ops if op.kind == W}
    stages = schedule.virtual_stages
    if layers is not None and (len(layers) != stages or min(layers) < 1):
        raise ValueError(f"layers={list(layers)} must give {stages} virtual stages >= 1 layer each")
    weight = [1.0] * stages if layers is None else [n * stages / sum(layers) for n in layers]

    def duration(rank: int, op: Op) -> float:
        scale = weight[schedule.virtual_stage(rank, op.chunk)]
        if op.kind == B and (rank, op.microbatch, op.chunk) in deferred:
            return costs["Bsplit"] * scale  # its weight gradients come later, in a W
        return costs[op.kind] * scale

    p = schedule.pp
    finished: dict[tuple[int, Op], float] = {}
    free, position = [0.0] * p, [0] * p
    spans: list[Span] = []
    messages = 0
    while any(position[r] < len(schedule.ops[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while position[r] < len(schedule.ops[r]):
                op = schedule.ops[r][position[r]]
                dep = _dependency(schedule, r, op)
                ready = 0.0
                if dep is not None:
                    dep_op, dep_rank = dep
                    if (dep_rank, dep_op) not in finished:
                        break
                    ready = finished[(dep_rank, dep_op)] + (p2p if dep_rank != r else 0.0)
                    messages += dep_rank != r
                start = max(free[r], ready)
                end = start + duration(r, op)
                finished[(r, op)] = free[r] = end
                spans.append(Span(r, op, start, end))
                position[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: str(schedule.ops[r][position[r]]) for r in range(p) if position[r] < len(schedule.ops[r])}
            raise ValueError(f"schedule {schedule.name!r} deadlocks: ranks wait forever at {stuck}")
    makespan = max(free)
    busy = [sum(s.end - s.start for s in spans if s.rank == r) for r in range(p)]
    return Simulation(schedule, spans, makespan, busy, _peak_activations(schedule, spans), messages, costs)


def _peak_activations(schedule: Schedule, spans: list[Span]) -> list[float]:
    """Most activations a rank holds at once, in micro-batches of a whole stage (an interleaved chunk holds
    1/v): a forward stores them when it starts; they are freed when the backward ends — or, when a W comes
    later, when the W ends, since the weight gradients need the layers' inputs (what `lab.parallel.pp`
    holds too)."""
    peaks = []
    for r in range(schedule.pp):
        mine = [s for s in spans if s.rank == r]
        deferred = {(s.op.microbatch, s.op.chunk) for s in mine if s.op.kind == W}
        events = []
        for s in mine:
            if s.op.kind == F:
                events.append((s.start, 1))
            elif (s.op.kind == W) == ((s.op.microbatch, s.op.chunk) in deferred):  # the op that frees
                events.append((s.end, -1))
        held = peak = 0.0
        for _, change in sorted(events):  # at equal times, frees come first
            held += change * schedule.stage_share
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def bubble_ratio(pp: int, microbatches: int, chunks: int = 1) -> float:
    """The playbook's closed form, idle / useful: (p - 1) / (v·m), for AFAB, 1F1B and interleaved 1F1B."""
    return (pp - 1) / (chunks * microbatches)


def min_microbatches(pp: int, target: float, chunks: int = 1) -> int:
    """The fewest micro-batches whose bubble ratio (p - 1)/(v·m) is at most `target`: ceil((p - 1)/(v·target)),
    rounded up to a multiple of p when interleaved (Megatron's schedule walks micro-batches in groups of p).
    The global batch then has to hold m micro-batches per data-parallel replica: the real constraint."""
    if not (isinstance(target, int | float) and 0 < target < math.inf):
        raise ValueError(f"target={target!r} must be a bubble ratio > 0")
    check_count("pp", pp)
    check_count("chunks", chunks)
    m = max(1, math.ceil((pp - 1) / (chunks * target) - 1e-9))  # 21 / 0.35 = 60.00000000000001
    return m if chunks == 1 else math.ceil(m / pp) * pp


def boundary_bytes(micro_batch: int, seq: int, d_model: int, dtype_bytes: int = 2, seq_shards: int = 1) -> int:
    """Bytes of one message across a pipeline boundary: one micro-batch's residual stream (b, s / seq_shards, h)
    going forward, or its gradient coming back — what `lab.parallel.pp.Boundary` describes. A boundary carries
    two per micro-batch and step, whatever the number of layers in a stage."""
    return micro_batch * seq // seq_shards * d_model * dtype_bytes


def zb_h1_bubble(pp: int, tf: float, tb: float, tw: float) -> float:
    """Idle time per rank of ZB-H1: (p - 1)(t_f + t_b - 2·t_w), against 1F1B's (p - 1)(t_f + t_b). Exact in the
    paper's regime — m >= p, and each waiting W no longer than the F or the B whose gap it fills (t_w <= t_f,
    t_w <= t_b - t_w); `simulate` gives the rest."""
    return (pp - 1) * (tf + tb - 2 * tw)


def dualpipe_bubble(pp: int, tf: float, tb: float, tw: float) -> float:
    """Idle time per rank of DualPipe's order as this simulator plays it, (p/2 - 1)(t_f + 2(t_b - t_w) - 3·t_w),
    in the regime t_f = t_b - t_w = 2·t_w. DeepSeek-V3's table writes (PP/2 - 1)(F&B + B - 3W), with B the
    whole backward and F&B a forward and a backward whose compute and communication overlap on the GPU; the
    simulator runs the two one after the other and counts what that order leaves idle."""
    return (pp / 2 - 1) * (tf + 2 * (tb - tw) - 3 * tw)


def closed_form(schedule: str, pp: int, microbatches: int, chunks: int = 1, tf: float = 1.0, tb: float = 2.0,
                tw: float = 1.0, p2p: float = 0.0) -> dict:
    """The textbook answer next to the simulated one: {"bubble_ratio", "idle" (per rank), "formula",
    "exact_when", "exact" (whether these inputs meet it)}. (p-1)/(v·m) holds for any t_f, t_b without latency."""
    useful = microbatches * (tf + tb)  # per rank, whatever the schedule: every op once
    if schedule == "dualpipe":  # DeepSeek-V3's table, B and W being the split backward's two parts
        idle = dualpipe_bubble(pp, tf, tb, tw)
        return {"bubble_ratio": idle / useful, "idle": idle,
                "formula": "idle = (p/2-1)(tf + 2(tb-tw) - 3·tw), F and B not overlapped",
                "exact_when": "m >= 2p, tf = tb - tw = 2·tw, p2p = 0",
                "exact": microbatches >= 2 * pp and tf == tb - tw == 2 * tw and p2p == 0}
    if schedule == "zb-h2":
        idle = (pp - 1) * tf  # only the fill offset: the last rank starts (p-1)·t_f late, the first ends as early
        return {"bubble_ratio": idle / useful, "idle": idle, "formula": "idle = (p-1)·tf, none inside the step",
                "exact_when": "m >= 2p, tf = tb - tw = tw, p2p = 0",
                "exact": microbatches >= 2 * pp and tf == tb - tw == tw and p2p == 0}
    if schedule == "zb-h1":
        idle = zb_h1_bubble(pp, tf, tb, tw)
        return {"bubble_ratio": idle / useful, "idle": idle, "formula": "idle = (p-1)(tf + tb - 2·tw)",
                "exact_when": "m >= p, tw <= tf, tw <= tb - tw, p2p = 0",
                "exact": microbatches >= pp and tw <= tf and 2 * tw <= tb and p2p == 0}
    ratio = bubble_ratio(pp, microbatches, chunks)
    return {"bubble_ratio": ratio, "idle": ratio * useful, "formula": "bubble ratio = (p-1)/(v·m)",
            "exact_when": "p2p = 0", "exact": p2p == 0}


MAX_OPS = 65_536  # pp x microbatches x chunks: beyond this the simulator takes seconds


def explore(schedule: str, pp: int, microbatches: int, chunks: int | None = None, tf: float = 1.0,
            tb: float = 2.0, tw: float = 1.0, p2p: float = 0.0) -> Simulation:
    """Build a schedule by name and simulate it: what the CLI and the pipeline explorer widget call.
    `chunks=None` means 2 for interleaved, else 1."""
    chunks = pp_chunks(schedule, chunks) if chunks is not None else pp_chunks(schedule)
    schedule_ = make_schedule(schedule, pp, microbatches, chunks)
    if pp * microbatches * chunks > MAX_OPS:
        raise ValueError(f"pp x microbatches x chunks = {pp * microbatches * chunks:,} must be at most "
                         f"{MAX_OPS:,} (the simulator plays every op)")
    return simulate(schedule_, tf, tb, tw, p2p)
