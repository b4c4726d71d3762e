"""`python -m lab.train`: the loss falls, parallel runs equal the single-process run, bad input is one line."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from lab.config import load_config
from lab.train import run

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lab.train", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def _losses(path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def _assert_same_losses(a: list[float], b: list[float], rel: float = 1e-5) -> None:
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b, strict=True), start=1):
        assert abs(x - y) <= rel * abs(x), f"step {step}: {x} vs {y}"


def test_cli_lowers_the_loss_and_dp2_matches_single_process(tmp_path):
    single, dp2 = tmp_path / "single.jsonl", tmp_path / "dp2.jsonl"
    done = _cli("--config", "configs/tiny.toml", "--steps", "20", "--log-json", str(single))
    assert done.returncode == 0, done.stderr
    assert "loss" in done.stdout and "data floor" in done.stdout
    records = [json.loads(line) for line in single.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 21))
    assert set(records[0]) == {"step", "loss", "lr", "grad_norm", "tokens_per_s", "peak_bytes"}
    losses = [r["loss"] for r in records]
    assert losses[-1] < losses[0] - 0.5, losses  # from ln(256) = 5.55 to about 4.2
    done = _cli("--config", "configs/tiny.toml", "--steps", "20", "--nproc", "2", "--dp", "2",
                "--log-json", str(dp2))
    assert done.returncode == 0, done.stderr
    assert "2 rank(s) [dp=2]" in done.stdout
    _assert_same_losses(losses, _losses(dp2))


@pytest.mark.parametrize("overrides, nproc", [
    (["parallel.dp=4"], 4),
    (["parallel.grad_accum=4"], 1),
    (["parallel.dp=2", "parallel.grad_accum=2"], 2),
    (["parallel.recompute='full'"], 1),
    (["parallel.recompute='selective'", "parallel.dp=2"], 2),
    (["parallel.tp=2"], 2),
    (["parallel.tp=4", "parallel.sp=true"], 4),
    (["parallel.dp=2", "parallel.tp=2", "parallel.sp=true", "parallel.grad_accum=2"], 4),
    (["parallel.dp=2", "parallel.dp_mode='naive'"], 2),
    (["parallel.dp=2", "parallel.dp_mode='overlapped'", "parallel.grad_accum=2"], 2),
    (["parallel.dp=4", "parallel.bucket_mb=0.05", "parallel.grad_accum=2"], 4),
    (["parallel.dp=2", "parallel.zero=1", "parallel.grad_accum=2"], 2),
    (["parallel.dp=4", "parallel.zero=2"], 4),
    (["parallel.dp=2", "parallel.zero=3", "parallel.grad_accum=2", "parallel.recompute='full'"], 2),
    (["parallel.dp=4", "parallel.zero=3"], 4),
    (["parallel.cp=2"], 2),
    (["parallel.cp=4", "parallel.cp_impl='ring'"], 4),
    (["parallel.dp=2", "parallel.cp=2", "parallel.cp_impl='ulysses'", "parallel.grad_accum=2"], 4),
    (["parallel.cp=2", "parallel.tp=2", "parallel.sp=true", "parallel.recompute='selective'"], 4),
    (["parallel.pp=2", "parallel.grad_accum=4"], 2),
    (["parallel.pp=4", "parallel.grad_accum=2", "parallel.pp_schedule='afab'"], 4),
    (["parallel.pp=2", "parallel.grad_accum=4", "parallel.pp_schedule='interleaved'", "parallel.pp_virtual_stages=2",
      "parallel.recompute='full'"], 2),
    (["parallel.pp=4", "parallel.grad_accum=4", "parallel.pp_schedule='zb-h1'"], 4),
    (["parallel.pp=2", "parallel.dp=2", "parallel.grad_accum=2", "parallel.pp_schedule='zb-h1'"], 4),
])
def test_layouts_match_single_process(overrides, nproc):
    base = [log.loss for log in run(load_config("configs/tiny.toml", ["train.steps=6"]), verbose=False)]
    config = load_config("configs/tiny.toml", ["train.steps=6", *overrides])
    _assert_same_losses(base, [log.loss for log in run(config, nproc, verbose=False)])


def test_moe_data_parallel_matches_single_process():
    """Without the router's balancing losses: those are defined over the tokens one rank routes (Switch, GShard),
    so data parallelism changes them — and expert parallelism must not (next test)."""
    no_aux = ["train.steps=6", "model.aux_loss_coef=0.0", "model.z_loss_coef=0.0"]
    base = [log.loss for log in run(load_config("configs/tiny-moe.toml", no_aux), verbose=False)]
    dp2 = load_config("configs/tiny-moe.toml", [*no_aux, "parallel.dp=2"])
    _assert_same_losses(base, [log.loss for log in run(dp2, 2, verbose=False)])


@pytest.mark.parametrize("dp, ep, extra", [(2, 2, []), (4, 4, ["parallel.grad_accum=2"]),
                                           (4, 2, ["model.capacity_factor=1.0"])])
def test_expert_parallel_matches_data_parallel(dp, ep, extra):
    """--ep E shards the experts of a --dp D run: losses, gradient norms, balancing loss and expert load equal
    the same run without it, also with token dropping (capacity factor 1)."""
    common = ["train.steps=5", f"parallel.dp={dp}", *extra]
    base = run(load_config("configs/tiny-moe.toml", common), dp, verbose=False)
    sharded = run(load_config("configs/tiny-moe.toml", [*common, f"parallel.ep={ep}"]), dp, verbose=False)
    _assert_same_losses([log.loss for log in base], [log.loss for log in sharded])
    _assert_same_losses([log.grad_norm for log in base], [log.grad_norm for log in sharded], rel=1e-4)
    for a, b in zip(base, sharded, strict=True):
        assert a.expert_load == b.expert_load and a.dropped_tokens == b.dropped_tokens
        assert a.load_imbalance == pytest.approx(max(a.expert_load) * len(a.expert_load) / sum(a.expert_load))
        assert a.aux_loss == pytest.approx(b.aux_loss, rel=1e-5)
    assert sum(base[-1].expert_load) + base[-1].dropped_tokens == 8 * 32 * 2 * 4  # tokens x top_k x layers
    if extra == ["model.capacity_factor=1.0"]:
        assert base[-1].dropped_tokens > 0


@pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None,
                    reason="torchrun not installed next to this python")
def test_torchrun_joins_the_launched_group(tmp_path):
    single, launched = tmp_path / "single.jsonl", tmp_path / "torchrun.jsonl"
    assert _cli("--config", "configs/tiny.toml", "--steps", "5", "--log-json", str(single)).returncode == 0
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    done = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", "-m", "lab.train",
                           "--config", "configs/tiny.toml", "--steps", "5", "--dp", "2", "--quiet",
                           "--log-json", str(launched)], capture_output=True, text=True, timeout=240, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_same_losses(_losses(single), _losses(launched))


@pytest.mark.parametrize("args, message", [
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["--tp", "3"], "tp=3 must divide n_heads=4"),
    (["--dp", "-2"], "dp=-2 must be an integer >= 1"),
    (["--steps", "-5"], "steps=-5 must be an integer >= 1"),
    (["--nproc", "3", "--dp", "2"], "--nproc=3 must equal dp*tp*cp*pp = 2*1*1*1 = 2"),
    (["--set", "model.preset='gpt-17'"], "unknown model preset 'gpt-17'"),
    (["--config", "configs/nope.toml"], "config file 'configs/nope.toml' does not exist"),
    (["--ep", "2", "--dp", "2"], "ep=2 needs a mixture-of-experts model (n_experts=0)"),
    (["--config", "configs/tiny-moe.toml", "--ep", "3", "--dp", "3"], "ep=3 must divide n_experts=8"),
    (["--config", "configs/tiny-moe.toml", "--ep", "2", "--dp", "1", "--nproc", "1"], "ep=2 must divide dp*cp = 1*1"),
    (["--config", "configs/tiny-moe.toml", "--ep", "2", "--dp", "2", "--tp", "2"],
     "ep=2 with tp=2, cp=1, pp=1, zero=0: lab.train combines expert parallelism with data parallelism only"),
    (["--config", "configs/tiny-moe.toml", "--pp", "2", "--grad-accum", "2"],
     "pp=2 with a mixture-of-experts model: pipeline stages do not carry the router's auxiliary losses yet"),
    (["--pp", "3", "--nproc", "3"], "pp*pp_virtual_stages = 3*1 = 3 must divide n_layers=8"),
    (["--pp", "4", "--grad-accum", "2", "--pp-schedule", "interleaved", "--pp-chunks", "2"],
     "grad_accum=2 (the micro-batches) must be a multiple of pp=4 for pp_schedule='interleaved'"),
    (["--pp", "2", "--pp-schedule", "interleaved"], "pp_virtual_stages=1 must be >= 2 for pp_schedule='interleaved'"),
    (["--pp", "2", "--pp-chunks", "2"], "pp_virtual_stages=2: only pp_schedule='interleaved' runs several chunks"),
    (["--pp", "2", "--tp", "2"], "pp=2 with tp=2, cp=1, zero=0: lab.train combines pipeline parallelism with data"),
    (["--sp"], "sp=True needs tp > 1 (got tp=1)"),
    (["--zero", "1"], "zero=1 needs dp > 1: it shards over the data-parallel ranks (got dp=1)"),
    (["--zero", "2", "--dp", "2", "--tp", "2"], "zero=2 with tp=2: lab's ZeRO shards a model that is not tensor"),
    (["--bucket-mb", "0"], "bucket_mb=0.0 must be a number > 0"),
    (["--cp", "3"], "seq_len=32 must be divisible by 2*cp = 6 for cp_impl='zigzag'"),
    (["--cp", "8", "--cp-impl", "ulysses"], "cp=8 must divide the heads per tensor-parallel rank, n_heads/tp = 4/1"),
    (["--cp-impl", "stripes"], "argument --cp-impl: invalid choice: 'stripes'"),
    (["--dp-mode", "ring"], "argument --dp-mode: invalid choice: 'ring'"),
    (["--pp-schedule", "gpipe"], "argument --pp-schedule: invalid choice: 'gpipe'"),
])
def test_bad_input_is_one_clear_line(args, message):
    done = _cli("--config", "configs/tiny.toml", *args) if "--config" not in args else _cli(*args)
    assert done.returncode == 2
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
