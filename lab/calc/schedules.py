"""Pipeline schedules as data: for every pipeline rank, the ordered list of operations it runs.

An operation is a forward (F), a backward (B) or — in zero-bubble schedules, which split the backward in
two — an input-gradient backward (B) followed later by a weight-gradient pass (W), for one micro-batch and
one *chunk* of layers. Without interleaving a rank owns one chunk (its stage); with interleaving it owns v
chunks, and chunk c of rank r is virtual stage c·p + r (Megatron's round-robin: rank 0 runs stages 0 and p).
Virtual stage s of S runs the s-th slice of consecutive layers, of the size `lab.layout.stage_layers` gives it
(equal slices by default; Llama 3's first and last stage one layer lighter; or counts given per stage).
`virtual_stage_layers` and `rank_layers` state that rule once for the executor (`lab.parallel.pp.build_chunk`) and
the memory model (`lab.calc.memory`).

The same objects drive the simulator (`lab.calc.bubble`) and the real pipeline (`lab.parallel.pp`), so what
the bubble calculator draws is what the ranks execute. Torch-free.

    afab(p, m)             all forwards, then all backwards (GPipe): m micro-batches in flight
    one_f_one_b(p, m)      p - r - 1 warm-up forwards, then alternate: at most p - r in flight
    interleaved(p, m, v)   1F1B over v chunks per rank: the bubble shrinks by v, messages grow by v
    zb_h1(p, m)            1F1B with B split from W; W's fill the cool-down's bubbles (Qi et al. 2023)
    zb_h2(p, m)            more warm-up forwards (up to 2p - 1 in flight): no bubble inside the step
    dualpipe(p, m)         DeepSeek-V3's bidirectional schedule: half the micro-batches enter at each end
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from lab.config import PP_SCHEDULES
from lab.layout import stage_layers

F, B, W = "F", "B", "W"
SCHEDULES = (*PP_SCHEDULES, "zb-h2", "dualpipe")  # lab.train runs the first four; the others, the simulator


def virtual_stage_of(rank: int, chunk: int, pp: int) -> int:
    """Megatron's round-robin: chunk c of pipeline rank r is virtual stage c·pp + r."""
    return chunk * pp + rank


def virtual_stage_layers(n_layers: int, virtual_stage: int, virtual_stages: int, split: str = "even") -> range:
    """The layers virtual stage `virtual_stage` of `virtual_stages` runs: its slice of consecutive layers, of the
    size `split` gives it (`lab.layout.stage_layers`: "even", "llama3" or counts such as "3,5")."""
    counts = stage_layers(n_layers, virtual_stages, split)
    if not 0 <= virtual_stage < virtual_stages:
        raise ValueError(f"virtual_stage={virtual_stage} must be in [0, {virtual_stages})")
    start = sum(counts[:virtual_stage])
    return range(start, start + counts[virtual_stage])


def rank_layers(n_layers: int, pp: int, chunks: int = 1, split: str = "even") -> list[list[int]]:
    """Layer indices of each pipeline rank: its `chunks` virtual stages, dealt round-robin, in chunk order."""
    return [[layer for chunk in range(chunks)
             for layer in virtual_stage_layers(n_layers, virtual_stage_of(rank, chunk, pp), pp * chunks, split)]
            for rank in range(pp)]


