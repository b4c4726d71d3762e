"""`python -m lab.train`: the loss falls, parallel runs equal the single-process run, bad input is one line."""

import contextlib
import functools
import json
import math
import os
import subprocess
import sys
import time

import psutil
import pytest
import torch

import lab.train
import lab.trainer
from lab.config import load_config
from lab.distributed import RankTimeout
from lab.distributed.launch import HANG_TIMEOUT_S
from lab.faults import InjectedFailure
from lab.layout import INTERLEAVED_CHUNKS
from lab.precision.loss_scale import DynamicLossScaler
from lab.train import (
    NonFiniteLoss,
    StepLog,
    build_parser,
    config_from_args,
    main,
    run,
    summary,
    throughput,
)

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


@functools.cache
def _single_process_losses() -> list[float]:
    """The reference every layout below must reproduce: computed once per test process."""
    return [log.loss for log in run(load_config("configs/tiny.toml", ["train.steps=6"]), verbose=False)]


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
    # the W pass on TP's layers: under SP a row-parallel layer's output is reduce-scattered, so W must see the
    # partial sum it computed, not the reduced output
    (["parallel.pp=2", "parallel.tp=2", "parallel.sp=true", "parallel.grad_accum=2", "parallel.pp_schedule='zb-h1'"],
     4),
])
def test_layouts_match_single_process(overrides, nproc):
    base = _single_process_losses()
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


