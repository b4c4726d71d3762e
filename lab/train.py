"""`python -m lab.train`: train a model with the parallelisms a config asks for.

    python -m lab.train --config configs/tiny.toml --steps 20
    python -m lab.train --config configs/tiny.toml --nproc 2             # two local gloo ranks: dp=2
    torchrun --nproc_per_node 8 -m lab.train --model llama3-1b --seq 2048 --mbs 1 --tp 2   # dp=4 x tp=2
    python -m lab.train --config configs/llama3-70b.toml --dp 8 --tp 8 --pp 4 --dry-run --rank 37  # lab.dryrun
    python -m lab.train --config configs/tiny.toml --nproc 2 --checkpoint-dir ckpt --checkpoint-every 2 \
        --inject-failure rank=1,step=3,kind=kill --max-restarts 1     # a rank dies; the group resumes (lab.faults)
    python -m lab.train --config configs/tiny.toml --nproc 2 --inject-failure rank=1,kind=straggler,delay_ms=50
    python -m lab.train --config configs/tiny.toml --nproc 3 --set train.global_batch=6 --sdc-check 1 \
        --inject-failure rank=1,step=3,kind=bitflip                 # caught: rank 1 and the parameter named
    python -m lab.train --config configs/tiny.toml --nproc 4 --tp 2 --precision fp8-tilewise  # lab.precision
    python -m lab.train --config configs/tiny.toml --nproc 2 --zero 3 --fp8-all-gather  # ZeRO-3 gathers in e4m3
    python -m lab.train --config configs/tiny.toml --nproc 2 --tp 2 --compile  # each block torch.compiled (inductor)

On a CPU it starts `--nproc` gloo ranks through `lab.distributed.run`; under `torchrun` it joins the launched
group (NCCL on GPUs). Every step writes one JSON object (step, loss, lr, grad_norm, tokens_per_s,
peak_bytes, and with two or more ranks each rank's compute and step seconds) to `--log-json`; the final summary
names a straggler if there is one (`lab.distributed.health`), and compares the loss with the data's known floor.
A group started again after a failure (`--max-restarts`, or `torchrun --max-restarts`) resumes from its newest
checkpoint.

Each chapter adds its flag here and a test showing its losses equal the single-process run's.

What belongs here: the command line, turning it into a runnable `Config` (flags, overrides, the degrees the
launched ranks imply), and the final summary. The loop each rank runs, and the launch of those ranks (`run`,
which notebooks call as `from lab.train import run`), are `lab.trainer`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch
import torch.distributed as dist

from lab import distributed as lab_dist
from lab.checkpoint import CheckpointOptions
from lab.config import (
    COMPILE_MODES,
    KERNEL_MODES,
    PRECISIONS,
    Config,
    ParallelConfig,
    check_supported,
    parse_override,
    read_config,
)
from lab.data import SyntheticTokens
from lab.distributed.health import SilentDataCorruption, find_straggler
from lab.distributed.launch import HANG_TIMEOUT_S
from lab.dryrun import dry_run
from lab.faults import USAGE, InjectedFailure
from lab.layout import describe, infer_dp
from lab.model import build_model, num_params
from lab.precision.fp8 import NonFiniteAmax
from lab.precision.scheme import precision_scheme
from lab.preemption import EXIT_STOPPED, StoppedBySignal
from lab.trainer import (
    NonFiniteLoss,
    StepLog,
    run,
)


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
    p.add_argument("--compile", nargs="?", const="inductor", choices=COMPILE_MODES, help="torch.compile each block "
                   "after the parallelisms are applied (lab.parallel.compile): --compile alone is inductor; 'auto' "
                   "(the default) compiles on a GPU where `lab doctor` says compile works and stays eager on a CPU; "
                   "as --set train.compile=MODE")
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
                        "step: raise an error (default), SIGKILL itself, or hang (first attempt only); or fail "
                        "silently: straggler (sleep D ms per step from step S, default 1) or bitflip (flip bit B of "
                        "parameter NAME after step S's update; see --sdc-check)")
    faults.add_argument("--max-restarts", type=int, default=0, metavar="K", help="start the whole group again after a "
                        "failure, up to K times, resuming from the newest checkpoint (needs --checkpoint-dir; "
                        "under torchrun, give torchrun --max-restarts instead)")
    faults.add_argument("--sdc-check", type=int, default=0, metavar="N", help="every N steps, compare a checksum "
                        "of the data-parallel replicas' parameters and optimizer states (lab.distributed.health) and "
                        "stop on a mismatch, naming the rank and the tensor (0: never)")
    faults.add_argument("--sdc-report", action="store_true", help="with --sdc-check: report a mismatch (stderr, "
                        "and the step's 'sdc' in --log-json) and go on, instead of stopping")
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
                                 (train, "kernels", args.kernels), (train, "compile", args.compile),
                                 (train, "precision", args.precision)):
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


def summary(config: Config, logs: list[StepLog], nproc: int, seconds: float) -> str:
    floor = SyntheticTokens(config.model.vocab_size, 2, 1, branching=config.train.data_branching).loss_floor
    layout = describe(config.parallel, grad_accum=True)
    rate, startup, steady = throughput(logs, config.train.global_batch * config.train.seq_len, seconds)
    precision = "" if config.train.precision == "fp32" else f" in {config.train.precision}"
    skipped = sum(bool(log.skipped) for log in logs)
    skipped = f", {skipped} step(s) skipped on fp16 overflow" if skipped else ""
    return (f"trained {config.model.name} ({num_params(build_model(config.model)):,} parameters){precision} for "
            f"{len(logs)} steps on {nproc} rank(s) [{layout}]{skipped}: loss {logs[0].loss:.4f} -> {logs[-1].loss:.4f} "
            f"(data floor {floor:.4f}); {rate:,.0f} tokens/s over {steady}; start-up {startup:.1f} s "
            f"(ranks, model, first step), {seconds:.1f} s in all{_straggler_line(logs)}")


def _straggler_line(logs: list[StepLog]) -> str:
    """A second line naming the straggler and its cost to every step, when the ranks' times show one."""
    timed = [log for log in logs if log.rank_compute_s is not None]
    found = find_straggler([log.rank_compute_s for log in timed], [log.rank_step_s for log in timed])
    return f"\n{found.describe()}" if found else ""


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
                   hang_timeout_s=args.hang_timeout, time_limit_s=args.time_limit, sdc_check=args.sdc_check,
                   sdc_stop=not args.sdc_report)
    except ValueError as err:
        return _error_once(parser.prog, str(err))
    except SilentDataCorruption as err:  # every rank found the same mismatch: one line, and a failing exit status
        _error_once(parser.prog, str(err))
        return 1
    except StoppedBySignal as err:  # SIGTERM (a Slurm time limit, a preemption): checkpointed, not finished
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"{parser.prog}: {err}", file=sys.stderr)
        return EXIT_STOPPED
    except (NonFiniteLoss, NonFiniteAmax) as err:  # a run that diverged did not succeed: one line, exit status 1
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

