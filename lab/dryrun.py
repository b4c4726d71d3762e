"""`python -m lab.train ... --dry-run [--rank R]`: one rank of a real-size layout, built but never run.

A 70B model on 256 GPUs cannot be started on a laptop, but one rank of it can be *built*: `parallelize` makes
the rank's modules on the `meta` device (shapes, no memory), with every parallelism applied exactly as a real run
applies it, under torch's fake process group, which answers "you are rank R of W" and creates groups without
starting any other rank or moving a byte (a collective on it would return garbage, and none is run here).

From the modules the dry run then measures what the rank keeps from step to step, and sets it beside
`lab.calc.memory.estimate_memory` for the same rank's pipeline stage:

- parameters: the numel of the rank's local parameters x their dtype size (under ZeRO-3, only its shard pieces);
- gradients: of the same tensors as the parameters (under ZeRO-2 and 3, the shard pieces), in the dtype they are
  summed in (`train.reduce_dtype`), plus the fp32 copy the master weights take of 16-bit sums;
- optimizer: AdamW's two fp32 states (m, v) over what the rank's optimizer updates, `engine.parameters()` (ZeRO's
  pieces), plus an fp32 master copy when the weights are not fp32 (`train.precision` bf16, fp16, fp8-*).

Tensors are counted, not the flat buffers behind them: ZeRO's padding of each unit to a multiple of the group
(at most dp·cp - 1 elements a unit) is in neither column, and the last ranks of a ZeRO group, where the padding
falls, hold fewer elements (calc's `zero_rank`). The comparison is in the calc precision of the run's
`--precision` (`lab.calc.memory.training_precision`: fp32's 4 + 4 + 8 bytes per parameter, bf16's 2 + 4 + 12).
The two are independent accounts of the same layout — one
counts tensors that exist, the other multiplies out a formula — so they must agree to the byte; a difference is a
bug in one of them.

The report ends with a verdict for the layout's fullest rank (calc's fullest pipeline stage, first place of its
ZeRO group), whichever rank was built: whether its static bytes and activations fit the accelerator the config
names (`train.hardware`), "fits on h100: 71.2 of 80 GiB" or "does not fit on h100: 11.1 GiB over", counting the
loss's working set when the fullest rank is the last stage (`lab.calc.memory.loss_bytes`). It is a
verdict, not an error: the exit status stays 0 (1 only when the two accounts disagree).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lab.calc.hardware import HARDWARE, GiB, get_accelerator
from lab.calc.memory import MemoryEstimate, estimate_memory, training_precision
from lab.config import Config, check_supported
from lab.distributed.mesh import AXES, GROUPS
from lab.layout import describe, micro_batch
from lab.parallel.parallelize import Parallelized, build_mesh, parallelize
from lab.precision.scheme import precision_scheme

STATIC = ("params", "grads", "optimizer")
ADAMW_STATES = 2  # m and v, fp32 whatever the weights' dtype


@dataclass
class DryRun:
    """One rank of a layout, built on `meta`: where it sits, its groups, and its static bytes two ways."""

    config: Config
    rank: int
    coords: dict[str, int]  # dp, pp, cp, tp and ep coordinates
    groups: dict[str, list[int]]  # axis -> the global ranks of this rank's group
    measured: dict[str, int]  # bytes counted on the built modules
    estimated: dict[str, int]  # bytes from lab.calc.memory for this rank's stage (and its activations)
    precision: str  # the calc.memory precision the measured dtypes correspond to
    seconds: float
    fullest: MemoryEstimate  # calc.memory's estimate for the layout's fullest rank, whichever rank was built

    @property
    def headroom(self) -> int:
        """Bytes the fullest rank leaves free on `train.hardware`; negative when it needs that much more."""
        return self.fullest.headroom(get_accelerator(self.config.train.hardware).memory_bytes)

    def verdict(self) -> str:
        """One line: whether the fullest rank fits the config's accelerator, and by how much."""
        hardware, est = self.config.train.hardware, self.fullest
        total, capacity = est.per_gpu["total"], get_accelerator(hardware).memory_bytes
        acts, loss = est.per_gpu["activations"], est.per_gpu["loss"]
        where = (f"the fullest rank, pipeline stage {est.stage}: {(total - acts - loss) / GiB:.1f} GiB static + "
                 f"{acts / GiB:.1f} GiB activations" + (f" + {loss / GiB:.1f} GiB for the loss" if loss else ""))
        if self.headroom >= 0:
            return f"fits on {hardware}: {total / GiB:.1f} of {capacity / GiB:.0f} GiB ({where})"
        return f"does not fit on {hardware}: {-self.headroom / GiB:.1f} GiB over ({where})"

    @property
    def mismatches(self) -> list[str]:
        return [key for key in STATIC if self.measured[key] != self.estimated[key]]

    def report(self) -> str:
        c, p = self.config, self.config.parallel
        world, mbs = p.world_size, micro_batch(c.train.global_batch, p.dp, p.grad_accum)
        lines = [f"dry run of {c.model.name} on {world:,} ranks [{describe(p)}]: rank {self.rank} built on the meta "
                 f"device under a fake process group in {self.seconds:.1f} s (no rank started, no collective run)",
                 "coordinates: " + "  ".join(f"{axis}={self.coords[axis]}" for axis in (*AXES, "ep")),
                 "groups (global ranks):"]
        lines += [f"  {axis:<6} {describe_ranks(ranks)}" for axis, ranks in self.groups.items()]
        lines.append(f"static memory of rank {self.rank} (pipeline stage {self.coords['pp']}), precision "
                     f"{self.precision!r}: weights in the modules' dtype, gradients in the one they are summed in, "
                     "fp32 master weights (unless fp32) and AdamW's m and v")
        lines.append(f"  {'bytes':<12}{'measured (modules)':>20}{'lab.calc.memory':>20}{'GiB':>10}")
        for key in (*STATIC, "total"):
            got = sum(self.measured.values()) if key == "total" else self.measured[key]
            want = sum(self.estimated[k] for k in STATIC) if key == "total" else self.estimated[key]
            flag = "" if got == want else f"   MISMATCH: {got - want:+,} bytes"
            lines.append(f"  {key:<12}{got:>20,}{want:>20,}{want / 2**30:>10,.2f}{flag}")
        acts = self.estimated["activations"]
        lines.append(f"  {'activations':<12}{'-':>20}{acts:>20,}{acts / 2**30:>10,.2f}   calc only (Korthikanti, "
                     f"flash attention), micro-batch {mbs} x {c.train.seq_len} tokens")
        if loss := self.estimated["loss"]:
            lines.append(f"  {'loss':<12}{'-':>20}{loss:>20,}{loss / 2**30:>10,.2f}   calc only: what the loss works in"
                         f" beyond what it keeps (fp32 copies of the logits)")
        lines.append("static bytes agree exactly" if not self.mismatches else
                     f"static bytes differ in {', '.join(self.mismatches)}: a bug in the modules or in calc.memory")
        lines.append(self.verdict())
        return "\n".join(lines)


