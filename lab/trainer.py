"""The training loop, and the launch of the ranks that run it: `run(config, nproc)` trains on one process, on local
ranks, or in the group torchrun started, and every rank runs `train_worker`.

What belongs here: what every rank does with a runnable `Config` — build its part of the model (`parallelize`),
the optimizer over its shards (with fp16's loss scaler: mixed precision in one place), the data, checkpoints and
restarts, the steps, and the per-step log. What does not: the command line, the config's assembly and the final
summary (`lab.train`), and anything about the layout beyond "is there a pipeline", which the loop asks
`Parallelized` (its batch, `forward_backward`, the gradients' and the loss's reductions).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lab import distributed as lab_dist
from lab.checkpoint import Checkpointer, CheckpointError, CheckpointOptions, check_resume, newest
from lab.config import Config, check_supported
from lab.data import SyntheticTokens
from lab.distributed import Mesh, flight
from lab.distributed.comm import all_gather_single
from lab.distributed.health import Mismatch, SilentDataCorruption, check_replicas
from lab.distributed.launch import HANG_TIMEOUT_S
from lab.faults import InjectedFailure
from lab.loss import cross_entropy
from lab.outputs import check_output_dir, check_output_file
from lab.parallel.compile import compile_backend, graph_breaks
from lab.parallel.optim import adamw, clip_grad_norm
from lab.parallel.parallelize import build_mesh, parallelize
from lab.precision.fp8 import NonFiniteAmax, NonFiniteFlags, nonfinite_amax_error, nonfinite_sites
from lab.precision.fp8_linear import nonfinite_flags
from lab.precision.loss_scale import DynamicLossScaler
from lab.precision.scheme import precision_scheme
from lab.preemption import StopOnSignal, StoppedBySignal, checkpoint_now


@dataclass
class StepLog:
    step: int
    loss: float  # the language-model loss (cross-entropy), comparable with the data's floor
    lr: float
    grad_norm: float
    tokens_per_s: float
    peak_bytes: int | None
    # mixture-of-experts models only: assignments per expert over all layers and ranks, their max/mean (1 when
    # balanced), those dropped by the capacity limit, and the load-balancing loss (1 when balanced)
    expert_load: list[int] | None = None
    expert_load_per_layer: dict[str, list[int]] | None = None  # the same for each MoE layer, keyed by its block
    load_imbalance: float | None = None
    dropped_tokens: int | None = None
    aux_loss: float | None = None
    loss_scale: float | None = None  # fp16 only: the dynamic loss scale this step's backward used
    skipped: bool | None = None  # fp16 only: an inf/nan gradient made the step skip its update
    # two or more ranks: each rank's seconds from the step's start to the end of its backward (before it waits for
    # the gradients' reduction), and to the step's end; lab.distributed.health.find_straggler reads them
    rank_compute_s: list[float] | None = None
    rank_step_s: list[float] | None = None
    sdc: list[str] | None = None  # --sdc-check with sdc_stop=False: the replicas that disagreed at this step

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None or k == "peak_bytes"}


def run(config: Config, nproc: int = 1, log_path: str | None = None, verbose: bool = True,
        checkpoint: CheckpointOptions | None = None, inject: InjectedFailure | None = None, max_restarts: int = 0,
        collective_timeout_s: float | None = None, on_step: Callable[[StepLog], None] | None = None,
        hang_timeout_s: float | None = HANG_TIMEOUT_S, time_limit_s: float | None = None, sdc_check: int = 0,
        sdc_stop: bool = True) -> list[StepLog]:
    """Train in this process (nproc=1), on `nproc` local ranks, or in the group torchrun launched. A layout
    lab cannot run raises ValueError here, before any rank starts (`lab.config.check_supported`).

    `inject` makes a rank fail on purpose (`lab.faults`); `max_restarts` starts the local ranks again after a
    failure, resuming from the newest checkpoint (under torchrun, torchrun's own `--max-restarts` does this).
    `collective_timeout_s` bounds how long a collective waits for a missing rank (the process group's timeout).
    `on_step(log)` is called after every step, in every rank (benchmarks/gpu_lane.py steps a profiler with it).
    Local ranks are stopped when one makes no progress (finishes no step, no collective) for `hang_timeout_s`, and
    after `time_limit_s` if given: a run that progresses has no time limit (`lab.distributed.run`).
    `sdc_check` N > 0 compares the data-parallel replicas' parameters and optimizer states every N steps
    (`lab.distributed.health`): a mismatch raises `SilentDataCorruption`, or with `sdc_stop=False` is logged.
    Every output path is checked first, and a non-finite loss or gradient norm stops the run (`NonFiniteLoss`), as
    does a non-finite amax in an FP8 linear (`lab.precision.fp8.NonFiniteAmax`, naming the tensor): both before
    the step's update."""
    check_supported(config)
    _check_faults(config, checkpoint, inject, max_restarts, collective_timeout_s)
    _check_sdc(config, sdc_check)
    _check_limits(hang_timeout_s, time_limit_s)
    _check_outputs(log_path, checkpoint)
    logs = _run(config, nproc, log_path, verbose, checkpoint, inject, max_restarts, collective_timeout_s, on_step,
                hang_timeout_s, time_limit_s, (sdc_check, sdc_stop))
    if logs and (reason := non_finite(logs[-1].loss, logs[-1].grad_norm, logs[-1].loss_scale is not None)):
        raise NonFiniteLoss(f"step {logs[-1].step}: {reason}; stopped before its update (lower train.lr="
                            f"{config.train.lr:g}, or look at the data and the model's numerics)")
    return logs


def _run(config: Config, nproc: int, log_path: str | None, verbose: bool, checkpoint: CheckpointOptions | None,
         inject: InjectedFailure | None, max_restarts: int, collective_timeout_s: float | None,
         on_step: Callable[[StepLog], None] | None, hang_timeout_s: float | None, time_limit_s: float | None,
         sdc: tuple[int, bool]) -> list[StepLog]:
    """`run` once its arguments are checked: train here, on local ranks, or in torchrun's group."""
    if lab_dist.launched_by_torchrun():
        lab_dist.init_from_env(**({} if collective_timeout_s is None else {"timeout_s": collective_timeout_s}))
        if dist.get_world_size() != config.parallel.world_size:
            raise ValueError(f"torchrun started {dist.get_world_size()} ranks but dp*tp*cp*pp = "
                             f"{config.parallel.world_size}")
        return train_worker(config, log_path, verbose, checkpoint, inject, on_step, sdc)
    if nproc != config.parallel.world_size:
        p = config.parallel
        raise ValueError(f"nproc={nproc} must equal dp*tp*cp*pp = {p.dp}*{p.tp}*{p.cp}*{p.pp} = {p.world_size}")
    check_resume(checkpoint, config)  # a damaged or foreign checkpoint: one line now, not a traceback per rank
    if nproc == 1 and inject is None and not max_restarts:  # a failure on purpose runs in a rank of its own
        return train_worker(config, log_path, verbose, checkpoint, on_step=on_step)
    backend = "nccl" if config.train.device != "cpu" and torch.cuda.device_count() >= nproc else "gloo"
    try:
        return lab_dist.run(train_worker, nproc, config, log_path, verbose, checkpoint, inject, on_step, sdc,
                            backend=backend, timeout_s=time_limit_s, hang_timeout_s=hang_timeout_s,
                            max_restarts=max_restarts,
                            **({} if collective_timeout_s is None else {"pg_timeout_s": collective_timeout_s}))[0]
    except lab_dist.RankError as err:
        # a failed save, silent data corruption every rank found, a non-finite amax every rank stopped on: the
        # one line the run gives in one process, not a rank's traceback
        for kind in (CheckpointError, SilentDataCorruption, NonFiniteAmax):
            if err.summary.startswith(f"{kind.__name__}: "):
                raise kind(err.summary.removeprefix(f"{kind.__name__}: ")) from None
        raise


class NonFiniteLoss(RuntimeError):
    """The loss or the gradient norm of a step was inf or nan: every later step would be nan too."""


def non_finite(loss: float, grad_norm: float, loss_scaled: bool) -> str | None:
    """What is not finite in a step ("loss nan, grad norm inf"), or None when it can go on. Under fp16's loss
    scaling an inf/nan gradient is the scaler's business (it skips the step and lowers the scale), not a stop."""
    if math.isfinite(loss) and (loss_scaled or math.isfinite(grad_norm)):
        return None
    return f"loss {loss:g}, grad norm {grad_norm:g}: both must be finite"


def _check_limits(hang_timeout_s: float | None, time_limit_s: float | None) -> None:
    for flag, value in (("--hang-timeout", hang_timeout_s), ("--time-limit", time_limit_s)):
        if value is not None and not value > 0:
            raise ValueError(f"{flag}={value!r} must be a number of seconds > 0 (inf: no limit)")


def _check_outputs(log_path: str | None, checkpoint: CheckpointOptions | None) -> None:
    """Every path the run writes, checked before any rank starts: a bad one would fail at its first use."""
    if log_path is not None:
        check_output_file(log_path, "--log-json")
    if checkpoint is not None:
        check_output_dir(checkpoint.dir, "--checkpoint-dir")


def _check_faults(config: Config, checkpoint: CheckpointOptions | None, inject: InjectedFailure | None,
                  max_restarts: int, collective_timeout_s: float | None) -> None:
    if inject is not None:
        inject.check(config.parallel.world_size, config.train.steps)
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        raise ValueError(f"--max-restarts={max_restarts!r} must be an integer >= 0")
    if max_restarts and lab_dist.launched_by_torchrun():
        raise ValueError(f"--max-restarts={max_restarts} under torchrun: give it to torchrun instead "
                         f"(torchrun --max-restarts {max_restarts} ...), which restarts the group")
    if max_restarts and checkpoint is None:
        raise ValueError(f"--max-restarts={max_restarts} needs --checkpoint-dir: a restart resumes from the "
                         f"newest checkpoint")
    if collective_timeout_s is not None and not collective_timeout_s > 0:
        raise ValueError(f"--collective-timeout={collective_timeout_s!r} must be > 0 (seconds)")


def _check_sdc(config: Config, every: int) -> None:
    if not isinstance(every, int) or isinstance(every, bool) or every < 0:
        raise ValueError(f"--sdc-check={every!r} must be an integer >= 0 (steps between checks; 0: none)")
    p = config.parallel
    if every and p.dp * p.cp < 2:
        raise ValueError(f"--sdc-check={every} compares data-parallel replicas: it needs dp x cp >= 2 (dp={p.dp}, "
                         f"cp={p.cp})")
    if every and (p.zero == 3 or p.ep > 1):
        raise ValueError(f"--sdc-check={every} with {'zero=3' if p.zero == 3 else f'ep={p.ep}'}: its replicas are "
                         f"not whole over the dp x cp group; use zero<=2 and ep=1")


def replicated_state(model: torch.nn.Module, masters: list[torch.Tensor], optimizer: torch.optim.Optimizer
                     ) -> list[tuple[str, torch.Tensor]]:
    """What must be identical on every rank of the dp x cp group, by name: the model's parameters (whole after
    the step, ZeRO-1/2 included) and, when the tensors the optimizer updates (`masters`) are one per trainable
    parameter, of its shape (the parameter itself or its fp32 master), those and the optimizer's states. Under ZeRO
    the optimizer updates flat pieces of this rank's shard instead, different on every rank: they are left out."""
    named = list(model.named_parameters())
    trainable = [(name, param) for name, param in named if param.requires_grad]
    if [m.shape for m in masters] != [p.shape for _, p in trainable]:
        return named
    for (name, param), master in zip(trainable, masters, strict=True):
        if master is not param:
            named.append((f"{name} (fp32 master)", master))
        named += [(f"{name} (optimizer {key})", value) for key, value in optimizer.state[master].items()
                  if torch.is_tensor(value) and value.numel() > 1]
    return named


def _device(config: Config) -> torch.device:
    if config.train.device == "cuda" or (config.train.device == "auto" and torch.cuda.is_available()):
        index = dist.get_rank() % torch.cuda.device_count() if dist.is_initialized() else 0
        return torch.device("cuda", index)
    return torch.device("cpu")


def _compile_backend(config: Config, device: torch.device, verbose: bool) -> str | None:
    """The `torch.compile` backend of `--compile` on this device (None: eager), said once at start-up with what
    the layout keeps out of the graphs: a run never falls back to eager, or splits a block, without a line. The
    default on a CPU (auto: eager) goes without saying."""
    backend, line = compile_backend(config.train.compile, device)
    if backend is not None and (why := graph_breaks(config.model, config.parallel)):
        line += f"; each block in pieces around {why}"
    said = config.train.compile != "auto" or device.type == "cuda"
    if said and verbose and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"compile: {line}", file=sys.stderr, flush=True)
    return backend


def lr_factor(step: int, config: Config) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak learning rate."""
    warmup, total = config.train.warmup_steps, config.train.steps
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def train_worker(config: Config, log_path: str | None = None, verbose: bool = True,
                 checkpoint: CheckpointOptions | None = None, inject: InjectedFailure | None = None,
                 on_step: Callable[[StepLog], None] | None = None, sdc: tuple[int, bool] = (0, True)
                 ) -> list[StepLog]:
    """The training loop run by every rank (or by the only process). Returns the per-step log (of the steps
    this run made: after a resume, those after the checkpoint's step). A group started again after a failure
    (`lab.distributed.restarts`, under `lab.distributed.run` or torchrun) resumes as `--resume` does.

    It knows nothing of the layout. Which rows and tokens this rank holds, whether a pipeline drives the model,
    how the loss and gradients are reduced: each is asked of what `parallelize` built, through its methods.
    `sdc` is (check every N steps, stop on a mismatch): `run`'s `sdc_check` and `sdc_stop`."""
    parallel, train = config.parallel, config.train
    device = _device(config)
    loss = cross_entropy
    if train.kernels == "triton":  # the fused loss here; RMSNorm, SwiGLU and attention patched in below
        from lab import kernels
        from lab.kernels.cross_entropy import cross_entropy as loss
    scheme = precision_scheme(train.precision, train.reduce_dtype)
    mesh = build_mesh(parallel)  # its dp x cp group holds the replicas --sdc-check compares
    backend = _compile_backend(config, device, verbose)
    par = parallelize(config.model, mesh, parallel, device, train.seed, train.seq_len, loss, scheme, backend,
                      whole_logits=train.loss == "whole")
    if train.kernels == "triton":
        kernels.patch(par.model)
    fp8_flags = nonfinite_flags(par.model)  # the FP8 linears' records of a non-finite amax (none: empty)
    optimizer = adamw(par.parameters(), train.lr, train.weight_decay)  # fp32 master weights under bf16/fp16
    replicas = functools.partial(replicated_state, par.model, par.parameters(), optimizer)
    scaler = DynamicLossScaler(enabled=scheme.policy.needs_loss_scaling)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))
    data = SyntheticTokens(config.model.vocab_size, train.seq_len, train.global_batch, train.seed,
                           train.data_branching)

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    restart, max_restarts = lab_dist.restarts()
    if restart > 0 and rank == 0:
        path = newest(checkpoint.dir)[0] if checkpoint is not None else None
        where = (f"resuming from checkpoint {os.path.basename(path)}" if path else
                 f"starting again from step 0 ({'no checkpoint yet' if checkpoint else 'no --checkpoint-dir'})")
        print(f"restart {restart}/{max_restarts}: {where}", file=sys.stderr, flush=True)
    if restart > 0 and checkpoint is not None:  # a restarted group goes on from its newest checkpoint
        checkpoint = dataclasses.replace(checkpoint, resume=True)
    checkpointer = Checkpointer(checkpoint, config, scaler) if checkpoint is not None else None
    first = checkpointer.resume(par, optimizer, scheduler, data) if checkpointer is not None else 0

    log_file = _open_log(log_path, first) if (log_path and rank == 0) else None
    stop = StopOnSignal(enabled=checkpointer is not None)  # SIGTERM: a checkpoint at the step's end, then exit
    stop.install()
    progress = _progress(train.steps, enabled=verbose and rank == 0)
    logs: list[StepLog] = []
    try:
        for step in range(first, train.steps):
            start = time.perf_counter()
            began = _gpu_mark(device)  # on a GPU the compute's end is its kernels', not Python's
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            if inject is not None:  # a straggler's rank is slow in its compute, before any collective
                inject.maybe_delay(rank, step + 1)
            inputs, targets = par.batch(*data.next_batch())
            scale = scaler.get_scale()  # fp16: backward starts from loss x scale (1 otherwise)
            loss, moe = par.forward_backward(inputs, targets, scale)  # moe: the router's record (MoE models)
            compute, computed = time.perf_counter() - start, _gpu_mark(device)  # next: wait for the gradients
            par.finish_gradients()  # every rank now holds the averaged gradients of what it updates (fp32 masters)
            loss = par.mean_loss(loss)
            scaler.unscale_(par.parameters())  # fp16: divide by the scale; all ranks agree on any inf/nan
            norm = clip_grad_norm(par.parameters(), train.grad_clip)
            lr = scheduler.get_last_lr()[0]
            # FP8: one read of the amax flags, just before the loss and norm are read (the step waits for the
            # device once either way); NonFiniteAmax names the tensor, and no rank makes the update below
            _stop_on_nonfinite_amax(fp8_flags, step + 1, scheme.fp8 is not None and world > 1, device)
            if non_finite(loss.item(), norm.item(), scaler.enabled) is not None:  # every rank holds the same two
                logs.append(StepLog(step + 1, loss.item(), lr, norm.item(), math.nan, None))
                break  # before the update, which would write nan into every weight: `run` says so
            if inject is not None:  # gradients reduced, update not made: the step is lost
                inject.maybe_fire(rank, step + 1)
            stepped = scaler.step(optimizer)  # fp16: skipped when a gradient overflowed
            scaler.update()
            par.after_step()  # the masters rounded into the model's weights; ZeRO-1/2 all-gather
            scheduler.step()
            par.zero_grad()
            if inject is not None:  # silent data corruption: no error, only replicas that no longer agree
                inject.maybe_flip(rank, step + 1, par.model)
            corrupt = _sdc_check(sdc, step + 1, replicas, mesh, rank)
            if device.type == "cuda":  # kernels run asynchronously: the step ends when the GPU's work does
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - start
            if began is not None:
                compute = began.elapsed_time(computed) / 1e3
            times = _gather_times(compute, elapsed, world, device)
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            fp16 = {"loss_scale": scale, "skipped": not stepped} if scaler.enabled else {}
            entry = StepLog(step + 1, loss.item(), lr, norm.item(), train.global_batch * train.seq_len / elapsed,
                            peak, **(moe or {}), **fp16, **times, sdc=corrupt)
            logs.append(entry)
            if log_file:
                log_file.write(json.dumps(entry.as_dict()) + "\n")
                log_file.flush()
            progress(entry)
            flight.heartbeat()  # a step is progress, whether or not the launcher saw its collectives
            if on_step is not None:  # e.g. a profiler's step(), so that it records chosen steps and not the set-up
                on_step(entry)
            if checkpointer is not None:
                checkpointer.after_step(step + 1, par, optimizer, scheduler, data)
            if stop.agreed(device) and step + 1 < train.steps:  # lab.preemption: every rank stops at this step
                raise StoppedBySignal(step + 1, checkpoint_now(checkpointer, step + 1, par, optimizer, scheduler, data))
    finally:
        stop.uninstall()
        if log_file:
            log_file.close()
    return logs


