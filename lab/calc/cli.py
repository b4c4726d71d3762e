"""`python -m lab calc ...`: the cost models on the command line (a table, or --json).

    python -m lab calc params --model llama3-8b
    python -m lab calc memory --model llama3-8b --seq 4096 --dp 8 --zero 1 --tp 2 --sp --recompute selective
    python -m lab calc flops --model llama3-8b --seq 4096 --dp 64 --grad-accum 4 --step-time 5.1 --hardware h100
    python -m lab calc comms --op all_reduce --ranks 16 --hardware h100 --bytes 256MiB
    python -m lab calc bubble --pp-schedule interleaved --pp 8 --grad-accum 32 --pp-chunks 2 --tf 1 --tb 2
    python -m lab calc search --model llama3-70b --gpus 256 --gpus-per-node 8 --hardware h100 --seq 8192 --gbs-tokens 4M
    python -m lab calc search --run llama3-405b-16k-gpus      # pinned to a measured run: predicted vs measured
    python -m lab calc inference --model llama3-70b --hardware h100 --tp 8 --seq 8192 --batch 32 --kv-dtype int8
    python -m lab calc inference --model deepseek-v3 --hardware h100 --batch 16 --ep 32

One vocabulary with `python -m lab train`: a concept has one flag name in every command (`VOCABULARY`).
Invalid values print one line naming the field, the value and what is allowed, and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys

from lab.calc import inference, roofline
from lab.calc.bubble import Simulation, closed_form, explore
from lab.calc.calibration import ASYNC_TP, RUNS, STACKS
from lab.calc.comms import ALGORITHMS as COMM_ALGORITHMS
from lab.calc.comms import OPS as COMM_OPS
from lab.calc.comms import collective_time
from lab.calc.flops import COUNTINGS, hfu, mfu, training_flops
from lab.calc.hardware import HARDWARE, get_accelerator
from lab.calc.memory import ACTIVATION_MODELS, PARAM_CONVENTIONS, PRECISIONS, estimate_memory
from lab.calc.network import SYSTEMS
from lab.calc.params import param_breakdown
from lab.calc.schedules import SCHEDULES
from lab.calc.search import REASONS, predict_run, predicted_over_measured, reported_memory, search
from lab.config import PP_SCHEDULES, PRESETS, RECOMPUTE_MODES, ModelConfig, ParallelConfig
from lab.layout import INTERLEAVED_CHUNKS, describe

# The flags that name the same concept in `lab train` and the `lab calc` subcommands, and the commands that take
# each: one spelling everywhere (tests/test_calc_cli.py checks every parser accepts them).
VOCABULARY = {
    "--model": ("train", "params", "memory", "flops", "search", "inference"),
    "--seq": ("train", "memory", "flops", "search", "inference"),
    "--mbs": ("train", "memory", "flops", "search"),
    "--dp": ("train", "memory", "flops", "search"), "--tp": ("train", "memory", "flops", "search", "inference"),
    "--cp": ("train", "memory", "flops", "search"), "--pp": ("train", "memory", "flops", "bubble", "search"),
    "--ep": ("train", "memory", "search", "inference"), "--zero": ("train", "memory", "search"),
    "--sp": ("train", "memory"),
    "--grad-accum": ("train", "memory", "flops", "bubble", "search"),
    "--pp-schedule": ("train", "memory", "bubble", "search"),
    "--pp-chunks": ("train", "memory", "bubble", "search"),
    "--recompute": ("train", "memory", "flops", "search"),
    "--precision": ("memory", "flops", "inference"),
    "--hardware": ("memory", "flops", "comms", "search", "inference"),
    "--gpus-per-node": ("comms", "search"),
}
SEARCH_HARDWARE = tuple(h for h in HARDWARE if h in SYSTEMS)  # an accelerator and a cluster design of that name
# Old spellings, accepted (and not shown in --help) for one release: subcommand -> {old: new}.
RENAMED = {"flops": {"--gpu": "--hardware", "--dtype": "--precision"},
           "bubble": {"--schedule": "--pp-schedule", "--microbatches": "--grad-accum", "--chunks": "--pp-chunks"}}

_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """A byte count as written on a command line: 268435456, 1e9, 256MB (10^6 B each), 1GiB (2^30 B), 1.5 GB."""
    match = re.fullmatch(r"\s*(\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = _BYTE_UNITS.get(match[2].lower()) if match else None
    if unit is None or round(float(match[1]) * unit) < 1:
        raise ValueError(f"bytes={text!r} must be a byte count >= 1: a number (268435456, 1e9) or a number with a "
                         f"unit, B, kB/MB/GB/TB (powers of 10) or KiB/MiB/GiB/TiB (powers of 2), e.g. 256MB, 1GiB")
    return round(float(match[1]) * unit)


_TOKEN_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}


def parse_tokens(text: str) -> int:
    """A token count: 4194304, 4e6, or with K, M, G = 2^10, 2^20, 2^30 tokens — batches are counted in sequences
    of power-of-two lengths, so "1M tokens" is the playbook's 256 x 4096 and "4M" Llama 3's 512 x 8192."""
    match = re.fullmatch(r"\s*(\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)\s*([A-Za-z]?)\s*", text)
    unit = _TOKEN_UNITS.get(match[2].lower()) if match else None
    if unit is None or round(float(match[1]) * unit) < 1:
        raise ValueError(f"tokens={text!r} must be a token count >= 1: a number (4194304, 4e6) or a number with K, M "
                         f"or G (2^10, 2^20, 2^30 tokens), e.g. 1M, 4M")
    return round(float(match[1]) * unit)


def _tokens_arg(text: str) -> int:
    try:
        return parse_tokens(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _bytes_arg(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as err:  # argparse shows an ArgumentTypeError's own words
        raise argparse.ArgumentTypeError(str(err)) from None


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class _OldName(argparse.Action):
    """An old spelling kept for one release: hidden from --help, stores into the new flag's value, and says the
    new name on stderr."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kwargs) -> None:
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"{parser.prog}: note: {option_string} is now {self.new}; the old name goes in the next release",
              file=sys.stderr)
        setattr(namespace, self.dest, values)


