"""`python -m lab.train`: train a model with the parallelisms a config asks for.

    python -m lab.train --config configs/tiny.toml --steps 20
    python -m lab.train --config configs/tiny.toml --nproc 2             # two local gloo ranks: dp=2
    torchrun --nproc_per_node 8 -m lab.train --model llama3-1b --seq 2048 --mbs 1 --tp 2   # dp=4 x tp=2
    python -m lab.train --config configs/llama3-70b.toml --dp 8 --tp 8 --pp 4 --dry-run --rank 37  # lab.dryrun
    python -m lab.train --config configs/tiny.toml --nproc 2 --checkpoint-dir ckpt --checkpoint-every 2 \
        --inject-failure rank=1,step=3,kind=kill --max-restarts 1     # a rank dies; the group resumes (lab.faults)
    python -m lab.train --config configs/tiny.toml --nproc 4 --tp 2 --precision fp8-tilewise  # lab.precision

On a CPU it starts `--nproc` gloo ranks through `lab.distributed.run`; under `torchrun` it joins the launched
group (NCCL on GPUs). Every step writes one JSON object (step, loss, lr, grad_norm, tokens_per_s,
peak_bytes) to `--log-json`; the final summary compares the loss with the data's known floor. A group started
again after a failure (`--max-restarts`, or `torchrun --max-restarts`) resumes from its newest checkpoint.

Each chapter adds its flag here and a test showing its losses equal the single-process run's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lab import distributed as lab_dist
from lab.calc.schedules import INTERLEAVED_CHUNKS
from lab.checkpoint import Checkpointer, CheckpointError, CheckpointOptions, check_resume, newest
from lab.config import KERNEL_MODES, PRECISIONS, Config, ParallelConfig, check_supported, parse_override, read_config
from lab.data import SyntheticTokens
from lab.distributed import flight
from lab.distributed.launch import HANG_TIMEOUT_S
from lab.dryrun import dry_run
from lab.faults import USAGE, InjectedFailure
from lab.model import MoE, build_model, moe_losses, num_params
from lab.outputs import check_output_dir, check_output_file
from lab.parallel.optim import adamw, clip_grad_norm
from lab.parallel.parallelize import Parallelized, build_mesh, parallelize
from lab.parallel.pp import cross_entropy
from lab.precision.loss_scale import DynamicLossScaler
from lab.precision.scheme import precision_scheme
from lab.preemption import EXIT_STOPPED, StopOnSignal, StoppedBySignal, checkpoint_now


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

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None or k == "peak_bytes"}


def _error_once(prog: str, message: str) -> int:
    """Print one `error:` line for the whole launch and give the exit status, 2. Under torchrun every rank meets
    the same error: rank 0 prints it, the others wait a moment before exiting, since torchrun stops the whole
    group as soon as one rank exits non-zero and could otherwise stop rank 0 before its line is out."""
    if lab_dist.launched_by_torchrun() and os.environ["RANK"] != "0":
        time.sleep(2.0)
    else:
        print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


class _OneLineParser(argparse.ArgumentParser):
    """Bad flags end in one line naming the problem (argparse's default also dumps the usage)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(_error_once(self.prog, f"{message} (see --help)"))


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog="python -m lab.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="TOML run config (configs/*.toml); defaults to the tiny model")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override any config field, e.g. --set model.n_layers=4 (repeatable)")
    p.add_argument("--nproc", type=int, help="local ranks to start (default: the product of the degrees)")
    p.add_argument("--model", help="model preset, as --set model.preset=NAME")
    p.add_argument("--seq", type=int, help="sequence length in tokens, as --set train.seq_len=N")
    p.add_argument("--mbs", type=int, help="sequences per micro-batch: the global batch is mbs x dp x grad-accum "
                                          "(instead of train.global_batch)")
    p.add_argument("--steps", type=int)
    p.add_argument("--kernels", choices=KERNEL_MODES, help="'triton': train with lab.kernels' Triton kernels patched "
                   "into the model (Triton's interpreter on CPU), as --set train.kernels=triton")
    p.add_argument("--precision", choices=PRECISIONS, help="what the model computes in: bf16/fp16 with fp32 master "
                   "weights and fp32 gradient sums (fp16 with loss scaling), fp8-*: bf16 with the linears' GEMMs in "
                   "FP8 (lab.precision), as --set train.precision=NAME")
    p.add_argument("--seed", type=int)
    p.add_argument("--log-json", metavar="PATH", help="write one JSON object per step to PATH")
    p.add_argument("--quiet", action="store_true", help="print only the final summary")
    p.add_argument("--dry-run", action="store_true", help="build one rank of the layout on the meta device under a "
                   "fake process group and compare its static bytes with lab.calc.memory (lab.dryrun); train nothing")
    p.add_argument("--rank", type=int, help="the rank --dry-run builds (default 0)")
    ckpt = p.add_argument_group("checkpoints (lab.checkpoint: torch.distributed.checkpoint, reshardable)")
    ckpt.add_argument("--checkpoint-dir", metavar="DIR", help="save checkpoints as DIR/step-N (and at the end)")
    ckpt.add_argument("--checkpoint-every", type=int, default=0, metavar="N", help="save every N steps")
    ckpt.add_argument("--async-checkpoint", action="store_true", help="write checkpoints in the background "
                      "(DCP async_save): training waits only for the copy to CPU memory")
    ckpt.add_argument("--keep", type=int, default=0, metavar="K", help="keep the newest K checkpoints (0: all)")
    ckpt.add_argument("--resume", action="store_true", help="continue from the newest intact checkpoint in "
                      "--checkpoint-dir (naming newer damaged ones it skips), at this run's layout (which may differ "
                      "from the one that saved it); refuses another model, precision or data stream, and step "
                      "folders none of which is intact")
    ckpt.add_argument("--fresh", action="store_true", help="with --resume: start from step 0 when no checkpoint in "
                      "--checkpoint-dir is intact, instead of refusing")
    faults = p.add_argument_group("failures and restarts (lab.faults)")
    faults.add_argument("--inject-failure", metavar=USAGE, help="make rank R fail in step S, before its optimizer "
                        "step: raise an error (default), SIGKILL itself, or hang (first attempt only)")
    faults.add_argument("--max-restarts", type=int, default=0, metavar="K", help="start the whole group again after a "
                        "failure, up to K times, resuming from the newest checkpoint (needs --checkpoint-dir; "
                        "under torchrun, give torchrun --max-restarts instead)")
    faults.add_argument("--collective-timeout", type=float, metavar="SECONDS", help="how long a collective waits "
                        "for a missing rank before it fails (default: 30 s for --nproc, 1800 s under torchrun)")
    faults.add_argument("--hang-timeout", type=float, default=HANG_TIMEOUT_S, metavar="SECONDS",
                        help="with --nproc: stop the run when a rank finishes no step and no collective for this "
                        "long, naming it and where it hangs (default: %(default)g s; raise it when a checkpoint "
                        "save or the first step takes longer)")
    faults.add_argument("--time-limit", type=float, metavar="SECONDS", help="with --nproc: stop the run after this "
                        "long, progressing or not (default: no limit)")
    group = p.add_argument_group("parallelism (the fields of [parallel]; each flag sets one)")
    for spec in dataclasses.fields(ParallelConfig):
        flag, meta = spec.metadata.get("flag", "--" + spec.name.replace("_", "-")), spec.metadata
        if spec.type == "bool":
            group.add_argument(flag, dest=spec.name, action="store_true", default=None, help=meta["help"])
        else:
            kind = {"int": int, "float": float, "str": str}[spec.type]
            group.add_argument(flag, dest=spec.name, type=kind, choices=meta.get("choices"), help=meta["help"])
    return p


def infer_dp(world_size: int, parallel: dict) -> int | None:
    """The data-parallel degree that `world_size` launched ranks imply: the ranks that tp x cp x pp leave.

    One rule for both launchers (`--nproc N` and torchrun), applied when the command line does not name dp.
    `parallel` is the [parallel] section as requested (file, then overrides), before defaults and validation.
    None when the degrees are not valid integers or do not divide world_size: the layout check then says why."""
    others = 1
    for name in ("tp", "cp", "pp"):
        value = parallel.get(name, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return None
        others *= value
    return world_size // others if world_size % others == 0 else None


def _world_size_launched(args: argparse.Namespace) -> int | None:
    """How many ranks run this: torchrun's WORLD_SIZE, else --nproc, else None (the layout decides)."""
    if args.nproc is not None and args.nproc < 1:
        raise ValueError(f"--nproc={args.nproc} must be >= 1")
    if not lab_dist.launched_by_torchrun():
        return args.nproc
    world = int(os.environ["WORLD_SIZE"])
    if args.nproc is not None and args.nproc != world:
        raise ValueError(f"--nproc={args.nproc} under torchrun, which started {world} ranks: leave --nproc out")
    return world


def config_from_args(args: argparse.Namespace) -> tuple[Config, int]:
    """The run config (file < --set < flags) and the number of ranks; raises ValueError on bad input."""
    data = read_config(args.config, args.set)
    model, parallel, train = (data.setdefault(section, {}) for section in ("model", "parallel", "train"))
    for section, name, value in ((model, "preset", args.model), (train, "seq_len", args.seq),
                                 (train, "steps", args.steps), (train, "seed", args.seed),
                                 (train, "kernels", args.kernels), (train, "precision", args.precision)):
        if value is not None:
            section[name] = value
    flags = {spec.name: getattr(args, spec.name) for spec in dataclasses.fields(ParallelConfig)}
    parallel.update({name: value for name, value in flags.items() if value is not None})
    world = _world_size_launched(args)
    # `--nproc 4` (or torchrun with 4 ranks) alone means "four data-parallel ranks"; a dp named on the command
    # line wins (a config file's dp is overridden, as a file cannot know how many ranks were launched).
    names_dp = args.dp is not None or any(parse_override(o)[:2] == ("parallel", "dp") for o in args.set)
    if world is not None and not names_dp and (dp := infer_dp(world, parallel)) is not None:
        parallel["dp"] = dp
    if parallel.get("pp_schedule") == "interleaved" and "pp_virtual_stages" not in parallel:
        parallel["pp_virtual_stages"] = INTERLEAVED_CHUNKS
    if args.mbs is not None:  # the global batch is what the config holds: mbs x dp x grad_accum sequences
        if args.mbs < 1:
            raise ValueError(f"--mbs={args.mbs} must be >= 1 (sequences per micro-batch)")
        if any(parse_override(o)[:2] == ("train", "global_batch") for o in args.set):
            raise ValueError(f"--mbs={args.mbs} and train.global_batch both set the batch size: give one")
        dp, accum = parallel.get("dp", 1), parallel.get("grad_accum", 1)
        if all(isinstance(n, int) and not isinstance(n, bool) for n in (dp, accum)):  # else from_dict says why
            train["global_batch"] = args.mbs * dp * accum
    config = Config.from_dict(data)
    p = config.parallel
    nproc = world if world is not None else p.world_size
    if nproc != p.world_size:
        launched = (f"torchrun started {nproc} ranks but" if lab_dist.launched_by_torchrun()
                    else f"--nproc={nproc} must equal")
        raise ValueError(f"{launched} dp*tp*cp*pp = {p.dp}*{p.tp}*{p.cp}*{p.pp} = {p.world_size}")
    if config.train.device == "cuda" and not torch.cuda.is_available():
        available = "no CUDA build of torch" if torch.version.cuda is None else "no CUDA device visible"
        raise ValueError(f"train.device='cuda' but this machine has {available}; available: 'cpu' "
                         f"(or 'auto', which picks CUDA where there is one)")
    if config.train.kernels == "triton":
        _check_kernels(config)
    check_supported(config)
    return config, nproc


def _check_kernels(config: Config) -> None:
    """Triton must be installed, and its kernels must run where the model does: compiled on a GPU, or in the
    interpreter on CPU tensors (set when lab.kernels is imported on a machine without a GPU)."""
    from lab import kernels

    kernels.require_triton()
    on_gpu = config.train.device == "cuda" or (config.train.device == "auto" and torch.cuda.is_available())
    if on_gpu != (kernels.DEVICE == "cuda"):
        where = "CPU tensors (Triton's interpreter, TRITON_INTERPRET=1)" if kernels.DEVICE == "cpu" else "the GPU"
        raise ValueError(f"--kernels triton with train.device={config.train.device!r}: this process runs Triton "
                         f"kernels on {where}; use the same device for the model, or --kernels eager")
    compute = precision_scheme(config.train.precision).policy.param_dtype
    if compute not in kernels.supported_dtypes():
        names = ", ".join(str(d).removeprefix("torch.") for d in kernels.supported_dtypes())
        raise ValueError(f"--kernels triton with --precision {config.train.precision} (computing in "
                         f"{str(compute).removeprefix('torch.')}): the kernels here take {names}; use --precision "
                         f"fp32 or fp16, or --kernels eager")


def _device(config: Config) -> torch.device:
    if config.train.device == "cuda" or (config.train.device == "auto" and torch.cuda.is_available()):
        index = dist.get_rank() % torch.cuda.device_count() if dist.is_initialized() else 0
        return torch.device("cuda", index)
    return torch.device("cpu")


def _lr_factor(step: int, config: Config) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak learning rate."""
    warmup, total = config.train.warmup_steps, config.train.steps
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def train_worker(config: Config, log_path: str | None = None, verbose: bool = True,
                 checkpoint: CheckpointOptions | None = None, inject: InjectedFailure | None = None,
                 on_step: Callable[[StepLog], None] | None = None) -> list[StepLog]:
    """The training loop run by every rank (or by the only process). Returns the per-step log (of the steps
    this run made: after a resume, those after the checkpoint's step). A group started again after a failure
    (`lab.distributed.restarts`, under `lab.distributed.run` or torchrun) resumes as `--resume` does.

    It knows one thing about the layout: whether a pipeline drives the model. Everything else — which rows and
    tokens this rank holds, how the loss and gradients are reduced — is asked of what `parallelize` built."""
    parallel, train = config.parallel, config.train
    device = _device(config)
    loss = cross_entropy
    if train.kernels == "triton":  # the fused loss here; RMSNorm, SwiGLU and attention patched in below
        from lab import kernels
        from lab.kernels.cross_entropy import cross_entropy as loss
    scheme = precision_scheme(train.precision, train.reduce_dtype)
    par = parallelize(config.model, build_mesh(parallel), parallel, device, train.seed, train.seq_len, loss, scheme)
    if train.kernels == "triton":
        kernels.patch(par.model)
    optimizer = adamw(par.parameters(), train.lr, train.weight_decay)  # fp32 master weights under bf16/fp16
    scaler = DynamicLossScaler(enabled=scheme.policy.needs_loss_scaling)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, config))
    data = SyntheticTokens(config.model.vocab_size, train.seq_len, train.global_batch, train.seed,
                           train.data_branching)
    moe = MoEStats(config) if config.model.is_moe else None
    if par.pipeline is not None and moe is not None:
        par.pipeline.extra_loss = moe.router_loss  # each stage's MoE layers, after its forward

    rank = dist.get_rank() if dist.is_initialized() else 0
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
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            inputs, targets = par.batch(*data.next_batch())
            if moe is not None:
                moe.reset()
            scale = scaler.get_scale()  # fp16: backward starts from loss x scale (1 otherwise)
            if par.pipeline is not None:
                par.pipeline.grad_scale = scale
                with par.engine.no_sync():  # the schedule's backwards accumulate; gradients are reduced after
                    loss = par.pipeline.step(inputs, targets, par.batch.positions)
                loss = torch.zeros((), device=device) if loss is None else loss
            else:
                loss = _accumulate_gradients(par, inputs, targets, parallel.grad_accum, moe, scale)
            par.finish_gradients()  # every rank now holds the averaged gradients of what it updates (fp32 masters)
            loss = par.mean_loss(loss)
            scaler.unscale_(par.parameters())  # fp16: divide by the scale; all ranks agree on any inf/nan
            norm = clip_grad_norm(par.parameters(), train.grad_clip)
            lr = scheduler.get_last_lr()[0]
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
            if device.type == "cuda":  # kernels run asynchronously: the step ends when the GPU's work does
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - start
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            fp16 = {"loss_scale": scale, "skipped": not stepped} if scaler.enabled else {}
            entry = StepLog(step + 1, loss.item(), lr, norm.item(), train.global_batch * train.seq_len / elapsed,
                            peak, **(moe.summary() if moe else {}), **fp16)
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


class MoEStats:
    """The router's losses and what the MoE layers report over one step: assignments per expert, dropped ones,
    the balancing loss (mean over layers, micro-batches and ranks)."""

    def __init__(self, config: Config) -> None:
        self.cfg, self.tp = config.model, config.parallel.tp
        self.reset()

    def reset(self) -> None:
        self.load = torch.zeros(self.cfg.n_experts, dtype=torch.double)
        self.layer_load = torch.zeros(self.cfg.n_layers, self.cfg.n_experts, dtype=torch.double)  # row: a block
        self.dropped = self.aux = self.layer_forwards = 0.0

    def router_loss(self, module: nn.Module) -> torch.Tensor:
        """After `module`'s forward (the model, or a pipeline stage's chunk): its MoE layers' balancing and z
        losses with their weights, to add to what is backpropagated; their load is recorded."""
        layers = [m for m in module.modules() if isinstance(m, MoE)]
        for m in layers:
            self.load += m.load.cpu().double()
            self.layer_load[m.layer] += m.load.cpu().double()
            self.dropped += m.dropped
            self.aux += m.aux_loss.item()
            self.layer_forwards += 1
        aux, z = moe_losses(module)
        return self.cfg.aux_loss_coef * aux + self.cfg.z_loss_coef * z

    def summary(self) -> dict:
        totals = torch.cat([self.layer_load.flatten(), self.load,
                            torch.tensor([self.dropped, self.aux, self.layer_forwards])])
        if dist.is_initialized():  # every rank routed its own tokens through its own layers...
            dist.all_reduce(totals)
            totals[:-2] /= self.tp  # ...except the TP ranks of one group, which route the same ones
        per_layer, load = totals[:self.layer_load.numel()].view_as(self.layer_load), totals[self.layer_load.numel():-3]
        return {"expert_load": [round(n) for n in load.tolist()], "load_imbalance": (load.max() / load.mean()).item(),
                "expert_load_per_layer": {str(i): [round(n) for n in row.tolist()] for i, row in enumerate(per_layer)
                                          if self.cfg.is_moe_layer(i)},
                "dropped_tokens": round(totals[-3].item()), "aux_loss": (totals[-2] / totals[-1]).item()}


def _accumulate_gradients(par: Parallelized, inputs: torch.Tensor, targets: torch.Tensor, micro_batches: int,
                          moe: MoEStats | None, grad_scale: float = 1.0) -> torch.Tensor:
    """Forward and backward of every micro-batch in turn (gradient accumulation); returns the mean
    cross-entropy. An MoE model's router losses are added to what is backpropagated, with their weights; what is
    backpropagated is multiplied by `grad_scale` (fp16's loss scale)."""
    loss = torch.zeros((), device=inputs.device)
    positions = par.batch.positions
    pairs = list(zip(inputs.chunk(micro_batches), targets.chunk(micro_batches), strict=True))
    for i, (micro_in, micro_tgt) in enumerate(pairs):
        # no gradient communication until the last micro-batch's backward
        with par.engine.backward_context(last_micro_batch=i == len(pairs) - 1):
            micro_loss = par.loss_fn(par.model(micro_in, positions), micro_tgt)
            objective = micro_loss + (moe.router_loss(par.model) if moe is not None else 0.0)
            (objective * (grad_scale / micro_batches)).backward()
        loss += micro_loss.detach() / micro_batches
    return loss


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


def summary(config: Config, logs: list[StepLog], nproc: int, seconds: float) -> str:
    p = config.parallel
    floor = SyntheticTokens(config.model.vocab_size, 2, 1, branching=config.train.data_branching).loss_floor
    layout = ", ".join([f"{k}={getattr(p, k)}" for k in ("dp", "tp", "cp", "pp", "ep", "grad_accum")
                        if getattr(p, k) != 1] + ([f"cp_impl={p.cp_impl}"] if p.cp > 1 else [])
                       + ([f"pp_schedule={p.pp_schedule}"] if p.pp > 1 else [])
                       + ([f"pp_chunks={p.pp_virtual_stages}"] if p.pp_virtual_stages > 1 else [])
                       + (["sp"] if p.sp else []) + ([f"zero={p.zero}"] if p.zero else [])) or "single process"
    rate, startup, steady = throughput(logs, config.train.global_batch * config.train.seq_len, seconds)
    precision = "" if config.train.precision == "fp32" else f" in {config.train.precision}"
    skipped = sum(bool(log.skipped) for log in logs)
    skipped = f", {skipped} step(s) skipped on fp16 overflow" if skipped else ""
    return (f"trained {config.model.name} ({num_params(build_model(config.model)):,} parameters){precision} for "
            f"{len(logs)} steps on {nproc} rank(s) [{layout}]{skipped}: loss {logs[0].loss:.4f} -> {logs[-1].loss:.4f} "
            f"(data floor {floor:.4f}); {rate:,.0f} tokens/s over {steady}; start-up {startup:.1f} s "
            f"(ranks, model, first step), {seconds:.1f} s in all")


def throughput(logs: list[StepLog], tokens_per_step: int, seconds: float) -> tuple[float, float, str]:
    """(steady-state tokens/s, start-up seconds, which steps the rate covers) of a run that took `seconds` in all.

    The first step pays one-time costs (communicators built on first use, the allocator warming up, lazy
    initialisation), and the run's wall time also holds starting the ranks and building the model: over a short
    run these dwarf the steps (986 tokens/s over 1.3 s for steps running at ~10,000). So the rate is over the
    steps after the first, and everything else is reported as start-up."""
    steady = logs[1:] or logs
    step_seconds = sum(tokens_per_step / log.tokens_per_s for log in steady)
    which = f"steps {steady[0].step}-{steady[-1].step}" if len(steady) > 1 else f"step {steady[0].step}"
    return tokens_per_step * len(steady) / step_seconds, max(0.0, seconds - step_seconds), which


def run(config: Config, nproc: int = 1, log_path: str | None = None, verbose: bool = True,
        checkpoint: CheckpointOptions | None = None, inject: InjectedFailure | None = None, max_restarts: int = 0,
        collective_timeout_s: float | None = None, on_step: Callable[[StepLog], None] | None = None,
        hang_timeout_s: float | None = HANG_TIMEOUT_S, time_limit_s: float | None = None) -> list[StepLog]:
    """Train in this process (nproc=1), on `nproc` local ranks, or in the group torchrun launched. A layout
    lab cannot run raises ValueError here, before any rank starts (`lab.config.check_supported`).

    `inject` makes a rank fail on purpose (`lab.faults`); `max_restarts` starts the local ranks again after a
    failure, resuming from the newest checkpoint (under torchrun, torchrun's own `--max-restarts` does this).
    `collective_timeout_s` bounds how long a collective waits for a missing rank (the process group's timeout).
    `on_step(log)` is called after every step, in every rank (benchmarks/gpu_lane.py steps a profiler with it).
    Local ranks are stopped when one makes no progress (finishes no step, no collective) for `hang_timeout_s`, and
    after `time_limit_s` if given: a run that progresses has no time limit (`lab.distributed.run`).
    Every output path is checked first, and a non-finite loss or gradient norm stops the run (`NonFiniteLoss`)."""
    check_supported(config)
    _check_faults(config, checkpoint, inject, max_restarts, collective_timeout_s)
    _check_limits(hang_timeout_s, time_limit_s)
    _check_outputs(log_path, checkpoint)
    logs = _run(config, nproc, log_path, verbose, checkpoint, inject, max_restarts, collective_timeout_s, on_step,
                hang_timeout_s, time_limit_s)
    if logs and (reason := non_finite(logs[-1].loss, logs[-1].grad_norm, logs[-1].loss_scale is not None)):
        raise NonFiniteLoss(f"step {logs[-1].step}: {reason}; stopped before its update (lower train.lr="
                            f"{config.train.lr:g}, or look at the data and the model's numerics)")
    return logs


def _run(config: Config, nproc: int, log_path: str | None, verbose: bool, checkpoint: CheckpointOptions | None,
         inject: InjectedFailure | None, max_restarts: int, collective_timeout_s: float | None,
         on_step: Callable[[StepLog], None] | None, hang_timeout_s: float | None, time_limit_s: float | None
         ) -> list[StepLog]:
    """`run` once its arguments are checked: train here, on local ranks, or in torchrun's group."""
    if lab_dist.launched_by_torchrun():
        lab_dist.init_from_env(**({} if collective_timeout_s is None else {"timeout_s": collective_timeout_s}))
        if dist.get_world_size() != config.parallel.world_size:
            raise ValueError(f"torchrun started {dist.get_world_size()} ranks but dp*tp*cp*pp = "
                             f"{config.parallel.world_size}")
        return train_worker(config, log_path, verbose, checkpoint, inject, on_step)
    if nproc != config.parallel.world_size:
        p = config.parallel
        raise ValueError(f"nproc={nproc} must equal dp*tp*cp*pp = {p.dp}*{p.tp}*{p.cp}*{p.pp} = {p.world_size}")
    check_resume(checkpoint, config)  # a damaged or foreign checkpoint: one line now, not a traceback per rank
    if nproc == 1 and inject is None and not max_restarts:  # a failure on purpose runs in a rank of its own
        return train_worker(config, log_path, verbose, checkpoint, on_step=on_step)
    backend = "nccl" if config.train.device != "cpu" and torch.cuda.device_count() >= nproc else "gloo"
    try:
        return lab_dist.run(train_worker, nproc, config, log_path, verbose, checkpoint, inject, on_step,
                            backend=backend, timeout_s=time_limit_s, hang_timeout_s=hang_timeout_s,
                            max_restarts=max_restarts,
                            **({} if collective_timeout_s is None else {"pg_timeout_s": collective_timeout_s}))[0]
    except lab_dist.RankError as err:
        if err.summary.startswith("CheckpointError: "):  # a save that failed: its one line, as in one process
            raise CheckpointError(err.summary.removeprefix("CheckpointError: ")) from None
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


def _checkpoint_options(args: argparse.Namespace) -> CheckpointOptions | None:
    if args.checkpoint_dir is None:
        if args.resume or args.fresh or args.checkpoint_every or args.keep or args.async_checkpoint:
            raise ValueError("--resume, --fresh, --checkpoint-every, --keep and --async-checkpoint need "
                             "--checkpoint-dir")
        return None
    return CheckpointOptions(args.checkpoint_dir, args.checkpoint_every, args.keep, args.resume,
                             args.async_checkpoint, args.fresh)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config, nproc = config_from_args(args)
    except ValueError as err:
        return _error_once(parser.prog, str(err))
    if args.rank is not None and not args.dry_run:
        return _error_once(parser.prog, f"--rank={args.rank} picks the rank of a --dry-run; a run starts every rank")
    if args.dry_run:
        try:
            report = dry_run(config, 0 if args.rank is None else args.rank)
        except ValueError as err:
            return _error_once(parser.prog, str(err))
        print(report.report())
        return 1 if report.mismatches else 0
    try:
        checkpoint = _checkpoint_options(args)
        inject = InjectedFailure.parse(args.inject_failure) if args.inject_failure is not None else None
    except ValueError as err:
        return _error_once(parser.prog, str(err))
    start = time.perf_counter()
    try:
        logs = run(config, nproc, args.log_json, verbose=not args.quiet, checkpoint=checkpoint, inject=inject,
                   max_restarts=args.max_restarts, collective_timeout_s=args.collective_timeout,
                   hang_timeout_s=args.hang_timeout, time_limit_s=args.time_limit)
    except ValueError as err:
        return _error_once(parser.prog, str(err))
    except StoppedBySignal as err:  # SIGTERM (a Slurm time limit, a preemption): checkpointed, not finished
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"{parser.prog}: {err}", file=sys.stderr)
        return EXIT_STOPPED
    except NonFiniteLoss as err:  # a run that diverged did not succeed: one line, and a failing exit status
        _error_once(parser.prog, str(err))
        return 1
    except lab_dist.RankError as err:
        print(f"{parser.prog}: {err}", file=sys.stderr)
        return 1
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(summary(config, logs, nproc, time.perf_counter() - start) if logs else
              f"nothing to train: the checkpoint is already at step {config.train.steps} (--steps)")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
