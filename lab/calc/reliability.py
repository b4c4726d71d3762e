"""Failures and checkpoints at scale: how often a job fails, what a checkpoint weighs, how often to save one,
and which saved pieces a rank reads when it resumes at another layout.

**Failures.** A synchronous job stops when any one of its N GPUs (or their hosts, links, switches) fails, so with
independent failures at a constant rate the job's mean time between failures is M = M_gpu / N. Llama 3 405B saw
419 unexpected interruptions in a 54-day snapshot on 16,384 H100s (Llama Team 2024, "The Llama 3 Herd of
Models", §3.3.4, Table 5): M = 3.1 hours for the job, about 5.8 years per GPU.

**How often to save.** Saving after every τ seconds of work, at C seconds a save, a failure costs on average half a
segment of work redone, plus R seconds of restart. To first order in τ/M and C/M the share of time lost is

    waste(τ) = C/τ + τ/(2M) + R/M            (saving, redoing, restarting)

minimal at Young's interval τ* = sqrt(2·C·M) (Young 1974, "A first order approximation to the optimum
checkpoint interval", CACM 17(9)), where saving and redoing cost the same, sqrt(C/(2M)) each. Daly (2006, "A
higher order estimate of the optimum checkpoint interval for restart dumps", FGCS 22) gives the exact expected run
time under Poisson failures (`expected_wall_time`) and a higher-order optimum (`daly_interval`) that stays close
to it while C approaches M. An asynchronous save blocks training only while the state is copied to host memory:
C is that blocking time (`async_save_seconds`). What is copied is everything the rank *holds*, not the share it
will write: `dcp.async_save` stages the whole local state dict first and only then, in the background, plans the
save and removes the duplicates (torch 2.13, torch/distributed/checkpoint/state_dict_saver.py: `async_save` calls
the stager before `_async_thread_executor.py` runs `save`, whose planner calls `dedup_save_plans`). An
asynchronous save therefore blocks far less than a synchronous one only where a rank holds little more than it
writes (ZeRO or FSDP, which shard the optimizer's state); with replicated state it stages every replica's copy.

**What a checkpoint weighs.** Every parameter once, with the optimizer's state: the weights at the precision the
optimizer updates them (fp32 master weights in mixed precision: the bf16 copy is derived from them) and Adam's two
moments, 12 bytes a parameter (10 in "bf16", which has no master copy). A rank *holds* its TP/PP piece of that
state, ZeRO-sharded or replicated over dp × cp (`lab.calc.memory`); with DCP's deduplication each replicated piece
is *written* once. Deduplication does not cut a tensor into shares: each replicated chunk (a whole tensor, or a
rank's whole TP slice of it) goes to the replica with the fewest bytes planned so far (`dedup_save_plans` in
torch/distributed/checkpoint/_dedup_save_plans.py), which over the hundreds of tensors of a model balances the
writing to within a chunk. The model here takes the balanced limit: a rank writes what ZeRO-3 over dp × cp would
leave it, whatever the ZeRO stage it trains with.

**Goodput** is the share of wall time spent on training that is kept. Of every M seconds a failure takes its
restart R and the work since the last save, half an interval on average; the rest trains, slowed by C/τ seconds of
saving per second of work:

    goodput = (1 − (R + τ/2)/M) / (1 + C/τ)            (1 − waste(τ) to first order)

Three ways to recover set R, C and τ apart. *Restart from a persistent checkpoint* (`restart_goodput`): R is
rescheduling the job, loading the checkpoint from storage and warming up (`Restart`). *In-memory checkpoints*
(`in_memory_goodput`; Wang et al. 2023, "Gemini: Fast Failure Recovery in Distributed Training with In-Memory
Checkpoints", SOSP, its group placement of checkpoint replicas and its failure recovery): every host keeps its state
and a copy of a peer's in host memory, so a save costs almost nothing, τ shrinks, and a restart loads from memory;
but when all the hosts holding one piece fail together (`peer_loss_probability`) the job falls back to the persistent
checkpoint. *Hot spares* (`hot_spare_goodput`): standby nodes swap in for a failed one, so R loses the rescheduling;
the spares' GPUs do not train, and goodput is charged for them. A spare is missing when every spare is still out for
repair (`spares_exhausted_probability`).

**Resharding.** A checkpoint keeps each tensor whole and logical; every saved piece is a box (offsets and sizes in
the full tensor), as in `lab.checkpoint`. Loading at another layout, a rank reads from each saved box the part
that overlaps the box it now holds (`reads_for`): what DCP's `create_read_items_for_chunk_list` computes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from lab.calc.memory import PRECISIONS, estimate_memory
from lab.calc.params import count_params
from lab.config import ModelConfig, ParallelConfig

HOUR = 3600.0
Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets in the full tensor, sizes)


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 and math.isfinite(value)):
            raise ValueError(f"{name}={value!r} must be a finite number > 0")


# --- failures -----------------------------------------------------------------------------------------------------


def job_mtbf(gpus: int, gpu_mtbf_s: float) -> float:
    """Seconds between failures of a job on `gpus` GPUs that each fail every `gpu_mtbf_s` seconds on average: any
    one failure stops a synchronous job, so the rates add up."""
    _positive(gpus=gpus, gpu_mtbf_s=gpu_mtbf_s)
    return gpu_mtbf_s / gpus


def gpu_mtbf_from_log(failures: int, duration_s: float, gpus: int) -> float:
    """A GPU's mean time between failures read from a job's log: `failures` in `duration_s` on `gpus` GPUs."""
    _positive(failures=failures, duration_s=duration_s, gpus=gpus)
    return duration_s * gpus / failures


# --- how often to save ----------------------------------------------------------------------------------------


def young_interval(save_s: float, mtbf_s: float) -> float:
    """Young's optimum: seconds of work between saves that minimise `waste`, sqrt(2·C·M)."""
    _positive(save_s=save_s, mtbf_s=mtbf_s)
    return math.sqrt(2 * save_s * mtbf_s)