def _old_names(parser: argparse.ArgumentParser, what: str) -> None:
    actions = {option: action for action in parser._actions for option in action.option_strings}
    for old, new in RENAMED.get(what, {}).items():
        action = actions[new]
        parser.add_argument(old, action=_OldName, new=new, dest=action.dest, type=action.type,
                            choices=action.choices, metavar=action.metavar)


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

    memory = sub.add_parser("memory", help="per-GPU bytes: parameters, gradients, optimizer, activations; "
                                           "whether they fit")
    _layout_args(memory)
    memory.add_argument("--zero", type=int, default=0, help="ZeRO stage 0-3")
    memory.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp > 1)")
    memory.add_argument("--ep", type=int, default=1)
    memory.add_argument("--pp-schedule", choices=PP_SCHEDULES, default="1f1b")
    memory.add_argument("--pp-chunks", type=int, default=None,
                        help=f"layer chunks per pipeline rank (default: {INTERLEAVED_CHUNKS} for interleaved, else 1)")
    memory.add_argument("--pp-layers", default="even",
                        help="layers per virtual stage: even, llama3 (first and last stage one layer fewer) or "
                             "counts such as 7,8,8,7")
    memory.add_argument("--precision", choices=tuple(PRECISIONS), default="mixed")
    memory.add_argument("--fp32-grad-accum", action="store_true", help="fp32 gradient buffer (mixed only)")
    memory.add_argument("--flash", action="store_true", help="flash attention (no s x s scores kept)")
    memory.add_argument("--activation-model", choices=ACTIVATION_MODELS, default="korthikanti")
    memory.add_argument("--param-convention", choices=PARAM_CONVENTIONS, default="exact")
    memory.add_argument("--stage", type=int, default=None, help="pipeline stage (default: the fullest)")
    memory.add_argument("--hardware", choices=tuple(HARDWARE), default="h100",
                        help="the accelerator whose memory the total is compared with (default h100)")

    flops = sub.add_parser("flops", help="FLOPs per token and per step; MFU/HFU from a measured step time")
    _layout_args(flops)
    flops.add_argument("--counting", choices=COUNTINGS, default="6N")
    flops.add_argument("--step-time", type=float, default=None, help="measured seconds per step")
    flops.add_argument("--hardware", choices=tuple(HARDWARE), default=None, help="the accelerator, for its peak")
    flops.add_argument("--precision", choices=("bf16", "fp8", "int8"), default="bf16",
                       help="number format of the matmuls, for the peak (default bf16)")
    _old_names(flops, "flops")

    roof = sub.add_parser("roofline", help="one Llama block's ops on a chip's roofline: FLOPs, bytes, intensity, "
                                           "memory- or compute-bound, least time")
    roof.add_argument("--model", required=True, help=f"preset (dense GQA): {', '.join(PRESETS)}")
    roof.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    roof.add_argument("--mbs", type=int, default=1, help="sequences per micro-batch (default 1)")
    roof.add_argument("--hardware", choices=tuple(HARDWARE), default="h100")
    roof.add_argument("--dtype", choices=tuple(roofline.DTYPE_BYTES), default="bf16")
    roof.add_argument("--attention", choices=roofline.ATTENTION_CORES, default="naive",
                      help="naive: the T x T scores written to HBM; flash: one fused kernel")
    roof.add_argument("--json", action="store_true")

    comms = sub.add_parser("comms", help="alpha-beta time of a collective on a cluster's links")
    comms.add_argument("--op", choices=COMM_OPS, default="all_reduce")
    comms.add_argument("--bytes", type=_bytes_arg, required=True,
                       help="message size (all-reduce input): 268435456, 1e9, 256MB (10^6 B), 1GiB (2^30 B)")
    comms.add_argument("--ranks", type=int, required=True)
    comms.add_argument("--gpus-per-node", type=int, default=None, help="default: the system's (8)")
    comms.add_argument("--hardware", choices=tuple(SYSTEMS), default="h100",
                       help="the cluster design: its GPU, NVLink and NICs (default h100)")
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
                    "With --pp-chunks v (interleaved) each op of one chunk takes 1/v of these.")
    bubble.add_argument("--pp-schedule", choices=SCHEDULES, default="1f1b", help="default 1f1b")
    bubble.add_argument("--pp", type=int, default=8, help="pipeline ranks p (default 8)")
    bubble.add_argument("--grad-accum", type=int, default=32,
                        help="micro-batches m per step, as lab train's --grad-accum (default 32)")
    bubble.add_argument("--pp-chunks", type=int, default=None,
                        help=f"chunks of layers per rank v, interleaved only (default: {INTERLEAVED_CHUNKS} for "
                             f"interleaved, else 1)")
    bubble.add_argument("--tf", type=float, default=1.0, help="forward time of one micro-batch per stage (default 1)")
    bubble.add_argument("--tb", type=float, default=2.0, help="whole backward time, input + weight grads (default 2)")
    bubble.add_argument("--tw", type=float, default=1.0, help="weight-gradient part of --tb (default 1)")
    bubble.add_argument("--p2p", type=float, default=0.0,
                        help="latency of one send between ranks, same unit (default 0)")
    bubble.add_argument("--json", action="store_true", help="print the numbers as one JSON object")
    _old_names(bubble, "bubble")

    search = sub.add_parser(
        "search", help="the config search: every layout that fits, ranked by modelled tokens/s (lab.calc.search)",
        description="Enumerate dp (ZeRO 0-3), tp (+sp), pp (schedule, chunks), cp, ep, micro-batch, grad-accum "
                    "and recompute for --gpus GPUs; keep the layouts lab.train runs that fit --hardware's memory; "
                    "rank them by modelled tokens/s. A layout flag (--tp 8, --cp 1, ...) pins that setting.")
    search.add_argument("--run", choices=[r.name for r in RUNS], default=None,
                        help="pin everything to a measured run of the validation table (lab.calc.calibration.RUNS): "
                             "its model, GPUs, batch, hardware, stack and layout; prints predicted against measured")
    search.add_argument("--model", help=f"preset: {', '.join(PRESETS)} (required without --run)")
    search.add_argument("--gpus", type=int, help="GPUs in all (required without --run)")
    search.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node, joined by NVLink (default 8)")
    search.add_argument("--hardware", choices=SEARCH_HARDWARE, default="h100",
                        help="the accelerator and its cluster design (default h100)")
    search.add_argument("--system", choices=tuple(SYSTEMS), default=None,
                        help="the network, when not the --hardware's own cluster design (lab.calc.network; e.g. "
                             "llama3-roce, Llama 3's fabric of pods)")
    search.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    search.add_argument("--gbs-tokens", type=_tokens_arg,
                        help="global batch in tokens, rounded to whole sequences: 4194304, 4e6, 1M, 4M "
                             "(K, M, G = 2^10, 2^20, 2^30; required without --run)")
    for flag in ("dp", "tp", "pp", "cp", "ep", "zero", "mbs", "grad-accum"):
        search.add_argument(f"--{flag}", type=int, default=None, help="pin it (default: searched)")
    search.add_argument("--pp-schedule", choices=PP_SCHEDULES, default=None, help="pin it (default: searched)")
    search.add_argument("--pp-chunks", type=int, default=None, help="pin it (default: searched)")
    search.add_argument("--recompute", choices=RECOMPUTE_MODES, default=None, help="pin it (default: searched)")
    search.add_argument("--pp-layers", default=None,
                        help="pin the layers' split: even, llama3 or counts like 7,8,8,7 (default: even where it "
                             "divides, else llama3)")
    search.add_argument("--stack", choices=tuple(STACKS), default="eager",
                        help="the software that runs the step (lab.calc.calibration.STACKS; default eager)")
    search.add_argument("--tp-overlap", type=float, default=0.0,
                        help=f"share of TP's collectives async TP hides (default 0; TorchTitan's: {ASYNC_TP:.2f})")
    search.add_argument("--top", type=int, default=10, help="layouts shown (default 10)")
    search.add_argument("--json", action="store_true")

    serve = sub.add_parser(
        "inference", help="serving on paper: KV cache, sequences that fit, decode step bound, prefill, critical batch",
        description="How to Scale Your Model ch. 7-8 for a preset on --tp chips (lab.calc.inference): the KV cache "
                    "per token and sequence, the weights per chip, how many sequences of --seq tokens fit, the "
                    "decode step at --batch sequences (weights + KV read once from HBM; the weight matmuls "
                    "compute-bound past the critical batch), its tokens/s, and one prompt's prefill at --mfu.")
    serve.add_argument("--model", required=True, help=f"preset: {', '.join(PRESETS)}")
    serve.add_argument("--hardware", choices=tuple(HARDWARE), default="h100", help="the accelerator (default h100)")
    serve.add_argument("--tp", type=int, default=1, help="tensor-parallel chips serving one replica (default 1)")
    serve.add_argument("--seq", type=int, default=4096, help="context length of each sequence (default 4096)")
    serve.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1)")
    serve.add_argument("--kv-dtype", choices=tuple(inference.STORAGE_BYTES), default="bf16",
                       help="number format of the KV cache (default bf16)")
    serve.add_argument("--weight-dtype", choices=tuple(inference.STORAGE_BYTES), default="bf16",
                       help="number format the weights are stored in (default bf16)")
    serve.add_argument("--precision", choices=("bf16", "fp8", "int8"), default="bf16",
                       help="number format of the matmuls, for the peak (default bf16)")
    serve.add_argument("--mfu", type=float, default=0.4, help="fraction of the peak prefill reaches (default 0.4)")
    serve.add_argument("--comms", action="store_true",
                       help="add TP's all-reduces (2 per layer, alpha-beta over NVLink) to the decode step")
    serve.add_argument("--ep", type=int, default=None,
                       help="a mixture of experts only: its experts over EP GPUs, each decoding --batch sequences; "
                            "adds the all-to-alls of a decode step (dispatch and combine per MoE layer, their "
                            "latency floor; lab.calc.inference.ep_decode)")
    serve.add_argument("--json", action="store_true")
    return parser


