"""`python -m lab.train`: train a model with the parallelisms a config asks for.

    python -m lab.train --config configs/tiny.toml --steps 20
    python -m lab.train --config configs/tiny.toml --nproc 2             # two local gloo ranks: dp=2
    torchrun --nproc_per_node 8 -m lab.train --model llama3-1b --seq 2048 --mbs 1 --tp 2   # dp=4 x tp=2

On a CPU it starts `--nproc` gloo ranks through `lab.dist.run`; under `torchrun` it joins the launched
group (NCCL on GPUs). Every step writes one JSON object (step, loss, lr, grad_norm, tokens_per_s,
peak_bytes) to `--log-json`; the final summary compares the loss with the data's known floor.

Each chapter adds its flag here and a test showing its losses equal the single-process run's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lab import dist as lab_dist
from lab.calc.schedules import INTERLEAVED_CHUNKS, make_schedule
from lab.config import (
    CP_IMPLS,
    DP_MODES,
    PP_SCHEDULES,
    RECOMPUTE_MODES,
    Config,
    apply_overrides,
    load_config,
    parse_override,
)
from lab.data import SyntheticTokens, shard_rows
from lab.dist import Mesh
from lab.model import MoE, build_model, materialize, moe_losses, num_params, set_recompute
from lab.parallel.cp import apply_context_parallel, layout_of, sequence_positions, shard_sequence
from lab.parallel.dp import NaiveDP
from lab.parallel.ep import ExpertDataParallel, apply_expert_parallel
from lab.parallel.pp import Pipeline, build_chunk
from lab.parallel.tp import apply_tensor_parallel, sync_tensor_parallel_grads, vocab_parallel_cross_entropy
from lab.parallel.zero import make_data_parallel


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
    load_imbalance: float | None = None
    dropped_tokens: int | None = None
    aux_loss: float | None = None

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
    p.add_argument("--seed", type=int)
    p.add_argument("--log-json", metavar="PATH", help="write one JSON object per step to PATH")
    p.add_argument("--quiet", action="store_true", help="print only the final summary")
    group = p.add_argument_group("parallelism")
    for name in ("dp", "tp", "cp", "pp", "ep", "grad-accum"):
        group.add_argument(f"--{name}", type=int)
    group.add_argument("--sp", action="store_true", default=None, help="sequence parallelism (with --tp)")
    group.add_argument("--zero", type=int, help="ZeRO stage 0-3 over the dp ranks (0: plain data parallelism)")
    group.add_argument("--dp-mode", choices=DP_MODES, help="how plain data parallelism averages gradients "
                                                          "(default bucketed)")
    group.add_argument("--bucket-mb", type=float, help="MiB per gradient bucket for --dp-mode bucketed")
    group.add_argument("--cp-impl", choices=CP_IMPLS, help="context parallelism: ring attention on contiguous "
                                                          "or zig-zag chunks, or Ulysses (default zigzag)")
    group.add_argument("--pp-schedule", choices=PP_SCHEDULES, help="pipeline schedule (default 1f1b); the "
                                                                   "micro-batches are --grad-accum's")
    group.add_argument("--pp-chunks", type=int, help="layer chunks per pipeline rank (interleaved schedule)")
    group.add_argument("--recompute", choices=RECOMPUTE_MODES)
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


def _requested(path: str | None, overrides: list[str], section: str) -> dict:
    """The fields of a config section the run asks for (file, then overrides), without defaults. An unreadable
    file gives {}: load_config reports it."""
    data: dict = {}
    if path is not None and Path(path).is_file():
        with contextlib.suppress(tomllib.TOMLDecodeError, UnicodeDecodeError):
            data = tomllib.loads(Path(path).read_text())
    return dict(apply_overrides(data, overrides).get(section, {}))


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
    overrides = list(args.set)
    for section, name, value in (
        ("model", "preset", args.model), ("train", "seq_len", args.seq),
        ("train", "steps", args.steps), ("train", "seed", args.seed),
        ("parallel", "dp", args.dp), ("parallel", "tp", args.tp), ("parallel", "cp", args.cp),
        ("parallel", "pp", args.pp), ("parallel", "ep", args.ep), ("parallel", "grad_accum", args.grad_accum),
        ("parallel", "zero", args.zero), ("parallel", "sp", args.sp), ("parallel", "dp_mode", args.dp_mode),
        ("parallel", "bucket_mb", args.bucket_mb), ("parallel", "cp_impl", args.cp_impl),
        ("parallel", "pp_schedule", args.pp_schedule), ("parallel", "pp_virtual_stages", args.pp_chunks),
        ("parallel", "recompute", args.recompute),
    ):
        if value is not None:
            overrides.append(f"{section}.{name}={json.dumps(value)}")
    world = _world_size_launched(args)
    requested = _requested(args.config, overrides, "parallel")
    # `--nproc 4` (or torchrun with 4 ranks) alone means "four data-parallel ranks"; a dp named on the command
    # line wins (a config file's dp is overridden, as a file cannot know how many ranks were launched).
    names_dp = any(parse_override(o)[:2] == ("parallel", "dp") for o in overrides)
    if world is not None and not names_dp and (dp := infer_dp(world, requested)) is not None:
        overrides.append(f"parallel.dp={dp}")
    if requested.get("pp_schedule") == "interleaved" and "pp_virtual_stages" not in requested:
        overrides.append(f"parallel.pp_virtual_stages={INTERLEAVED_CHUNKS}")
    if args.mbs is not None:  # the global batch is what the config holds: mbs x dp x grad_accum sequences
        if args.mbs < 1:
            raise ValueError(f"--mbs={args.mbs} must be >= 1 (sequences per micro-batch)")
        if any(parse_override(o)[:2] == ("train", "global_batch") for o in overrides):
            raise ValueError(f"--mbs={args.mbs} and train.global_batch both set the batch size: give one")
        parallel = _requested(args.config, overrides, "parallel")
        dp, accum = parallel.get("dp", 1), parallel.get("grad_accum", 1)
        if all(isinstance(n, int) and not isinstance(n, bool) for n in (dp, accum)):  # else load_config says why
            overrides.append(f"train.global_batch={args.mbs * dp * accum}")
    config = load_config(args.config, overrides)
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
    # A layout the calculators accept (ZeRO over TP shards is how large runs train) that lab.train cannot run yet.
    if p.zero and p.tp > 1:
        raise ValueError(f"zero={p.zero} with tp={p.tp}: lab's ZeRO shards a model that is not tensor parallel; "
                         f"use zero=0 with tp > 1")
    if p.pp > 1 and (p.tp > 1 or p.cp > 1 or p.zero):
        raise ValueError(f"pp={p.pp} with tp={p.tp}, cp={p.cp}, zero={p.zero}: lab.train combines pipeline "
                         f"parallelism with data parallelism only, for now; use --tp 1 --cp 1 --zero 0 with --pp")
    if p.ep > 1 and (p.tp > 1 or p.cp > 1 or p.pp > 1 or p.zero):
        raise ValueError(f"ep={p.ep} with tp={p.tp}, cp={p.cp}, pp={p.pp}, zero={p.zero}: lab.train combines expert "
                         f"parallelism with data parallelism only, for now")
    if p.pp > 1 and config.model.is_moe:
        raise ValueError(f"pp={p.pp} with a mixture-of-experts model: pipeline stages do not carry the router's "
                         f"auxiliary losses yet; train {config.model.name} without --pp")
    return config, nproc


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


def _build_model(config: Config, mesh: Mesh | None, device: torch.device) -> tuple[nn.Module, Pipeline | None]:
    """The model with the parallelisms applied (TorchTitan's order: pipeline split, TP, CP, recompute), and
    the pipeline driving it when pp > 1 (then the model is this rank's chunks)."""
    parallel, seed = config.parallel, config.train.seed
    if parallel.pp > 1:
        schedule = make_schedule(parallel.pp_schedule, parallel.pp, parallel.grad_accum, parallel.pp_virtual_stages)
        chunks = [build_chunk(config.model, schedule.virtual_stage(mesh.pp_rank, c), schedule.virtual_stages, device,
                              seed) for c in range(schedule.chunks)]
        for chunk in chunks:
            set_recompute(chunk, parallel.recompute)
        return nn.ModuleList(chunks), Pipeline(chunks, schedule, mesh.pp_group)
    model = materialize(build_model(config.model), device, seed=seed)
    if parallel.tp > 1:
        apply_tensor_parallel(model, mesh.tp_group, sequence_parallel=parallel.sp)
    if parallel.cp > 1:
        apply_context_parallel(model, mesh.cp_group, parallel.cp_impl)
    if parallel.ep > 1:
        apply_expert_parallel(model, mesh.ep_group)
    set_recompute(model, parallel.recompute)
    return model, None


def train_worker(config: Config, log_path: str | None = None, verbose: bool = True) -> list[StepLog]:
    """The training loop run by every rank (or by the only process). Returns the per-step log."""
    parallel, train = config.parallel, config.train
    mesh = (Mesh(dp=parallel.dp, pp=parallel.pp, cp=parallel.cp, tp=parallel.tp, ep=parallel.ep)
            if dist.is_initialized() else None)
    rank, dp_rank, cp_rank = (mesh.rank, mesh.dp_rank, mesh.cp_rank) if mesh else (0, 0, 0)
    tp_group = mesh.tp_group if mesh else None
    # Each CP rank saw other tokens of the same sequences: gradients and the loss are averaged over dp x cp.
    dp_group = (mesh.dp_cp_group if parallel.cp > 1 else mesh.dp_group) if mesh else None
    layout = layout_of(parallel.cp_impl)
    device = _device(config)
    positions = sequence_positions(train.seq_len, cp_rank, parallel.cp, layout).to(device) if parallel.cp > 1 else None

    model, pipeline = _build_model(config, mesh, device)
    # Plain DP (naive, overlapped or bucketed) or ZeRO: one object owns gradient averaging, clipping and AdamW.
    # A pipeline's backwards are spread over its schedule: it averages over dp once the schedule is done.
    if pipeline is not None:
        engine = NaiveDP(model, dp_group, train.lr, train.weight_decay, pp_group=mesh.pp_group)
    elif parallel.ep > 1:
        engine = ExpertDataParallel(model, dp_group, mesh.ep_group, mesh.ep_dp_group, train.lr, train.weight_decay)
    else:
        engine = make_data_parallel(model, dp_group, train, zero=parallel.zero, dp_mode=parallel.dp_mode,
                                    bucket_mb=parallel.bucket_mb, tp_group=tp_group if parallel.tp > 1 else None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda step: _lr_factor(step, config))
    data = SyntheticTokens(config.model.vocab_size, train.seq_len, train.global_batch, train.seed,
                           train.data_branching)

    log_file = open(log_path, "w") if (log_path and rank == 0) else None  # noqa: SIM115 - closed below
    progress = _progress(train.steps, enabled=verbose and rank == 0)
    logs: list[StepLog] = []
    try:
        for step in range(train.steps):
            start = time.perf_counter()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            inputs, targets = (shard_rows(t, dp_rank, parallel.dp).to(device) for t in data.next_batch())
            if parallel.cp > 1:
                inputs, targets = (shard_sequence(t, cp_rank, parallel.cp, layout) for t in (inputs, targets))
            moe = MoEStats(model) if config.model.is_moe else None
            if pipeline is not None:
                loss = pipeline.step(inputs, targets)
                loss = torch.zeros((), device=device) if loss is None else loss
                dist.all_reduce(loss, group=mesh.pp_group)  # the last stage's loss, to every stage
            else:
                loss = _accumulate_gradients(model, engine, inputs, targets, positions, config, tp_group, moe)
            engine.finish()  # every rank now holds the averaged gradients (ZeRO: of its shard)
            if parallel.tp > 1:
                sync_tensor_parallel_grads(model, tp_group)
            if parallel.dp * parallel.cp > 1:
                dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=dp_group)
                loss /= parallel.dp * parallel.cp
            norm = engine.clip_grad_norm(train.grad_clip)
            lr = scheduler.get_last_lr()[0]
            engine.step()
            scheduler.step()
            engine.zero_grad()
            elapsed = time.perf_counter() - start
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            entry = StepLog(step + 1, loss.item(), lr, norm.item(),
                            train.global_batch * train.seq_len / elapsed, peak,
                            **(moe.summary(dp_group, parallel.dp * parallel.cp) if moe else {}))
            logs.append(entry)
            if log_file:
                log_file.write(json.dumps(entry.as_dict()) + "\n")
                log_file.flush()
            progress(entry)
    finally:
        if log_file:
            log_file.close()
    return logs


class MoEStats:
    """What the MoE layers report over one step: assignments per expert, dropped ones, the balancing loss."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = [m for m in model.modules() if isinstance(m, MoE)]
        self.load = torch.zeros(self.layers[0].n_experts, dtype=torch.long)
        self.dropped, self.aux, self.micro_batches = 0, 0.0, 0

    def add(self) -> None:
        """After a micro-batch's forward."""
        self.load += sum(m.load.cpu() for m in self.layers)
        self.dropped += sum(m.dropped for m in self.layers)
        self.aux += sum(m.aux_loss.item() for m in self.layers) / len(self.layers)
        self.micro_batches += 1

    def summary(self, dp_group: dist.ProcessGroup | None, replicas: int) -> dict:
        totals = torch.cat([self.load, torch.tensor([self.dropped])]).double()
        aux = torch.tensor([self.aux / self.micro_batches], dtype=torch.double)
        if replicas > 1:  # every data-parallel rank routed its own tokens
            dist.all_reduce(totals, group=dp_group)
            dist.all_reduce(aux, group=dp_group)
            aux /= replicas
        load = totals[:-1]
        return {"expert_load": [int(n) for n in load.tolist()], "load_imbalance": (load.max() / load.mean()).item(),
                "dropped_tokens": int(totals[-1]), "aux_loss": aux.item()}


def _accumulate_gradients(model: nn.Module, engine, inputs: torch.Tensor, targets: torch.Tensor,
                          positions: torch.Tensor | None, config: Config, tp_group,
                          moe: MoEStats | None) -> torch.Tensor:
    """Forward and backward of every micro-batch in turn (gradient accumulation); returns the mean
    cross-entropy. An MoE model's router losses are added to what is backpropagated, with their weights."""
    parallel, cfg = config.parallel, config.model
    loss = torch.zeros((), device=inputs.device)
    micro_batches = list(zip(inputs.chunk(parallel.grad_accum), targets.chunk(parallel.grad_accum), strict=True))
    for i, (micro_in, micro_tgt) in enumerate(micro_batches):
        # no gradient communication until the last micro-batch's backward
        with engine.backward_context(last_micro_batch=i == len(micro_batches) - 1):
            logits = model(micro_in, positions)
            if parallel.tp > 1:
                micro_loss = vocab_parallel_cross_entropy(logits, micro_tgt, tp_group)
            else:
                micro_loss = F.cross_entropy(logits.flatten(0, 1), micro_tgt.flatten())
            objective = micro_loss
            if moe is not None:
                moe.add()
                aux, z = moe_losses(model)
                objective = micro_loss + cfg.aux_loss_coef * aux + cfg.z_loss_coef * z
            (objective / parallel.grad_accum).backward()
        loss += micro_loss.detach() / parallel.grad_accum
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
    return (f"trained {config.model.name} ({num_params(build_model(config.model)):,} parameters) for "
            f"{len(logs)} steps on {nproc} rank(s) [{layout}]: loss {logs[0].loss:.4f} -> {logs[-1].loss:.4f} "
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


def run(config: Config, nproc: int = 1, log_path: str | None = None, verbose: bool = True) -> list[StepLog]:
    """Train in this process (nproc=1), on `nproc` local ranks, or in the group torchrun launched."""
    if lab_dist.launched_by_torchrun():
        lab_dist.init_from_env()
        if dist.get_world_size() != config.parallel.world_size:
            raise ValueError(f"torchrun started {dist.get_world_size()} ranks but dp*tp*cp*pp = "
                             f"{config.parallel.world_size}")
        return train_worker(config, log_path, verbose)
    if nproc == 1:
        return train_worker(config, log_path, verbose)
    backend = "nccl" if config.train.device != "cpu" and torch.cuda.device_count() >= nproc else "gloo"
    return lab_dist.run(train_worker, nproc, config, log_path, verbose, backend=backend,
                        timeout_s=max(600.0, 10.0 * config.train.steps))[0]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config, nproc = config_from_args(args)
    except ValueError as err:
        return _error_once(parser.prog, str(err))
    start = time.perf_counter()
    try:
        logs = run(config, nproc, args.log_json, verbose=not args.quiet)
    except lab_dist.RankError as err:
        print(f"{parser.prog}: {err}", file=sys.stderr)
        return 1
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(summary(config, logs, nproc, time.perf_counter() - start))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
