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