def _comms(args: argparse.Namespace) -> int:
    cost = collective_time(args.op, args.bytes, args.ranks, system=args.hardware, algorithm=args.algorithm,
                           gpus_per_node=args.gpus_per_node)
    if args.json:
        print(json.dumps(cost.as_dict()))
        return 0
    print(f"{args.op} of {args.bytes:,} bytes ({args.bytes / 1e6:,.1f} MB, {args.bytes / 2**20:,.1f} MiB) on "
          f"{args.ranks} ranks ({args.algorithm}, {args.hardware}):")
    print(f"  priced on {cost.link}")
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
    sim = explore(args.pp_schedule, args.pp, args.grad_accum, args.pp_chunks, args.tf, args.tb, args.tw, args.p2p)
    closed = closed_form(args.pp_schedule, args.pp, args.grad_accum, sim.schedule.chunks, args.tf, args.tb, args.tw,
                         args.p2p)
    out = {**sim.as_dict(), "tf": args.tf, "tb": args.tb, "tw": args.tw, "p2p": args.p2p, "busy": sim.busy,
           "bubble_ratio_closed_form": closed["bubble_ratio"], "idle_closed_form": closed["idle"],
           "closed_form": closed["formula"], "closed_form_exact_when": closed["exact_when"],
           "closed_form_exact": closed["exact"],
           # every op as [rank, kind, micro-batch, chunk, start, end]: the timeline a page draws (issue 38)
           "timeline": [[s.rank, s.op.kind, s.op.microbatch, s.op.chunk, s.start, s.end] for s in sim.spans]}
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
                              grad_accum=args.grad_accum, recompute=args.recompute, pp_schedule=args.pp_schedule,
                              pp_virtual_stages=args.pp_chunks or 0,  # 0: ParallelConfig resolves the default
                              pp_layers=args.pp_layers)
    est = estimate_memory(cfg, args.seq, args.mbs, parallel, precision=args.precision,
                          fp32_grad_accum=args.fp32_grad_accum, flash=args.flash,
                          activation_model=args.activation_model, param_convention=args.param_convention,
                          stage=args.stage)
    total, capacity = est.per_gpu["total"], get_accelerator(args.hardware).memory_bytes
    if args.json:
        print(json.dumps({**est.as_dict(), "stage": est.stage, "hardware": args.hardware,
                          "hardware_memory_bytes": capacity, "fits": est.headroom(capacity) >= 0}))
        return 0
    print(f"{cfg.name}: {est.num_params:,} parameters; seq {args.seq} x micro-batch {args.mbs}")
    print(f"{describe(parallel)}; precision {args.precision}{' + fp32 grad accum' if args.fp32_grad_accum else ''}; "
          f"recompute {args.recompute}{'; flash attention' if args.flash else ''}; "
          f"activations: {args.activation_model}")
    if args.pp > 1:
        print(f"pipeline stage {est.stage} of 0..{args.pp - 1}{' (the fullest)' if args.stage is None else ''}")
    print(f"per GPU{'bytes':>35}   GiB (2^30 B)   GB (10^9 B)")
    rows = [(k, est.per_gpu[k]) for k in ("params", "grads", "optimizer", "activations")]
    rows += [(f"  {k}", v) for k, v in est.activations_breakdown.items()]
    rows += [("loss", est.per_gpu["loss"])]  # the logits' working memory, on the stage that computes the loss
    for name, value in [*rows, ("total", total)]:
        print(f"  {name:<16} {value:>23,} {value / 2**30:>14.3f} {value / 1e9:>13.3f}")
    spare = est.headroom(capacity)
    verdict = (f"fits on one {args.hardware} ({capacity / 2**30:,.0f} GiB), {spare / 2**30:,.1f} GiB to spare"
               if spare >= 0 else f"does NOT fit on one {args.hardware} ({capacity / 2**30:,.0f} GiB): "
               f"{-spare / 2**30:,.1f} GiB over")
    print(f"verdict: {verdict}")
    return 0