def daly_interval(save_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (2006): sqrt(2CM)·(1 + sqrt(C/2M)/3 + (C/2M)/9) − C for C < 2M, else M."""
    _positive(save_s=save_s, mtbf_s=mtbf_s)
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    x = save_s / (2 * mtbf_s)
    return math.sqrt(2 * save_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - save_s


def waste(interval_s: float, save_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """First-order share of the run lost to failures and saves, C/τ + τ/(2M) + R/M (per second of useful work)."""
    _positive(interval_s=interval_s, save_s=save_s, mtbf_s=mtbf_s)
    if restart_s < 0:
        raise ValueError(f"restart_s={restart_s!r} must be >= 0")
    return save_s / interval_s + interval_s / (2 * mtbf_s) + restart_s / mtbf_s


def expected_wall_time(work_s: float, interval_s: float, save_s: float, mtbf_s: float, restart_s: float = 0.0
                       ) -> float:
    """Expected seconds to finish `work_s` of training, saving after every `interval_s` of it, under failures at
    rate 1/M (Daly 2006: M·e^(R/M)·(e^((τ+C)/M) − 1)·work/τ). Each segment of work and its save must run
    through without a failure; a failure costs the segment so far and a restart."""
    _positive(work_s=work_s, interval_s=interval_s, save_s=save_s, mtbf_s=mtbf_s)
    if restart_s < 0:
        raise ValueError(f"restart_s={restart_s!r} must be >= 0")
    return mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((interval_s + save_s) / mtbf_s) * work_s / interval_s


def best_every(step_s: float, save_s: float, mtbf_s: float) -> int:
    """The `--checkpoint-every N` (in steps of `step_s` seconds) with the least `waste`: Young's interval falls
    between two whole numbers of steps, and the better of the two wins (at least 1)."""
    _positive(step_s=step_s)
    steps = young_interval(save_s, mtbf_s) / step_s
    options = {max(1, math.floor(steps)), max(1, math.ceil(steps))}
    return min(sorted(options), key=lambda n: waste(n * step_s, save_s, mtbf_s))


# --- goodput: restart, in-memory checkpoints, hot spares ----------------------------------------------------------


@dataclass(frozen=True)
class Restart:
    """What bringing a failed job back costs, in seconds. `reschedule_s`: noticing the failure, draining the bad
    host, getting nodes, relaunching every rank and rebuilding its communicators; `load_s`: reading the checkpoint
    back; `warmup_s`: the first steps, slower while kernels compile, caches fill and data loaders refill. Each
    strategy shortens a different part: in-memory checkpoints the load, hot spares the rescheduling."""

    reschedule_s: float
    load_s: float
    warmup_s: float

    def __post_init__(self) -> None:
        for name in ("reschedule_s", "load_s", "warmup_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < math.inf):
                raise ValueError(f"{name}={value!r} must be a finite number >= 0")

    @property
    def seconds(self) -> float:
        return self.reschedule_s + self.load_s + self.warmup_s


def lost_per_failure(interval_s: float, restart_s: float) -> float:
    """Seconds one failure costs: the restart, and the work done since the last save, which a failure striking at a
    uniformly random moment of the interval makes half an interval on average (Young 1974)."""
    return restart_s + interval_s / 2


def goodput(mtbf_s: float, per_failure_s: float, save_overhead: float) -> float:
    """The share of wall time that is kept training: of every `mtbf_s` seconds a failure takes `per_failure_s`
    (`lost_per_failure`), and the rest trains, slowed by `save_overhead` seconds of saving per second of work (C/τ,
    summed over every kind of save). To first order 1 − waste: `waste`'s three terms. 0 when failures come faster
    than the job recovers from them."""
    _positive(mtbf_s=mtbf_s)
    if per_failure_s < 0 or save_overhead < 0:
        raise ValueError(f"per_failure_s={per_failure_s!r} and save_overhead={save_overhead!r} must be >= 0")
    return max(0.0, 1 - per_failure_s / mtbf_s) / (1 + save_overhead)


def restart_goodput(gpus: int, gpu_mtbf_s: float, save_s: float, restart: Restart, interval_s: float | None = None
                    ) -> float:
    """Goodput restarting from a persistent checkpoint (remote storage) after every failure: saves of `save_s`
    seconds every `interval_s` of work (Daly's optimum for the job's MTBF when None), half an interval redone and a
    full `restart` per failure. Llama 3's setting (§3.3.4: automated restarts from the last checkpoint)."""
    mtbf_s = job_mtbf(gpus, gpu_mtbf_s)
    tau = daly_interval(save_s, mtbf_s) if interval_s is None else interval_s
    _positive(interval_s=tau)
    return goodput(mtbf_s, lost_per_failure(tau, restart.seconds), save_s / tau)


def peer_loss_probability(hosts: int, failed: int, copies: int = 2) -> float:
    """The probability that `failed` hosts failing together, out of `hosts`, include every host of one group of
    `copies` (Gemini's group placement: a host's state is copied to the other hosts of its group), so that one piece
    of the in-memory checkpoint is gone everywhere. Exact by inclusion–exclusion over the groups wholly failed; for
    failed < 2·copies at most one group can fail whole, and it is (hosts/copies)·C(hosts − copies, failed − copies)
    / C(hosts, failed). One host failing loses nothing while copies ≥ 2."""
    _positive(hosts=hosts, failed=failed, copies=copies)
    if hosts % copies or failed > hosts:
        raise ValueError(f"hosts={hosts} must be a multiple of copies={copies} and >= failed={failed}")
    groups = hosts // copies
    lost = sum((-1) ** (j + 1) * math.comb(groups, j) * math.comb(hosts - j * copies, failed - j * copies)
               for j in range(1, min(groups, failed // copies) + 1))
    return lost / math.comb(hosts, failed)


def in_memory_goodput(gpus: int, gpu_mtbf_s: float, memory_save_s: float, memory_load_s: float, peer_loss: float,
                      save_s: float, restart: Restart) -> float:
    """Goodput with in-memory checkpoints (Gemini, SOSP 2023): a save that blocks `memory_save_s` (a copy to host
    memory; Gemini interleaves the copy to the peer with training traffic) at Daly's interval, a restart that loads
    in `memory_load_s` instead of from storage. A failure that takes every copy of a piece (probability
    `peer_loss`, e.g. `peer_loss_probability`) falls back to the persistent checkpoint, still saved — at Daly's
    interval for the rarer failures that need it, M/peer_loss — and costs a full `restart` and half its interval."""
    if not 0 <= peer_loss <= 1:
        raise ValueError(f"peer_loss={peer_loss!r} must be a probability in [0, 1]")
    mtbf_s = job_mtbf(gpus, gpu_mtbf_s)
    tau = daly_interval(memory_save_s, mtbf_s)
    from_memory = dataclasses.replace(restart, load_s=memory_load_s)
    per_failure = (1 - peer_loss) * lost_per_failure(tau, from_memory.seconds)
    overhead = memory_save_s / tau
    if peer_loss > 0:
        tau_disk = daly_interval(save_s, mtbf_s / peer_loss)
        per_failure += peer_loss * lost_per_failure(tau_disk, restart.seconds)
        overhead += save_s / tau_disk
    return goodput(mtbf_s, per_failure, overhead)


def spares_exhausted_probability(spares: int, repair_s: float, mtbf_s: float) -> float:
    """The probability that a failure finds no spare node free: failed nodes come every `mtbf_s` seconds and stay
    out `repair_s` each, so the number out for repair at once is Poisson with mean repair_s/mtbf_s (an M/G/∞ queue),
    and a failure sees that same distribution (Poisson arrivals see time averages): P(out ≥ spares)."""
    _positive(mtbf_s=mtbf_s)
    if not (isinstance(spares, int) and spares >= 0) or repair_s < 0:
        raise ValueError(f"spares={spares!r} must be an integer >= 0 and repair_s={repair_s!r} >= 0")
    mean = repair_s / mtbf_s
    term, below = math.exp(-mean), 0.0  # P(out = k), P(out < k), term by term: k! overflows a float past 170
    for k in range(spares):
        below += term
        term *= mean / (k + 1)
    return max(0.0, 1 - below)


def hot_spare_goodput(gpus: int, gpu_mtbf_s: float, save_s: float, restart: Restart, swap_s: float,
                      spare_nodes: int, repair_s: float, gpus_per_node: int = 8, interval_s: float | None = None
                      ) -> float:
    """Goodput with `spare_nodes` standby nodes beside a job of `gpus` training GPUs that restarts from a persistent
    checkpoint: a failed node is replaced by a spare in `swap_s` seconds instead of `restart.reschedule_s`, unless
    every spare is out for repair (`spares_exhausted_probability`). The spares' GPUs idle, so the kept share of all
    the GPUs paid for is goodput × gpus / (gpus + spares' GPUs). Idle spares are taken not to fail."""
    _positive(gpus_per_node=gpus_per_node)
    if swap_s < 0:
        raise ValueError(f"swap_s={swap_s!r} must be >= 0")
    mtbf_s = job_mtbf(gpus, gpu_mtbf_s)
    missing = spares_exhausted_probability(spare_nodes, repair_s, mtbf_s)
    swapped = dataclasses.replace(restart, reschedule_s=missing * restart.reschedule_s + (1 - missing) * swap_s)
    spare_gpus = spare_nodes * gpus_per_node
    return restart_goodput(gpus, gpu_mtbf_s, save_s, swapped, interval_s) * gpus / (gpus + spare_gpus)


# --- what a checkpoint weighs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointSize:
    """Bytes of a checkpoint: in all, held by one rank (the fullest; what an asynchronous save stages), and
    written by it when every replicated piece is written once (DCP's deduplication spreads them over their
    replicas)."""

    total: int
    held_per_rank: int
    written_per_rank: int
    bytes_per_param: int


def _state_bytes(model: ModelConfig, parallel: ParallelConfig, precision: str, stage: int) -> int:
    seq = parallel.cp * parallel.tp  # the static bytes do not depend on it; this one passes every shape check
    per_gpu = estimate_memory(model, seq, 1, parallel, precision=precision, stage=stage).per_gpu
    return per_gpu["optimizer"] + (0 if precision == "mixed" else per_gpu["params"])  # mixed: master in optimizer


def checkpoint_size(model: ModelConfig, parallel: ParallelConfig | None = None, precision: str = "mixed"
                    ) -> CheckpointSize:
    """What a checkpoint of `model` trained at `parallel` weighs (see the module's docstring)."""
    parallel = parallel or ParallelConfig()
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} must be one of {', '.join(map(repr, PRECISIONS))}")
    weights, _, optimizer = PRECISIONS[precision]
    per_param = optimizer + (0 if precision == "mixed" else weights)
    replicas = parallel.dp * parallel.cp
    sharded = dataclasses.replace(parallel, dp=replicas, cp=1, zero=3 if replicas > 1 else 0)
    stages = range(parallel.pp)
    return CheckpointSize(total=count_params(model) * per_param,
                          held_per_rank=max(_state_bytes(model, parallel, precision, s) for s in stages),
                          written_per_rank=max(_state_bytes(model, sharded, precision, s) for s in stages),
                          bytes_per_param=per_param)


def write_seconds(bytes_per_rank: float, ranks: int, rank_bandwidth: float, storage_bandwidth: float = math.inf
                  ) -> float:
    """Seconds to write a checkpoint: every rank writes its bytes at `rank_bandwidth` (bytes/s) at once, and all
    of them together at most at the storage's `storage_bandwidth`: the slower of the two limits decides."""
    _positive(ranks=ranks, rank_bandwidth=rank_bandwidth)
    if not storage_bandwidth > 0:
        raise ValueError(f"storage_bandwidth={storage_bandwidth!r} must be > 0 (math.inf: no limit)")
    if bytes_per_rank < 0:
        raise ValueError(f"bytes_per_rank={bytes_per_rank!r} must be >= 0")
    return max(bytes_per_rank / rank_bandwidth, bytes_per_rank * ranks / storage_bandwidth)


def async_save_seconds(size: CheckpointSize, stage_bandwidth: float) -> float:
    """Seconds an asynchronous save blocks training: the copy of everything the rank holds to host memory at
    `stage_bandwidth` (bytes/s; device to host). DCP stages before it deduplicates, so the rank's held bytes
    count, not its written share: `size.held_per_rank`, which equals `size.written_per_rank` only when the state
    is sharded (ZeRO ≥ 1, FSDP) or not replicated at all."""
    _positive(stage_bandwidth=stage_bandwidth)
    return size.held_per_rank / stage_bandwidth


# --- resharding: boxes -----------------------------------------------------------------------------------------


def shard_box(shape: Sequence[int], dim: int, parts: int, index: int) -> Box:
    """Piece `index` of `shape` cut into `parts` equal slices along `dim` (how TP and lab's placements cut)."""
    if not 0 <= dim < len(shape):
        raise ValueError(f"dim={dim} must be in 0..{len(shape) - 1} for shape {tuple(shape)}")
    if parts < 1 or shape[dim] % parts:
        raise ValueError(f"parts={parts} must be >= 1 and divide shape[{dim}] = {shape[dim]}")
    if not 0 <= index < parts:
        raise ValueError(f"index={index} must be in 0..{parts - 1}")
    size = shape[dim] // parts
    offsets = tuple(index * size if d == dim else 0 for d in range(len(shape)))
    return offsets, tuple(size if d == dim else n for d, n in enumerate(shape))


def overlap(a: Box, b: Box) -> Box | None:
    """The box two boxes share, or None: boxes that only touch (one ends where the other starts) share nothing."""
    (a_off, a_size), (b_off, b_size) = a, b
    if len(a_off) != len(b_off):
        raise ValueError(f"boxes of {len(a_off)} and {len(b_off)} dimensions cannot overlap")
    lo = tuple(max(x, y) for x, y in zip(a_off, b_off, strict=True))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a_off, a_size, b_off, b_size, strict=True))
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi, strict=True))


def reads_for(saved: Sequence[Box], wanted: Box) -> list[tuple[int, Box]]:
    """(index in `saved`, the region to read, in full-tensor coordinates) for every saved box that overlaps the box
    a rank now holds: the regions tile `wanted` exactly when the saved boxes tile the tensor."""
    return [(i, part) for i, box in enumerate(saved) if (part := overlap(box, wanted)) is not None]
