"""Does the config search rank layouts the way they really run? The tiny model on CPU ranks, both ways.

    python benchmarks/search_vs_measured.py                  # 4 and 8 gloo ranks, 8 steps per layout
    python benchmarks/search_vs_measured.py --ranks 4 --steps 12

For each rank count, `lab.calc.search` ranks the layouts of configs/tiny.toml (its sequence length and global
batch) on the `cpu` system of `lab.calc.network` (gloo over loopback: its fitted α and β) with the FLOP/s a
matmul of the model's MLP really reaches here, measured at startup on one thread (every rank runs one thread)
and shared: n ranks on c cores get c/n of it each when n > c. The search's candidates are variants (ZeRO
stage, schedule, micro-batch) of a few families; the search's best layout of each family and pipeline schedule
is run (`--variants` changes that) by `lab.train.run(config, n)`, the loop `python -m lab.train` runs. A
measured step is the median of rank 0's step times after the first 2 (communicators and allocator warm up).
Both rankings of step time are printed side by side with each layout's modelled split (compute, exposed comms
by parallelism, bubble), to see which term misranks, and two Spearman rank correlations (the goal is >= 0.8):
over the search's best layout of each family (which family to pick), and over every layout run (which
family and which pipeline schedule).
The search keeps >= 1024 tokens per CP rank, so with the tiny model's 32-token sequences no CP layout is run.

What to expect: the model is built for GPUs, where a step is large matmuls and bandwidth-bound collectives.
The tiny model's CPU steps are Python dispatch and gloo messages for a few MFLOPs each, modelled at a few ms
and measured at hundreds: the ranking rests on the communication terms alone. Measured on the course's 2-core
machine while other jobs loaded it (load 5-12), over four runs: at 4 ranks rho = 0.89-0.94 over the families and
0.50-0.94 over every layout run; at 8 ranks 0.50-0.81 and 0.49-0.65. What holds: pure data parallelism
was measured fastest in every run (the search has it in its top 4), and tensor parallelism's per-layer
collectives (32 a step at α = 0.5 ms for tp=2) put the tp=4 layouts at or near the bottom of both rankings.
What misranks is the pipeline: at 8 ranks the search's first, dp4 · pp2, ran 2-3.5x slower than
dp8 and dp2 · pp4 in every run, where it models 1 ms of sends and < 1 ms of bubble; and the bubble term's
order of the schedules (ZB-H1 < interleaved < 1F1B) is not measured here, where 1F1B is often the fastest.
Eight one-thread ranks share two cores: a stage that waits for its neighbour does not idle a GPU, its
neighbour must first be scheduled, so a pipeline's many small sends each cost a scheduler time slice rather
than α, and the extra ops of ZB-H1 and interleaving cost Python dispatch, which the model has no term for.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from lab import train as lab_train  # noqa: E402
from lab.calc.hardware import Accelerator  # noqa: E402
from lab.calc.search import Candidate, SearchResult, search  # noqa: E402
from lab.config import Config, load_config  # noqa: E402

CONFIG = ROOT / "configs" / "tiny.toml"
WARMUP = 2  # steps left out of the median
GOAL = 0.8
TERMS = ("compute", "tp", "cp", "ep", "pp", "dp", "bubble")


def matmul_flops(m: int, k: int, n: int, repeats: int = 50) -> float:
    """FLOP/s of an (m x k) @ (k x n) fp32 matmul on one thread: the median of `repeats` timings."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(m, k), torch.randn(k, n)
        for _ in range(5):
            a @ b
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return 2 * m * k * n / statistics.median(times)


def cpu_accelerator(flops_one_thread: float, ranks: int) -> Accelerator:
    """One rank as the search sees it: its share of the cores' measured FLOP/s, its share of the RAM."""
    cores = os.cpu_count() or 1
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    share = min(1.0, cores / ranks)
    return Accelerator(f"CPU rank ({share:.2g} of a core)", flops_one_thread * share, None, None, ram // ranks,
                       1e10, "measured: one thread's fp32 matmul FLOP/s x the rank's share of the cores "
                             "(HBM bandwidth unused by the search)")


VARIANTS = {  # which of the search's candidates are run: the best of each group, in the search's order
    "family": lambda c: c.family,
    "schedule": lambda c: (c.family, c.parallel.pp_schedule),  # each pipeline schedule of a family too
    "all": lambda c: (c.layout, c.mbs),
}


def best_of_each(result: SearchResult, variants: str) -> list[Candidate]:
    """The search's best layout of each group of `VARIANTS[variants]`, in its ranking order."""
    seen, chosen = set(), []
    for c in result.candidates:
        key = VARIANTS[variants](c)
        if key not in seen:
            seen.add(key)
            chosen.append(c)
    return chosen