def _flops(cfg: ModelConfig, args: argparse.Namespace) -> int:
    parallel = ParallelConfig(dp=args.dp, tp=args.tp, cp=args.cp, pp=args.pp, grad_accum=args.grad_accum,
                              recompute=args.recompute)
    parallel.check_model(cfg)
    if args.step_time is not None and args.hardware is None:
        raise ValueError(f"--step-time={args.step_time} needs --hardware (one of {', '.join(HARDWARE)}) for the peak")
    tokens = args.mbs * args.seq * args.dp * args.grad_accum
    est = training_flops(cfg, args.seq, tokens, recompute=args.recompute, counting=args.counting)
    n_gpus = parallel.world_size
    out = {"model": cfg.name, "tokens_per_step": tokens, "n_gpus": n_gpus,
           "flops_per_token": {"model": est.model_flops_per_token, "hardware": est.hardware_flops_per_token},
           "flops_per_step": {"model": est.model_flops, "hardware": est.hardware_flops}}
    if args.hardware is not None:
        peak = get_accelerator(args.hardware).peak_flops(args.precision)
        out["ideal_step_time_s"] = est.model_flops / (n_gpus * peak)
    if args.step_time is not None:
        out["mfu"] = mfu(est, args.step_time, n_gpus, args.hardware, args.precision)
        out["hfu"] = hfu(est, args.step_time, n_gpus, args.hardware, args.precision)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{cfg.name}: {tokens:,} tokens per step on {n_gpus} GPUs (counting {args.counting}, "
          f"recompute {args.recompute})")
    print(f"  FLOPs per token  model {est.model_flops_per_token:.4g}   hardware {est.hardware_flops_per_token:.4g}")
    print(f"  FLOPs per step   model {est.model_flops:.4g}   hardware {est.hardware_flops:.4g}")
    if "ideal_step_time_s" in out:
        print(f"  step time at 100% MFU on {args.hardware} ({args.precision}): {out['ideal_step_time_s']:.4g} s")
    if "mfu" in out:
        print(f"  MFU {out['mfu']:.1%}   HFU {out['hfu']:.1%}   (step time {args.step_time} s)")
    return 0


