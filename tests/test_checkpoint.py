"""`lab.checkpoint`: resume is bit-for-bit, a checkpoint saved at one layout loads exactly at another, a save killed
at any moment never leaves a checkpoint that loads wrongly, and `python -m lab checkpoint` inspects and converts."""

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from lab import checkpoint
from lab import distributed as lab_dist
from lab.config import Config
from lab.data import SyntheticTokens
from lab.model import build_model
from lab.parallel.optim import adamw
from lab.parallel.parallelize import build_mesh, parallelize
from lab.train import _lr_factor

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
STEPS = 6
LAYOUTS = {  # the flags of each layout, on top of configs/tiny.toml
    "single": [],
    "dp2": ["--nproc", "2"],
    "zero3": ["--nproc", "2", "--zero", "3"],
    "tp2": ["--nproc", "2", "--tp", "2"],
    "pp2": ["--nproc", "2", "--pp", "2"],
    "tp4": ["--nproc", "4", "--tp", "4"],  # 2 KV heads: each copied on 2 TP ranks
    "dp4": ["--nproc", "4"],
    "zero3_dp4": ["--nproc", "4", "--zero", "3"],
}


def _train_args(layout: str, ckpt_dir, log, *extra: str) -> list[str]:
    return [sys.executable, "-m", "lab.train", "--config", "configs/tiny.toml", "--steps", str(STEPS), "--quiet",
            *LAYOUTS[layout], "--checkpoint-dir", str(ckpt_dir), "--log-json", str(log), *extra]


def _train(layout: str, ckpt_dir, log, *extra: str) -> subprocess.CompletedProcess:
    done = subprocess.run(_train_args(layout, ckpt_dir, log, *extra), capture_output=True, text=True, timeout=300,
                          env=ENV)
    assert done.returncode == 0, done.stderr
    return done


