"""The failures that do not crash: a rank that is slow (a straggler) and a rank whose replicated state silently
differs from its peers' (silent data corruption). Neither raises an error or kills a process; both are found only
by comparing a rank with the ranks that should match it.

What belongs here: the comparisons, over numbers and tensors the caller hands in, and the one collective that
gathers a checksum per tensor. What does not: which tensors are replicated and over which group (the trainer asks
its layout), and the injection of either failure (`lab.faults`). This package knows nothing of the techniques above
it, so nothing here imports from `lab.parallel` or `lab.model`.

**Stragglers.** A synchronous step ends when its slowest rank does: every other rank waits in the gradient
all-reduce for it. A rank's *compute time* (step start to the end of its backward, before it waits) shows who is
slow; its *step time* is the same on every rank (they leave the all-reduce together), so it only shows the cost.
`find_straggler` reads both, per step and per rank (`lab.train` gathers them to rank 0 with one small all-gather
per step), and names a rank whose compute time is, step after step, well above the others'.

**Silent data corruption.** Data-parallel replicas hold identical parameters and optimizer states: the same
averaged gradients, the same update, bit for bit. A flipped bit in one replica's memory (a faulty core or HBM
cell; Meta's Llama 3 report and Google's Gemini model report, "Gemini: A Family of Highly Capable Multimodal
Models", §3 Training Infrastructure, both name silent data corruption among their interruptions) raises nothing,
and the replicas drift apart from then on. Comparing the replicas finds it: each rank sums the *bit
patterns* of each tensor, as 64-bit integer words (`checksum`), the sums are all-gathered over the data-parallel
group (8 bytes per tensor per rank), and a tensor whose sums disagree names the rank that differs from the majority.

Why the bits and not the values: a float sum rounds. A flip in a low mantissa bit changes one element by one ulp,
far below the rounding of a sum over thousands of elements, so the float sums of a corrupt and a clean replica are
often equal. The integer sum of the words changes by exactly ±2^k (mod 2^64) for any single flipped bit, so it never
misses one. It reads every byte of the state once (the parameters, and with Adam two states per parameter: 12 bytes
per fp32 parameter) at memory speed: ~20 GB/s on one CPU core (0.4 GB in ~20 ms), a few ms per GB on a GPU's HBM —
about one optimizer step's reads, plus one tiny all-gather. So it is cheap enough to run every few steps, and N
is chosen by what a corruption may spoil: a check every N steps finds it within N steps, and the run resumes from
the checkpoint before it (`lab.train --sdc-check N`; chapter 08b measures the cost on the tiny and a larger model).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lab.distributed.comm import all_gather_single


def checksum(tensor: torch.Tensor) -> int:
    """The sum, wrapping mod 2^64, of the tensor's bytes read as 64-bit integers (a last partial word as its own
    integer). A single flipped bit changes one word by ±2^k, k < 64, so it always changes the sum — which a float
    sum of the values does not guarantee. 64-bit words, not one integer per element: a sum of int64 runs at memory
    speed, while widening int32 elements to int64 first is ~30x slower on a CPU."""
    data = tensor.detach().contiguous().view(-1).view(torch.uint8)
    whole = data.numel() // 8 * 8
    words = data[:whole]
    if words.storage_offset() % 8:  # a view at an odd offset into its storage: copy it to an aligned one
        words = words.clone()
    total = int(words.view(torch.int64).sum()) + sum(int(b) << (8 * i) for i, b in enumerate(data[whole:].tolist()))
    return (total + 2**63) % 2**64 - 2**63  # back into int64's range, to be gathered as one


@dataclass(frozen=True)
class Mismatch:
    """A tensor whose replicas disagree: `ranks` differ from the majority (all the group's ranks when there is
    none, as with two replicas, which cannot say which of them is corrupt)."""

    name: str
    ranks: tuple[int, ...]
    majority: bool

    def describe(self) -> str:
        if self.majority:
            who = " and ".join(f"rank {r}" for r in self.ranks)
            return f"{who} differ{'s' if len(self.ranks) == 1 else ''} from the other replicas in {self.name}"
        return (f"ranks {', '.join(map(str, self.ranks))} disagree on {self.name} with no majority "
                f"(two replicas cannot say which one is corrupt; a third can)")


class SilentDataCorruption(RuntimeError):
    """Data-parallel replicas that must be identical are not: one rank's state was corrupted in place."""


