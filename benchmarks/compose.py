"""The 8-rank layouts of issue 15 trained by `lab.train`, against the same model under torch's own stack.

    python benchmarks/compose.py                                # every layout, gloo on CPU, 8 steps each
    python benchmarks/compose.py --layouts dp2-tp2-pp2 --steps 4
    python benchmarks/compose.py --model tiny --seq 64 --batch 16

lab's side is `lab.train.run(config, 8)`, the loop `python -m lab.train` runs; a layout it refuses (its
`check_supported`) is a row with the one-line reason, not a crash.
torch's side trains the same model (the same `build_chunk` / `materialize` weights, the same batches) on one
`DeviceMesh` with dims (dp, pp, tp): DTensor TP (`parallelize_module` with lab's `torch_tp_plan`: the blocks
split, embedding and output layer whole, where lab splits them along the vocabulary), data parallelism with
FSDP2's machinery (`replicate` for zero=0, `fully_shard` for ZeRO; ZeRO-1 has no FSDP2 mode, so FSDP2 without
resharding after forward, ZeRO-2's memory, stands in, as TorchTitan does under PP), `torch.distributed.pipelining`
(Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble for zb-h1) over the stages, clipping by the
global norm as TorchTitan does it, and torch's AdamW with the config's lr and weight decay (lab's also spares the
norm weights from decay and warms the lr up: the same work per step). Context parallelism (torch's
`context_parallel` rewrites only the CUDA attention kernels) and expert parallelism (torch has none) get no
torch column.

Both sides time one training step the same way on rank 0: from taking the batch to after `zero_grad` (forward and
backward of every micro-batch, gradient reduction, clipping, AdamW), the median of the steps after the first 2.
The ratio is lab / torch; the goal is <= 1.2x. The script runs gloo on the CPU. On a 2-core CPU with 8 one-thread
ranks the tiny model's steps are Python dispatch, scheduling and gloo latency, not arithmetic: the ratio says
which stack spends less per op and per message (DTensor's dispatch and FSDP2's hooks cost most of torch's time),
and it moves by tens of percent between runs on a loaded machine: compare within one run. On GPUs with a model of
realistic width, compute and NCCL bandwidth dominate, and a ratio would measure overlap and kernel counts instead.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lab import train as lab_train  # noqa: E402
from lab.config import Config, load_config  # noqa: E402
from lab.data import SyntheticTokens, shard_rows  # noqa: E402
from lab.distributed import RankError, run  # noqa: E402
from lab.model import build_model, materialize  # noqa: E402
from lab.parallel.pp import build_chunk  # noqa: E402
from lab.parallel.tp import torch_tp_plan  # noqa: E402

WORLD = 8
WARMUP = 2  # steps left out of the median: communicators, allocator and lazy initialisation warm up
GOAL = 1.2
DENSE = "configs/tiny.toml"
NO_TORCH_CP = "no torch equivalent on CPU: context_parallel shards only CUDA's SDPA kernels"


@dataclass(frozen=True)
class Layout:
    """One row: a config file and the overrides that make it the layout."""

    name: str
    config: str  # relative to the repository root
    overrides: tuple[str, ...]
    no_torch: str | None = None  # why torch's stack cannot run it, when it cannot


LAYOUTS = (
    Layout("dp2-tp2-pp2", DENSE,
           ("parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.grad_accum=4")),
    Layout("dp2-cp2-tp2-sp", DENSE,
           ("parallel.dp=2", "parallel.cp=2", "parallel.tp=2", "parallel.sp=true"), NO_TORCH_CP),
    Layout("zero3-dp4-tp2", DENSE, ("parallel.dp=4", "parallel.tp=2", "parallel.zero=3")),
    Layout("pp2-tp2-cp2-interleaved", DENSE,
           ("parallel.dp=1", "parallel.pp=2", "parallel.tp=2", "parallel.cp=2", "parallel.pp_schedule=interleaved",
            "parallel.pp_virtual_stages=2", "parallel.grad_accum=4"), NO_TORCH_CP),
    # ep is carved out of dp in lab's mesh: dp=4 with ep=2 is ep2 x dp2 over the 4 data-parallel ranks
    Layout("ep2-dp2-pp2-moe", "configs/tiny-moe.toml",
           ("parallel.dp=4", "parallel.ep=2", "parallel.pp=2", "parallel.grad_accum=2"),
           "no torch equivalent: torch has no expert parallelism"),
    Layout("zero1-pp2-dp2-tp2-zb", DENSE,
           ("parallel.dp=2", "parallel.pp=2", "parallel.tp=2", "parallel.zero=1", "parallel.pp_schedule=zb-h1",
            "parallel.grad_accum=4")),
)


def lab_config(layout: Layout, extra: list[str]) -> Config:
    return load_config(ROOT / layout.config, [*layout.overrides, *extra])


def lab_step_seconds(config: Config) -> list[float]:
    """Rank 0's seconds per step under `lab.train`, from its tokens/s; a layout lab cannot run raises ValueError
    before any rank starts."""
    tokens = config.train.global_batch * config.train.seq_len
    return [tokens / log.tokens_per_s for log in lab_train.run(config, WORLD, verbose=False)]


def _pipeline(modules: list[torch.nn.Module], config: Config, pp_rank: int, pp_group: dist.ProcessGroup):
    from torch.distributed import pipelining

    p = config.parallel
    stages = [pipelining.PipelineStage(m, pp_rank + c * p.pp, p.pp * len(modules), torch.device("cpu"), group=pp_group)
              for c, m in enumerate(modules)]

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    schedule = {"afab": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B,
                "interleaved": pipelining.ScheduleInterleaved1F1B,
                "zb-h1": pipelining.ScheduleInterleavedZeroBubble}[p.pp_schedule]
    multi = p.pp_schedule in ("interleaved", "zb-h1")  # torch's zero-bubble schedule takes a list of stages
    return schedule(stages if multi else stages[0], n_microbatches=p.grad_accum, loss_fn=loss_fn)


def _clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup) -> None:
    """Clip to a global gradient norm as TorchTitan does: DTensor norms over their mesh, squares summed over the
    pipeline stages. The TP-split weights live on the (dp, tp) mesh, the rest (embedding, norms, output) on dp
    alone, and DTensor will not mix meshes in one op: norms and scaling go mesh by mesh."""
    from torch.distributed.tensor import DTensor

    by_mesh: dict = {}
    for q in params:
        if q.grad is not None:
            by_mesh.setdefault(getattr(q.grad, "device_mesh", None), []).append(q)
    square = torch.zeros(())
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([q.grad for q in group])
        square += (norm.full_tensor() if isinstance(norm, DTensor) else norm).pow(2)
    dist.all_reduce(square, group=pp_group)
    for group in by_mesh.values() if max_norm > 0 else ():  # grad_clip = 0: the norm only, as lab logs it
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, square.sqrt())


def torch_worker(config: Config) -> dict[str, list[float]]:
    """One rank of the torch-stack run; returns its seconds per step and the loss of each step."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    p, train, cfg = config.parallel, config.train, config.model
    if p.cp > 1 or p.ep > 1 or p.sp:
        raise ValueError(f"torch_worker composes dp, zero, tp and pp only (got cp={p.cp}, ep={p.ep}, sp={p.sp})")
    mesh = DeviceMesh("cpu", torch.arange(dist.get_world_size()).view(p.dp, p.pp, p.tp),
                      mesh_dim_names=("dp", "pp", "tp"))
    if p.dp > 1 and p.tp > 1:  # as DTensor advises (and TorchTitan does): a 2-D norm is then one all-reduce, not two
        mesh["dp", "tp"]._flatten()
    dp_rank, pp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    if p.pp > 1:
        chunks = p.pp_virtual_stages
        modules = [build_chunk(cfg, pp_rank + c * p.pp, p.pp * chunks, seed=train.seed) for c in range(chunks)]
    else:
        modules = [materialize(build_model(cfg), seed=train.seed)]
    for module in modules:  # TorchTitan's order: pipeline split, TP, then data parallelism
        if p.tp > 1:
            parallelize_module(module, mesh["tp"], torch_tp_plan(module))
        if p.dp > 1:
            if p.zero:
                shard = dict(mesh=mesh["dp"], reshard_after_forward=p.zero == 3)
                for block in module.layers.values():
                    fully_shard(block, **shard)
                fully_shard(module, **shard)
            else:
                for block in module.layers.values():
                    replicate(block, mesh=mesh["dp"])
                replicate(module, mesh=mesh["dp"])
    params = [q for m in modules for q in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay)
    schedule = _pipeline(modules, config, pp_rank, mesh["pp"].get_group()) if p.pp > 1 else None
    first, last = pp_rank == 0, pp_rank == p.pp - 1
    data = SyntheticTokens(cfg.vocab_size, train.seq_len, train.global_batch, train.seed, train.data_branching)
    times, losses_logged = [], []
    for _ in range(train.steps):
        start = time.perf_counter()
        inputs, targets = (shard_rows(t, dp_rank, p.dp) for t in data.next_batch())
        if schedule is not None:
            losses: list[torch.Tensor] = []
            schedule.step(*((inputs,) if first else ()), **({"target": targets, "losses": losses} if last else {}))
            loss = torch.stack(losses).mean() if last else torch.zeros(())
            dist.all_reduce(loss, group=mesh["pp"].get_group())  # as lab's loop: every stage logs the loss
        else:
            loss = torch.zeros(())
            pairs = list(zip(inputs.chunk(p.grad_accum), targets.chunk(p.grad_accum), strict=True))
            for i, (x, y) in enumerate(pairs):
                if p.dp > 1:
                    modules[0].set_requires_gradient_sync(i == len(pairs) - 1)
                micro = F.cross_entropy(modules[0](x).flatten(0, 1), y.flatten())
                (micro / p.grad_accum).backward()
                loss += micro.detach() / p.grad_accum
        if p.dp > 1:
            dist.all_reduce(loss, group=mesh["dp"].get_group())
            loss /= p.dp
        _clip_grad_norm(params, train.grad_clip, mesh["pp"].get_group())
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        losses_logged.append(loss.item())
    return {"seconds": times, "losses": losses_logged}