def measured_step_s(base: Config, candidate: Candidate, ranks: int, steps: int) -> float:
    """Rank 0's median seconds per step under lab.train, after the first WARMUP steps."""
    train = dataclasses.replace(base.train, steps=steps, device="cpu")
    config = dataclasses.replace(base, parallel=candidate.parallel, train=train)
    logs = lab_train.run(config, ranks, verbose=False)
    tokens = train.global_batch * train.seq_len
    return statistics.median(tokens / log.tokens_per_s for log in logs[WARMUP:])


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
    """Spearman's rank correlation: the Pearson correlation of the ranks."""
    rx, ry = ranks_of(x), ranks_of(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (sx * sy)


def compare(base: Config, ranks: int, flops: float, steps: int, variants: str) -> dict[str, float]:
    """Run the layouts the search proposes at `ranks` and print both rankings; the Spearman correlation over
    the search's best layout of each family, and over every layout run."""
    result = search(base.model, ranks, gpus_per_node=ranks, hardware=cpu_accelerator(flops, ranks), system="cpu",
                    seq=base.train.seq_len, global_batch_tokens=base.train.global_batch * base.train.seq_len,
                    efficiency=1.0)
    layouts = best_of_each(result, variants)
    print(f"\n{ranks} ranks: {len(result.candidates)} layouts fit and run, in "
          f"{len({c.family for c in result.candidates})} families; running {len(layouts)} (the search's best of each "
          f"{'layout' if variants == 'all' else variants}), {steps} steps each")
    modelled, measured, names = [], [], []
    for c in layouts:
        name = f"{c.layout} mbs{c.mbs}"
        try:
            seconds = measured_step_s(base, c, ranks, steps)
        except Exception as err:  # a layout that fails to run is a row, not the end of the benchmark
            print(f"  {name:<42} failed: {str(err).splitlines()[0]}")
            continue
        modelled.append(c.time.total)
        measured.append(seconds)
        names.append((name, c))
        print(f"  {name:<42} modelled {c.time.total * 1e3:7.2f} ms   measured {seconds * 1e3:7.2f} ms", flush=True)
    model_rank, measured_rank = ranks_of(modelled), ranks_of(measured)
    header = "  ".join(f"{t:>7}" for t in TERMS)
    print(f"\n  {'layout':<42} {'search':>6} {'measured':>8}   modelled ms: {header}   measured ms")
    for i in sorted(range(len(names)), key=measured_rank.__getitem__):
        name, c = names[i]
        split = "  ".join(f"{getattr(c.time, t) * 1e3:7.2f}" for t in TERMS)
        print(f"  {name:<42} {model_rank[i]:>6g} {measured_rank[i]:>8g}                {split}   "
              f"{measured[i] * 1e3:9.2f}")
    families, seen = [], set()  # the first run of each family: the search's best of it
    for i, (_, c) in enumerate(names):
        if c.family not in seen:
            seen.add(c.family)
            families.append(i)
    rhos = {"families": _rho([modelled[i] for i in families], [measured[i] for i in families]),
            "layouts": _rho(modelled, measured)}
    print(f"\n  Spearman rank correlation, {ranks} ranks (goal {GOAL}):\n"
          f"    the search's best of each family, {len(families)} layouts: {rhos['families']:.3f}\n"
          f"    every layout run, {len(names)} layouts:{' ' * 16}{rhos['layouts']:.3f}")
    return rhos


def _rho(x: list[float], y: list[float]) -> float:
    return spearman(x, y) if len(x) > 1 else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8], help="gloo rank counts (default 4 8)")
    parser.add_argument("--steps", type=int, default=8, help=f"steps per layout (the first {WARMUP} are not timed)")
    parser.add_argument("--variants", choices=list(VARIANTS), default="schedule",
                        help="run the search's best layout of each family, of each family and pipeline schedule "
                             "(default), or every candidate (slow: about 100 runs)")
    args = parser.parse_args(argv)
    if args.steps <= WARMUP:
        parser.error(f"--steps={args.steps} must be > {WARMUP} (the warm-up steps are left out)")
    base = load_config(CONFIG)
    d, ffn = base.model.d_model, base.model.d_ff
    flops = matmul_flops(base.train.global_batch * base.train.seq_len, d, ffn)
    print(f"{base.model.name}: seq {base.train.seq_len}, global batch {base.train.global_batch} sequences; one "
          f"thread's fp32 matmul ({base.train.global_batch * base.train.seq_len} x {d} x {ffn}): "
          f"{flops / 1e9:.2f} GFLOP/s; {os.cpu_count()} cores")
    results = {ranks: compare(base, ranks, flops, args.steps, args.variants) for ranks in args.ranks}
    print("\nSpearman, best of each family: " + ", ".join(f"{n} ranks {r['families']:.3f}" for n, r in results.items())
          + "; every layout run: " + ", ".join(f"{n} ranks {r['layouts']:.3f}" for n, r in results.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
