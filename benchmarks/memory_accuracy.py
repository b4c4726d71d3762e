"""Activation memory of lab.model on a CPU: measured vs the `exact` model vs Korthikanti et al.

    python benchmarks/memory_accuracy.py

For every configuration of `lab.measure.memory.ACCURACY_GRID` (tiny fp32 models varying sequence, batch, width,
heads, KV heads and depth) and every recompute mode (none with the math and with the flash attention
kernel, selective, full), it prints the bytes autograd keeps after forward + loss (saved-tensor hooks,
deduplicated by storage), the `exact` model's prediction and Korthikanti's, with their ratios to the
measurement. Korthikanti counts a GPT layer (4h GeLU MLP, MHA, dropout) with 16-bit activations, so on
lab's fp32 SwiGLU/GQA model it is a different model, not a wrong one: expect ratios well below 1.
tests/test_measure.py holds the bound |exact - measured| <= 2% on the same grid.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from lab.measure.memory import accuracy_rows  # noqa: E402


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # --help; no options
    torch.set_num_threads(min(2, torch.get_num_threads()))
    start = time.perf_counter()
    rows = accuracy_rows()
    elapsed = time.perf_counter() - start
    header = (f"{'seq':>4} {'mbs':>3} {'d':>3} {'a':>3} {'kv':>3} {'L':>2} {'ff':>4}  {'recompute':<15}"
              f"{'measured B':>12} {'exact B':>12} {'korthikanti B':>14} {'exact/meas':>11} {'korth/meas':>11}")
    print(header)
    print("-" * len(header))
    for r in rows:
        mode = r["recompute"] + (" (flash)" if r["flash"] else " (math)" if r["recompute"] == "none" else "")
        print(f"{r['seq']:>4} {r['mbs']:>3} {r['d_model']:>3} {r['n_heads']:>3} {r['n_kv_heads']:>3} "
              f"{r['n_layers']:>2} {r['d_ff']:>4}  {mode:<15}{r['measured']:>12,} {r['exact']:>12,} "
              f"{r['korthikanti']:>14,} {r['exact'] / r['measured']:>11.4f} {r['korthikanti'] / r['measured']:>11.3f}")
    worst = max(abs(r["exact"] - r["measured"]) / r["measured"] for r in rows)
    print(f"\n{len(rows)} measurements in {elapsed:.1f} s; worst |exact - measured| / measured = {worst:.3%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
