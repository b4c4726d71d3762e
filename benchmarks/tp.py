"""Tensor parallelism: lab's plan against torch's DTensor `parallelize_module`, same model, same ranks.

    python benchmarks/tp.py                  # gloo on CPU, tp = 2 and 4
    python benchmarks/tp.py --d-model 512    # a wider model
    python benchmarks/tp.py --backend nccl --d-model 2048 --seq 2048   # GPUs, one per rank (make bench-gpu)

Prints the median forward+backward time of each and their ratio (lab / DTensor), plus the number of
collectives per step. DTensor's plan here is the TorchTitan one for the blocks (Colwise q/k/v/w1/w3,
Rowwise wo/w2); lab additionally splits the embedding and the output layer along the vocabulary.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lab.config import PRESETS  # noqa: E402
from lab.distributed import Mesh, count_collectives, run  # noqa: E402
from lab.model import build_model, materialize  # noqa: E402
from lab.parallel.tp import apply_tensor_parallel, torch_tp_plan, vocab_parallel_cross_entropy  # noqa: E402


def _step_time(step, iterations: int, device: torch.device) -> float:
    times = []
    for i in range(iterations + 1):
        dist.barrier()
        start = time.perf_counter()
        step()
        if device.type == "cuda":  # the step's kernels run asynchronously: it ends when they do
            torch.cuda.synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - start], device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i:
            times.append(elapsed.item())
    return statistics.median(times)


def _compare(cfg, batch: int, seq: int, iterations: int) -> dict:
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = Mesh(tp=dist.get_world_size())
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    ours = apply_tensor_parallel(materialize(build_model(cfg), device, seed=0), mesh.tp_group)
    theirs = materialize(build_model(cfg), device, seed=0)
    parallelize_module(theirs, mesh.device_mesh()["tp"], torch_tp_plan(theirs))

    def lab_step():
        vocab_parallel_cross_entropy(ours(tokens), tokens, mesh.tp_group).backward()

    def torch_step():
        F.cross_entropy(theirs(tokens).flatten(0, 1), tokens.flatten()).backward()

    with count_collectives() as counts:
        lab_step()
    return {"lab_s": _step_time(lab_step, iterations, device), "torch_s": _step_time(torch_step, iterations, device),
            "lab_collectives": sum(counts.calls.values())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    args = parser.parse_args(argv)
    cfg = dataclasses.replace(PRESETS["tiny"], d_model=args.d_model, n_layers=args.layers, n_heads=8, n_kv_heads=4,
                              d_ff=4 * args.d_model, vocab_size=1024, head_dim=0)
    print(f"model: d_model={cfg.d_model}, layers={cfg.n_layers}, heads={cfg.n_heads}/{cfg.n_kv_heads}, "
          f"batch {args.batch} x seq {args.seq}, fp32, {args.backend}")
    print(f"{'tp':>3}{'lab ms':>10}{'DTensor ms':>12}{'lab/DTensor':>13}{'lab collectives':>17}")
    for tp in args.tp:
        r = run(_compare, tp, cfg, args.batch, args.seq, args.iterations, backend=args.backend, timeout_s=1800)[0]
        print(f"{tp:>3}{r['lab_s'] * 1e3:>10.1f}{r['torch_s'] * 1e3:>12.1f}{r['lab_s'] / r['torch_s']:>13.2f}"
              f"{r['lab_collectives']:>17}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
