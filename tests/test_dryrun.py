"""The dry run (`lab.dryrun`, `python -m lab.train --dry-run`): one rank of a real-size layout built on `meta` under
a fake process group, its static bytes measured on the modules and equal, to the byte, to `lab.calc.memory`'s.

The two sides are independent: the modules are what `lab.parallel.parallelize` really builds for that rank (TP
pieces, the stage's layers, the rank's experts, ZeRO's shard pieces); calc multiplies out formulas. Issue 16 asks
for llama3-70b and deepseek-v3 at three layouts each, and for world sizes up to 16,384 in seconds.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab.calc.memory import training_precision
from lab.config import PRESETS, Config, ParallelConfig, TrainConfig, check_supported, load_config
from lab.distributed.mesh import GROUPS, axis_groups
from lab.dryrun import STATIC, DryRun, describe_ranks, dry_run

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ["llama3-1b", "llama3-8b", "llama3-70b", "llama3-405b", "mixtral-8x7b", "deepseek-v3"]


def _config(model: str, rank_layout: dict, seq: int = 4096) -> Config:
    parallel = ParallelConfig(**rank_layout)
    train = TrainConfig(global_batch=parallel.dp * parallel.grad_accum, seq_len=seq)
    config = Config(PRESETS[model], parallel, train)
    config.validate()
    return config


def _agrees(config: Config, rank: int) -> DryRun:
    result = dry_run(config, rank)
    assert result.precision == training_precision(config.train.precision, config.train.reduce_dtype)[0]
    assert result.mismatches == [], result.report()
    assert all(result.measured[k] > 0 for k in ("params", "grads", "optimizer"))
    p = config.parallel
    degrees = {"dp": p.dp, "pp": p.pp, "cp": p.cp, "tp": p.tp, "ep": p.ep}
    for axis in GROUPS:  # the groups printed are the mesh's own, one of axis_groups' lines through this rank
        assert result.groups[axis] in axis_groups(p.world_size, axis, **degrees)
        assert rank in result.groups[axis]
    return result


# TP (with KV heads copied beyond n_kv_heads=8 at tp=16), SP, CP, PP (1F1B and interleaved), ZeRO-1 and ZeRO-3;
# ranks in the middle and at the end of the grid, so that first, middle and last pipeline stages are all checked.
LLAMA3_70B = [
    (dict(dp=8, tp=8, pp=4, zero=1, grad_accum=4), 37),  # the command line; stage 0, dp_rank 1, tp_rank 5
    (dict(dp=4, tp=8, sp=True, zero=3), 31),  # TorchTitan's FSDP x TP (+SP), smaller
    (dict(dp=2, cp=2, tp=16, pp=2, pp_schedule="interleaved", pp_virtual_stages=2, grad_accum=4), 127),
]
# lab refuses TP with MLA and ZeRO with EP, and 61 layers split only into 61 stages: dp / pp / ep / zero.
DEEPSEEK_V3 = [
    (dict(dp=8, zero=3), 5),  # ZeRO-3 shards the 671B parameters over 8 ranks
    (dict(dp=4, pp=61, zero=1, grad_accum=2), 243),  # ZeRO-1 with PP: the last stage (final norm, output layer)
    (dict(dp=32, pp=61, ep=32, grad_accum=2), 335),  # configs/deepseek-v3.toml's layout: stage 30 (MoE), experts 40-47
]


@pytest.mark.parametrize("layout, rank", LLAMA3_70B)
def test_llama3_70b_static_bytes_equal_calc_memory(layout, rank):
    _agrees(_config("llama3-70b", layout, seq=8192), rank)


@pytest.mark.parametrize("layout, rank", DEEPSEEK_V3)
def test_deepseek_v3_static_bytes_equal_calc_memory(layout, rank):
    _agrees(_config("deepseek-v3", layout), rank)


@pytest.mark.parametrize("rank", [0, 95])
def test_zero_pads_each_unit_and_the_last_ranks_hold_fewer_elements(rank):
    """dp=12 divides no block of llama3-70b: ZeRO pads each unit (a block, the root) to a multiple of 12, and the
    padding falls on the group's last ranks, which hold fewer elements. Rounding the whole model once, as calc
    did, was 53 elements short of the first rank's shard and 591 over the last rank's (found by this test)."""
    _agrees(_config("llama3-70b", dict(dp=12, tp=8, zero=3), seq=8192), rank)


def test_16384_ranks_in_seconds():
    """Llama 3's scale (16,384 GPUs: TP 8 x PP 16 x DP 128): one rank, its mesh, its groups and its bytes. Every
    rank of a mesh creates every group, 7 x O(world) `new_group` calls; the fake backend makes them cheap."""
    config = _config("llama3-70b", dict(dp=128, tp=8, pp=16, zero=1, grad_accum=16), seq=8192)
    start = time.perf_counter()
    result = dry_run(config, 16383)
    seconds = time.perf_counter() - start
    print(f"dry run of rank 16383 of 16,384: {seconds:.1f} s")
    assert seconds < 60  # about 3 s on a quiet 2-core machine
    assert result.mismatches == []
    assert result.coords == {"dp": 127, "pp": 15, "cp": 0, "tp": 7, "ep": 0}
    assert result.groups["tp"] == list(range(16376, 16384))
    assert result.groups["pp"] == list(range(16263, 16384, 8))
    assert result.groups["dp"] == list(range(127, 16384, 128))


@pytest.mark.parametrize("name", CONFIGS)
def test_every_real_size_config_is_a_layout_lab_runs(name):
    config = load_config(ROOT / "configs" / f"{name}.toml")
    check_supported(config)
    assert config.model.name == name and config.train.device == "auto"
    assert config.parallel.world_size > 1


@pytest.mark.parametrize("name", CONFIGS)
def test_real_size_configs_fit_their_gpu_in_a_16_bit_precision(name):
    """Issue 33: every real config trained in fp32, and llama3-8b, mixtral-8x7b and deepseek-v3 did not fit an
    H100 by lab's own calculator. Each now states its precision and its GPU, and its dry run (of the last rank;
    the verdict is the fullest rank's) agrees with calc.memory, ends with the verdict and fits. deepseek-v3 takes
    ~10 s of the ~15 s: building 61 layers of 256 experts on meta, 45,000 Linears, before PP and EP cut them."""
    config = load_config(ROOT / "configs" / f"{name}.toml")
    assert config.train.precision != "fp32" and config.train.hardware == "h100"
    result = _agrees(config, config.parallel.world_size - 1)
    verdict = result.report().splitlines()[-1]
    assert result.headroom >= 0 and verdict.startswith("fits on h100: "), verdict
    assert result.fullest.per_gpu["total"] >= sum(result.estimated[k] for k in (*STATIC, "activations"))
    assert config.train.warmup_steps <= config.train.steps


def test_the_verdict_names_the_excess_of_the_fullest_rank():
    """llama3-8b in fp32 with TorchTitan's 2 sequences a micro-batch and selective recompute: issue 33's numbers were
    11.1 GiB over and 91.1 GiB on a B200 with the fp32 logits (7.8 GiB of 2 x 8192 x 128,256) among the activations.
    lab.train's chunked loss (issue 36) holds instead the gradients it formed for the hidden states and the output
    weight (2.2 GiB) and, while it runs, one chunk's logits and the weight gradient's fp32 sum (2.5 GiB)."""
    before = ["train.precision='fp32'", "parallel.recompute='selective'"]
    result = dry_run(load_config(ROOT / "configs" / "llama3-8b.toml", before), 3)
    assert result.verdict().startswith("does not fit on h100: 7.9 GiB over (the fullest rank, pipeline stage 0: ")
    assert result.verdict().endswith(" + 2.5 GiB for the loss)")
    assert result.headroom == 80 * 2**30 - result.fullest.per_gpu["total"] < 0
    bigger = load_config(ROOT / "configs" / "llama3-8b.toml", [*before, "train.hardware='b200'"])
    assert dry_run(bigger, 0).verdict().startswith("fits on b200: 87.9 of 192 GiB")
    # --loss whole: the fp32 logits among the activations, two more copies while the loss runs (issue 37's numbers)
    whole = dry_run(load_config(ROOT / "configs" / "llama3-8b.toml", [*before, "train.loss='whole'"]), 3).verdict()
    assert whole.startswith("does not fit on h100: 26.8 GiB over") and whole.endswith(" + 15.7 GiB for the loss)")


def test_the_cli_prints_coordinates_and_groups():
    done = subprocess.run([sys.executable, "-m", "lab.train", "--config", "configs/llama3-70b.toml", "--dp", "8",
                           "--tp", "8", "--pp", "4", "--dry-run", "--rank", "37"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "dry run of llama3-70b on 256 ranks [dp=8, tp=8, pp=4, zero=1, sp, pp_schedule=1f1b]: rank 37" in out
    assert "coordinates: dp=1  pp=0  cp=0  tp=5  ep=0" in out  # rank = 32·dp + 8·pp + tp
    assert "  tp     32, 33, 34, 35, 36, 37, 38, 39 (8 ranks)" in out
    assert "  pp     37, 45, 53, 61 (4 ranks)" in out
    assert "  dp     5, 37, 69, 101, 133, 165, 197, 229 (8 ranks)" in out
    assert "static bytes agree exactly" in out
    # stage 0 holds 21.0 GiB; the last stage's loss works in 6.8 GiB more (issue 37), which makes it the fullest
    assert out.splitlines()[-1].startswith("fits on h100: 26.0 of 80 GiB (the fullest rank, pipeline stage 3: ")


@pytest.mark.parametrize("argv, message", [
    (["--config", "configs/deepseek-v3.toml", "--tp", "2", "--dry-run"], "lab.train does not run tp with mla"),
    (["--config", "configs/llama3-70b.toml", "--dry-run", "--rank", "256"], "rank=256 must be in [0, 256)"),
    (["--config", "configs/llama3-70b.toml", "--rank", "3"], "--rank=3 picks the rank of a --dry-run"),
    (["--config", "configs/tiny.toml", "--dry-run", "--set", "train.hardware='h800'"],
     "train.hardware='h800' must be one of 'h100', 'h200', 'a100'"),
])
def test_the_cli_refuses_in_one_line(capsys, argv, message):
    from lab.train import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_ranks_are_described_in_one_short_line():
    assert describe_ranks([3]) == "3 (1 rank)"
    assert describe_ranks(list(range(0, 1024, 8))) == "0, 8, ..., 1016 (128 ranks, every 8)"
    assert describe_ranks([0, 1, 4, 5, 8, 9, 12, 13, 16, 17]) == "0, 1, 4, 5, ..., 16, 17 (10 ranks)"
