"""Pipeline schedules: the simulator's prediction against the same schedule run on gloo ranks.

    python benchmarks/pipeline.py                    # pp 2 and 4, every schedule, 50 ms per unit of work
    python benchmarks/pipeline.py --unit 0.02 --pp 4

Each op sleeps its share of a synthetic cost (t_f = 1, t_b = 2, t_w = 1 units) on top of the tiny model's real
compute, so that on a laptop the stages are visible as they would be on GPUs. The table gives the measured
makespan of one step (the last op's end on any rank, from a common barrier), the simulator's makespan for
the same costs, and their ratio; the goal is within 10%. The remainder is real compute and p2p latency,
which the simulator does not know.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lab.calc.bubble import simulate  # noqa: E402
from lab.calc.schedules import make_schedule  # noqa: E402
from lab.config import PRESETS  # noqa: E402
from lab.distributed import run  # noqa: E402
from lab.parallel.pp import timed_step  # noqa: E402

CFG = dataclasses.replace(PRESETS["tiny"], n_layers=8, vocab_size=96)
CASES = [("afab", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--grad-accum", "--microbatches", dest="grad_accum", type=int, default=8,
                        help="micro-batches per step (lab train's name; --microbatches is the old one)")
    parser.add_argument("--unit", type=float, default=0.05, help="seconds per unit of synthetic work")
    args = parser.parse_args()
    tf, tb, tw = 1.0 * args.unit, 2.0 * args.unit, 1.0 * args.unit
    print(f"tiny model, {args.grad_accum} micro-batches, t_f={tf * 1e3:.0f} ms, t_b={tb * 1e3:.0f} ms "
          f"(t_w={tw * 1e3:.0f} ms for zb-h1) of synthetic work per op")
    print(f"{'pp':>3} {'schedule':>12} {'measured s':>11} {'simulated s':>12} {'ratio':>6} {'bubble (sim)':>13}")
    for pp in args.pp:
        for name, chunks in CASES:
            schedule = make_schedule(name, pp, args.grad_accum, chunks)
            timings = run(timed_step, pp, CFG, schedule, tf, tb, tw, timeout_s=600)
            measured = max(t.end for rank in timings for t in rank)
            sim = simulate(schedule, tf, tb, tw)
            print(f"{pp:>3} {name:>12} {measured:>11.3f} {sim.makespan:>12.3f} {measured / sim.makespan:>6.2f} "
                  f"{sim.bubble_ratio:>13.3f}")


if __name__ == "__main__":
    main()