def compare_checksums(names: list[str], sums: list[list[int]], ranks: list[int]) -> list[Mismatch]:
    """The tensors whose checksums differ between replicas. `sums[i][j]` is replica i's checksum of tensor
    `names[j]`; `ranks[i]` its global rank. A rank is named when it differs from a strict majority of the group."""
    mismatches = []
    for j, name in enumerate(names):
        column = [row[j] for row in sums]
        if len(set(column)) == 1:
            continue
        common = max(set(column), key=column.count)
        if column.count(common) * 2 > len(column):
            odd = tuple(rank for rank, value in zip(ranks, column, strict=True) if value != common)
            mismatches.append(Mismatch(name, odd, True))
        else:
            mismatches.append(Mismatch(name, tuple(ranks), False))
    return mismatches


def check_replicas(named: Iterable[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None = None
                   ) -> list[Mismatch]:
    """Compare every tensor of `named` with the same tensor on the other ranks of `group` (which must all hold
    the same tensors, in the same order): one all-gather of one int64 per tensor. Every rank gets the same answer."""
    pairs = list(named)
    names, tensors = [name for name, _ in pairs], [tensor for _, tensor in pairs]
    device = tensors[0].device if tensors else torch.device("cpu")
    local = torch.tensor([checksum(t) for t in tensors], dtype=torch.int64, device=device)
    size = dist.get_world_size(group)
    gathered = torch.empty(size * len(names), dtype=torch.int64, device=device)
    all_gather_single(gathered, local, group=group)
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    return compare_checksums(names, gathered.view(size, len(names)).tolist(), ranks)


def state_bytes(named: Iterable[tuple[str, torch.Tensor]]) -> int:
    """The bytes one check reads on each rank."""
    return sum(t.numel() * t.element_size() for _, t in named)


@dataclass(frozen=True)
class Straggler:
    """A rank whose compute takes `excess_s` longer per step than the median of the other ranks': every
    synchronous step waits that long for it, out of a step of `step_s` (both medians over the steps read)."""

    rank: int
    excess_s: float
    step_s: float

    def describe(self) -> str:
        ms = self.excess_s * 1e3
        return (f"rank {self.rank} is the straggler: +{ms:.0f} ms/step of compute over the other ranks, who wait for "
                f"it in the gradient all-reduce; it costs every synchronous step {ms:.0f} ms "
                f"({self.excess_s / self.step_s:.0%} of a {self.step_s * 1e3:.0f} ms step)")


def rank_excess(compute_s: list[list[float]]) -> list[float]:
    """Per rank, the median over steps of (its compute time - the median of the other ranks' that step).
    `compute_s[step][rank]`. Medians, not means: one step descheduled by the OS does not make a straggler."""
    ranks = len(compute_s[0])
    return [statistics.median(row[r] - statistics.median(row[:r] + row[r + 1:]) for row in compute_s)
            for r in range(ranks)]


def find_straggler(compute_s: list[list[float]], step_s: list[list[float]], fraction: float = 0.2,
                   floor_s: float = 0.002) -> Straggler | None:
    """The slowest rank if its compute exceeds the others' by more than `fraction` of the median step (and by
    `floor_s` at least, below which timer and scheduling noise dominate), else None. `compute_s[step][rank]` and
    `step_s[step][rank]` as `lab.train` logs them; the first step (communicators built, allocator warmed) is
    left out when there are others. One rank alone cannot straggle: it has no one to wait for it."""
    if len(compute_s) > 1:
        compute_s, step_s = compute_s[1:], step_s[1:]
    if not compute_s or len(compute_s[0]) < 2:
        return None
    excess = rank_excess(compute_s)
    slowest = max(range(len(excess)), key=excess.__getitem__)
    step = statistics.median(max(row) for row in step_s)
    if excess[slowest] <= max(floor_s, fraction * step):
        return None
    return Straggler(slowest, excess[slowest], step)