def describe_ranks(ranks: list[int]) -> str:
    """A group of ranks in one short line, however large: an arithmetic run as first, second, ..., last."""
    n = len(ranks)
    if n <= 8:
        return ", ".join(map(str, ranks)) + f" ({n} rank{'s' if n > 1 else ''})"
    steps = {b - a for a, b in zip(ranks, ranks[1:], strict=False)}
    if len(steps) == 1:
        return f"{ranks[0]}, {ranks[1]}, ..., {ranks[-1]} ({n} ranks, every {steps.pop()})"
    return f"{', '.join(map(str, ranks[:4]))}, ..., {', '.join(map(str, ranks[-2:]))} ({n} ranks)"


def _numel(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() for t in {id(t): t for t in tensors}.values())  # a tied weight counts once


def measure_static(par: Parallelized, zero: int) -> dict[str, int]:
    """Bytes of weights, gradients and optimizer states the rank keeps between steps, counted on its modules."""
    local = list(par.model.parameters())  # a ZeRO-3 model's parameters are views of freed buffers...
    updated = par.engine.parameters()  # ...what the rank keeps is its shard; its optimizer updates the shard's pieces
    dtype = local[0].dtype
    if any(t.dtype != dtype for t in local + updated):
        raise ValueError(f"the rank's parameters mix dtypes ({sorted({str(t.dtype) for t in local})}): the dry run "
                         f"compares one precision")
    policy = par.precision.policy
    master = 4 if policy.needs_master_weights else 0  # fp32 master weights next to 16-bit ones
    # gradients summed in reduce_dtype; 16-bit sums also get an fp32 copy in the master gradients
    grad = policy.reduce_dtype.itemsize + (master if policy.reduce_dtype != torch.float32 else 0)
    kept_params = updated if zero >= 3 else local
    kept_grads = updated if zero >= 2 else local
    return {"params": dtype.itemsize * _numel(kept_params), "grads": grad * _numel(kept_grads),
            "optimizer": (4 * ADAMW_STATES + master) * _numel(updated)}