def _losses(log) -> list[float]:
    return [json.loads(line)["loss"] for line in open(log)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Uninterrupted runs (checkpoints every 2 steps), made once per layout: {layout: (checkpoint dir, log)}."""
    root, made = tmp_path_factory.mktemp("trained"), {}

    def get(layout: str):
        if layout not in made:
            ckpt, log = root / layout, root / f"{layout}.jsonl"
            _train(layout, ckpt, log, "--checkpoint-every", "2")
            made[layout] = ckpt, log
        return made[layout]

    return get


@pytest.mark.parametrize("layout", ["dp2", "zero3", "tp2", "pp2"])
def test_resume_continues_bit_for_bit(trained, tmp_path, layout):
    """Stop after step 2 (the later checkpoints removed), resume in a new run: steps 3.. equal the uninterrupted
    run's exactly (fp32 on CPU)."""
    source, reference = trained(layout)
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    shutil.copytree(source / "step-00000002", ckpt / "step-00000002")
    shutil.copy(reference, log)
    done = _train(layout, ckpt, log, "--resume")
    assert f"checkpoint: resuming from {ckpt / 'step-00000002'}" in done.stdout
    assert [json.loads(line)["step"] for line in open(log)] == list(range(1, STEPS + 1))
    assert _losses(log) == _losses(reference)


def test_kill_9_between_checkpoints_then_resume(trained, tmp_path):
    """SIGKILL the whole run (launcher and ranks) once its first checkpoint exists; `--resume` ends with the
    uninterrupted run's losses, bit for bit."""
    _, reference = trained("dp2")
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    run = subprocess.Popen(_train_args("dp2", ckpt, log, "--checkpoint-every", "2"), env=ENV,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while not checkpoint.complete_checkpoints(str(ckpt)) and run.poll() is None:
            time.sleep(0.02)
        os.killpg(run.pid, signal.SIGKILL)
    finally:
        run.wait()
    assert checkpoint.complete_checkpoints(str(ckpt))
    _train("dp2", ckpt, log, "--checkpoint-every", "2", "--resume")
    assert _losses(log) == _losses(reference)


def test_kill_9_of_one_rank_then_resume(trained, tmp_path):
    """SIGKILL one rank once the first checkpoint exists: the launcher stops the others and fails; `--resume`
    ends with the uninterrupted run's losses, bit for bit."""
    _, reference = trained("dp2")
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    run = subprocess.Popen(_train_args("dp2", ckpt, log, "--checkpoint-every", "2"), env=ENV,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        while not checkpoint.complete_checkpoints(str(ckpt)) and run.poll() is None:
            time.sleep(0.02)
        ranks = sorted(psutil.Process(run.pid).children(), key=lambda p: p.pid)  # forked by lab.distributed.run
        ranks[-1].send_signal(signal.SIGKILL)  # rank 1
        _, stderr = run.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    assert run.returncode != 0 and "rank" in stderr
    _train("dp2", ckpt, log, "--checkpoint-every", "2", "--resume")
    assert _losses(log) == _losses(reference)


def test_saves_killed_at_random_moments_never_load_wrongly(trained, tmp_path):
    """Checkpoint every step and SIGKILL the run at random moments, three times, each run resuming the last: every
    checkpoint left complete holds every tensor, unfinished saves are ignored (and said so), and the run that
    finishes has the uninterrupted losses."""
    source, reference = trained("dp2")
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    n_params = len(list(build_model(_config({}).model).parameters()))
    rng = random.Random(17)
    resume: list[str] = []
    unfinished = 0  # kills that landed inside a save (its .tmp directory left behind)
    for _ in range(3):
        before = len(checkpoint.complete_checkpoints(str(ckpt)))
        run = subprocess.Popen(_train_args("dp2", ckpt, log, "--checkpoint-every", "1", *resume), env=ENV,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            while len(checkpoint.complete_checkpoints(str(ckpt))) <= before and run.poll() is None:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.3))
            os.killpg(run.pid, signal.SIGKILL)
        finally:
            run.wait()
        resume = ["--resume"]
        unfinished += any(name.startswith(".tmp-") for name in os.listdir(ckpt))
        for path in checkpoint.complete_checkpoints(str(ckpt)):
            full = checkpoint.read_full(path)  # every tensor there, whole
            assert len([k for k in full if k.startswith(("model.", "optim."))]) == 4 * n_params
            twin = source / os.path.basename(path)  # the uninterrupted run saved the even steps
            if twin.exists():
                expected = checkpoint.read_full(str(twin))
                assert all(torch.equal(full[k], expected[k]) for k in expected if not k.startswith("rng."))
    assert unfinished >= 1  # saves take most of a step here: 6 of 6 kills landed in one when this was written
    path, note = checkpoint.newest(str(ckpt))
    assert path is not None and note.startswith(f"resuming from {path}")
    _train("dp2", ckpt, log, "--checkpoint-every", "1", "--resume")
    assert _losses(log) == _losses(reference)


def test_an_unfinished_save_is_ignored_and_named(trained, tmp_path):
    source, _ = trained("dp2")
    shutil.copytree(source / "step-00000002", tmp_path / "step-00000002")
    shutil.copytree(source / "step-00000004", tmp_path / ".tmp-step-00000004")  # killed before its rename
    os.remove(tmp_path / ".tmp-step-00000004" / ".metadata")
    path, note = checkpoint.newest(str(tmp_path))
    assert path == str(tmp_path / "step-00000002")
    assert note == (f"resuming from {path} (ignoring .tmp-step-00000004: a save that did not finish)")


def test_a_save_killed_after_dcp_finished_stays_invisible(tmp_path, monkeypatch):
    """Killed after DCP wrote every file and its .metadata, but before lab's own file and the rename: the
    checkpoint is not visible, and resume takes the previous one (writing in place would expose it)."""
    state = _build({})
    first = checkpoint.save(str(tmp_path), 1, *state)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(json, "dump", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(str(tmp_path), 2, *state)
    monkeypatch.undo()
    assert os.path.exists(tmp_path / ".tmp-step-00000002" / ".metadata")
    path, note = checkpoint.newest(str(tmp_path))
    assert path == first and ".tmp-step-00000002" in note
    checkpoint.load(path, *state)


def test_keep_keeps_the_newest(tmp_path):
    ckpt = tmp_path / "ckpt"
    _train("single", ckpt, tmp_path / "log.jsonl", "--checkpoint-every", "1", "--keep", "2")
    assert sorted(os.listdir(ckpt)) == ["step-00000005", "step-00000006"]


# --- resharding -----------------------------------------------------------------------------------------------


def _config(parallel: dict) -> Config:
    return Config.from_dict({"model": {"preset": "tiny"}, "parallel": parallel,
                             "train": {"steps": STEPS, "global_batch": 8, "seq_len": 32, "lr": 3e-3,
                                       "warmup_steps": 2, "seed": 0}})


def _build(parallel: dict) -> tuple:
    """(par, optimizer, scheduler, data, config) at `parallel`'s layout, built as `lab.train` builds them."""
    config = _config(parallel)
    par = parallelize(config.model, build_mesh(config.parallel), config.parallel, torch.device("cpu"),
                      config.train.seed, config.train.seq_len)
    optimizer = adamw(par.parameters(), config.train.lr, config.train.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, config))
    data = SyntheticTokens(config.model.vocab_size, config.train.seq_len, config.train.global_batch, 0)
    return par, optimizer, scheduler, data, config


def _reshard_worker(source: str, target: str, parallel: dict) -> int:
    """Build the run at `parallel`'s layout, load `source` into it, save it to `target`."""
    par, optimizer, scheduler, data, config = _build(parallel)
    meta = checkpoint.load(source, par, optimizer, scheduler, data, config)
    checkpoint.save(target, meta["step"], par, optimizer, scheduler, data, config)
    return data.step


@pytest.mark.parametrize("source_layout, parallel", [
    ("dp4", {"dp": 2, "tp": 2}),
    ("zero3_dp4", {"dp": 2, "zero": 1}),
    ("pp2", {}),
    ("tp2", {}),
    ("tp4", {"dp": 2, "tp": 2}),
])
def test_reshard_is_exact(trained, tmp_path, source_layout, parallel):
    """Load at another layout and save again: every model and optimizer tensor, gathered whole, is equal."""
    source = str(trained(source_layout)[0] / "step-00000002")
    world = _config(parallel).parallel.world_size
    if world == 1:
        steps = [_reshard_worker(source, str(tmp_path), parallel)]
    else:
        steps = lab_dist.run(_reshard_worker, world, source, str(tmp_path), parallel, timeout_s=120)
    assert steps == [2] * world  # the data stream continues at the saved global batch
    before, after = checkpoint.read_full(source), checkpoint.read_full(str(tmp_path / "step-00000002"))
    tensors = [k for k in before if k.startswith(("model.", "optim."))]
    assert len(tensors) == 4 * len(list(build_model(_config({}).model).parameters()))
    for key in tensors:
        assert torch.equal(before[key], after[key]), key


def test_resume_at_another_dp_sees_the_same_global_batches(trained, tmp_path):
    """dp4 -> dp2 x tp2: the resumed run says how the data stream changed and continues with the same global
    batches (another batch would move the loss by far more than the reduction order's 1e-5)."""
    source, reference = trained("dp4")
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    shutil.copytree(source / "step-00000002", ckpt / "step-00000002")
    LAYOUTS["dp2_tp2"] = ["--nproc", "4", "--dp", "2", "--tp", "2"]
    done = _train("dp2_tp2", ckpt, log, "--resume")
    assert "resharded (dp 4->2, tp 1->2)" in done.stdout
    assert "each dp rank now reads other rows" in done.stdout
    resumed, expected = _losses(log), _losses(reference)[2:]
    assert len(resumed) == len(expected)
    for a, b in zip(resumed, expected, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)


# --- python -m lab checkpoint ----------------------------------------------------------------------------------


def test_inspect_and_convert(trained, tmp_path):
    source, _ = trained("tp2")
    done = subprocess.run([sys.executable, "-m", "lab", "checkpoint", "inspect", str(source)],  # its newest
                          capture_output=True, text=True, timeout=120, env=ENV)
    assert done.returncode == 0, done.stderr
    assert f"step {STEPS}, saved by 2 rank(s) [dp=1, tp=2" in done.stdout
    assert "model.layers.0.attn.wq.weight" in done.stdout and "(2 chunk(s))" in done.stdout
    assert "optim.layers.0.attn.wq.weight.exp_avg_sq" in done.stdout
    out = tmp_path / "model.pt"
    done = subprocess.run([sys.executable, "-m", "lab", "checkpoint", "convert", str(source / "step-00000004"),
                           "--to-single-file",
                           str(out)], capture_output=True, text=True, timeout=120, env=ENV)
    assert done.returncode == 0, done.stderr
    model = build_model(_config({}).model, "cpu")
    model.load_state_dict(torch.load(out))  # ordinary PyTorch, strict: every key, every shape
    saved = checkpoint.read_full(str(source / "step-00000004"), "model.")
    for name, param in model.named_parameters():
        assert torch.equal(param, saved[f"model.{name}"]), name


def test_bad_input_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "lab", "checkpoint", "inspect", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, env=ENV)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "not a complete checkpoint" in done.stderr
    done = subprocess.run([sys.executable, "-m", "lab.train", "--resume"], capture_output=True, text=True,
                          timeout=60, env=ENV)
    assert done.returncode == 2 and "need --checkpoint-dir" in done.stderr


def test_async_checkpoints_hold_the_same_state(trained, tmp_path):
    """--async-checkpoint: training goes on while a checkpoint is written from its copy in CPU memory; every
    checkpoint equals the synchronous run's, tensor by tensor."""
    source, reference = trained("dp2")
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    _train("dp2", ckpt, log, "--checkpoint-every", "2", "--async-checkpoint")
    assert _losses(log) == _losses(reference)
    for step in (2, 4, 6):
        name = f"step-{step:08d}"
        got, expected = checkpoint.read_full(str(ckpt / name)), checkpoint.read_full(str(source / name))
        assert all(torch.equal(got[k], expected[k]) for k in expected if not k.startswith("rng.")), name


def test_resume_at_the_last_step_trains_nothing(trained, tmp_path):
    source, _ = trained("dp2")
    shutil.copytree(source / f"step-{STEPS:08d}", tmp_path / f"step-{STEPS:08d}")
    done = _train("single", tmp_path, tmp_path / "log.jsonl", "--resume")
    assert "resharded (dp 2->1)" in done.stdout and f"already at step {STEPS}" in done.stdout
