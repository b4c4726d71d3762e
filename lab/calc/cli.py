"""`python -m lab calc ...`: the cost models on the command line (a table, or --json).

    python -m lab calc params --model llama3-8b
    python -m lab calc memory --model llama3-8b --seq 4096 --dp 8 --zero 1 --tp 2 --sp --recompute selective
    python -m lab calc flops --model llama3-8b --seq 4096 --dp 64 --grad-accum 4 --step-time 5.1 --gpu h100
    python -m lab calc bubble --schedule interleaved --pp 8 --microbatches 32 --chunks 2 --tf 1 --tb 2

Invalid values print one line naming the field, the value and what is allowed, and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from lab.calc.bubble import Simulation, closed_form, explore
from lab.calc.comms import ALGORITHMS as COMM_ALGORITHMS
from lab.calc.comms import OPS as COMM_OPS
from lab.calc.comms import collective_time
from lab.calc.flops import COUNTINGS, hfu, mfu, training_flops
from lab.calc.hardware import HARDWARE, get_accelerator
from lab.calc.memory import ACTIVATION_MODELS, PARAM_CONVENTIONS, PRECISIONS, estimate_memory
from lab.calc.network import SYSTEMS
from lab.calc.params import param_breakdown
from lab.calc.schedules import SCHEDULES
from lab.config import PP_SCHEDULES, PRESETS, RECOMPUTE_MODES, ModelConfig, ParallelConfig


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _layout_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help=f"preset: {', '.join(PRESETS)}")
    parser.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    parser.add_argument("--mbs", type=int, default=1, help="micro-batch size in sequences (default 1)")
    for name in ("dp", "tp", "pp", "cp"):
        parser.add_argument(f"--{name}", type=int, default=1)
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (per dp rank)")
    parser.add_argument("--recompute", choices=RECOMPUTE_MODES, default="none")
    parser.add_argument("--json", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="python -m lab calc")
    sub = parser.add_subparsers(dest="what", required=True, parser_class=_OneLineParser)
    params = sub.add_parser("params", help="parameter count of a preset, by component")
    params.add_argument("--model", required=True, help=f"preset: {', '.join(PRESETS)}")
    params.add_argument("--json", action="store_true")

    memory = sub.add_parser("memory", help="per-GPU bytes: parameters, gradients, optimizer, activations")
    _layout_args(memory)
    memory.add_argument("--zero", type=int, default=0, help="ZeRO stage 0-3")
    memory.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp > 1)")
    memory.add_argument("--ep", type=int, default=1)
    memory.add_argument("--pp-schedule", choices=PP_SCHEDULES, default="1f1b")
    memory.add_argument("--precision", choices=tuple(PRECISIONS), default="mixed")
    memory.add_argument("--fp32-grad-accum", action="store_true", help="fp32 gradient buffer (mixed only)")
    memory.add_argument("--flash", action="store_true", help="flash attention (no s x s scores kept)")
    memory.add_argument("--activation-model", choices=ACTIVATION_MODELS, default="korthikanti")
    memory.add_argument("--param-convention", choices=PARAM_CONVENTIONS, default="exact")
    memory.add_argument("--stage", type=int, default=None, help="pipeline stage (default: the fullest)")

    flops = sub.add_parser("flops", help="FLOPs per token and per step; MFU/HFU from a measured step time")
    _layout_args(flops)
    flops.add_argument("--counting", choices=COUNTINGS, default="6N")
    flops.add_argument("--step-time", type=float, default=None, help="measured seconds per step")
    flops.add_argument("--gpu", choices=tuple(HARDWARE), default=None)
    flops.add_argument("--dtype", choices=("bf16", "fp8", "int8"), default="bf16")

    comms = sub.add_parser("comms", help="alpha-beta time of a collective on a cluster's links")
    comms.add_argument("--op", choices=COMM_OPS, default="all_reduce")
    comms.add_argument("--bytes", type=float, required=True, help="message size (all-reduce input), e.g. 1e9")
    comms.add_argument("--ranks", type=int, required=True)
    comms.add_argument("--gpus-per-node", type=int, default=None, help="default: the system's (8)")
    comms.add_argument("--hardware", choices=tuple(SYSTEMS), default="h100", help="the cluster design")
    comms.add_argument("--algorithm", choices=COMM_ALGORITHMS, default="ring")
    comms.add_argument("--json", action="store_true")

    bubble = sub.add_parser(
        "bubble", help="pipeline schedule simulated: bubble, makespan, peak activations, timeline",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Simulate a pipeline schedule op by op (lab.calc.bubble) and compare with the closed form.\n\n"
                    "Time model, in any unit you like (makespan and idle come out in the same unit):\n"
                    "  --tf   the forward of one micro-batch through one stage (a rank's layers)\n"
                    "  --tb   its whole backward: input + weight gradients, usually about 2 x tf\n"
                    "  --tw   the weight-gradient part of tb (zb-h1 runs B in tb - tw, then W in tw)\n"
                    "  --p2p  the latency of each send between ranks\n"
                    "With --chunks v (interleaved) each op of one chunk takes 1/v of these.")
    bubble.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="default 1f1b")
    bubble.add_argument("--pp", type=int, default=8, help="pipeline ranks p (default 8)")
    bubble.add_argument("--microbatches", type=int, default=32, help="micro-batches m per step (default 32)")
    bubble.add_argument("--chunks", type=int, default=None,
                        help="chunks of layers per rank v, interleaved only (default: 2 for interleaved, else 1)")
    bubble.add_argument("--tf", type=float, default=1.0, help="forward time of one micro-batch per stage (default 1)")
    bubble.add_argument("--tb", type=float, default=2.0, help="whole backward time, input + weight grads (default 2)")
    bubble.add_argument("--tw", type=float, default=1.0, help="weight-gradient part of --tb (default 1)")
    bubble.add_argument("--p2p", type=float, default=0.0,
                        help="latency of one send between ranks, same unit (default 0)")
    bubble.add_argument("--json", action="store_true", help="print the numbers as one JSON object")
    return parser


def _comms(args: argparse.Namespace) -> int:
    cost = collective_time(args.op, args.bytes, args.ranks, system=args.hardware, algorithm=args.algorithm,
                           gpus_per_node=args.gpus_per_node)
    if args.json:
        print(json.dumps(cost.as_dict()))
        return 0
    print(f"{args.op} of {args.bytes:,.0f} bytes on {args.ranks} ranks ({args.algorithm}, {args.hardware}):")
    print(f"  steps {cost.steps}, bytes sent per rank {cost.bytes_sent_per_rank:,.0f}")
    print(f"  time {cost.time_s * 1e3:.3f} ms, algbw {cost.algbw / 1e9:.1f} GB/s, busbw {cost.busbw / 1e9:.1f} GB/s")
    return 0


def _nice_step(x: float) -> float:
    """The smallest of 1, 2, 2.5, 5 x 10^k that is >= x."""
    power = 10.0 ** math.floor(math.log10(x))
    return next(k * power for k in (1, 2, 2.5, 5, 10) if k * power >= x * (1 - 1e-9))


def text_timeline(sim: Simulation, width: int = 120) -> tuple[list[str], float]:
    """A character Gantt chart, one line per rank, and the time one column stands for. A column shows the op
    running at its middle: F, B or W where an op starts, f, b or w where it continues, '.' where the rank idles."""
    cell = _nice_step(sim.makespan / width)
    columns = math.ceil(sim.makespan / cell - 1e-9)
    lines = []
    for rank in range(sim.schedule.pp):
        spans = sorted((s for s in sim.spans if s.rank == rank), key=lambda s: (s.start, s.end))
        row, i, previous = [], 0, None
        for column in range(columns):
            middle = (column + 0.5) * cell
            while i < len(spans) and spans[i].end <= middle:
                i += 1
            span = spans[i] if i < len(spans) and spans[i].start <= middle else None
            row.append("." if span is None else span.op.kind if span is not previous else span.op.kind.lower())
            previous = span
        lines.append(f"rank {rank:>2} |{''.join(row)}|")
    return lines, cell


def _bubble(args: argparse.Namespace) -> int:
    sim = explore(args.schedule, args.pp, args.microbatches, args.chunks, args.tf, args.tb, args.tw, args.p2p)
    closed = closed_form(args.schedule, args.pp, args.microbatches, sim.schedule.chunks, args.tf, args.tb, args.tw,
                         args.p2p)
    out = {**sim.as_dict(), "tf": args.tf, "tb": args.tb, "tw": args.tw, "p2p": args.p2p, "busy": sim.busy,
           "bubble_ratio_closed_form": closed["bubble_ratio"], "idle_closed_form": closed["idle"],
           "closed_form": closed["formula"], "closed_form_exact_when": closed["exact_when"],
           "closed_form_exact": closed["exact"]}
    if args.json:
        print(json.dumps(out))
        return 0
    p, m, v = sim.schedule.pp, sim.schedule.microbatches, sim.schedule.chunks
    print(f"{sim.schedule.name}: pp={p}, {m} micro-batches, {v} chunk{'s' if v > 1 else ''} per rank; "
          f"tf={args.tf:g} tb={args.tb:g} tw={args.tw:g} p2p={args.p2p:g} "
          f"(times in the unit of --tf/--tb/--tw)")
    print(f"  bubble ratio (idle / useful)  {sim.bubble_ratio:<10.6g} closed form {closed['bubble_ratio']:.6g}  "
          f"[{closed['formula']}; exact when {closed['exact_when']}"
          f"{'' if closed['exact'] else ': not here'}]")
    print(f"  idle fraction (idle / total)  {sim.idle_fraction:.6g}")
    print(f"  makespan                      {sim.makespan:.6g} time units")
    print(f"  idle per rank (most)          {max(sim.idle):<10.6g} closed form {closed['idle']:.6g}")
    print(f"  p2p messages                  {sim.p2p_messages:,}")
    print("  rank        busy        idle   peak activations (micro-batches of a whole stage)")
    for rank in range(p):
        print(f"  {rank:>4} {sim.busy[rank]:>11.6g} {sim.idle[rank]:>11.6g}   {sim.peak_activations[rank]:g}")
    lines, cell = text_timeline(sim)
    backward = "B = input gradient, W = weight gradient" if sim.schedule.split_backward else "B = whole backward"
    print(f"timeline: 1 column = {cell:g} time unit{'s' if cell != 1 else ''} "
          f"(F/B/W: an op starts, f/b/w: it continues, '.': idle; {backward})")
    for line in lines:
        print(f"  {line}")
    return 0


def _params(cfg: ModelConfig, args: argparse.Namespace) -> int:
    parts = param_breakdown(cfg)
    if args.json:
        print(json.dumps({"model": cfg.name, **parts}))
        return 0
    print(f"{cfg.name}: {parts['total']:,} parameters ({parts['total'] / 1e9:.3f} B)")
    for name, value in parts.items():
        if name != "total" and value:
            print(f"  {name:<15} {value:>18,}")
    return 0


def _memory(cfg: ModelConfig, args: argparse.Namespace) -> int:
    parallel = ParallelConfig(dp=args.dp, tp=args.tp, sp=args.sp, cp=args.cp, pp=args.pp, ep=args.ep, zero=args.zero,
                              grad_accum=args.grad_accum, recompute=args.recompute, pp_schedule=args.pp_schedule)
    est = estimate_memory(cfg, args.seq, args.mbs, parallel, precision=args.precision,
                          fp32_grad_accum=args.fp32_grad_accum, flash=args.flash,
                          activation_model=args.activation_model, param_convention=args.param_convention,
                          stage=args.stage)
    if args.json:
        print(json.dumps(est.as_dict()))
        return 0
    print(f"{cfg.name}: {est.num_params:,} parameters; seq {args.seq} x micro-batch {args.mbs}")
    print(f"dp={args.dp} (ZeRO-{args.zero}) tp={args.tp}{' +sp' if args.sp else ''} pp={args.pp} cp={args.cp} "
          f"ep={args.ep}; precision {args.precision}{' + fp32 grad accum' if args.fp32_grad_accum else ''}; "
          f"recompute {args.recompute}{'; flash attention' if args.flash else ''}; "
          f"activations: {args.activation_model}")
    print(f"per GPU (pipeline stage {est.stage} of 0..{args.pp - 1})        bytes   GiB (2^30 B)   GB (10^9 B)")
    rows = [(k, est.per_gpu[k]) for k in ("params", "grads", "optimizer", "activations")]
    rows += [(f"  {k}", v) for k, v in est.activations_breakdown.items()]
    for name, value in [*rows, ("total", est.per_gpu["total"])]:
        print(f"  {name:<16} {value:>23,} {value / 2**30:>14.3f} {value / 1e9:>13.3f}")
    return 0


def _flops(cfg: ModelConfig, args: argparse.Namespace) -> int:
    parallel = ParallelConfig(dp=args.dp, tp=args.tp, cp=args.cp, pp=args.pp, grad_accum=args.grad_accum,
                              recompute=args.recompute)
    parallel.check_model(cfg)
    if args.step_time is not None and args.gpu is None:
        raise ValueError(f"--step-time={args.step_time} needs --gpu (one of {', '.join(HARDWARE)}) for the peak")
    tokens = args.mbs * args.seq * args.dp * args.grad_accum
    est = training_flops(cfg, args.seq, tokens, recompute=args.recompute, counting=args.counting)
    n_gpus = parallel.world_size
    out = {"model": cfg.name, "tokens_per_step": tokens, "n_gpus": n_gpus,
           "flops_per_token": {"model": est.model_flops_per_token, "hardware": est.hardware_flops_per_token},
           "flops_per_step": {"model": est.model_flops, "hardware": est.hardware_flops}}
    if args.gpu is not None:
        out["ideal_step_time_s"] = est.model_flops / (n_gpus * get_accelerator(args.gpu).peak_flops(args.dtype))
    if args.step_time is not None:
        out["mfu"] = mfu(est, args.step_time, n_gpus, args.gpu, args.dtype)
        out["hfu"] = hfu(est, args.step_time, n_gpus, args.gpu, args.dtype)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{cfg.name}: {tokens:,} tokens per step on {n_gpus} GPUs (counting {args.counting}, "
          f"recompute {args.recompute})")
    print(f"  FLOPs per token  model {est.model_flops_per_token:.4g}   hardware {est.hardware_flops_per_token:.4g}")
    print(f"  FLOPs per step   model {est.model_flops:.4g}   hardware {est.hardware_flops:.4g}")
    if "ideal_step_time_s" in out:
        print(f"  step time at 100% MFU on {args.gpu} ({args.dtype}): {out['ideal_step_time_s']:.4g} s")
    if "mfu" in out:
        print(f"  MFU {out['mfu']:.1%}   HFU {out['hfu']:.1%}   (step time {args.step_time} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.what == "comms":
            return _comms(args)
        if args.what == "bubble":
            return _bubble(args)
        cfg = ModelConfig.from_preset(args.model)
        return {"params": _params, "memory": _memory, "flops": _flops}[args.what](cfg, args)
    except ValueError as err:
        print(f"{parser.prog} {args.what}: error: {err}", file=sys.stderr)
        return 2