def dry_run(config: Config, rank: int = 0) -> DryRun:
    """Build `rank`'s part of `config`'s layout on `meta` under a fake process group of the layout's world size,
    and measure its static bytes beside calc.memory's. Nothing is allocated and nothing is communicated."""
    check_supported(config)  # what a real run refuses, the dry run refuses too
    if config.train.hardware not in HARDWARE:
        raise ValueError(f"train.hardware={config.train.hardware!r} must be one of "
                         f"{', '.join(map(repr, HARDWARE))} (the accelerators lab.calc.hardware knows)")
    p = config.parallel
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < p.world_size:
        raise ValueError(f"rank={rank!r} must be in [0, {p.world_size}) (dp*tp*cp*pp = {p.dp}*{p.tp}*{p.cp}*{p.pp})")
    if dist.is_initialized():
        raise ValueError("a dry run starts its own fake process group: call it outside an initialised one")
    # Importing it registers torch's "fake" backend: ranks and groups without processes or communication.
    import torch.testing._internal.distributed.fake_pg  # noqa: F401

    start = time.perf_counter()
    dist.init_process_group("fake", rank=rank, world_size=p.world_size, store=dist.HashStore())
    try:
        mesh = build_mesh(p)
        scheme = precision_scheme(config.train.precision, config.train.reduce_dtype)
        par = parallelize(config.model, mesh, p, torch.device("meta"), config.train.seed, config.train.seq_len,
                          precision=scheme, whole_logits=config.train.loss == "whole")
        measured = measure_static(par, p.zero)
        coords = {**mesh.coords(rank), "ep": mesh.ep_rank}
        groups = {axis: mesh.group_ranks(axis) for axis in GROUPS}
    finally:
        dist.destroy_process_group()
    seconds = time.perf_counter() - start
    mbs = micro_batch(config.train.global_batch, p.dp, p.grad_accum)
    precision, fp32_grad_accum = training_precision(config.train.precision, config.train.reduce_dtype)
    kw = {"precision": precision, "fp32_grad_accum": fp32_grad_accum, "flash": True,  # SDPA's fused kernel on a GPU
          "loss": config.train.loss}
    estimate = estimate_memory(config.model, config.train.seq_len, mbs, p, stage=coords["pp"],
                               zero_rank=groups["dp_cp"].index(rank), **kw)
    fullest = estimate_memory(config.model, config.train.seq_len, mbs, p, **kw)  # the fullest stage, ZeRO place 0
    return DryRun(config, rank, coords, groups, measured, estimate.per_gpu, precision, seconds, fullest)
