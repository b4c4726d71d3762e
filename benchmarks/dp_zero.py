"""lab's data parallelism and ZeRO against torch's DDP and FSDP2: step time and memory, on the same ranks.

    python benchmarks/dp_zero.py                          # gloo on CPU, 2 and 4 ranks
    python benchmarks/dp_zero.py --world 4 --d-model 512 --steps 10
    python benchmarks/dp_zero.py --backend nccl           # GPUs, one per rank

Every variant trains the same model on the same batches with the same loop (`lab.parallel.dp`'s), each in
freshly started ranks. Per variant and world size it prints the median step time of the slowest rank, the
lab/torch ratio for the two pairs that do the same job (BucketedDP vs DDP, ZeRO-3 vs FSDP2), the model
state one rank holds right after the optimizer step (parameters, gradients, optimizer states; measured on
live tensors) and the rank's peak memory during the timed steps (CPU: peak RSS minus the RSS before the
model was built, so activations, gathered units and allocator slack count; GPU: max_memory_allocated).
"""

from __future__ import annotations

import argparse
import ctypes
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lab.config import ModelConfig, TrainConfig  # noqa: E402
from lab.data import SyntheticTokens, shard_rows  # noqa: E402
from lab.distributed import run  # noqa: E402
from lab.model import build_model, materialize, num_params  # noqa: E402
from lab.parallel.dp import TorchDDP  # noqa: E402
from lab.parallel.optim import adamw, clip_grad_norm  # noqa: E402
from lab.parallel.zero import TorchFSDP2, make_data_parallel  # noqa: E402

VARIANTS = ("naive", "overlapped", "bucketed", "ddp", "zero1", "zero2", "zero3", "fsdp2")
PAIRS = (("bucketed", "ddp"), ("zero3", "fsdp2"))


def _engine(kind: str, model: torch.nn.Module, bucket_mb: float):
    if kind == "ddp":
        return TorchDDP(model, None, bucket_mb)
    if kind == "fsdp2":
        return TorchFSDP2(model, None)
    zero = int(kind[-1]) if kind.startswith("zero") else 0
    return make_data_parallel(model, None, zero=zero, dp_mode="naive" if zero else kind, bucket_mb=bucket_mb)


def _return_freed_memory() -> None:
    """glibc keeps freed blocks for reuse (and raises its mmap threshold after large frees), so RSS would not
    fall when a tensor is freed; a fixed 64 KiB threshold maps every large tensor and unmaps it when freed."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD
    except OSError:  # not glibc: peaks include freed memory
        pass


def _rss_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM (peak RSS) := current RSS


def bench(kind: str, model_config: ModelConfig, train: TrainConfig, steps: int, warmup: int, bucket_mb: float) -> dict:
    """One variant on this rank: step times, model state after the step, peak memory of the timed steps."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    if device.type == "cpu":
        _return_freed_memory()
    baseline = 0 if device.type == "cuda" else 1024 * _rss_kib("VmRSS")
    engine = _engine(kind, materialize(build_model(model_config), device, seed=0), bucket_mb)
    optimizer = adamw(engine.parameters(), train.lr, train.weight_decay)
    data = SyntheticTokens(model_config.vocab_size, train.seq_len, train.global_batch)
    times, state = [], {}
    for step in range(warmup + steps):
        if step == warmup:
            _reset_peak(device)
        x, y = (shard_rows(t, rank, world).to(device) for t in data.next_batch())
        dist.barrier()
        start = time.perf_counter()
        F.cross_entropy(engine.model(x).flatten(0, 1), y.flatten()).backward()
        engine.finish()
        clip_grad_norm(engine.parameters(), train.grad_clip)
        optimizer.step()
        engine.after_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        state = engine.resident_bytes(optimizer)  # before zero_grad: the gradients are still held
        engine.zero_grad()
    slowest = torch.tensor(times[warmup:], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 1024 * _rss_kib("VmHWM") - baseline
    return {"step_s": statistics.median(slowest.tolist()), "state": state, "peak": peak}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="global batch in sequences")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    args = parser.parse_args(argv)
    model = ModelConfig.from_preset("tiny", d_model=args.d_model, n_layers=args.layers, vocab_size=args.vocab,
                                    d_ff=int(args.d_model * 8 / 3), head_dim=args.d_model // 4,
                                    max_seq_len=args.seq_len)
    train = TrainConfig(global_batch=args.batch, seq_len=args.seq_len)
    print(f"model: {num_params(build_model(model)):,} parameters ({args.layers} layers, d_model {args.d_model}); "
          f"{args.batch} x {args.seq_len} tokens per step; bucket {args.bucket_mb:g} MiB; backend {args.backend}")
    print(f"{'W':>2} {'variant':<11}{'step ms':>9}{'vs torch':>10}{'params MB':>11}{'grads MB':>10}"
          f"{'optim MB':>10}{'peak MB':>9}")
    for world in args.world:
        results = {kind: run(bench, world, kind, model, train, args.steps, args.warmup, args.bucket_mb,
                             backend=args.backend, timeout_s=1800)[0] for kind in args.variants}
        torch_of = {lab: reference for lab, reference in PAIRS if reference in results}
        for kind, r in results.items():
            ratio = f"{r['step_s'] / results[torch_of[kind]]['step_s']:.2f}x" if kind in torch_of else ""
            mb = {category: value / 2**20 for category, value in r["state"].items()}
            print(f"{world:>2} {kind:<11}{r['step_s'] * 1e3:>9.1f}{ratio:>10}{mb['params']:>11.2f}{mb['grads']:>10.2f}"
                  f"{mb['optimizer']:>10.2f}{r['peak'] / 2**20:>9.1f}")
    print("vs torch: lab's step time / torch's (bucketed vs DDP, zero3 vs FSDP2); MB are MiB of rank 0. "
          "CPU timings on a loaded machine vary by up to 2x: compare within one run.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