def _roofline(cfg: ModelConfig, args: argparse.Namespace) -> int:
    ops = roofline.llama_block_ops(cfg, args.mbs, args.seq, args.dtype, args.attention)
    placed = [roofline.place(op, args.hardware, args.dtype) for op in ops]
    total = sum(p.time_s for p in placed)
    ridge = roofline.ridge_point(args.hardware, args.dtype)
    if args.json:
        print(json.dumps({"model": cfg.name, "hardware": args.hardware, "dtype": args.dtype, "ridge": ridge,
                          "block_time_s": total, "ops": [
                              {"name": p.op.name, "flops": p.op.flops, "bytes": p.op.bytes_moved,
                               "intensity": p.op.intensity, "bound": p.bound, "time_s": p.time_s} for p in placed]}))
        return 0
    print(f"{cfg.name}: one block's forward on {args.mbs} x {args.seq} tokens, {args.dtype} on {args.hardware} "
          f"(ridge point {ridge:.0f} FLOPs/byte); attention {args.attention}")
    print(f"  {'op':<16} {'GFLOP':>10} {'MB moved':>10} {'FLOPs/byte':>11} {'bound':>8} {'least us':>9} {'share':>6}")
    for p in placed:
        print(f"  {p.op.name:<16} {p.op.flops / 1e9:>10.2f} {p.op.bytes_moved / 1e6:>10.2f} {p.op.intensity:>11.1f} "
              f"{p.bound:>8} {p.time_s * 1e6:>9.1f} {p.time_s / total:>6.1%}")
    memory = [p for p in placed if p.bound == "memory"]
    print(f"  block: at least {total * 1e6:.1f} us; {len(memory)} of {len(placed)} ops memory-bound, "
          f"{sum(p.time_s for p in memory) / total:.0%} of the time")
    return 0


