"""The GPU lane: what only NVIDIA GPUs can show, in one command, kept as JSON records.

    make bench-gpu                      # python benchmarks/gpu_lane.py bench
    make record-gpu                     # python benchmarks/gpu_lane.py record
    python benchmarks/gpu_lane.py bench --parts correctness mfu --out /tmp/gpu --budget-s 300
    make bench-gpu-36                   # python benchmarks/gpu_lane.py bench --plan issue36 (8 minutes)

Nothing on a CPU machine can say whether the course's promise holds on NCCL and CUDA: this lane checks it and
measures what the chapters quote. Without a GPU it prints one line and exits 2.

bench, in order (each part in a process of its own, with a time limit, so one crash or hang costs only its part):
  correctness  pytest over tests/gpu (fp32 parity with the CPU, activation bytes against `lab.calc.memory`, bf16
               training, and every `lab.train` layout the machine has GPUs for under NCCL against one GPU), the
               Triton kernels' tests and the FP8 tests, compiled on this GPU
  mfu          `lab.train` on Llama 3.2 1B on one GPU in bf16: MFU = model FLOPs per step (`lab.calc.flops`, 6N plus
               attention) / (median steady step time x the device's dense bf16 peak from `lab.calc.hardware`), at
               `lab.train`'s default (--compile auto), then the compile rows: seq 2048 and 8192, eager and with
               --compile (each block torch.compiled, `lab.parallel.compile`), the same tokens per micro-batch;
               the row the default run already is comes from it, not from a second run
  nccl         benchmarks/collectives.py on NCCL: bus bandwidth of torch's and lab's collectives (>= 2 GPUs)
  fp8_train    FP8 training against bf16 on an 8B-shaped model (4 layers of Llama 3 8B, seq 2048), blocks compiled:
               lab's tensorwise and rowwise recipes beside torchao's float8 (a line when torchao does not import)
  decode       batch-1 decode tokens/s and share of HBM bandwidth, Llama 3.2 1B and Llama 3 8B shapes, with
               lab's CUDA-graph decoder and a plain torch.compile decode loop (gpt-fast's)
  kernels, fp8, serving, dp_zero, tp
               the GPU columns of benchmarks/kernels.py (Triton vs torch eager and compiled, bf16, issue 36's
               kernel targets), fp8_gemm.py (FP8 vs bf16 GEMMs),
               serving.py (the inference engine's throughput), dp_zero.py (lab's DP/ZeRO vs DDP/FSDP2) and tp.py
               (lab's TP vs DTensor's); the last two on >= 2 GPUs. The other benchmarks measure gloo ranks on a CPU
               (pipeline, cp, compose, checkpoint, search_vs_measured, precision_side_by_side, memory_accuracy)
record: the recordings chapters 01-03 show
  memory       the memory timeline of three training steps by category (`lab.measure.memory_timeline`, the CPU
               figure of chapter 01, now on the GPU), and a CUDA allocator snapshot for https://pytorch.org/memory_viz
  trace        a profiler trace of two training steps (chrome://tracing, https://ui.perfetto.dev) and its kernel table
  ddp_trace    DDP's bucketed all-reduce overlapping backward, on NCCL (>= 2 GPUs)

The document written to --out (benchmarks/results/ by default), `<date>-<device>-<command>.json`, holds the
environment (devices, driver, torch, CUDA, NCCL, Triton) and one record per part: status (pass, fail, skip,
timeout), wall time, and what it measured. `validate` is its schema; tests/test_gpu_lane.py checks it on a CPU.
The document is rewritten after every part (a temporary file renamed over it), so a lane killed from outside keeps
every part it finished; a part the lane's own deadline cuts off or never starts is a timeout or skip record saying so.

--plan NAME runs a plan instead of the parts: the parts one issue needs, in priority order, each with the
arguments and time limit that fit a lent GPU's one command (PLANS; `issue36`: 480 s), an estimate of each part's
time beside its basis, and the plan written into the document. A part starts only when its estimate fits the time
left, and gets min(its limit, the time left); the lane prints the parts it left.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SCHEMA = "lab-gpu-lane/1"
STATUSES = ("pass", "fail", "skip", "timeout")
# part: (time limit in seconds, GPUs it needs). kernels: 35.5 s for its 10 fp16 rows on an H100 (2026-11-26 record);
# now 15 bf16 rows, the tiled matmul autotuned over its configs, Inductor's max-autotune GEMM search and SDPA
# compiled: ~2 min estimated, not yet measured.
BENCH_PARTS = {"correctness": (170, 1), "mfu": (600, 1), "nccl": (150, 2), "kernels": (180, 1),
               "fp8": (90, 1), "serving": (90, 1), "dp_zero": (200, 2), "tp": (150, 2), "fp8_train": (480, 1),
               "decode": (420, 1)}
RECORD_PARTS = {"memory": (60, 1), "trace": (45, 1), "ddp_trace": (90, 2)}
ALL_PARTS = {**BENCH_PARTS, **RECORD_PARTS}
MFU_WARMUP_STEPS = 2  # the first steps build CUDA contexts, cuBLAS plans and the allocator's pools
MIN_START_S = 20.0  # a part without an estimate starts only with this much of the budget left
NO_GPU = "{command} needs an NVIDIA GPU: {why}. Run it on a machine where nvidia-smi lists one."


@dataclasses.dataclass(frozen=True)
class PlanStep:
    """One part of a plan: its time limit, the time it is expected to take and why (the basis: what was measured,
    what is guessed), the arguments it runs with (`_parser`'s dests), and whether it runs only on time left over
    (an optional step is not in the plan's sum of limits: it gets what the others leave)."""

    part: str
    limit_s: float
    estimate_s: float
    basis: str
    args: dict = dataclasses.field(default_factory=dict)
    optional: bool = False

    def record(self) -> dict:
        return dataclasses.asdict(self)


# Issue 36's GPU measurements in one command of ~8 minutes (a lent GPU's session has 15 minutes of device time,
# the machine's start-up and a rerun included). Estimates are from the 2026-11-26 H100 records
# (benchmarks/results/) and, where nothing was measured yet, guesses that say so; each record's wall_s corrects them.
ISSUE36 = (
    PlanStep("kernels", 90, 75,
             "35.5 s for 10 fp16 rows with the interpreter's comparison (2026-11-26); now 6 bf16 rows (matmul tiled "
             "and persistent at 4096^3, softmax's four), no interpreter, but the tiled matmul autotuned over its "
             "configs and Inductor's Triton GEMM search (max-autotune) at one shape: ~30 s guessed for the two",
             {"kernel_names": ["matmul", "softmax"]}),
    PlanStep("mfu", 160, 140,
             "90.2 s for 12 eager steps of 0.957 s and two builds of the 1B model (2026-11-26): ~40 s a build with "
             "start-up; here three runs (compiled default, its profile, eager) of 5 + 4 + 5 steps, one block's "
             "Inductor compile (forward and backward, 16 cores: ~40 s guessed), the eager row at seq 2048 taken "
             "from the default run when the default is eager (not run twice)",
             {"mfu_steps": MFU_WARMUP_STEPS + 3, "mfu_long_seq": 0}),
    PlanStep("decode", 120, 110,
             "29.1 s for the 1B's eager and graph decode (serving, 2026-11-26); here the 1B and 8B graph decoders "
             "(~25 s together: 8B's 16 GB made on the device, ~1.3k tokens at ~8 ms) and two torch.compile'd "
             "decode steps (reduce-overhead, 16 and 32 layers: ~30 s each, guessed)", {}),
    PlanStep("fp8_train", 110, 100,
             "not measured yet: three variants (bf16, lab tensorwise, lab rowwise; torchao is not in the lent "
             "machine's image, two one-line rows), each a 1.9B-parameter 4-layer model made on the device and one "
             "block compiled (~25 s guessed) and 7 steps of 2048 tokens (~1 s)", {}),
    PlanStep("mfu", 140, 110,
             "the seq 8192 rows (1 x 8192 tokens per micro-batch, the same tokens as 4 x 2048): two runs of 5 steps "
             "(~1.1 s eager) and a second compile for the new shapes, no profile; only on time left over",
             {"mfu_seq": 8192, "mfu_mbs": 1, "mfu_steps": MFU_WARMUP_STEPS + 3, "mfu_long_seq": 0,
              "mfu_profile": False}, optional=True),
)
PLANS = {"issue36": (480.0, ISSUE36)}  # name: (the command's budget in seconds, its steps in priority order)


def plan_steps(name: str) -> tuple[float, tuple[PlanStep, ...]]:
    """A plan's budget and steps; an unknown name is one line naming the plans."""
    if name not in PLANS:
        raise ValueError(f"--plan {name!r}: the plans are {', '.join(PLANS)}")
    return PLANS[name]


def gpu_problem() -> str | None:
    """Why this machine cannot run the lane, in a few words, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is a CPU build"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
    return None


# --- the environment ----------------------------------------------------------------------------------------


def _driver_version() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=30)
    return done.stdout.splitlines()[0].strip() if done.returncode == 0 and done.stdout.strip() else None


def _lab_commit() -> str | None:
    if os.environ.get("LAB_COMMIT"):
        return os.environ["LAB_COMMIT"]
    try:  # a lent machine gets the working tree without git's history (then LAB_COMMIT says which commit)
        done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def environment() -> dict:
    """Who measured: the devices, the driver and every version a number depends on."""
    import torch

    from lab.calc.hardware import device_accelerator

    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        chip = device_accelerator(props.name)
        devices.append({"name": props.name, "memory_bytes": props.total_memory,
                        "capability": f"{props.major}.{props.minor}", "multiprocessors": props.multi_processor_count,
                        "peak_bf16_flops": chip.peak_flops("bf16") if chip else None})
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
    return {"devices": devices, "driver": _driver_version(), "host": platform.node(),
            "versions": {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                         "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
                         "triton": triton_version, "lab_commit": _lab_commit()}}


# --- the document and its schema ----------------------------------------------------------------------------


def document(command: str, env: dict, parts: list[dict], plan: dict | None = None) -> dict:
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"schema": SCHEMA, "command": command, "date": now, "environment": env, "parts": parts,
            **({"plan": plan} if plan else {})}


def write_document(path: Path, doc: dict) -> None:
    """Write `doc` to `path` whole or not at all: a temporary file beside it, renamed over it (a rename within a
    folder is atomic), so that a lane killed while writing leaves the previous document, never half of one."""
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as tmp:
        tmp.write(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp.name, path)


def validate(doc: dict) -> list[str]:
    """What is wrong with a lane document, one line each (empty when it is well formed)."""
    problems = []
    for key, kind in (("schema", str), ("command", str), ("date", str), ("environment", dict), ("parts", list)):
        if not isinstance(doc.get(key), kind):
            problems.append(f"{key}: must be a {kind.__name__}, got {type(doc.get(key)).__name__}")
    if problems:
        return problems
    if doc["schema"] != SCHEMA:
        problems.append(f"schema: {doc['schema']!r} is not {SCHEMA!r}")
    if doc["command"] not in ("bench", "record"):
        problems.append(f"command: {doc['command']!r} must be 'bench' or 'record'")
    env = doc["environment"]
    for key in ("devices", "driver", "versions"):
        if key not in env:
            problems.append(f"environment.{key}: missing")
    for key in ("torch", "cuda", "nccl", "triton", "python", "lab_commit"):
        if key not in env.get("versions", {}):
            problems.append(f"environment.versions.{key}: missing")
    for i, part in enumerate(doc["parts"]):
        where = f"parts[{i}] ({part.get('name', '?')})"
        if part.get("name") not in ALL_PARTS:
            problems.append(f"{where}: name must be one of {', '.join(ALL_PARTS)}")
        if part.get("status") not in STATUSES:
            problems.append(f"{where}: status {part.get('status')!r} must be one of {', '.join(STATUSES)}")
        if not isinstance(part.get("wall_s"), (int, float)) or part["wall_s"] < 0:
            problems.append(f"{where}: wall_s must be a number >= 0")
        if part.get("status") in ("skip", "fail", "timeout") and not part.get("reason"):
            problems.append(f"{where}: a {part.get('status')} part must say why (reason)")
        if part.get("name") in ("fp8_train", "decode") and part.get("status") == "pass" and \
                not isinstance(part.get("metrics", {}).get("rows"), list):
            problems.append(f"{where}: metrics.rows must be a list")
        if part.get("name") == "mfu" and part.get("status") == "pass":
            for key in ("mfu", "step_s", "tokens_per_step", "model_flops_per_step", "peak_flops"):
                if not isinstance(part.get("metrics", {}).get(key), (int, float)):
                    problems.append(f"{where}: metrics.{key} must be a number")
            problems += _compile_row_problems(where, part.get("metrics", {}).get("compile_rows"))
    return problems


def _compile_row_problems(where: str, rows) -> list[str]:
    """The mfu part's compile rows: a list of {seq, compile, and mfu + step_s, or the error that stopped it}."""
    if not isinstance(rows, list):
        return [f"{where}: metrics.compile_rows must be a list"]
    problems = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("seq"), int) or row.get("compile") not in \
                ("eager", "inductor", "aot_eager"):
            problems.append(f"{where}: metrics.compile_rows[{i}] needs seq (int) and compile (eager or a backend)")
        elif not (isinstance(row.get("mfu"), (int, float)) and isinstance(row.get("step_s"), (int, float))
                  or row.get("error")):
            problems.append(f"{where}: metrics.compile_rows[{i}] needs mfu and step_s, or the error that stopped it")
    return problems


# --- the MFU arithmetic -------------------------------------------------------------------------------------


def mfu_of_run(step_seconds: list[float], model_cfg, seq: int, tokens_per_step: int, peak_flops: float,
               warmup: int = MFU_WARMUP_STEPS) -> dict:
    """Model FLOPs utilisation of a one-GPU run from its step times: `lab.calc.flops.mfu` of the median steady step,
    whose FLOPs are the model's (6N plus attention, `lab.calc.flops.training_flops`; recomputation would not count)."""
    from lab.calc.flops import mfu, training_flops

    if len(step_seconds) <= warmup:
        raise ValueError(f"{len(step_seconds)} steps: MFU needs more than the {warmup} warm-up steps")
    if not peak_flops > 0:
        raise ValueError(f"peak_flops={peak_flops!r} must be > 0 (FLOP/s)")
    step_s = statistics.median(step_seconds[warmup:])
    estimate = training_flops(model_cfg, seq, tokens=tokens_per_step)
    return {"mfu": mfu(estimate, step_s, 1, peak_flops), "step_s": step_s, "tokens_per_s": tokens_per_step / step_s,
            "tokens_per_step": tokens_per_step, "model_flops_per_step": estimate.model_flops,
            "peak_flops": peak_flops, "steady_steps": len(step_seconds) - warmup}


def _peak_flops(device: str) -> float | None:
    import torch

    from lab.calc.hardware import device_accelerator

    if device != "cuda":
        return None
    chip = device_accelerator(torch.cuda.get_device_name())
    return chip.peak_flops("bf16") if chip else None


def part_mfu(args: argparse.Namespace) -> dict:
    """Train the MFU model for a few steps with `lab.train`'s own loop; the device's peak comes from the table."""
    import torch

    from lab.config import load_config
    from lab.parallel.compile import compile_backend
    from lab.train import run

    config = load_config(None, [f"model.preset='{args.mfu_model}'", f"train.seq_len={args.mfu_seq}",
                                f"train.global_batch={args.mfu_mbs * args.mfu_accum}",
                                f"parallel.grad_accum={args.mfu_accum}", f"train.steps={args.mfu_steps}",
                                f"train.warmup_steps={args.mfu_steps}", "train.lr=3e-4",
                                f"train.precision='{args.mfu_precision}'", f"train.device='{args.device}'",
                                # on a CPU (the tests) the same loop, profiler and compiled rows at a toy depth
                                *([f"model.n_layers={CPU_WALK['layers']}"] if args.device == "cpu" else [])])
    peak = args.peak_flops or _peak_flops(args.device)
    if peak is None:
        return {"status": "skip", "reason": "no dense bf16 peak for this device in lab.calc.hardware "
                                            "(give --peak-flops)"}
    attention = _attention_backend(args.device)
    logs = run(config, 1, verbose=False)
    tokens = config.train.global_batch * config.train.seq_len
    metrics = mfu_of_run([tokens / log.tokens_per_s for log in logs], config.model, config.train.seq_len, tokens, peak)
    metrics.update(model=args.mfu_model, seq=args.mfu_seq, micro_batch=args.mfu_mbs, grad_accum=args.mfu_accum,
                   precision=args.mfu_precision, attention=attention,
                   peak_memory_bytes=max((log.peak_bytes or 0) for log in logs),
                   losses=[round(log.loss, 4) for log in logs])
    if args.device == "cuda":
        metrics["device"] = torch.cuda.get_device_name()
    if args.mfu_profile:
        metrics["where_the_time_goes"] = _profiled_steps(config, metrics["step_s"], on_gpu=args.device == "cuda")
    metrics["compile"] = compile_backend(config.train.compile, torch.device(args.device))[0] or "eager"
    default_row = {"seq": args.mfu_seq, "compile": metrics["compile"], "micro_batch": args.mfu_mbs,
                   **{k: metrics[k] for k in ("mfu", "step_s", "tokens_per_s", "peak_memory_bytes", "losses")},
                   "from": "the part's default run"}
    metrics["compile_rows"] = [  # the row the default run already is, taken from it rather than run twice
        default_row if (seq, mode) == (args.mfu_seq, metrics["compile"])
        else _compile_row(config, seq, mode, args.mfu_mbs, peak)
        for seq in dict.fromkeys(s for s in (args.mfu_seq, args.mfu_long_seq) if s) for mode in
        ("eager", args.mfu_compile)]
    goal = args.mfu_goal
    status = "pass" if metrics["mfu"] >= goal else "fail"
    reason = None if status == "pass" else f"MFU {metrics['mfu']:.1%} is under the goal of {goal:.0%}"
    return {"status": status, "metrics": metrics, **({"reason": reason} if reason else {})}


def _compile_row(config, seq: int, mode: str, micro_batch: int, peak: float) -> dict:
    """MFU of the same run at `seq` tokens, eager or with `--compile mode`, keeping the micro-batch's tokens
    (4 x 2048 = 1 x 8192). Dynamo starts afresh for each row: a second sequence length would otherwise make it
    recompile with dynamic shapes, slower kernels than the static ones a real run gets. An out-of-memory (or any
    error) is the row's record, not the part's end."""
    import torch

    from lab.train import run

    micro = max(1, micro_batch * config.train.seq_len // seq)
    accum = config.parallel.grad_accum
    row_config = dataclasses.replace(
        config, train=dataclasses.replace(config.train, seq_len=seq, global_batch=micro * accum, compile=mode))
    if mode != "eager":
        torch._dynamo.reset()
    row = {"seq": seq, "compile": mode, "micro_batch": micro}
    start = time.perf_counter()
    try:
        logs = run(row_config, 1, verbose=False)
    except Exception as err:  # noqa: BLE001 - e.g. torch.OutOfMemoryError at 8192: the row says so
        return {**row, "error": f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}"}
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    tokens = micro * accum * seq
    metrics = mfu_of_run([tokens / log.tokens_per_s for log in logs], config.model, seq, tokens, peak)
    return {**row, "mfu": metrics["mfu"], "step_s": metrics["step_s"], "tokens_per_s": metrics["tokens_per_s"],
            "peak_memory_bytes": max((log.peak_bytes or 0) for log in logs),
            "losses": [round(log.loss, 4) for log in logs], "wall_s": round(time.perf_counter() - start, 1)}


def _profiled_steps(config, step_s: float, on_gpu: bool, active: int = 2) -> dict:
    """Where a step's time goes: the same run again with the profiler on for `active` steps after two unrecorded
    ones (building the model, a first step and the next are set-up; lab.train's `on_step` steps the profiler).
    The GPU's kernel time per step by category (`lab.measure.kernel_time`: matmul, attention, elementwise,
    copy+cast, ...) and each category's share, against the unprofiled step time; what is left is time the GPU
    waited for the host (launches, data, syncs). On a CPU (the tests) the same table of CPU ops."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from lab.measure.kernel_time import shares, time_by_category
    from lab.train import run

    steps = 2 + active
    short = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=steps, warmup_steps=steps))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=active)) as prof:
        run(short, 1, verbose=False, on_step=lambda log: prof.step())
        if on_gpu:
            torch.cuda.synchronize()
    rows = kernel_table(prof.key_averages(), on_gpu)
    by_kind = time_by_category((row["name"], row["total_ms"] / active) for row in rows)
    busy_ms = sum(by_kind.values())
    share = shares(by_kind)
    return {"profiled_steps": active,
            "kernel_ms_per_step": {k: round(v, 1) for k, v in by_kind.items()},
            "kernel_share": {k: round(v, 3) for k, v in share.items()},
            "elementwise_copy_cast_share": share["elementwise"] + share["copy+cast"],  # issue 36's goal: <= 25%
            "kernel_busy_share": busy_ms / (1000 * step_s), "kernels_per_step": sum(r["calls"] for r in rows) / active,
            "top_kernels": [{**r, "total_ms": round(r["total_ms"] / active, 2), "calls": r["calls"] // active}
                            for r in rows[:15]]}


def _attention_backend(device: str) -> str:
    """Whether SDPA's flash kernel takes the model's grouped-query attention (it falls back to slower kernels)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device != "cuda":
        return "cpu"
    q = torch.randn(1, 32, 256, 64, device=device, dtype=torch.bfloat16)
    kv = torch.randn(1, 8, 256, 64, device=device, dtype=torch.bfloat16)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        return "flash (GQA)"
    except RuntimeError as error:
        return f"not flash: {str(error).splitlines()[0][:200]}"


# --- FP8 training and batch-1 decode (issue 36) ---------------------------------------------------------------

FP8_VARIANTS = ("bf16", "lab fp8-tensorwise", "lab fp8-rowwise", "torchao tensorwise", "torchao rowwise")
FP8_GOAL = 1.15  # issue 36: lab's FP8 tensorwise at >= 1.15x bf16 tokens/s on the 8B-shaped run
DECODE_GOALS = {"llama3-1b": 0.45, "llama3-8b": 0.60}  # issue 36: batch-1 decode, share of HBM bandwidth
TIMED_STEPS = (2, 5)  # warm-up steps (compilation, cuBLAS plans, the allocator's pools), then timed steps
CPU_WALK = {"layers": 1, "steps": (1, 1)}  # the CPU walk-through (the tests): the code a GPU runs, at a toy size


def _fp8_shape(device: str):
    """Llama 3 8B's layer (d_model 4096, d_ff 14336, 32 query and 8 KV heads) four times at seq 2048, one sequence:
    GEMMs large enough for FP8's doubled tensor-core rate to pay for its casts (torchao measured its 1.25x on
    the whole 8B). On a CPU (the tests), the tiny preset cut to CPU_WALK's layers."""
    from lab.config import ModelConfig

    if device == "cpu":
        return ModelConfig.from_preset("tiny", n_layers=CPU_WALK["layers"]), 16, 2
    return ModelConfig.from_preset("llama3-8b", n_layers=4, max_seq_len=2048), 2048, 1


def _fp8_convert(model, variant: str) -> None:
    """FP8 on the block linears, lab's (`lab.precision.scheme.convert_to_fp8`) or torchao's, with the same rule:
    the linears inside the blocks, not the output layer nor a router."""
    from lab.precision.fp8_linear import RECIPES
    from lab.precision.scheme import KEEP_IN_HIGH_PRECISION, convert_to_fp8

    owner, _, recipe = variant.partition(" ")
    if owner == "lab":
        convert_to_fp8(model, RECIPES[recipe.removeprefix("fp8-")])
    elif owner == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=lambda
                                   module, fqn: fqn.startswith("layers.") and fqn.rsplit(".", 1)[-1]
                                   not in KEEP_IN_HIGH_PRECISION)


def _timed_training(model, cfg, seq: int, micro_batch: int, device: str) -> dict:
    """tokens/s of the median timed step of forward, loss, backward and AdamW (`language_model_step`)."""
    import torch

    from lab.measure.memory_timeline import language_model_step
    from lab.parallel.optim import adamw

    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, seq), device=device)
    step = language_model_step(model, adamw(model.parameters(), 3e-4, 0.1), tokens, tokens.roll(-1, 1))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    warmup, timed = TIMED_STEPS if device == "cuda" else CPU_WALK["steps"]
    times = []
    for _ in range(warmup + timed):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times[warmup:])
    return {"step_s": step_s, "tokens_per_s": micro_batch * seq / step_s,
            "peak_memory_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None}


def _fp8_row(variant: str, cfg, seq: int, micro_batch: int, device: str) -> dict:
    """One variant's training speed, or why it did not run (one line)."""
    import torch

    if variant.startswith("torchao") and device == "cpu":
        return {"variant": variant, "skipped": "torchao's rows run on a GPU only (on a CPU its import alone takes "
                                               "seconds of the suite's walk-through)"}
    if variant.startswith("torchao") and (why := _torchao_missing()):
        return {"variant": variant, "skipped": why}
    model = _benchmark_module("serving").random_model(cfg, device).train()
    try:
        _fp8_convert(model, variant)
        if device == "cuda":  # TorchTitan's way: each block compiled on its own, the casts fused into its kernels
            for block in model.layers.values():
                block.compile()
            torch.cuda.reset_peak_memory_stats()
        return {"variant": variant, **_timed_training(model, cfg, seq, micro_batch, device)}
    except Exception as error:  # a variant this torch or GPU refuses: the others still run
        return {"variant": variant, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
    finally:
        del model
        if device == "cuda":
            torch._dynamo.reset()
            torch.cuda.empty_cache()


def _torchao_missing() -> str | None:
    try:
        import torchao.float8  # noqa: F401
    except Exception as error:  # not installed, or built for another torch
        return f"torchao's float8 does not import here ({type(error).__name__}: {str(error).splitlines()[0][:200]})"
    return None


def part_fp8_train(args: argparse.Namespace) -> dict:
    """FP8 training against bf16, lab's recipes beside torchao's, on one GPU: tokens/s of the same model, the
    block linears converted (compiled per block on a GPU), and the ratio to bf16."""
    cfg, seq, micro_batch = _fp8_shape(args.device)
    rows = [_fp8_row(variant, cfg, seq, micro_batch, args.device) for variant in FP8_VARIANTS]
    bf16 = rows[0].get("tokens_per_s")
    for row in rows[1:]:
        if bf16 and "tokens_per_s" in row:
            row["vs_bf16"] = row["tokens_per_s"] / bf16
    metrics = {"model": f"{cfg.name} shape, {cfg.n_layers} layers", "d_model": cfg.d_model, "d_ff": cfg.d_ff,
               "layers": cfg.n_layers, "seq": seq, "micro_batch": micro_batch, "compiled": args.device == "cuda",
               "timed_steps": TIMED_STEPS[1], "rows": rows}
    if bf16 is None:
        return {"status": "fail", "reason": f"the bf16 baseline did not run: {rows[0].get('error')}",
                "metrics": metrics}
    tensorwise = rows[1].get("vs_bf16")
    if args.device == "cuda" and (tensorwise or 0) < FP8_GOAL:
        reason = (f"lab's FP8 tensorwise at {tensorwise:.2f}x bf16 is under the goal of {FP8_GOAL}x" if tensorwise
                  else f"lab's FP8 tensorwise did not run: {rows[1].get('error')}")
        return {"status": "fail", "reason": reason, "metrics": metrics}
    return {"status": "pass", "metrics": metrics}


def _decode_row(cfg, decoder: str, device: str) -> dict:
    """Batch-1 greedy decode of the model `cfg` with random bf16 weights: ms per token from two generation lengths
    (their difference cancels the prefill, as benchmarks/serving.py's gpu_decode), and the share of HBM bandwidth that
    the bytes one step reads (`lab.calc.inference.decode_step`: the weights and the KV cache) reach. "graph":
    `GraphedDecoder` (one CUDA graph per 256-slot length bucket); "compile": `CompiledDecoder` (gpt-fast's
    torch.compile'd step; on a CPU dynamo's eager backend, which checks that it traces without a break)."""
    import torch

    from lab.calc.hardware import device_accelerator
    from lab.calc.inference import decode_step
    from lab.inference.cuda_graph import CompiledDecoder, GraphedDecoder

    serving = _benchmark_module("serving")
    cuda = device == "cuda"
    prompt_len, lengths, repeats = (128, (32, 288), 3) if cuda else (8, (4, 12), 1)
    model = serving.random_model(cfg, device, torch.bfloat16 if cuda else torch.float32)
    prompt = torch.randint(cfg.vocab_size, (1, prompt_len), device=device)
    max_len = prompt_len + max(*lengths, serving.WARM_UP)
    try:
        decode = GraphedDecoder(model, 1, max_len) if decoder == "graph" else \
            CompiledDecoder(model, 1, max_len, **({} if cuda else {"backend": "eager"}))
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        times = serving._best_times(lambda n: decode.generate(prompt, n), lengths, repeats, sync)
    finally:
        del model
        if cuda:
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    short, long = lengths
    seconds = (times[long] - times[short]) / (long - short)
    context = prompt_len + (short + long) // 2
    row = {"preset": cfg.name, "decoder": decoder, "context": context}
    if not seconds > 0:  # a loaded CPU (the tests) can time the longer run faster: no number rather than a wrong one
        return {**row, "error": f"{long} tokens took no longer than {short}: timing noise, no rate"}
    row.update(ms_per_token=1e3 * seconds, tokens_per_s=1 / seconds)
    chip = device_accelerator(torch.cuda.get_device_name()) if cuda else None
    if chip is not None:
        step = decode_step(cfg, chip, 1, context)
        row.update(bytes_per_step=step.weight_bytes + step.kv_bytes, hbm_fraction=step.latency_bound_s / seconds,
                   hbm_gb_s=chip.hbm_bandwidth / 1e9)
    return row


def _benchmark_module(name: str):
    """A sibling script of benchmarks/ imported as a module (its GPU helpers, not its command line)."""
    import importlib

    sys.path.insert(0, str(REPO / "benchmarks"))
    return importlib.import_module(name)


def part_decode(args: argparse.Namespace) -> dict:
    """Batch-1 decode of Llama 3.2 1B and Llama 3 8B shapes (the cut tiny preset on a CPU) with the graph decoder and
    a plain torch.compile decode loop, against the goals' shares of HBM bandwidth."""
    from lab.config import ModelConfig

    models = [ModelConfig.from_preset(name) for name in DECODE_GOALS] if args.device == "cuda" else \
        [ModelConfig.from_preset("tiny", n_layers=CPU_WALK["layers"])]
    rows = [_decode_row(cfg, decoder, args.device) for cfg in models for decoder in ("graph", "compile")]
    misses = []
    for preset, goal in DECODE_GOALS.items():
        best = max((r["hbm_fraction"] for r in rows if r["preset"] == preset and "hbm_fraction" in r), default=None)
        if best is not None and best < goal:
            misses.append(f"{preset} at {best:.0%} of HBM bandwidth (goal {goal:.0%})")
    metrics = {"rows": rows, "goals": DECODE_GOALS}
    if misses:
        return {"status": "fail", "reason": "; ".join(misses), "metrics": metrics}
    return {"status": "pass", "metrics": metrics}


# --- parts that run pytest or a benchmark script --------------------------------------------------------------


def _child(command: list[str], timeout_s: float, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, **(env or {})})


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def junit_summary(xml_text: str) -> dict:
    """Counts and the failing tests' ids and first message lines of a pytest --junitxml report."""
    root = ET.fromstring(xml_text)
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in root.iter("testcase"):
        for child in case:
            if child.tag in ("failure", "error"):
                message = (child.get("message") or child.text or "").strip().splitlines()
                failed.append(f"{case.get('classname')}::{case.get('name')}: {message[0][:300] if message else ''}")
    skipped = sorted({(child.get("message") or "").strip()[:200] for case in root.iter("testcase")
                      for child in case if child.tag == "skipped"})
    measured = {f"{case.get('name')}.{prop.get('name')}": prop.get("value")  # the tests' record_property
                for case in root.iter("testcase") for prop in case.iter("property")}
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed": failed, "skip_reasons": skipped, "measured": measured}


def part_correctness(args: argparse.Namespace, timeout_s: float) -> dict:
    tests = ["tests/gpu", *sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_kernels_*.py")),
             "tests/test_fp8.py"]
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        done = _child([sys.executable, "-m", "pytest", *tests, "-p", "no:xdist", "-p", "no:cacheprovider", "-v",
                       "-rs", f"--junitxml={report}"], timeout_s)
        if not report.exists():
            return {"status": "fail", "reason": f"pytest wrote no report (exit {done.returncode})",
                    "log_tail": _tail(done.stdout + done.stderr)}
        summary = junit_summary(report.read_text())
    bad = summary["failures"] + summary["errors"]
    return {"status": "pass" if bad == 0 and done.returncode == 0 else "fail", "metrics": summary,
            **({"reason": f"{bad} of {summary['tests']} tests failed"} if bad else {}),
            "log_tail": _tail(done.stdout, 25)}


def _script(name: str, extra: list[str], timeout_s: float, with_json: bool = True) -> dict:
    """Run benchmarks/<name>.py; its --json records (when it writes them) or its printed table come back."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "records.json"
        command = [sys.executable, str(REPO / "benchmarks" / f"{name}.py"), *extra,
                   *(["--json", str(out)] if with_json else [])]
        done = _child(command, timeout_s)
        records = json.loads(out.read_text()) if out.exists() else None
    result = {"status": "pass" if done.returncode == 0 else "fail", "command": " ".join(command[1:]),
              "log_tail": _tail(done.stdout + ("\n" + done.stderr if done.returncode else ""), 60)}
    if done.returncode:
        missed = [line.strip() for line in done.stdout.splitlines() if line.rstrip().endswith("MISS")]
        result["reason"] = (f"targets missed: {'; '.join(missed)}"[:600] if missed
                            else f"exit {done.returncode}: {_tail(done.stderr, 1)[:300]}")
    if records is not None:
        result["records"] = records
    return result


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def part_script(name: str, args: argparse.Namespace, timeout_s: float) -> dict:
    gpus = _gpus()
    if name == "kernels":
        only = ["--kernels", *args.kernel_names] if args.kernel_names else []
        return _script("kernels", ["--lane", "gpu", "--no-interpreter", *only], timeout_s)
    if name == "fp8":
        return _script("fp8_gemm", ["--lane", "gpu", "--sizes", "1024", "2048", "4096", "8192", "16384"], timeout_s)
    if name == "serving":
        return _script("serving", ["--lane", "gpu", "--presets", "llama3-1b"], timeout_s)
    worlds = [str(w) for w in (2, 4, 8) if w <= gpus]
    if name == "nccl":
        return _script("collectives", ["--backend", "nccl", "--world", *worlds, "--max-mb", "256"], timeout_s,
                       with_json=False)
    if name == "dp_zero":
        return _script("dp_zero", ["--backend", "nccl", "--world", *worlds, "--d-model", "2048", "--layers", "8",
                                   "--vocab", "32000", "--seq-len", "1024", "--batch", str(4 * int(worlds[-1]))],
                       timeout_s, with_json=False)
    if name == "tp":
        return _script("tp", ["--backend", "nccl", "--tp", *worlds, "--d-model", "2048", "--layers", "4",
                              "--seq", "2048"], timeout_s, with_json=False)
    raise ValueError(f"part={name!r} is not a benchmark script part")


# --- recordings -----------------------------------------------------------------------------------------------


def _record_model(device: str, dtype=None):
    """A model big enough for the GPU's timeline to show its phases, small enough to record in seconds; in
    `dtype` (weights and optimizer states alike: a recording, not lab.train's mixed precision)."""
    import torch

    from lab.config import ModelConfig
    from lab.model import build_model, materialize
    from lab.parallel.optim import adamw

    if device == "cpu":  # the tests run the CPU path: the tiny shape
        cfg, seq, mbs = ModelConfig.from_preset("tiny"), 32, 2
    else:
        cfg, seq, mbs = ModelConfig.from_preset("tiny", vocab_size=32000, d_model=1024, n_layers=8, n_heads=16,
                                                n_kv_heads=4, d_ff=2816, max_seq_len=1024), 1024, 8
    model = materialize(build_model(cfg), device, seed=0).to(dtype or torch.float32)
    optimizer = adamw(model.parameters(), 3e-4, 0.1)
    tokens = torch.randint(0, cfg.vocab_size, (mbs, seq), device=device)
    return cfg, model, optimizer, tokens, seq, mbs


def part_memory(args: argparse.Namespace) -> dict:
    import torch

    from lab.measure.memory_timeline import language_model_step, memory_timeline

    cfg, model, optimizer, tokens, seq, mbs = _record_model(args.device)
    step = language_model_step(model, optimizer, tokens, tokens.roll(-1, 1))
    timeline = memory_timeline(step, steps=3, device=args.device)
    metrics = {"model": dataclasses.asdict(cfg), "seq": seq, "micro_batch": mbs, "precision": "fp32",
               "timeline": thin(dataclasses.asdict(timeline)),
               "peak_bytes_by_step": [timeline.peak(k) for k in (1, 2, 3)]}
    files = []
    if args.device == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=100_000)
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        snapshot = Path(args.out) / f"{args.stem}-memory-snapshot.pickle"
        torch.cuda.memory._dump_snapshot(str(snapshot))
        torch.cuda.memory._record_memory_history(enabled=None)
        files.append(_gzip(snapshot))
        metrics["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return {"status": "pass", "metrics": metrics, "files": files}


def thin(timeline: dict, points: int = 1500) -> dict:
    """Keep about `points` samples of a memory timeline (every allocation is one), keeping each stretch's highest
    total so that no peak is lost: a file a chapter can load, and the same plot."""
    times = timeline["times_ms"]
    if len(times) <= points:
        return timeline
    columns = timeline["bytes_by_category"]
    totals = [sum(col[i] for col in columns.values()) for i in range(len(times))]
    size = -(-len(times) // points)
    keep = [max(range(i, min(i + size, len(times))), key=totals.__getitem__) for i in range(0, len(times), size)]
    return {**timeline, "times_ms": [times[i] for i in keep],
            "bytes_by_category": {name: [col[i] for i in keep] for name, col in columns.items()}}


def part_trace(args: argparse.Namespace) -> dict:
    import torch

    from lab.measure.memory_timeline import language_model_step

    # bf16 on a GPU: the kernels a real step runs (tensor-core GEMMs, flash attention), not fp32's
    on_gpu = args.device == "cuda"
    _, model, optimizer, tokens, _, _ = _record_model(args.device, torch.bfloat16 if on_gpu else None)
    step = language_model_step(model, optimizer, tokens, tokens.roll(-1, 1))
    file, rows, wall_s = _trace_two_steps(step, on_gpu, Path(args.out) / f"{args.stem}-trace.json")
    busy_s = sum(r["total_ms"] for r in rows) / 1000 if on_gpu else None
    return {"status": "pass", "files": [file],
            "metrics": {"steps": 2, "precision": "bf16" if on_gpu else "fp32", "wall_s": wall_s,
                        "kernel_busy_s": busy_s, "top_ops": rows[:20]}}


def _trace_two_steps(step, on_gpu: bool, trace: Path | None) -> tuple[str | None, list[dict], float]:
    """One warm-up step (cuBLAS handles, the allocator's pools, the optimizer's states), then two profiled ones:
    the gzipped Chrome trace's file name (None: no `trace` asked for), the kernel table, and the two steps' wall
    time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(2):
            step()
        if on_gpu:
            torch.cuda.synchronize()
    wall_s = time.perf_counter() - start
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    return _gzip(trace) if trace else None, kernel_table(prof.key_averages(), on_gpu), wall_s


def kernel_table(averages, on_gpu: bool) -> list[dict]:
    """The profiler's ops by their own time, longest first: GPU kernels on a GPU, CPU ops otherwise."""
    from torch.autograd import DeviceType

    from lab.measure.memory_timeline import (
        PHASES,  # the annotations of language_model_step's phases, also on the GPU's timeline
    )

    rows = []
    for event in averages:
        if event.key in PHASES or event.key.startswith("ProfilerStep"):
            continue  # annotations of spans, not work
        if on_gpu and (event.device_type != DeviceType.CUDA or getattr(event, "is_user_annotation", False)):
            continue  # a CPU op: its device time is its kernels', rows of their own
        total_us = (getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
                    if on_gpu else event.self_cpu_time_total)
        if total_us > 0:
            rows.append({"name": event.key[:120], "calls": event.count, "total_ms": total_us / 1000})
    return sorted(rows, key=lambda r: -r["total_ms"])


def _gzip(path: Path) -> str:
    packed = path.with_name(path.name + ".gz")
    with path.open("rb") as src, gzip.open(packed, "wb") as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()
    return packed.name


def _ddp_trace_rank(out: str, stem: str, device: str) -> dict | None:
    """Two DDP steps on every rank, profiled; rank 0 writes the trace in which the all-reduce of each bucket
    starts while backward still computes (torch's DDP: lab's engines are compared with it in chapter 03)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from lab.measure.memory_timeline import language_model_step

    rank = dist.get_rank()  # lab.distributed.run has set this rank's GPU under NCCL
    _, model, _, tokens, _, _ = _record_model(device if device == "cpu" else f"cuda:{rank}")
    ddp = DistributedDataParallel(model, bucket_cap_mb=25)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-4)
    step = language_model_step(ddp, optimizer, tokens, tokens.roll(-1, 1))
    trace = Path(out) / f"{stem}-ddp-trace.json" if rank == 0 else None  # every rank runs the (collective) steps
    file, rows, _ = _trace_two_steps(step, device == "cuda", trace)
    if rank != 0:
        return None
    collective = re.compile(r"nccl|allreduce|all_reduce", re.IGNORECASE)
    return {"file": file, "top_ops": rows[:20],
            "collective_ms": sum(r["total_ms"] for r in rows if collective.search(r["name"]))}


def part_ddp_trace(args: argparse.Namespace) -> dict:
    from lab.distributed.launch import run

    world = 2
    backend = "nccl" if args.device == "cuda" else "gloo"
    result = run(_ddp_trace_rank, world, str(args.out), args.stem, args.device, backend=backend, timeout_s=240)[0]
    return {"status": "pass", "files": [result.pop("file")], "metrics": {"world": world, "backend": backend, **result}}


# --- orchestration --------------------------------------------------------------------------------------------


IN_PROCESS = {"mfu": part_mfu, "memory": part_memory, "trace": part_trace, "ddp_trace": part_ddp_trace,
              "fp8_train": part_fp8_train, "decode": part_decode}


def run_part(name: str, args: argparse.Namespace, timeout_s: float) -> dict:
    """One part, in a child process of its own where it touches the GPU: a record, whatever happened."""
    start = time.perf_counter()
    need = ALL_PARTS[name][1]
    gpus = _gpus() if args.device == "cuda" else need  # the tests run every part on the CPU
    try:
        if gpus < need:
            result = {"status": "skip", "reason": f"needs {need} GPUs, this machine has {gpus}"}
        elif name in IN_PROCESS:
            result = _in_child(name, args, timeout_s)
        elif name == "correctness":
            result = part_correctness(args, timeout_s)
        else:
            result = part_script(name, args, timeout_s)
    except subprocess.TimeoutExpired as stopped:  # what it printed until then says how far it got
        output = stopped.stdout.decode() if isinstance(stopped.stdout, bytes) else stopped.stdout or ""
        result = {"status": "timeout", "reason": f"stopped after its {timeout_s:.0f} s", "log_tail": _tail(output)}
    return {"name": name, **result, "wall_s": round(time.perf_counter() - start, 1)}


def _in_child(name: str, args: argparse.Namespace, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "part.json"
        command = [sys.executable, __file__, "_part", name, "--out", str(args.out), "--stem", args.stem,
                   "--json", str(out), "--device", args.device, *_mfu_flags(args)]
        done = _child(command, timeout_s)
        if not out.exists():
            return {"status": "fail", "reason": f"exit {done.returncode}: {_tail(done.stderr, 1)[:300]}",
                    "log_tail": _tail(done.stdout + done.stderr)}
        return json.loads(out.read_text())


def _mfu_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--mfu-model", args.mfu_model, "--mfu-seq", str(args.mfu_seq), "--mfu-long-seq", str(args.mfu_long_seq),
             "--mfu-compile", args.mfu_compile, "--mfu-mbs", str(args.mfu_mbs),
             "--mfu-accum", str(args.mfu_accum), "--mfu-steps", str(args.mfu_steps),
             "--mfu-precision", args.mfu_precision, "--mfu-goal", str(args.mfu_goal),
             "--mfu-profile" if args.mfu_profile else "--no-mfu-profile"]
    return flags + (["--peak-flops", str(args.peak_flops)] if args.peak_flops else [])


def lane(command: str, args: argparse.Namespace) -> dict:
    """Run the parts (or the plan's steps) in order against one deadline, rewriting the document after each."""
    if args.plan:
        budget, steps = plan_steps(args.plan)
    else:
        names = args.parts or list(BENCH_PARTS if command == "bench" else RECORD_PARTS)
        budget, steps = 3600.0, tuple(PlanStep(n, ALL_PARTS[n][0], MIN_START_S, "no estimate") for n in names)
    budget = args.budget_s or budget
    deadline = time.monotonic() + budget
    plan = {"name": args.plan, "budget_s": budget, "steps": [s.record() for s in steps]} if args.plan else None
    path = Path(args.out) / f"{args.stem}-{f'{args.plan}-' if args.plan else ''}{command}.json"
    env, records, left_out = environment(), [], []
    for step in steps:
        left = deadline - time.monotonic()
        given = {"args": step.args} if step.args else {}  # which of a part's runs this is (mfu at 8192, ...)
        if left < step.estimate_s:
            left_out.append(step.part)
            records.append({"name": step.part, "status": "skip", "wall_s": 0.0, **given,
                            "reason": f"not started: {max(left, 0):.0f} s of the lane's budget (--budget-s "
                                      f"{budget:.0f}) were left, it needs ~{step.estimate_s:.0f} s"})
        else:
            records.append({**run_part(step.part, argparse.Namespace(**{**vars(args), **step.args}),
                                       min(step.limit_s, left)), **given})
        last = records[-1]
        print(f"{step.part:12s} {last['status']:8s} {last['wall_s']:7.1f} s  {last.get('reason', '')}", flush=True)
        doc = document(command, env, records, plan)
        write_document(path, doc)
    problems = validate(doc)
    if problems:  # the lane's own bug: say it, keep the document
        print("the document does not match its schema:\n  " + "\n  ".join(problems), file=sys.stderr)
    if left_out:
        print(f"left for a rerun (--parts, or the plan with --budget-s): {', '.join(left_out)}")
    print(f"wrote {path}")
    return doc


def _stem() -> str:
    import torch

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower().removeprefix("nvidia ")).strip("-")
    return f"{datetime.date.today().isoformat()}-{slug}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("bench", "record", "_part"))
    parser.add_argument("part", nargs="?", help=argparse.SUPPRESS)  # _part's part
    parser.add_argument("--parts", nargs="+", metavar="PART", help=f"bench: {', '.join(BENCH_PARTS)}; "
                                                                    f"record: {', '.join(RECORD_PARTS)}")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--plan", help=f"bench: run a plan's parts instead ({', '.join(PLANS)})")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop starting parts after this long (default: 3600, or the plan's budget)")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # the tests run the parts on "cpu"
    parser.add_argument("--stem", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    mfu = parser.add_argument_group("mfu part")
    mfu.add_argument("--mfu-model", default="llama3-1b")
    mfu.add_argument("--mfu-seq", type=int, default=2048)
    mfu.add_argument("--mfu-long-seq", type=int, default=8192,
                     help="the compile rows' second sequence length (0: none)")
    mfu.add_argument("--mfu-compile", default="inductor", choices=("inductor", "aot_eager"),
                     help="the compile rows' backend (the tests walk the lane on a CPU with aot_eager)")
    mfu.add_argument("--mfu-mbs", type=int, default=4, help="sequences per micro-batch")
    mfu.add_argument("--mfu-accum", type=int, default=4, help="micro-batches per step")
    mfu.add_argument("--mfu-steps", type=int, default=8)
    mfu.add_argument("--mfu-precision", default="bf16")
    mfu.add_argument("--mfu-goal", type=float, default=0.45)
    mfu.add_argument("--peak-flops", type=float, help="the device's dense peak in FLOP/s (default: lab.calc.hardware)")
    mfu.add_argument("--mfu-profile", action=argparse.BooleanOptionalAction, default=True,
                     help="profile two steps for the kernel-time breakdown (a run of its own)")
    parser.add_argument("--kernels", dest="kernel_names", nargs="+", metavar="KERNEL",
                        help="kernels part: only these kernels of benchmarks/kernels.py (default: all)")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Bad input: one line naming the value and what is valid."""
    valid = BENCH_PARTS if args.command == "bench" else RECORD_PARTS
    if args.command == "_part":
        valid = ALL_PARTS
    for name in args.parts or []:
        if name not in valid:
            raise ValueError(f"--parts {name!r}: {args.command} has {', '.join(valid)}")
    if args.plan is not None:
        if args.command != "bench" or args.parts:
            raise ValueError(f"--plan {args.plan!r} is a list of bench parts: give it to bench, without --parts")
        plan_steps(args.plan)
    for flag in ("mfu_seq", "mfu_mbs", "mfu_accum"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be >= 1")
    if args.mfu_long_seq < 0:
        raise ValueError(f"--mfu-long-seq={args.mfu_long_seq} must be >= 0 (0: no second length)")
    if args.mfu_steps <= MFU_WARMUP_STEPS:
        raise ValueError(f"--mfu-steps={args.mfu_steps} must be > {MFU_WARMUP_STEPS} (the warm-up steps)")
    if not 0 < args.mfu_goal <= 1:
        raise ValueError(f"--mfu-goal={args.mfu_goal} must be in (0, 1]")
    if args.budget_s is not None and args.budget_s <= 0:
        raise ValueError(f"--budget-s={args.budget_s} must be > 0")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        check_args(args)
    except ValueError as error:
        print(f"gpu_lane: {error}", file=sys.stderr)
        return 2
    if args.device == "cuda" and (why := gpu_problem()):
        target = {"bench": "make bench-gpu-36" if args.plan == "issue36" else "make bench-gpu",
                  "record": "make record-gpu"}.get(args.command, "gpu_lane")
        print(NO_GPU.format(command=target, why=why), file=sys.stderr)
        return 2
    args.stem = args.stem or _stem()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.command == "_part":
        result = IN_PROCESS[args.part](args)
        args.json.write_text(json.dumps(result))
        return 0
    doc = lane(args.command, args)
    return 0 if all(p["status"] in ("pass", "skip") for p in doc["parts"]) else 1


if __name__ == "__main__":
    sys.exit(main())