def torch_step_seconds(config: Config) -> list[float]:
    """Rank 0's seconds per step under torch's stack."""
    return run(torch_worker, WORLD, config, timeout_s=max(600.0, 20.0 * config.train.steps))[0]["seconds"]


def _median_ms(seconds: list[float]) -> float:
    return 1e3 * statistics.median(seconds[WARMUP:] or seconds)


def _error_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def measure(layout: Layout, extra: list[str]) -> tuple[float | str, float | str]:
    """lab's and torch's median ms per step; a refusal, a failure or a missing torch piece gives its reason."""
    try:
        config = lab_config(layout, extra)
    except ValueError as error:  # e.g. --seq or --model values the layout's degrees do not divide
        reason = f"invalid config: {_error_line(error)}"
        return reason, layout.no_torch or reason
    try:
        lab_ms: float | str = _median_ms(lab_step_seconds(config))
    except ValueError as error:
        lab_ms = f"refused: {_error_line(error)}"
    except RankError as error:
        lab_ms = f"failed: {_error_line(error)}"
    if layout.no_torch:
        return lab_ms, layout.no_torch
    try:
        return lab_ms, _median_ms(torch_step_seconds(config))
    except RankError as error:
        return lab_ms, f"failed: {_error_line(error)}"


def main(argv: list[str] | None = None) -> int:
    names = [layout.name for layout in LAYOUTS]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", choices=names, default=names, metavar="LAYOUT",
                        help=f"which layouts to run (default all): {', '.join(names)}")
    parser.add_argument("--steps", type=int, default=8, help=f"steps per run; the first {WARMUP} are not timed")
    parser.add_argument("--seq", type=int, help="sequence length (default: the config's, 32)")
    parser.add_argument("--batch", type=int, help="global batch in sequences (default: the config's, 8)")
    parser.add_argument("--model", help=f"model preset for the dense layouts (default: {DENSE}'s; the MoE layout "
                                        f"keeps its own)")
    args = parser.parse_args(argv)
    if args.steps <= WARMUP:
        parser.error(f"--steps={args.steps} must be > {WARMUP} (the first {WARMUP} steps are warm-up)")
    extra = [f"train.steps={args.steps}"] + ([f"train.seq_len={args.seq}"] if args.seq else []) + (
        [f"train.global_batch={args.batch}"] if args.batch else [])
    print(f"{WORLD} gloo ranks on CPU, one thread each; {args.steps} steps, median of steps {WARMUP + 1}-{args.steps}; "
          f"torch {torch.__version__}")
    print(f"{'layout':<25}{'lab ms':>9}{'torch ms':>10}{'lab/torch':>11}")
    for layout in LAYOUTS:
        if layout.name not in args.layouts:
            continue
        model = [f"model.preset={args.model}"] if args.model and layout.config == DENSE else []
        lab_ms, torch_ms = measure(layout, extra + model)
        cells = [f"{v:.1f}" if isinstance(v, float) else "-" for v in (lab_ms, torch_ms)]
        ratio = f"{lab_ms / torch_ms:.2f}x" if isinstance(lab_ms, float) and isinstance(torch_ms, float) else "-"
        print(f"{layout.name:<25}{cells[0]:>9}{cells[1]:>10}{ratio:>11}", flush=True)
        for side, value in (("lab", lab_ms), ("torch", torch_ms)):
            if isinstance(value, str):  # a reason does not fit a column: a line of its own
                print(f"    {side}: {value}", flush=True)
    print(f"goal: lab/torch <= {GOAL}x wherever both run. ms: rank 0's median step, fp32; on a loaded CPU they "
          f"move by tens of percent between runs: compare within one run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
