"""`python -m lab sweep`: run a grid of layouts as short `lab.train` runs and set what each measured beside what
`lab.calc.search` predicts for it — the cost model checked on your own machine or cluster.

    python -m lab sweep --config configs/tiny.toml --nproc 4 --top 4 --steps 8 --out sweep        # local ranks
    python -m lab sweep --config configs/tiny.toml --nproc 4 --layout dp=4 --layout tp=2,sp=true --out sweep
    python -m lab sweep --config configs/llama3-8b.toml --nproc 16 --gpus-per-node 8 --top 5 --steps 20 \\
        --launch slurm --partition gpu --out sweep-8b          # writes sweep-8b/sweep.sbatch, a layout a task
    sbatch sweep-8b/sweep.sbatch                               # then, once its tasks are done:
    python -m lab sweep --collect sweep-8b

The layouts are the search's top k (`--top K`: `lab.calc.search.search` for the config's model, sequence and
global batch on `--hardware`; on a CPU the `cpu` system of `lab.calc.network`, gloo over loopback, and the FLOP/s
that one thread's matmul of the model's MLP reaches here, shared by the ranks that share the cores) or given ones
(`--layout`, repeatable: fields of [parallel]; dp left out is the ranks tp x cp x pp leave, as in lab.train). Each
runs `--steps` steps of `lab.train`, writing its per-step JSON log (`--log-json`) under DIR/logs/: on local ranks
(`lab.trainer.run`: gloo on a CPU, NCCL on a GPU box), or on a cluster from a torchrun line per layout
(DIR/torchrun.txt) and a Slurm job array whose task i runs layout i (DIR/sweep.sbatch,
`lab.distributed.slurm.array_script`). Either way the numbers are read back from those logs (`--collect DIR`, which
a local sweep does itself) into DIR/sweep.json: per layout the predicted step time and its split (compute, exposed
communication by parallelism, bubble), the measured median step time after `--warmup` steps, tokens/s, peak memory
where the device reports it (CUDA), and measured / predicted; then DIR/sweep.png (a heatmap: layouts x predicted
and measured throughput), a table, and Spearman's rho of the two rankings. DIR/plan.json is what was asked for and
predicted, written before any run, so that `--collect` works on a cluster's logs days later.

What a CPU can validate, and what it cannot. The model is built for GPUs, where a step is large matmuls and
bandwidth-bound collectives. The tiny model's CPU step is Python dispatch and gloo messages around a few MFLOPs:
modelled at a few ms and measured at hundreds, so measured / predicted is far from 1 and says nothing of the
compute term. One-thread ranks on 2 cores queue for the cores: a pipeline's many small sends each cost a scheduler
time slice rather than α, and the extra ops of interleaving and ZB-H1 cost dispatch, which the model has no term
for. What remains is the ranking, and it rests on the communication terms: how many collectives a layout makes and
over which group (data parallelism fastest, TP's per-layer collectives slowest; benchmarks/search_vs_measured.py
records the numbers). Throughput, the compute and overlap terms and memory (measured on CUDA only) need a GPU;
the inter-node terms, a cluster.

What belongs here: choosing the layouts, running or scripting them, reading their logs back, comparing. The cost
model is lab.calc.search's, the loop lab.trainer's, the Slurm script's pieces lab.distributed.slurm's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from lab.calc.hardware import Accelerator
from lab.calc.search import Candidate, SearchResult, search
from lab.config import Config, ParallelConfig, TrainConfig, check_supported, parse_override, read_config
from lab.distributed import slurm
from lab.layout import describe, infer_dp
from lab.measure.cpu import copy_bandwidth, matmul_flops
from lab.outputs import check_output_dir

PROG = "python -m lab sweep"
PLAN, RESULT, PLOT = "plan.json", "sweep.json", "sweep.png"  # under --out: asked and predicted, compared, drawn
TORCHRUN, SBATCH, LOGS = "torchrun.txt", "sweep.sbatch", "logs"  # a torchrun line per layout, the job array, logs
WARMUP = 2  # steps left out of the median: communicators are built and the allocator warms up in the first ones
LAYOUT_KEYS = tuple(f.name for f in dataclasses.fields(ParallelConfig))
ALIASES = {"pp_chunks": "pp_virtual_stages"}  # lab.train's flag names the field so
# What a layout pins when the search predicts it (its `fixed`): the settings the search varies; mbs follows.
PINNED = ("dp", "tp", "pp", "cp", "ep", "zero", "pp_schedule", "pp_virtual_stages", "recompute", "grad_accum")


@dataclass(frozen=True)
class Layout:
    """One run of the sweep: the `--set parallel.*` overrides that make it (on top of the config and its
    overrides), the config lab.train will build from them, and the search's prediction (None: not modelled)."""

    sets: tuple[str, ...]
    config: Config
    predicted: Candidate | None
    note: str = ""  # what the search modelled for it, or why it has no prediction

    @property
    def spec(self) -> str:
        """The `--layout` form, e.g. "dp=2,tp=2,sp=true"."""
        return ",".join(s.removeprefix("parallel.") for s in self.sets)