def _gpu_mark(device: torch.device) -> torch.cuda.Event | None:
    """A timing event recorded on the compute stream (None on a CPU). The backward's kernels run after Python
    has moved on, and the stream does not wait for the gradients' all-reduce before `finish_gradients`, so the
    time between two marks is the rank's compute, without the wait a straggler causes."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _gather_times(compute: float, elapsed: float, world: int, device: torch.device) -> dict:
    """Every rank's (compute, step) seconds, on every rank: one all-gather of two numbers per rank per step."""
    if world == 1:
        return {}
    gathered = torch.empty(world * 2, dtype=torch.float64, device=device)
    all_gather_single(gathered, torch.tensor([compute, elapsed], dtype=torch.float64, device=device))
    compute_s, step_s = gathered.view(world, 2).T.tolist()
    return {"rank_compute_s": compute_s, "rank_step_s": step_s}


def _stop_on_nonfinite_amax(flags: list[NonFiniteFlags], step: int, agree: bool, device: torch.device) -> None:
    """Raise `NonFiniteAmax` on every rank if any rank's FP8 flags are set (`lab.precision.fp8.NonFiniteFlags`).

    Each rank's flags are its own: an amax is measured on its replica's data and its stage's layers. A rank that
    raised alone would leave the others to make their update and wait at the next collective until the launcher
    stopped them; so with `agree` (FP8 on two or more ranks) the ranks first add up how many found one (one
    small all-reduce a step), and only then, when some did, gather their sites to name the lowest such rank's
    first tensor. Every rank raises the same line, before its update."""
    sites, rank = nonfinite_sites(flags), None
    if agree:
        found = torch.tensor([int(bool(sites))], device=device)
        dist.all_reduce(found)
        if found.item():
            everyone: list[list[str] | None] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, sites)
            rank, sites = next((r, s) for r, s in enumerate(everyone) if s)
    if (error := nonfinite_amax_error(sites, step, rank)) is not None:
        raise error