def _search(args: argparse.Namespace) -> int:
    if args.top < 1:
        raise ValueError(f"top={args.top} must be an integer >= 1")
    if args.run:
        return _search_run(args)
    missing = [f"--{name.replace('_', '-')}" for name in ("model", "gpus", "gbs_tokens") if getattr(args, name) is None]
    if missing:
        raise ValueError(f"{', '.join(missing)} required, or --run NAME (a measured run of lab.calc.calibration.RUNS)")
    pins = {"dp": args.dp, "tp": args.tp, "pp": args.pp, "cp": args.cp, "ep": args.ep, "zero": args.zero,
            "mbs": args.mbs, "grad_accum": args.grad_accum, "pp_schedule": args.pp_schedule,
            "pp_virtual_stages": args.pp_chunks, "pp_layers": args.pp_layers, "recompute": args.recompute}
    result = search(args.model, args.gpus, args.gpus_per_node, args.hardware, args.seq, args.gbs_tokens,
                    fixed={k: v for k, v in pins.items() if v is not None}, stack=args.stack,
                    tp_overlap=args.tp_overlap, system=args.system)
    if args.json:
        print(json.dumps(result.as_dict(args.top)))
        return 0
    nodes = max(args.gpus // args.gpus_per_node, 1)
    print(f"{result.model.name} on {args.gpus} x {args.hardware} ({nodes} node{'s' if nodes > 1 else ''} of "
          f"{min(args.gpus, args.gpus_per_node)}{', network ' + args.system if args.system else ''}); seq {args.seq}; "
          f"global batch {result.global_batch} sequences = "
          f"{result.tokens_per_step:,} tokens (asked {args.gbs_tokens:,}, rounded to whole sequences)")
    print(f"{len(result.candidates):,} layouts fit; large matmuls at {result.efficiency:.1%} of the bf16 peak, "
          f"{result.stack} kernels (lab.calc.calibration); searched in {result.elapsed_s:.2f} s. Times per step, "
          f"in ms; memory of the fullest GPU.")
    print(f"{'#':>3}  {'layout':<52} {'mbs':>4} {'accum':>5} {'GiB':>6} {'compute':>9} {'comms':>8} {'bubble':>8} "
          f"{'MFU':>6} {'tokens/s':>11} {'tok/s/GPU':>9}")
    for i, c in enumerate(result.top(args.top), 1):
        t = c.time
        print(f"{i:>3}  {c.layout:<52} {c.mbs:>4} {c.grad_accum:>5} {c.memory.per_gpu['total'] / 2**30:>6.1f} "
              f"{t.compute * 1e3:>9.1f} {t.comms * 1e3:>8.1f} {t.bubble * 1e3:>8.1f} {c.mfu:>6.1%} "
              f"{c.tokens_per_s:>11,.0f} {c.tokens_per_s_per_gpu:>9,.0f}")
    if not result.candidates:
        print("  no layout fits" + (" with the pinned settings" if any(v is not None for v in pins.values()) else ""))
    else:
        low, high = result.candidates[0].tokens_per_s_range
        print(f"ties: {result.ties} layout{'s reach' if result.ties > 1 else ' reaches'} the best one's range, "
              f"{low:,.0f}-{high:,.0f} tokens/s (the calibration's spread): the model cannot order them")
    rejected = result.rejected_families()
    if rejected:
        print(f"rejected families ({len(rejected)}; degrees dp·tp·pp·cp·ep, each over its ZeRO stages, schedules "
              f"and recompute modes):")
    for family, why in sorted(rejected.items()):
        reason, message = why.main_reason()
        counts = ", ".join(f"{n} {r}" for r, n in sorted(why.counts.items(), key=lambda rn: REASONS.index(rn[0])))
        print(f"  {family:<22} {why.total:>3} rejected ({counts}): {message}")
    return 0


def _search_run(args: argparse.Namespace) -> int:
    """The search pinned to a measured run (`search.predict_run`), beside what the run measured."""
    defaults = vars(build_parser().parse_args(["search", "--run", args.run]))
    given = [f"--{k.replace('_', '-')}" for k, v in vars(args).items() if k not in ("json", "top") and v != defaults[k]]
    if given:
        raise ValueError(f"--run {args.run} decides {', '.join(given)} itself: leave them out")
    run = next(r for r in RUNS if r.name == args.run)
    candidate = predict_run(run)
    throughput, memory = predicted_over_measured(run, candidate)
    reported = reported_memory(run, candidate)["total"] / 2**30
    measured = {"tokens_per_s_per_gpu": run.tokens_per_s_per_gpu, "mfu": run.mfu, "memory_gib": run.memory_gib}
    if args.json:
        print(json.dumps({"run": run.name, "source": run.source, "measured": measured, "candidate": candidate.as_dict(),
                          "reported_memory_gib": reported, "throughput_ratio": throughput, "memory_ratio": memory,
                          "goal_error": run.goal_error, "memory_error": run.memory_error, "why": run.why}))
        return 0
    print(f"{run.name}: {run.source}")
    print(f"  pinned: {candidate.layout}, micro-batch {candidate.mbs}, {run.gpus:,} GPUs, seq {run.seq}, "
          f"{run.stack} stack")
    if run.tokens_per_s_per_gpu:
        print(f"  tokens/s/GPU: predicted {candidate.tokens_per_s_per_gpu:,.0f}, measured "
              f"{run.tokens_per_s_per_gpu:,.0f} (predicted/measured {throughput:.2f})")
    else:
        print(f"  MFU: predicted {candidate.mfu:.1%}, measured {run.mfu:.1%} (predicted/measured {throughput:.2f})")
    if memory is not None:
        print(f"  memory per GPU as the run reports it: predicted {reported:.1f} GiB, measured "
              f"{run.memory_gib:.1f} GiB (predicted/measured {memory:.2f})")
    if run.why:
        print(f"  outside the goal (throughput +-15 %, memory +-10 %) because: {run.why}")
    return 0


def _inference(cfg: ModelConfig, args: argparse.Namespace) -> int:
    plan = inference.serving_plan(cfg, args.hardware, args.tp, args.seq, args.batch,
                                  inference.STORAGE_BYTES[args.kv_dtype], inference.STORAGE_BYTES[args.weight_dtype],
                                  args.precision, args.mfu, comms=args.comms)
    if args.ep is not None:
        ep = inference.ep_decode(cfg, args.batch, args.ep, args.hardware)
        plan = {**plan, "ep_decode": ep.as_dict(),
                "ep_counts_exchange": inference.ep_counts_exchange(cfg, args.ep, args.hardware).as_dict()}
    if args.json:
        print(json.dumps(plan))
        return 0
    step = plan["step"]
    print(f"{cfg.name} on {args.tp} x {args.hardware} (tensor parallel); context {args.seq:,} tokens, batch "
          f"{args.batch}; weights {args.weight_dtype}, KV cache {args.kv_dtype}, matmuls {args.precision}")
    rows = [("KV cache per token", f"{plan['kv_bytes_per_token']:,.0f} B"),
            ("KV cache per sequence", f"{plan['kv_bytes_per_sequence'] / 1e9:,.3f} GB (10^9 B)"),
            ("weights per chip", f"{plan['weight_bytes_per_chip'] / 1e9:,.2f} GB of {plan['weight_bytes'] / 1e9:,.2f} "
                                 f"GB ({plan['min_chips_for_weights']:.2f} chips' memory)"),
            ("sequences that fit", f"{plan['max_sequences']:,} ({'fits' if plan['fits'] else 'does NOT fit'} at "
                                   f"batch {args.batch})"),
            ("decode step bound", f"{step['latency_bound_s'] * 1e3:,.2f} ms reading weights + KV "
                                  f"({step['weights_s'] * 1e3:,.2f} + {step['kv_s'] * 1e3:,.2f} ms)"),
            ("decode step", f"{step['time_s'] * 1e3:,.2f} ms; weight matmuls {step['bound']}-bound"
                            + (f"; TP all-reduces {step['comms_s'] * 1e3:,.2f} ms" if args.comms else "")),
            ("critical batch", f"{plan['critical_batch']:,.0f} sequences (compute-bound above)"),
            ("tokens/s", f"{plan['tokens_per_s']:,.0f} ({plan['tokens_per_s_per_chip']:,.0f} per chip)"),
            ("prefill of one sequence", f"{plan['prefill_s'] * 1e3:,.1f} ms at {args.mfu:.0%} MFU")]
    if args.ep is not None:
        rows += [(f"EP{ep.ep} all-to-alls", f"{ep.step_s * 1e3:,.2f} ms a decode step: 2 x {ep.moe_layers} MoE layers "
                                          f"of {ep.dispatch.bytes / 1e3:,.1f} kB a GPU"),
                 ("  their latency floor", f"{ep.latency_floor_s * 1e3:,.2f} ms ({ep.latency_share:.0%} of them)"),
                 ("  tokens/s they allow", f"{ep.tokens_per_s:,.0f} ({ep.tokens_per_s_per_sequence:,.0f} a sequence)")]
    for name, value in rows:
        print(f"  {name:<24} {value}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.what == "comms":
            return _comms(args)
        if args.what == "bubble":
            return _bubble(args)
        if args.what == "search":
            return _search(args)
        cfg = ModelConfig.from_preset(args.model)
        return {"params": _params, "memory": _memory, "flops": _flops, "roofline": _roofline,
                "inference": _inference}[args.what](cfg, args)
    except ValueError as err:
        print(f"{parser.prog} {args.what}: error: {err}", file=sys.stderr)
        return 2