def _value(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def layout_sets(parallel: ParallelConfig, base: ParallelConfig) -> tuple[str, ...]:
    """The overrides that turn the config's [parallel] into `parallel`: dp always (lab.train would otherwise infer
    it), then every field that differs."""
    changed = [k for k in LAYOUT_KEYS if k != "dp" and getattr(parallel, k) != getattr(base, k)]
    return tuple(f"parallel.{k}={_value(getattr(parallel, k))}" for k in ("dp", *changed))


def parse_layout(text: str, ranks: int, base: dict) -> tuple[str, ...]:
    """`--layout "dp=2,tp=2"` as overrides of [parallel], dp inferred from `ranks` when not given. `base` is the
    config's [parallel] section as read. ValueError, one line, for an unknown key or degrees that do not make
    `ranks`."""
    values: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, raw = item.partition("=")
        key = ALIASES.get(key.strip().replace("-", "_"), key.strip().replace("-", "_"))
        if not raw or key not in LAYOUT_KEYS:
            why = f"unknown key {key!r}" if raw else f"{item!r} is not key=value"
            raise ValueError(f"--layout {text!r}: {why}; valid keys: {', '.join(LAYOUT_KEYS)}, pp_chunks")
        values[key] = parse_override(f"parallel.{key}={raw.strip()}")[2]
    if "dp" not in values:
        dp = infer_dp(ranks, {**base, **values})
        if dp is None:
            raise ValueError(f"--layout {text!r}: tp*cp*pp must be integers dividing --nproc={ranks}")
        values = {"dp": dp, **values}
    degrees = [values.get(k, base.get(k, 1)) for k in ("dp", "tp", "cp", "pp")]
    if all(isinstance(d, int) for d in degrees) and math.prod(degrees) != ranks:  # else Config says what is wrong
        raise ValueError(f"--layout {text!r}: dp*tp*cp*pp = {'*'.join(map(str, degrees))} = {math.prod(degrees)}, "
                         f"but --nproc={ranks}")
    return tuple(f"parallel.{k}={_value(v)}" for k, v in values.items())


def short_run(train: TrainConfig, steps: int) -> list[str]:
    """The overrides that make a config's run `steps` long. A learning-rate warm-up longer than that (Llama 3 8B's
    is 200 steps) is cut to it: the learning rate does not change a step's time."""
    return [f"train.steps={steps}", *([f"train.warmup_steps={steps}"] if train.warmup_steps > steps else [])]


def run_config(config_path: str, overrides: list[str], sets: tuple[str, ...]) -> Config:
    """The config lab.train builds from these arguments (`train_args`), validated and runnable."""
    config = Config.from_dict(read_config(config_path, [*overrides, *sets]))
    check_supported(config)
    return config


def train_args(plan: dict, layout: dict) -> list[str]:
    """`python -m lab.train`'s arguments for one layout of a plan: the config, its overrides (the run's length
    among them), the layout, and the JSON log the sweep reads back."""
    sets = [*plan["overrides"], *layout["sets"]]
    return ["--config", plan["config"], *(a for s in sets for a in ("--set", s)),
            "--log-json", os.path.join(plan["out"], layout["log"])]


def cpu_accelerator(flops_one_thread: float, ranks: int) -> Accelerator:
    """One CPU rank as the search sees it: its share of the cores' measured FLOP/s and copy bandwidth (n ranks on
    c cores get c/n of a core each when n > c; the search prices element-wise work from the bandwidth), its share
    of the RAM."""
    cores = os.cpu_count() or 1
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    share = min(1.0, cores / ranks)
    return Accelerator(f"CPU rank ({share:.2g} of a core)", flops_one_thread * share, None, None, ram // ranks,
                       copy_bandwidth() * share, "measured: one thread's fp32 matmul FLOP/s and copy bandwidth x "
                                                 "the rank's share of the cores")


@dataclass(frozen=True)
class Pricing:
    """Where the search prices the layouts: an accelerator (a `lab.calc.hardware` name, or a measured CPU rank),
    the network (`lab.calc.network`; None: the one named like the hardware), the node size, the matmul efficiency."""

    hardware: str | Accelerator
    system: str | None
    gpus_per_node: int
    efficiency: float | None  # None: the search's default

    @classmethod
    def cpu(cls, base: Config, ranks: int, flops: float | None = None, system: str = "cpu") -> Pricing:
        """CPU ranks: the FLOP/s of the model's MLP matmul, measured here (`flops`, if already measured), taken
        as they are (efficiency 1), on gloo's loopback network."""
        tokens = base.train.global_batch * base.train.seq_len
        flops = flops or matmul_flops(tokens, base.model.d_model, base.model.d_ff)
        return cls(cpu_accelerator(flops, ranks), system, ranks, 1.0)

    def search(self, base: Config, ranks: int, fixed: dict | None = None) -> SearchResult:
        t = base.train
        extra = {} if self.efficiency is None else {"efficiency": self.efficiency}
        return search(base.model, ranks, self.gpus_per_node, self.hardware, t.seq_len, t.global_batch * t.seq_len,
                      system=self.system, fixed=fixed, **extra)

    @property
    def name(self) -> str:
        return self.hardware if isinstance(self.hardware, str) else self.hardware.name


def predict(pricing: Pricing, base: Config, ranks: int, parallel: ParallelConfig) -> tuple[Candidate | None, str]:
    """The search's candidate for a given layout (pinned to its settings), or None and why not."""
    result = pricing.search(base, ranks, {k: getattr(parallel, k) for k in PINNED})
    if result.candidates:
        c = result.candidates[0]
        return c, f"modelled as {c.layout} (mbs {c.mbs})"
    why = "; ".join(f"{family}: {r.main_reason()[1]}" for family, r in result.rejected_families().items())
    return None, f"the search keeps no such layout ({why or 'not enumerated: see lab.calc.search'})"


def given_layouts(config_path: str, overrides: list[str], specs: list[str], ranks: int,
                  pricing: Pricing) -> list[Layout]:
    base = read_config(config_path, overrides).get("parallel", {})
    layouts = []
    for spec in specs:
        sets = parse_layout(spec, ranks, base)
        try:
            config = run_config(config_path, overrides, sets)
        except ValueError as err:
            raise ValueError(f"--layout {spec!r}: {err}") from None
        layouts.append(Layout(sets, config, *predict(pricing, config, ranks, config.parallel)))
    return layouts


def candidate_layouts(config_path: str, overrides: list[str], candidates: list[Candidate]) -> list[Layout]:
    """The search's candidates as runs of the config (its global batch is the search's)."""
    base = Config.from_dict(read_config(config_path, overrides)).parallel
    layouts = []
    for i, c in enumerate(candidates):
        sets = layout_sets(c.parallel, base)
        layouts.append(Layout(sets, run_config(config_path, overrides, sets), c,
                              f"the search's #{i + 1}: {c.layout} (mbs {c.mbs})"))
    return layouts


def _slug(spec: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in spec)[:60]


def make_plan(config_path: str, overrides: list[str], ranks: int, steps: int, warmup: int, layouts: list[Layout],
              pricing: Pricing, out: str, command: str) -> dict:
    """What the sweep runs and predicts, as plan.json holds it: everything `collect` needs besides the logs."""
    base = layouts[0].config
    rows = []
    for i, layout in enumerate(layouts):
        c = layout.predicted
        predicted = None if c is None else {
            "step_s": c.time.total, "split_s": c.time.as_dict(), "tokens_per_s": c.tokens_per_s, "mfu": c.mfu,
            "memory_bytes": c.memory.per_gpu["total"], "search_layout": c.layout, "mbs": c.mbs}
        rows.append({"index": i, "spec": layout.spec, "layout": describe(layout.config.parallel, grad_accum=True),
                     "sets": list(layout.sets), "parallel": dataclasses.asdict(layout.config.parallel),
                     "log": os.path.join(LOGS, f"{i:02d}-{_slug(layout.spec)}.jsonl"), "predicted": predicted,
                     "note": layout.note})
    return {"command": command, "config": config_path, "overrides": list(overrides), "model": base.model.name,
            "ranks": ranks, "steps": steps, "warmup": warmup, "hardware": pricing.name, "system": pricing.system,
            "gpus_per_node": pricing.gpus_per_node, "tokens_per_step": base.train.global_batch * base.train.seq_len,
            "out": out, "layouts": rows}


def write_plan(plan: dict) -> None:
    """plan.json, the logs' folder, and a torchrun line per layout (to run one by hand on a node, or several)."""
    out = Path(plan["out"])
    (out / LOGS).mkdir(parents=True, exist_ok=True)
    (out / PLAN).write_text(json.dumps(plan, indent=1) + "\n")
    nodes, per_node = max(1, plan["ranks"] // plan["gpus_per_node"]), min(plan["ranks"], plan["gpus_per_node"])
    where = "--standalone" if nodes == 1 else f"--nnodes {nodes} --rdzv-backend c10d --rdzv-endpoint HOST:29500"
    (out / TORCHRUN).write_text("".join(f"torchrun {where} --nproc-per-node {per_node} -m lab.train "
                                        f"{shlex.join(train_args(plan, layout))}\n" for layout in plan["layouts"]))


def run_local(plan: dict) -> dict[int, str]:
    """Each layout on local ranks, one after another; a layout that fails is a row, not the end of the sweep.
    Returns the failures: index -> their first line."""
    from lab.trainer import run

    failures = {}
    for layout in plan["layouts"]:
        config = run_config(plan["config"], plan["overrides"], tuple(layout["sets"]))
        print(f"{PROG}: running {layout['spec']} ({plan['steps']} steps, {plan['ranks']} ranks)", flush=True)
        try:
            run(config, plan["ranks"], os.path.join(plan["out"], layout["log"]), verbose=False)
        except Exception as err:  # noqa: BLE001 - whatever stopped it is reported in its row
            failures[layout["index"]] = f"failed: {(str(err) or type(err).__name__).splitlines()[0]}"
            print(f"{PROG}: {layout['spec']} {failures[layout['index']]}", file=sys.stderr)
    return failures


def slurm_script(plan: dict, args: argparse.Namespace) -> tuple[str, list[str]]:
    """The job array, a layout a task, each layout checked as `lab launch slurm` checks one; and its warnings."""
    job = slurm.SlurmJob(plan["config"], plan["ranks"] // plan["gpus_per_node"], plan["gpus_per_node"],
                         time=args.time, partition=args.partition, account=args.account,
                         job_name=f"lab-sweep-{Path(plan['config']).stem}",
                         log=os.path.join(plan["out"], LOGS, "slurm-%A_%a.out"))
    warnings = []
    for layout in plan["layouts"]:
        sets = (*plan["overrides"], *layout["sets"])
        warnings += slurm.check_layout(dataclasses.replace(job, overrides=sets))[1]
    tasks = [train_args(plan, layout) for layout in plan["layouts"]]
    return slurm.array_script(job, tasks, plan["command"]), list(dict.fromkeys(warnings))


def measured_of(path: Path, tokens_per_step: int, warmup: int) -> tuple[dict | None, str]:
    """Rank 0's per-step log as lab.train wrote it: the median step after `warmup`, or None and why not."""
    if not path.is_file():
        return None, "no log: not run yet, or it failed before its first step"
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    timed = [tokens_per_step / s["tokens_per_s"] for s in steps if s["step"] > warmup and s["tokens_per_s"] > 0]
    if not timed:
        return None, f"{len(steps)} step(s) logged, none after the {warmup} warm-up step(s)"
    step_s = statistics.median(timed)
    peaks = [s["peak_bytes"] for s in steps if s.get("peak_bytes") is not None]
    return {"step_s": step_s, "tokens_per_s": tokens_per_step / step_s, "peak_bytes": max(peaks, default=None),
            "steps_timed": len(timed), "step_times_s": timed, "final_loss": steps[-1]["loss"]}, "measured"


def ranks_of(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank (as Spearman's rho needs)."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation, the Pearson correlation of the ranks; nan for fewer than two or a constant."""
    if len(x) < 2:
        return math.nan
    rx, ry = ranks_of(x), ranks_of(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sx, sy = sum((a - mx) ** 2 for a in rx) ** 0.5, sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (sx * sy) if sx and sy else math.nan


def collect(out: str, failures: dict[int, str] | None = None) -> dict:
    """Read the sweep's logs back beside its plan; write sweep.json and sweep.png. Returns what sweep.json holds."""
    plan = json.loads(Path(out, PLAN).read_text())
    rows = []
    for layout in plan["layouts"]:
        measured, status = measured_of(Path(out, layout["log"]), plan["tokens_per_step"], plan["warmup"])
        predicted = layout["predicted"]
        both = measured is not None and predicted is not None
        memory = both and measured["peak_bytes"] is not None
        rows.append({**layout, "measured": measured, "status": (failures or {}).get(layout["index"], status),
                     "ratio": measured["step_s"] / predicted["step_s"] if both else None,
                     "memory_ratio": measured["peak_bytes"] / predicted["memory_bytes"] if memory else None})
    compared = [r for r in rows if r["ratio"] is not None]
    model_rank = ranks_of([r["predicted"]["step_s"] for r in compared])
    measured_rank = ranks_of([r["measured"]["step_s"] for r in compared])
    for row in rows:
        row["rank_predicted"] = row["rank_measured"] = None
    for row, m, s in zip(compared, model_rank, measured_rank, strict=True):
        row["rank_predicted"], row["rank_measured"] = m, s
    rho = spearman(model_rank, measured_rank)
    result = {**{k: v for k, v in plan.items() if k != "layouts"}, "layouts": rows, "compared": len(compared),
              "spearman": None if math.isnan(rho) else rho}
    result["plot"] = PLOT if plot(result, Path(out, PLOT)) else None
    Path(out, RESULT).write_text(json.dumps(result, indent=1) + "\n")
    return result


def _measured_order(row: dict) -> float:
    return math.inf if row["rank_measured"] is None else row["rank_measured"]


def plot(result: dict, path: Path) -> bool:
    """The playbook's heatmap: a row per layout (fastest measured first), its predicted and measured tokens/s,
    each column coloured by its share of the column's best, so that two rankings that agree look alike. Agg, no
    window (matplotlib's Figure without pyplot). False when matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return False
    rows = sorted(result["layouts"], key=_measured_order)
    values = [[(r[k] or {}).get("tokens_per_s", math.nan) for k in ("predicted", "measured")] for r in rows]
    best = [max((v[j] for v in values if not math.isnan(v[j])), default=1.0) for j in (0, 1)]
    fig = Figure(figsize=(6.5, 1.2 + 0.45 * len(rows)), layout="constrained")
    ax = fig.subplots()
    ax.imshow([[v[j] / best[j] for j in (0, 1)] for v in values], cmap="Blues", vmin=0, vmax=1.4, aspect="auto")
    for i, row in enumerate(rows):
        for j, key in enumerate(("predicted", "measured")):
            rank = row[f"rank_{key}"]
            text = "-" if math.isnan(values[i][j]) else f"{values[i][j]:,.0f}" + (f"  #{rank:g}" if rank else "")
            ax.text(j, i, text, ha="center", va="center", fontsize=8)
    labels = [r["spec"] + (f"  (x{r['ratio']:.2g})" if r["ratio"] else "") for r in rows]
    ax.set_xticks([0, 1], ["predicted tokens/s", "measured tokens/s"], fontsize=8)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.set_title(f"{result['model']}, {result['ranks']} ranks on {result['hardware']}: Spearman's rho "
                 f"{_rho(result['spearman'])}\n(#: rank; in brackets: measured / predicted step time)", fontsize=8)
    fig.savefig(path, dpi=120)
    return True


def table(result: dict) -> str:
    """Both rankings side by side, with each layout's modelled split, to see which term misranks."""
    terms = ("compute", "tp", "cp", "ep", "pp", "dp", "bubble")
    width = max(len("layout"), *(len(r["spec"]) for r in result["layouts"]))
    lines = [f"{'layout':<{width}} {'pred':>4} {'meas':>4} {'pred ms':>9} {'meas ms':>9} {'meas/pred':>9} "
             f"{'tokens/s':>9} {'peak GiB':>8}   modelled ms: " + " ".join(f"{t:>7}" for t in terms)]
    for r in sorted(result["layouts"], key=_measured_order):
        p, m = r["predicted"], r["measured"]
        peak = m["peak_bytes"] / 2**30 if m and m["peak_bytes"] is not None else None
        cells = [_cell(r["rank_predicted"], 4, "g"), _cell(r["rank_measured"], 4, "g"),
                 _cell(p and p["step_s"] * 1e3, 9), _cell(m and m["step_s"] * 1e3, 9), _cell(r["ratio"], 9),
                 _cell(m and m["tokens_per_s"], 9, ",.0f"), _cell(peak, 8)]
        split = " ".join(_cell(p and p["split_s"][t] * 1e3, 7) for t in terms)
        lines.append(f"{r['spec']:<{width}} {' '.join(cells)}                {split}"
                     + ("" if r["status"] == "measured" else f"   {r['status']}"))
    lines.append(f"Spearman's rho of the two rankings (step time), {result['compared']} layouts: "
                 f"{_rho(result['spearman'])}")
    return "\n".join(lines)


def _rho(rho: float | None) -> str:
    return "n/a (fewer than two layouts measured)" if rho is None else f"{rho:.3f}"


def _cell(value: float | None, width: int, fmt: str = ".2f") -> str:
    return f"{value:>{width}{fmt}}" if value is not None else f"{'-':>{width}}"


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(f"{message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="TOML run config, as lab.train --config (required unless --collect)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a config field for every layout (repeatable)")
    p.add_argument("--nproc", type=int, help="ranks every layout runs on (required unless --collect)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--top", type=int, metavar="K", help="run the search's best K layouts")
    which.add_argument("--layout", action="append", metavar="KEY=V,...", help="run this layout, e.g. dp=2,tp=2 "
                       "(fields of [parallel]; dp defaults to the ranks tp*cp*pp leave); repeatable")
    p.add_argument("--steps", type=int, default=8, help="steps per layout (default 8)")
    p.add_argument("--warmup", type=int, default=WARMUP, help=f"steps left out of the median (default {WARMUP})")
    p.add_argument("--out", default="sweep", metavar="DIR", help="where plan, logs and results go (default sweep)")
    p.add_argument("--collect", metavar="DIR", help="read back the logs of a sweep planned in DIR (after its "
                   "Slurm jobs ran) and write the comparison; nothing else is needed")
    p.add_argument("--hardware", help="the accelerator the search prices (lab.calc.hardware), or cpu: a CPU rank "
                   "with measured FLOP/s (default: cpu for local ranks without CUDA, else the config's "
                   "train.hardware)")
    p.add_argument("--system", help="the network the search prices (lab.calc.network; default: cpu with "
                   "--hardware cpu, else the one named like the hardware)")
    p.add_argument("--gpus-per-node", type=int, help="ranks per node (default: --nproc, one machine)")
    p.add_argument("--launch", choices=("local", "slurm"), default="local", help="run on local ranks now, or write "
                   "a Slurm job array (DIR/sweep.sbatch) to submit, then --collect DIR")
    p.add_argument("--partition", help="with --launch slurm")
    p.add_argument("--account", help="with --launch slurm")
    p.add_argument("--time", default="00:30:00", help="with --launch slurm: each task's limit (default 00:30:00)")
    return p


def _pricing(args: argparse.Namespace, base: Config) -> Pricing:
    cuda = base.train.device != "cpu" and torch.cuda.is_available()
    hardware = args.hardware or ("cpu" if args.launch == "local" and not cuda else base.train.hardware)
    if hardware == "cpu":
        return Pricing.cpu(base, args.nproc, system=args.system or "cpu")
    return Pricing(hardware, args.system, args.gpus_per_node or args.nproc, None)


def plan_from_args(args: argparse.Namespace, command: str) -> dict:
    """Every check before any rank starts: the flags, the output folder, each layout; then the predictions."""
    if args.config is None or args.nproc is None:
        raise ValueError("--config and --nproc are needed (or --collect DIR)")
    if not (args.top or args.layout):
        raise ValueError("say which layouts: --top K (the search's best) or --layout KEY=V,... (repeatable)")
    for flag, value, low in (("--nproc", args.nproc, 1), ("--top", args.top or 1, 1), ("--warmup", args.warmup, 0),
                             ("--steps", args.steps, args.warmup + 1), ("--gpus-per-node", args.gpus_per_node or 1, 1)):
        if value < low:
            raise ValueError(f"{flag}={value} must be >= {low}" + (" (more than --warmup)" * (flag == "--steps")))
    if args.launch == "slurm" and args.nproc % (args.gpus_per_node or args.nproc):
        raise ValueError(f"--nproc={args.nproc} must be a multiple of --gpus-per-node={args.gpus_per_node} (whole "
                         f"nodes)")
    check_output_dir(args.out, "--out")
    base = Config.from_dict(read_config(args.config, args.overrides))
    overrides = [*args.overrides, *short_run(base.train, args.steps)]
    pricing = _pricing(args, base)
    if args.layout:
        layouts = given_layouts(args.config, overrides, args.layout, args.nproc, pricing)
    else:
        candidates = pricing.search(base, args.nproc).top(args.top)
        if not candidates:
            raise ValueError(f"the search keeps no layout of {base.model.name} on {args.nproc} ranks of "
                             f"{pricing.name}")
        layouts = candidate_layouts(args.config, overrides, candidates)
    return make_plan(args.config, overrides, args.nproc, args.steps, args.warmup, layouts, pricing, args.out,
                     command)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = f"{PROG} {shlex.join(argv)}"
    try:
        args = build_parser().parse_args(argv)
        if args.collect is not None:
            if not Path(args.collect, PLAN).is_file():
                raise ValueError(f"--collect {args.collect}: no {PLAN} there (a sweep's --out writes one)")
            print(table(collect(args.collect)))
            return 0
        plan = plan_from_args(args, command)
        script, warnings = slurm_script(plan, args) if args.launch == "slurm" else (None, [])
        write_plan(plan)
        if script is not None:
            Path(plan["out"], SBATCH).write_text(script)
    except (ValueError, OSError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    for warning in warnings:
        print(f"{PROG}: {warning}", file=sys.stderr)
    if script is not None:
        print(f"wrote {Path(plan['out'], SBATCH)} ({len(plan['layouts'])} tasks) and {Path(plan['out'], TORCHRUN)}; "
              f"submit with: sbatch {Path(plan['out'], SBATCH)}; then: {PROG} --collect {plan['out']}")
        return 0
    result = collect(plan["out"], run_local(plan))
    print(table(result))
    print(f"wrote {Path(plan['out'], RESULT)}" + (f" and {Path(plan['out'], PLOT)}" if result["plot"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
