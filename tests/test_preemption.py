"""SIGTERM to a training run (`lab.preemption`): the run ends its step, writes a checkpoint at it and exits with
status 143; `--resume` continues from it to the same losses as a run that was never stopped.

In-process first (the signal raised from `on_step`, so it lands at a known step), then the command line with a
real SIGTERM from outside, at whatever step the run has reached.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab.checkpoint import CheckpointOptions, complete_checkpoints
from lab.config import load_config
from lab.preemption import EXIT_STOPPED, StoppedBySignal
from lab.train import run

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6


def _config():
    return load_config(ROOT / "configs" / "tiny.toml", [f"train.steps={STEPS}", "model.n_layers=2"])


def _sigterm_at(step: int):
    def on_step(entry) -> None:
        if entry.step == step:
            os.kill(os.getpid(), signal.SIGTERM)
    return on_step


@pytest.fixture
def ignored_sigterm():
    """A SIGTERM that no run handles is ignored rather than ending pytest (which the old lab.train let it do)."""
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        yield signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("every", [0, 3])  # a checkpoint of its own, or the one the step's regular save wrote
def test_sigterm_mid_run_checkpoints_that_step_and_resume_continues_exactly(tmp_path, every, ignored_sigterm):
    straight = [log.loss for log in run(_config(), 1, verbose=False)]
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(StoppedBySignal) as stopped:
        run(_config(), 1, verbose=False, checkpoint=CheckpointOptions(ckpt, every=every), on_step=_sigterm_at(3))
    assert stopped.value.step == 3 and [os.path.basename(p) for p in complete_checkpoints(ckpt)] == ["step-00000003"]
    assert stopped.value.path == complete_checkpoints(ckpt)[0]
    assert signal.getsignal(signal.SIGTERM) is ignored_sigterm  # the run's handler is gone with the run
    resumed = run(_config(), 1, verbose=False, checkpoint=CheckpointOptions(ckpt, every=every, resume=True))
    assert [log.step for log in resumed] == [4, 5, 6]
    assert [log.loss for log in resumed] == straight[3:]  # bit for bit: fp32 on a CPU


def test_without_checkpoints_sigterm_keeps_its_default_action(tmp_path):
    """Nothing to save: the handler is not installed, so SIGTERM ends the process as it always did."""
    script = ("import os, signal; from lab.config import load_config; from lab.train import run; "
              f"run(load_config('configs/tiny.toml', ['train.steps={STEPS}', 'model.n_layers=2']), 1, verbose=False, "
              "on_step=lambda e: os.kill(os.getpid(), signal.SIGTERM)); print('survived')")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGTERM and "survived" not in done.stdout


def test_the_command_line_exits_143_with_one_line_and_resumes(tmp_path):
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    argv = [sys.executable, "-m", "lab.train", "--config", "configs/tiny.toml", "--set", "model.n_layers=2",
            "--checkpoint-dir", str(ckpt), "--log-json", str(log), "--quiet"]
    process = subprocess.Popen([*argv, "--steps", "40"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        deadline = time.monotonic() + 240
        while not (log.exists() and len(log.read_text().splitlines()) >= 2):  # mid-run: two steps done
            assert process.poll() is None and time.monotonic() < deadline, "the run ended or never started"
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == EXIT_STOPPED == 143
    step = len(log.read_text().splitlines())
    assert 2 <= step < 40
    path = complete_checkpoints(str(ckpt))[-1]
    assert os.path.basename(path) == f"step-{step:08d}"
    assert err.strip().splitlines()[-1] == (f"python -m lab.train: stopped by SIGTERM after step {step}: checkpoint "
                                           f"{path} written; run again with --resume to continue from it (exit "
                                           f"status 143)")
    done = subprocess.run([*argv, "--steps", str(step + 2), "--resume"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == list(range(1, step + 3))
