"""Checkpoint cost: how long a save blocks training, and how long until it is on disk, synchronous vs asynchronous.

    python benchmarks/checkpoint.py                      # 2 gloo ranks on CPU, ZeRO-3, d_model 512
    python benchmarks/checkpoint.py --world 4 --d-model 768 --layers 6 --zero 0 --dir /fast/disk

Each rank builds its part of the run as `lab.train` does, takes one optimizer step (so that AdamW's moments
exist), then saves it with `lab.checkpoint` several times each way. Per mode it prints the median over saves of
the slowest rank's blocking time (what training waits for: for a synchronous save the whole save; for an
asynchronous one the planning and the copy of the state to CPU memory) and of the total time until the
checkpoint is complete and renamed, each also in ms per GB (1e9 bytes) of tensors in the checkpoint.

Integrity costs, on the last checkpoint: `verify` is what resume and `inspect` pay (read every file and compare
its sha256 with lab.json's, in threads, from the page cache here: a cold disk adds its read time), and `sha256`
is the hashing alone over the same bytes in memory, which is what a save adds: each rank hashes its files as DCP
writes them (in the background thread when asynchronous), so the slowest rank pays its share of it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lab import checkpoint  # noqa: E402
from lab.config import Config  # noqa: E402
from lab.data import SyntheticTokens  # noqa: E402
from lab.distributed import run  # noqa: E402
from lab.model import build_model, num_params  # noqa: E402
from lab.parallel.optim import adamw  # noqa: E402
from lab.parallel.parallelize import build_mesh, parallelize  # noqa: E402


def _worker(config: Config, directory: str, saves: int) -> dict[str, list[tuple[float, float]]]:
    par = parallelize(config.model, build_mesh(config.parallel), config.parallel, torch.device("cpu"), 0,
                      config.train.seq_len)
    optimizer = adamw(par.parameters(), 1e-3, 0.1)
    for param in par.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    data = SyntheticTokens(config.model.vocab_size, config.train.seq_len, config.train.global_batch)
    group = dist.new_group(backend="gloo")
    times: dict[str, list[tuple[float, float]]] = {"sync": [], "async": []}
    for i in range(saves):
        for mode in times:
            dist.barrier()
            start = time.perf_counter()
            pending = checkpoint.start_save(directory, i, par, optimizer, scheduler, data, config, group,
                                            asynchronous=mode == "async")
            blocking = time.perf_counter() - start
            checkpoint.finish_save(pending)
            times[mode].append((blocking, time.perf_counter() - start))
            if dist.get_rank() == 0 and i < saves - 1:  # the last one stays, for the integrity costs
                shutil.rmtree(pending.final)
    return times


def _integrity_ms(path: str) -> tuple[float, float]:
    """(verify: read and check every file as resume does, sha256 alone over the same bytes in memory), in ms."""
    checkpoint._INTACT.clear()  # a verdict this process remembers would skip the reading
    start = time.perf_counter()
    assert checkpoint._damage(path) is None
    verify = time.perf_counter() - start
    blobs = [open(os.path.join(path, name), "rb").read() for name in os.listdir(path) if name != checkpoint.LAB_FILE]
    start = time.perf_counter()
    for blob in blobs:
        hashlib.sha256(blob).hexdigest()
    return verify * 1e3, (time.perf_counter() - start) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--zero", type=int, default=3, choices=(0, 1, 2, 3))
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    args = parser.parse_args(argv)
    config = Config.from_dict({"model": {"preset": "tiny", "d_model": args.d_model, "n_layers": args.layers,
                                         "n_heads": 8, "n_kv_heads": 4, "d_ff": 4 * args.d_model},
                               "parallel": {"dp": args.world, "zero": args.zero},
                               "train": {"global_batch": args.world, "seq_len": 32}})
    directory = tempfile.mkdtemp(prefix="lab-ckpt-bench-", dir=args.dir)
    try:
        results = run(_worker, args.world, config, directory, args.saves, timeout_s=1200)
        gb = 3 * 4 * num_params(build_model(config.model)) / 1e9  # parameters and AdamW's two moments, fp32
        verify, sha = _integrity_ms(checkpoint.complete_checkpoints(directory)[-1])
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"{args.world} gloo rank(s), zero={args.zero}, {gb:.3f} GB of tensors per checkpoint, "
          f"median of {args.saves} saves, slowest rank")
    print(f"{'mode':<6} {'blocking ms':>12} {'total ms':>10} {'blocking ms/GB':>15} {'total ms/GB':>12}")
    for mode in ("sync", "async"):
        blocking = statistics.median(max(r[mode][i][0] for r in results) for i in range(args.saves)) * 1e3
        total = statistics.median(max(r[mode][i][1] for r in results) for i in range(args.saves)) * 1e3
        print(f"{mode:<6} {blocking:>12.1f} {total:>10.1f} {blocking / gb:>15.1f} {total / gb:>12.1f}")
    print(f"integrity: verify {verify:.1f} ms ({verify / gb:.1f} ms/GB, at resume and inspect); sha256 alone "
          f"{sha:.1f} ms ({sha / gb:.1f} ms/GB, what saves add, shared by the {args.world} ranks' writers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
