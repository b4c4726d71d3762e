"""Pipeline schedules as data: for every pipeline rank, the ordered list of operations it runs.

An operation is a forward (F), a backward (B) or — in zero-bubble schedules, which split the backward in
two — an input-gradient backward (B) followed later by a weight-gradient pass (W), for one micro-batch and
one *chunk* of layers. Without interleaving a rank owns one chunk (its stage); with interleaving it owns v
chunks, and chunk c of rank r is virtual stage c·p + r (Megatron's round-robin: rank 0 runs stages 0 and p).

The same objects drive the simulator (`lab.calc.bubble`) and the real pipeline (`lab.parallel.pp`), so what
the bubble calculator draws is what the ranks execute. Torch-free.

    afab(p, m)             all forwards, then all backwards (GPipe): m micro-batches in flight
    one_f_one_b(p, m)      p - r - 1 warm-up forwards, then alternate: at most p - r in flight
    interleaved(p, m, v)   1F1B over v chunks per rank: the bubble shrinks by v, messages grow by v
    zb_h1(p, m)            1F1B with B split from W; W's fill the cool-down's bubbles (Qi et al. 2023)
"""

from __future__ import annotations

from dataclasses import dataclass

from lab.config import PP_SCHEDULES as SCHEDULES

F, B, W = "F", "B", "W"


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

    @property
    def split_backward(self) -> bool:
        """True when backwards are split into B (input gradient) and W (weight gradient)."""
        return any(op.kind == W for rank_ops in self.ops for op in rank_ops)

    @property
    def virtual_stages(self) -> int:
        return self.pp * self.chunks

    def virtual_stage(self, rank: int, chunk: int) -> int:
        return chunk * self.pp + rank

    def rank_of(self, virtual_stage: int) -> tuple[int, int]:
        """(rank, chunk) that runs a virtual stage."""
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


def interleaved(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM's order): forwards walk micro-batches in groups
    of p, through chunk 0, then chunk 1, ...; backwards likewise, from the last chunk down. Rank r warms up
    with 2(p - r - 1) + (v - 1)·p forwards. Needs m to be a multiple of p."""
    _check(p, m, v)
    if m % p:
        raise ValueError(f"microbatches={m} must be a multiple of pp={p} for the interleaved schedule")
    total = m * v

    def unit(k: int, backward: bool) -> Op:  # the k-th forward (or backward) of a rank
        group = k // p
        chunk = group % v
        microbatch = (k // (p * v)) * p + k % p
        return Op(B, microbatch, v - 1 - chunk) if backward else Op(F, microbatch, chunk)

    ranks = []
    for r in range(p):
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
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


def make_schedule(name: str, pp: int, microbatches: int, chunks: int = 1) -> Schedule:
    """A schedule by name: "afab", "1f1b", "interleaved" (with `chunks` > 1) or "zb-h1"."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} must be one of {', '.join(map(repr, SCHEDULES))}")
    if name == "interleaved":
        if chunks < 2:
            raise ValueError(f"chunks={chunks} must be >= 2 for the interleaved schedule (1 is plain 1f1b)")
        return interleaved(pp, microbatches, chunks)
    if chunks != 1:
        raise ValueError(f"chunks={chunks}: only the interleaved schedule runs several chunks per rank")
    return {"afab": afab, "1f1b": one_f_one_b, "zb-h1": zb_h1}[name](pp, microbatches)