def _launch(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --standalone ARGS` with its output; whatever it started is killed if it
    outlives the timeout (torchrun's ranks are its children)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", *args]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        out, err = launcher.communicate(timeout=timeout)
        return subprocess.CompletedProcess(command, launcher.returncode, out, err)
    finally:
        if launcher.poll() is None:
            for child in psutil.Process(launcher.pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
            launcher.kill()
            launcher.wait()


def test_torchrun_joins_the_launched_group_and_infers_dp(tmp_path):
    """No --dp: torchrun's 2 ranks are 2 data-parallel ranks, as with --nproc 2, and train to one process's losses."""
    launched = tmp_path / "torchrun.jsonl"
    done = _launch("--nproc_per_node", "2", "-m", "lab.train", "--config", "configs/tiny.toml", "--steps", "6",
                   "--quiet", "--log-json", str(launched))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "on 2 rank(s) [dp=2]" in done.stdout
    _assert_same_losses(_single_process_losses(), _losses(launched))


def test_torchrun_reports_a_bad_layout_once_and_every_rank_exits_2():
    """One `error:` line (rank 0's), no traceback from lab.train, exit status 2 on every rank. torchrun then adds its
    own report (ChildFailedError, naming exit code 2) and exits 1 itself, as it does whenever a rank fails."""
    done = _launch("--nproc_per_node", "2", "-m", "lab.train", "--config", "configs/tiny.toml", "--tp", "3")
    output = done.stdout + done.stderr
    errors = [line for line in output.splitlines() if "error:" in line]
    assert errors == ["python -m lab.train: error: tp=3 must divide n_heads=4"], output[-3000:]
    assert "lab/train.py" not in output and "ValueError" not in output
    assert done.returncode != 0 and "exitcode  : 2 " in done.stderr


def _torchrun_env(monkeypatch, rank: int, world_size: int) -> None:
    for key, value in (("RANK", rank), ("WORLD_SIZE", world_size), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", 29500)):
        monkeypatch.setenv(key, str(value))


@pytest.mark.parametrize("args, world_size, layout", [
    ([], 4, dict(dp=4, tp=1)),
    (["--tp", "2"], 4, dict(dp=2, tp=2)),
    (["--pp", "2", "--grad-accum", "2"], 8, dict(dp=4, pp=2)),
    (["--cp", "2", "--tp", "2"], 8, dict(dp=2, cp=2, tp=2)),
    (["--config", "configs/tiny-moe.toml", "--ep", "2"], 2, dict(dp=2, ep=2)),  # dp=1 would be refused by ep=2
    (["--set", "parallel.tp=2"], 2, dict(dp=1, tp=2)),
])
def test_dp_is_inferred_from_the_launched_ranks_by_one_rule(monkeypatch, args, world_size, layout):
    """`--nproc N` and torchrun's WORLD_SIZE=N give the same layout: dp = N / (tp*cp*pp) unless dp is named."""
    args = args if "--config" in args else ["--config", "configs/tiny.toml", *args]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    local, nproc = config_from_args(build_parser().parse_args([*args, "--nproc", str(world_size)]))
    _torchrun_env(monkeypatch, 0, world_size)
    launched, world = config_from_args(build_parser().parse_args(args))
    assert nproc == world == world_size and local.parallel == launched.parallel
    assert {k: getattr(launched.parallel, k) for k in layout} == layout


@pytest.mark.parametrize("args, message", [
    (["--dp", "2"], "torchrun started 4 ranks but dp*tp*cp*pp = 2*1*1*1 = 2"),
    (["--set", "parallel.dp=2"], "torchrun started 4 ranks but dp*tp*cp*pp = 2*1*1*1 = 2"),
    (["--tp", "3"], "tp=3 must divide n_heads=4"),
    (["--nproc", "2"], "--nproc=2 under torchrun, which started 4 ranks: leave --nproc out"),
])
def test_under_torchrun_only_rank_0_prints_the_one_line_and_every_rank_exits_2(monkeypatch, capsys, args, message):
    monkeypatch.setattr(lab.train, "run", lambda *a, **k: pytest.fail("started training"))
    monkeypatch.setattr(lab.train.time, "sleep", lambda s: None)  # the other ranks' wait for rank 0's line
    for rank in (0, 1):
        _torchrun_env(monkeypatch, rank, 4)
        assert main(["--config", "configs/tiny.toml", *args]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err == (f"python -m lab.train: error: {message}\n" if rank == 0 else "")


def test_under_torchrun_a_bad_flag_is_one_line_from_rank_0_too(monkeypatch, capsys):
    monkeypatch.setattr(lab.train.time, "sleep", lambda s: None)
    for rank in (0, 1):
        _torchrun_env(monkeypatch, rank, 2)
        with pytest.raises(SystemExit) as exit_:
            main(["--tpp", "2"])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert err == ("python -m lab.train: error: unrecognized arguments: --tpp 2 (see --help)\n" if rank == 0
                       else "")


def test_cuda_without_cuda_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--set", "train.device=cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m lab.train: error: train.device='cuda' but this machine has no CUDA")
    assert "available: 'cpu'" in err and len(err.strip().splitlines()) == 1


def test_interleaved_without_pp_chunks_takes_2_like_calc_bubble():
    config, nproc = config_from_args(build_parser().parse_args(["--pp", "2", "--pp-schedule", "interleaved",
                                                                "--grad-accum", "2"]))
    assert config.parallel.pp_virtual_stages == 2 and nproc == 2
    from lab.calc.bubble import explore

    assert explore("interleaved", 2, 2).schedule.chunks == INTERLEAVED_CHUNKS


def test_summary_reports_the_steady_rate_and_start_up_apart():
    """Fake timing: 5 steps of 256 tokens, the first taking 1 s and the others 0.1 s, in a run of 2 s in all.
    Steady state is 2,560 tokens/s (not 5 x 256 / 2 = 640), start-up 2 - 4 x 0.1 = 1.6 s."""
    times = [1.0, 0.1, 0.1, 0.1, 0.1]
    logs = [StepLog(step, 5.0 - step / 10, 1e-3, 1.0, 256 / t, None) for step, t in enumerate(times, start=1)]
    rate, startup, steps = throughput(logs, 256, 2.0)
    assert (rate, steps) == (pytest.approx(2560), "steps 2-5") and startup == pytest.approx(1.6)
    config = load_config("configs/tiny.toml", ["train.global_batch=8", "train.seq_len=32"])
    assert "2,560 tokens/s over steps 2-5; start-up 1.6 s" in summary(config, logs, 1, 2.0)
    assert throughput(logs[:1], 256, 3.0) == (pytest.approx(256), pytest.approx(2.0), "step 1")


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
    (["--config", "configs/tiny-moe.toml", "--ep", "2", "--dp", "2", "--zero", "1"],
     "lab.train does not run zero with ep (zero=1, ep=2): experts' gradients are averaged over other ranks"),
    (["--config", "configs/tiny-moe.toml", "--tp", "2", "--sp"], "lab.train does not run sp with moe (sp=True, "),
    (["--pp", "3", "--nproc", "3"], "pp*pp_virtual_stages = 3*1 = 3 must divide n_layers=8"),
    (["--pp", "4", "--grad-accum", "2", "--pp-schedule", "interleaved", "--pp-chunks", "2"],
     "grad_accum=2 (the micro-batches) must be a multiple of pp=4 for pp_schedule='interleaved'"),
    (["--pp", "2", "--pp-schedule", "interleaved", "--pp-chunks", "1"],
     "pp_virtual_stages=1 must be >= 2 for pp_schedule='interleaved'"),
    (["--pp", "2", "--pp-schedule", "interleaved"],  # 2 chunks by default: then the micro-batches must fill them
     "grad_accum=1 (the micro-batches) must be a multiple of pp=2 for pp_schedule='interleaved'"),
    (["--nproc", "4", "--set", "parallel.dp=2"], "--nproc=4 must equal dp*tp*cp*pp = 2*1*1*1 = 2"),
    (["--pp", "2", "--pp-chunks", "2"], "pp_virtual_stages=2: only pp_schedule='interleaved' runs several chunks"),
    (["--pp", "2", "--dp", "2", "--zero", "2", "--grad-accum", "2"],
     "lab.train does not run zero>=2 with pp (zero=2, pp=2): ZeRO-2/3 would free gradients"),
    (["--sp"], "sp=True needs tp > 1 (got tp=1)"),
    (["--zero", "1"], "zero=1 needs dp > 1: it shards over the data-parallel ranks (got dp=1)"),
    (["--model", "deepseek-v3", "--tp", "2", "--nproc", "2"], "lab.train does not run tp with mla (tp=2, "
                                                                "attention='mla')"),
    (["--bucket-mb", "0"], "bucket_mb=0.0 must be a number > 0"),
    (["--cp", "3"], "seq_len=32 must be divisible by 2*cp = 6 for cp_impl='zigzag'"),
    (["--cp", "8", "--cp-impl", "ulysses"], "cp=8 must divide the heads per tensor-parallel rank, n_heads/tp = 4/1"),
    (["--cp-impl", "stripes"], "argument --cp-impl: invalid choice: 'stripes'"),
    (["--dp-mode", "ring"], "argument --dp-mode: invalid choice: 'ring'"),
    (["--pp-schedule", "gpipe"], "argument --pp-schedule: invalid choice: 'gpipe'"),
])
def test_bad_input_is_one_clear_line(capsys, args, message):
    """In this process (`main` is what `python -m lab.train` runs; a subprocess per case cost ~3 s of start-up):
    exit status 2 and one line on stderr, whether argparse or lab's own checks refuse."""
    argv = ["--config", "configs/tiny.toml", *args] if "--config" not in args else list(args)
    try:
        status = main(argv)
    except SystemExit as exit_:  # argparse refuses by exiting
        status = exit_.code
    err = capsys.readouterr().err
    assert status == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1, err


def test_model_seq_and_mbs_flags_speak_lab_calcs_vocabulary():
    """--model, --seq and --mbs mean what they mean in `lab calc`: the global batch is mbs x dp x grad_accum."""
    args = ["--config", "configs/tiny.toml", "--model", "tiny-moe", "--seq", "64", "--mbs", "3", "--dp", "2",
            "--grad-accum", "2"]
    config, nproc = config_from_args(build_parser().parse_args(args))
    assert (config.model.name, config.train.seq_len, config.train.global_batch, nproc) == ("tiny-moe", 64, 12, 2)
    with pytest.raises(ValueError, match=r"--mbs=3 and train.global_batch both set the batch size: give one"):
        config_from_args(build_parser().parse_args([*args, "--set", "train.global_batch=8"]))


# --- no wall-clock limit, a progress watchdog instead (lab.distributed.run) -------------------------------------

def test_nproc_runs_have_no_wall_clock_limit_unless_asked(monkeypatch):
    """A 1000-step run died at max(600 s, 10 s x steps) = 10,000 s whatever its progress; now only a hang (no step
    and no collective for --hang-timeout) stops it, and a wall-clock limit only when --time-limit asks for one."""
    calls = []
    monkeypatch.setattr(lab.trainer.lab_dist, "run", lambda *args, **kwargs: calls.append(kwargs) or [[]])
    config = load_config("configs/tiny.toml", ["parallel.dp=2", "train.steps=1000"])
    run(config, 2, verbose=False)
    run(config, 2, verbose=False, hang_timeout_s=30, time_limit_s=7200)
    assert [(kwargs["timeout_s"], kwargs["hang_timeout_s"]) for kwargs in calls] == [(None, HANG_TIMEOUT_S),
                                                                                   (7200, 30)]


def test_a_hung_rank_is_named_at_the_hang_timeout_not_the_collective_timeout():
    config = load_config("configs/tiny.toml", ["parallel.dp=2", "train.steps=3"])
    start = time.monotonic()
    with pytest.raises(RankTimeout) as err:
        run(config, 2, verbose=False, inject=InjectedFailure(1, 2, "hang"), collective_timeout_s=120,
            hang_timeout_s=2)
    assert err.value.rank == [1]
    assert str(err.value).startswith("rank(s) [1] made no progress for hang_timeout_s=2 s")
    assert "in maybe_fire" in err.value.traceback_text
    assert time.monotonic() - start < 60  # far from the collective's 120 s


# --- output paths are checked before any rank starts ------------------------------------------------------------

@pytest.mark.parametrize("flag, path, why", [
    ("--checkpoint-dir", "{file}", "not a directory (a file is there)"),
    ("--checkpoint-dir", "{file}/ckpt", "{file} is not a directory"),
    ("--log-json", "{tmp}/missing/x.jsonl", "its directory {tmp}/missing does not exist"),
    ("--log-json", "{tmp}", "is a directory; give a file path"),
    ("--log-json", "{file}/x.jsonl", "{file} is not a directory"),
    pytest.param("--log-json", "/sys/x.jsonl", "not writable (no file can be created in /sys): Permission denied",
                 marks=pytest.mark.skipif(not os.path.isdir("/sys"), reason="Linux's /sys: unwritable, even by root"),
                 id="unwritable"),
])
def test_a_bad_output_path_is_one_line_before_any_rank_starts(tmp_path, capsys, monkeypatch, flag, path, why):
    """Formerly a checkpoint dir that is a file failed at the first save (hours in, on a real job), a log path in a
    missing directory once the model was built. The checks work as root too (no permission bits involved)."""
    monkeypatch.setattr(lab.trainer.lab_dist, "run", lambda *args, **kwargs: pytest.fail("ranks were started"))
    (tmp_path / "file").write_text("")
    names = {"file": str(tmp_path / "file"), "tmp": str(tmp_path)}
    path, why = path.format(**names), why.format(**names)
    assert main(["--config", "configs/tiny.toml", "--nproc", "2", "--quiet", flag, path]) == 2
    err = capsys.readouterr().err
    assert err == f"python -m lab.train: error: {flag} {path}: {why}\n"


# --- a non-finite loss or gradient norm stops the run --------------------------------------------------------

def test_a_non_finite_loss_or_norm_stops_at_its_step_with_one_line(capsys):
    """lr=1e30 makes step 1's update blow the weights up: step 2's gradient norm is nan. The run used to go on to
    the end printing `loss nan`, and exit 0."""
    status = main(["--config", "configs/tiny.toml", "--steps", "6", "--quiet", "--set", "train.lr=1e30"])
    err = capsys.readouterr().err
    assert status == 1
    assert err.startswith("python -m lab.train: error: step 2: loss ") and err.count("\n") == 1, err
    assert "grad norm nan: both must be finite; stopped before its update (lower train.lr=1e+30" in err


def test_a_non_finite_step_stops_every_rank_of_a_group():
    config = load_config("configs/tiny.toml", ["parallel.dp=2", "train.steps=6", "train.lr=1e30"])
    with pytest.raises(NonFiniteLoss, match="^step 2: loss .*, grad norm nan: both must be finite"):
        run(config, 2, verbose=False)


def test_fp16_overflow_is_still_skipped_not_stopped(monkeypatch):
    """fp16's loss scaler owns an inf/nan gradient: a scale of 2^24 overflows the first steps, which it skips
    while it halves the scale; the run goes on."""
    monkeypatch.setattr(lab.trainer, "DynamicLossScaler", functools.partial(DynamicLossScaler, init_scale=2.0**24))
    logs = run(load_config("configs/tiny.toml", ["train.steps=6", "train.precision='fp16'"]), 1, verbose=False)
    assert len(logs) == 6 and logs[0].skipped and not math.isfinite(logs[0].grad_norm) and not logs[-1].skipped