def _sdc_check(sdc: tuple[int, bool], step: int, replicas: Callable[[], list[tuple[str, torch.Tensor]]],
               mesh: Mesh | None, rank: int) -> list[str] | None:
    """Every `sdc[0]` steps, compare the replicas (`lab.distributed.health`); raise, or return what differs."""
    every, stop = sdc
    if not every or step % every:
        return None
    mismatches: list[Mismatch] = check_replicas(replicas(), mesh.dp_cp_group)
    if not mismatches:
        return None
    lines = [m.describe() for m in mismatches]
    what = f"{lines[0]}" + (f" (and {len(lines) - 1} more tensor(s))" if len(lines) > 1 else "")
    if stop:
        raise SilentDataCorruption(f"step {step}: {what}: silent data corruption, stopped before it spreads; "
                                   f"resume from the last checkpoint (the check ran every {every} step(s))")
    if rank == 0:
        print(f"lab.train: step {step}: silent data corruption: {what}", file=sys.stderr, flush=True)
    return lines


def _open_log(path: str, first: int):
    """The JSON log, opened for writing; a resumed run keeps the entries up to the step it resumed from.

    They are kept by cutting the file after them in place, not by writing them again: a kill at any moment after
    this leaves them on disk. Reading stops at a line a kill tore in half."""
    if not (first and os.path.exists(path)):
        return open(path, "w")  # noqa: SIM115 - closed by the caller
    log_file = open(path, "r+")  # noqa: SIM115 - closed by the caller
    end = 0
    for line in iter(log_file.readline, ""):
        try:
            if json.loads(line)["step"] > first:
                break
        except json.JSONDecodeError:
            break
        end = log_file.tell()
    log_file.seek(end)
    log_file.truncate()
    return log_file


def _progress(total: int, enabled: bool):
    """A tqdm bar on a terminal; plain lines (about 20 per run) when the output is a file or a notebook."""
    if not enabled:
        return lambda entry: None
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=total, unit="step", dynamic_ncols=True)

        def update(entry: StepLog) -> None:
            bar.set_postfix(loss=f"{entry.loss:.4f}", tok_s=f"{entry.tokens_per_s:,.0f}")
            bar.update(1)
            if entry.step == total:
                bar.close()

        return update
    every = max(1, total // 20)

    def report(entry: StepLog) -> None:
        if entry.step % every == 0 or entry.step == total:
            print(f"step {entry.step:>5}/{total}  loss {entry.loss:.4f}  lr {entry.lr:.2e}  "
                  f"{entry.tokens_per_s:,.0f} tok/s", flush=True)

    return report