@dataclass(frozen=True, order=True)
class Op:
    kind: str  # F, B (the whole backward, or only its input gradient when the schedule has W ops) or W
    microbatch: int
    chunk: int = 0  # which of the rank's chunks (0 without interleaving)

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class Schedule:
    name: str
    pp: int
    microbatches: int
    chunks: int  # v, chunks of layers per rank
    ops: tuple[tuple[Op, ...], ...]  # ops[r]: what rank r runs, in order
    # DualPipe: two pipelines of p stages over the same ranks, chunk 0 entering at rank 0 and chunk 1 at rank
    # p - 1; each chunk is a whole stage (a copy of its parameters), not 1/v of one
    bidirectional: bool = False

    @property
    def split_backward(self) -> bool:
        """True when backwards are split into B (input gradient) and W (weight gradient)."""
        return any(op.kind == W for rank_ops in self.ops for op in rank_ops)

    @property
    def virtual_stages(self) -> int:
        """Stages a micro-batch goes through."""
        return self.pp if self.bidirectional else self.pp * self.chunks

    @property
    def stage_share(self) -> float:
        """One op's work, in stages (t_f, t_b, t_w are per stage): 1/v when interleaved, else 1."""
        return 1.0 if self.bidirectional else 1 / self.chunks

    def virtual_stage(self, rank: int, chunk: int) -> int:
        if self.bidirectional:
            return rank if chunk == 0 else self.pp - 1 - rank
        return virtual_stage_of(rank, chunk, self.pp)

    def rank_of(self, virtual_stage: int, chunk: int = 0) -> tuple[int, int]:
        """(rank, chunk) that runs a virtual stage (of the pipeline `chunk` runs in, when bidirectional)."""
        if self.bidirectional:
            return (virtual_stage if chunk == 0 else self.pp - 1 - virtual_stage), chunk
        return virtual_stage % self.pp, virtual_stage // self.pp

    def table(self) -> str:
        """One line per rank, e.g. 'rank 0: F0 F1 F2 B0 F3 B1 ...' (chunk shown as .c when interleaved)."""
        return "\n".join(f"rank {r}: " + " ".join(map(str, ops)) for r, ops in enumerate(self.ops))


