"""lab's hand-written collectives against torch.distributed's, across message sizes and world sizes.

    python benchmarks/collectives.py                       # gloo on CPU: 1 KB .. 64 MB, 2 and 4 ranks
    python benchmarks/collectives.py --max-mb 4 --world 4  # quicker
    python benchmarks/collectives.py --backend nccl        # GPUs (one per rank)

For every (operation, world size, size) it prints the median time of lab's version and torch's, their
ratio, and the bus bandwidth (nccl-tests' definition). It then fits the alpha-beta model
T = steps*alpha + bytes_on_wire*beta to torch's all-reduce times and prints measured vs model, so one
sees where the latency-bound regime ends.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lab.calc.comms import bus_factor, collective_time, fit_alpha_beta  # noqa: E402
from lab.calc.network import Link  # noqa: E402
from lab.collectives.timing import OPS, time_collectives  # noqa: E402
from lab.distributed import run  # noqa: E402


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MB" if nbytes >= 2**20 else f"{nbytes / 1024:g} KB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--min-kb", type=float, default=1)
    parser.add_argument("--max-mb", type=float, default=64)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    args = parser.parse_args(argv)
    sizes, size = [], int(args.min_kb * 1024)
    while size <= args.max_mb * 2**20:
        sizes.append(size)
        size *= 4
    rows = []
    for world in args.world:
        rows += run(time_collectives, world, OPS, sizes, args.iterations, backend=args.backend, timeout_s=1800)[0]
    print(f"{'op':<15}{'W':>3}{'size':>10}{'lab ms':>10}{'torch ms':>10}{'lab/torch':>11}{'busbw GB/s':>12}")
    for r in rows:
        busbw = r["bytes"] / r["torch_s"] * bus_factor(r["op"], r["ranks"]) / 1e9
        print(f"{r['op']:<15}{r['ranks']:>3}{_size(r['bytes']):>10}{r['lab_s'] * 1e3:>10.2f}{r['torch_s'] * 1e3:>10.2f}"
              f"{r['lab_s'] / r['torch_s']:>11.2f}{busbw:>12.2f}")
    for world in args.world:
        measured = [r for r in rows if r["op"] == "all_reduce" and r["ranks"] == world]
        alpha, beta = fit_alpha_beta([(2 * (world - 1), bus_factor("all_reduce", world) * r["bytes"], r["torch_s"])
                                      for r in measured])
        link = Link("fitted", 1 / beta, alpha, "this run")
        print(f"\nalpha-beta fit to torch's all_reduce at W={world}: alpha = {alpha * 1e6:.0f} us per step, "
              f"1/beta = {1 / beta / 1e9:.2f} GB/s")
        print(f"{'size':>10}{'measured ms':>13}{'model ms':>10}")
        for r in measured:
            model = collective_time("all_reduce", r["bytes"], world, link).time_s
            print(f"{_size(r['bytes']):>10}{r['torch_s'] * 1e3:>13.2f}{model * 1e3:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