def _check(p: int, m: int, v: int = 1) -> None:
    for name, value in (("pp", p), ("microbatches", m), ("chunks", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1")


def afab(p: int, m: int) -> Schedule:
    """All forwards, then all backwards, on every rank (GPipe)."""
    _check(p, m)
    ops = tuple(tuple([Op(F, i) for i in range(m)] + [Op(B, i) for i in range(m)]) for _ in range(p))
    return Schedule("afab", p, m, 1, ops)


def _one_f_one_b_rank(p: int, m: int, r: int) -> list[Op]:
    warmup = min(p - r - 1, m)
    ops = [Op(F, i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: one forward, then the oldest backward
        ops += [Op(F, warmup + i), Op(B, i)]
    return ops + [Op(B, i) for i in range(m - warmup, m)]  # cool-down


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-flush): rank r runs p - r - 1 warm-up forwards, then one forward and one backward in
    turn, then the remaining backwards. Same bubble as AFAB, but at most p - r micro-batches in flight."""
    _check(p, m)
    return Schedule("1f1b", p, m, 1, tuple(tuple(_one_f_one_b_rank(p, m, r)) for r in range(p)))


def interleaved(p: int, m: int, v: int, group: int | None = None) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM's order): forwards walk micro-batches in groups
    of `group` (default p), through chunk 0, then chunk 1, ...; backwards likewise, from the last chunk down.
    Rank r warms up with 2(p - r - 1) + (v - 1)·group forwards. Needs m to be a multiple of the group.

    The group is Llama 3's knob N (Llama 3 paper, §3.3.2, Figure 6): N = p is Megatron's depth-first order,
    which finishes each micro-batch soonest; N = m is breadth-first (Lamy-Poirier 2022), which runs every
    micro-batch through a chunk before the next chunk. A larger N holds more activations in the warm-up but
    gives a message N - p slots of slack before it is needed, and lets m be any multiple of N, not of p."""
    _check(p, m, v)
    if group is None and m % p:
        raise ValueError(f"microbatches={m} must be a multiple of pp={p} for the interleaved schedule")
    group = p if group is None else group
    if not isinstance(group, int) or isinstance(group, bool) or not p <= group <= m or m % group:
        raise ValueError(f"group={group!r} micro-batches per chunk must be from pp={p} to microbatches={m} and "
                         f"divide microbatches (for the interleaved schedule)")
    total = m * v

    def unit(k: int, backward: bool) -> Op:  # the k-th forward (or backward) of a rank
        chunk = (k // group) % v
        microbatch = (k // (group * v)) * group + k % group
        return Op(B, microbatch, v - 1 - chunk) if backward else Op(F, microbatch, chunk)

    ranks = []
    for r in range(p):
        warmup = min((p - r - 1) * 2 + (v - 1) * group, total)
        ops = [unit(k, False) for k in range(warmup)]
        for i in range(total - warmup):
            ops += [unit(warmup + i, False), unit(i, True)]
        ranks.append(tuple(ops + [unit(k, True) for k in range(total - warmup, total)]))
    return Schedule("interleaved", p, m, v, tuple(ranks))


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with every backward split into B
    (the input gradient, which the previous stage is waiting for) and W (the weight gradient, needed only by
    the optimizer step). Rank r lets up to r W's wait and runs the rest right after their B; the waiting
    ones fill the end of the step. Later ranks start r·t_f late but have W's to fill their waits, and each
    rank holds at most r pending W's plus 1F1B's p - r forwards: never more than p micro-batches, like
    1F1B's first stage. The bubble falls from (p-1)(t_f + t_b) to (p-1)(t_f + t_b - 2·t_w)."""
    _check(p, m)
    ranks = []
    for r in range(p):
        ops, waiting = [], []
        for op in _one_f_one_b_rank(p, m, r):
            ops.append(op)
            if op.kind == B:
                waiting.append(Op(W, op.microbatch))
                if len(waiting) > r:
                    ops.append(waiting.pop(0))
        ranks.append(tuple(ops + waiting))
    return Schedule("zb-h1", p, m, 1, tuple(ranks))


def zb_h2(p: int, m: int) -> Schedule:
    """ZB-H2 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §2.2): ZB-H1 with more memory. Rank r warms
    up with up to 2(p - r) - 1 forwards (holding up to 2p - 1 micro-batches, against 1F1B's p), so that its
    first B meets no gap, and its W's wait for the tail. With T_F = T_B = T_W (here t_f = t_b - t_w = t_w) and
    m >= 2p every rank is busy from its first op to its last: the timeline is a parallelogram, not 1F1B's
    trapezoid. What remains is the fill offset (p - 1)·t_f at the step's two ends, which the paper removes by
    letting one step's end overlap the next's start (it validates the optimizer step afterwards, §4).

    The order is a list schedule played in unit slots: at every slot a rank runs its oldest ready B, else its
    next forward while fewer than 2(p - r) - 1 micro-batches await their B (and fewer than 2p - 1 their W),
    else its oldest waiting W."""
    _check(p, m)
    forward_done = [[-1] * m for _ in range(p)]  # the slot in which rank r ran F(i), -1 before it has
    backward_done = [[-1] * m for _ in range(p)]
    next_f, next_b = [0] * p, [0] * p
    waiting: list[deque] = [deque() for _ in range(p)]  # micro-batches whose B ran and whose W has not
    ops: list[list[Op]] = [[] for _ in range(p)]

    def ran(done: list[int], i: int, slot: int) -> bool:
        return 0 <= done[i] < slot

    slot = 0
    while any(len(rank_ops) < 3 * m for rank_ops in ops):
        chosen = []
        for r in range(p):
            i, j = next_b[r], next_f[r]
            upstream = forward_done[r] if r == p - 1 else backward_done[r + 1]
            if i < j and ran(upstream, i, slot):
                chosen.append((r, Op(B, i)))
            elif j < m and (r == 0 or ran(forward_done[r - 1], j, slot)) and j - i < 2 * (p - r) - 1 \
                    and j - i + len(waiting[r]) < 2 * p - 1:
                chosen.append((r, Op(F, j)))
            elif waiting[r]:
                chosen.append((r, Op(W, waiting[r][0])))
        for r, op in chosen:  # every rank chose from the state at the slot's start
            ops[r].append(op)
            if op.kind == F:
                forward_done[r][op.microbatch], next_f[r] = slot, next_f[r] + 1
            elif op.kind == B:
                backward_done[r][op.microbatch], next_b[r] = slot, next_b[r] + 1
                waiting[r].append(op.microbatch)
            else:
                waiting[r].popleft()
        slot += 1
    return Schedule("zb-h2", p, m, 1, tuple(tuple(rank_ops) for rank_ops in ops))


def dualpipe(p: int, m: int) -> Schedule:
    """DualPipe (DeepSeek-V3, 2024): m/2 micro-batches enter at rank 0 (chunk 0: stage r on rank r) while the
    other m/2 enter at rank p-1 (chunk 1: stage r on rank p-1-r), so every rank holds two stages and the two
    pipelines fill each other's bubbles. The order follows DeepSeek's eight phases; h is a rank's distance
    from the nearer end, and "phase 0" is the pipeline entering at that end:

      1  2(p/2-h-1) F0            warm-up of the near pipeline
      2  h+1 × (F0 F1)            the far pipeline arrives
      3  p/2-h-1 × (B1 W1 F1)     zero-bubble backwards of the far pipeline
      4  m/2-p+h+1 × (F0 B1 F1 B0)  steady state: each F paired with a B (on GPUs, their compute and
                                   communication overlap; here they run one after the other)
      5  p/2-h-1 × (B1 F1 B0)
      6  h+1 × (B1 B0)            the second half of these split their W off
      7  p/2-h-1 × (W B0)
      8  h+1 × W                  the weight gradients still waiting

    Needs p even and m even, m >= 2p. The bubble: (p/2 - 1)(F&B + B - 3W) in the paper's units (F&B an
    overlapped forward and backward), for twice the parameters (each rank holds two stages)."""
    _check(p, m)
    if p % 2:
        raise ValueError(f"pp={p} must be even for dualpipe: ranks pair up from both ends")
    if m % 2 or m < 2 * p:
        raise ValueError(f"microbatches={m} must be even and >= 2*pp = {2 * p} for dualpipe")
    return Schedule("dualpipe", p, m, 2, tuple(_dualpipe_rank(p, m, r) for r in range(p)), bidirectional=True)


def _dualpipe_rank(p: int, m: int, r: int) -> tuple[Op, ...]:
    half = m // 2
    flip, h = int(r >= p // 2), min(r, p - 1 - r)  # phase 0 is chunk 0 on the first half of the ranks
    next_f, next_b, waiting, ops = [0, 0], [0, 0], deque(), []

    def forward(phase: int) -> None:
        chunk = phase ^ flip
        ops.append(Op(F, chunk * half + next_f[chunk], chunk))
        next_f[chunk] += 1

    def backward(phase: int, split: bool = False) -> None:
        chunk = phase ^ flip
        op = Op(B, chunk * half + next_b[chunk], chunk)
        next_b[chunk] += 1
        ops.append(op)
        if split:  # the weight gradient waits in a queue for a W slot
            waiting.append(Op(W, op.microbatch, chunk))

    for _ in range(2 * (p // 2 - h - 1)):
        forward(0)
    for _ in range(h + 1):
        forward(0), forward(1)
    for _ in range(p // 2 - h - 1):
        backward(1, split=True), ops.append(waiting.popleft()), forward(1)
    for _ in range(half - p + h + 1):
        forward(0), backward(1), forward(1), backward(0)
    for _ in range(p // 2 - h - 1):
        backward(1), forward(1), backward(0)
    split = False
    for i in range(h + 1):
        split = split or (i == (h + 1) // 2 and h % 2 == 1)
        backward(1, split)
        split = split or (i == (h + 1) // 2 and h % 2 == 0)
        backward(0, split)
    for _ in range(p // 2 - h - 1):
        ops.append(waiting.popleft()), backward(0, split=True)
    return tuple(ops + list(waiting))


def make_schedule(name: str, pp: int, microbatches: int, chunks: int = 1) -> Schedule:
    """A schedule by name: "afab", "1f1b", "interleaved" (with `chunks` > 1), "zb-h1", "zb-h2" or "dualpipe"."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} must be one of {', '.join(map(repr, SCHEDULES))}")
    if name == "interleaved":
        if chunks < 2:
            raise ValueError(f"chunks={chunks} must be >= 2 for the interleaved schedule (1 is plain 1f1b)")
        return interleaved(pp, microbatches, chunks)
    if chunks != 1:
        raise ValueError(f"chunks={chunks}: only the interleaved schedule runs several chunks per rank")
    return {"afab": afab, "1f1b": one_f_one_b, "zb-h1": zb_h1, "zb-h2": zb_h2,
            "dualpipe": dualpipe}[name](pp, microbatches)
