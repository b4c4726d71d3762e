"""`--inject-failure` and `--max-restarts` (lab.faults): a rank fails on purpose, the whole group starts again from
its newest checkpoint, and the run ends with the uninterrupted run's losses, bit for bit (fp32 on CPU). The runs are
`python -m lab.train`'s `main`, called in this process (its ranks are forked), on the tiny model for 4 steps."""

import contextlib
import json
import socket

import pytest
import torch.distributed as dist

from lab.faults import InjectedFailure
from lab.train import main
from lab.trainer import _open_log

STEPS = 4
TINY = ["--config", "configs/tiny.toml", "--steps", str(STEPS), "--quiet"]


def _losses(log) -> list[float]:
    return [json.loads(line)["loss"] for line in open(log)]


def _steps(log) -> list[int]:
    return [json.loads(line)["step"] for line in open(log)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted dp2 run's losses, with the same checkpoints (every 2 steps)."""
    root = tmp_path_factory.mktemp("reference")
    assert main([*TINY, "--nproc", "2", "--checkpoint-dir", str(root / "ckpt"), "--checkpoint-every", "2",
                 "--log-json", str(root / "log.jsonl")]) == 0
    return _losses(root / "log.jsonl")


@pytest.mark.parametrize("spec, message", [
    ("rank=1", "inject-failure 'rank=1' names no step"),
    ("rank=1,step=2,rank=0", "'rank=0' is not rank=R, step=S or kind=K, each once"),
    ("rank 1,step=2", "'rank 1' is not rank=R, step=S or kind=K"),
    ("rank=one,step=2", "inject-failure rank='one' must be an integer"),
    ("rank=-1,step=2", "inject-failure rank=-1 must be an integer >= 0"),
    ("rank=1,step=0", "inject-failure step=0 must be an integer >= 1"),
    ("rank=1,step=2,kind=segfault", "inject-failure kind='segfault' must be one of raise, kill, hang"),
])
def test_a_bad_failure_spec_is_one_line(spec, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as err:
        InjectedFailure.parse(spec)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("args, message", [
    (["--inject-failure", "rank=2,step=1"], "inject-failure rank=2 must be in 0..1 (the run has 2 rank(s))"),
    (["--inject-failure", "rank=0,step=5"], "inject-failure step=5 must be in 1..4 (the run has 4 steps)"),
    (["--inject-failure", "rank=0,step=1,kind=hang", "--nproc", "1"], "kind='hang' needs 2 or more ranks"),
    (["--max-restarts", "1"], "--max-restarts=1 needs --checkpoint-dir: a restart resumes from the newest checkpoint"),
    (["--max-restarts", "-1", "--checkpoint-dir", "ckpt"], "--max-restarts=-1 must be an integer >= 0"),
    (["--collective-timeout", "0"], "--collective-timeout=0.0 must be > 0"),
])
def test_bad_flags_are_one_line_before_any_rank_starts(capsys, args, message):
    argv = [*TINY, *([] if "--nproc" in args else ["--nproc", "2"]), *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("kind", ["raise", "kill", "hang"])
def test_a_restart_resumes_from_the_last_checkpoint_and_ends_with_the_uninterrupted_losses(
        reference, tmp_path, capfd, kind):
    """Rank 1 fails in step 3 (after the step-2 checkpoint); --max-restarts 1 starts both ranks again, which resume
    from step 2: steps 3-4 are trained once more and every step's loss equals the uninterrupted run's."""
    log = tmp_path / "log.jsonl"
    assert main([*TINY, "--nproc", "2", "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2",
                 "--log-json", str(log), "--inject-failure", f"rank=1,step=3,kind={kind}", "--max-restarts", "1",
                 "--collective-timeout", "3"]) == 0  # a hang: rank 0 gives up waiting for rank 1 after 3 s
    out, err = capfd.readouterr()
    injected = [line for line in err.splitlines() if line.startswith("lab.faults:")]
    assert injected == [f"lab.faults: injecting a failure on rank 1 at step 3 (kind={kind})"], err  # once, rank 1
    cause = {"raise": "rank 1 failed: RuntimeError: injected failure: rank 1 at step 3",
             "kill": "rank 1 was killed by signal SIGKILL",
             "hang": "rank(s) [0] failed in a collective while rank(s) [1] never joined it"}[kind]
    assert f"lab.distributed.run: {cause}" in err
    assert "lab.distributed.run: restart 1/1: starting 2 rank(s) again" in err
    assert "restart 1/1: resuming from checkpoint step-00000002" in err
    assert "for 2 steps on 2 rank(s)" in out  # the restarted group trained steps 3 and 4 only
    assert _steps(log) == [1, 2, 3, 4]
    assert _losses(log) == reference


def test_without_restarts_the_failure_names_the_rank_and_the_step(tmp_path, capfd):
    """Rank 0 (which writes the log) fails in step 3 before its update: the log ends at step 2."""
    log = tmp_path / "log.jsonl"
    assert main([*TINY, "--nproc", "2", "--log-json", str(log), "--inject-failure", "rank=0,step=3"]) == 1
    err = capfd.readouterr().err
    assert "python -m lab.train: rank 0 failed: RuntimeError: injected failure: rank 0 at step 3" in err
    assert "restart" not in err
    assert _steps(log) == [1, 2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_under_torchrun_a_restarted_rank_resumes_from_the_last_checkpoint(tmp_path, monkeypatch, capfd, one_thread):
    """torchrun --max-restarts 1 with one rank, played in this process: attempt 0 (TORCHELASTIC_RESTART_COUNT=0)
    fails in step 3; attempt 1 resumes from step 2 and ends with the single-process run's losses."""
    single = tmp_path / "single.jsonl"
    assert main([*TINY, "--log-json", str(single)]) == 0
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    argv = [*TINY, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--log-json", str(log),
            "--inject-failure", "rank=0,step=3"]
    for key, value in (("RANK", 0), ("WORLD_SIZE", 1), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", _free_port()),
                       ("TORCHELASTIC_RESTART_COUNT", 0), ("TORCHELASTIC_MAX_RESTARTS", 1)):
        monkeypatch.setenv(key, str(value))
    try:
        with pytest.raises(RuntimeError, match="injected failure: rank 0 at step 3"):
            main(argv)  # torchrun would see the rank exit with an error, and start it again
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    assert _steps(log) == [1, 2]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))  # a new rendezvous, as torchrun makes for each attempt
    assert main(argv) == 0
    out, err = capfd.readouterr()
    assert "restart 1/1: resuming from checkpoint step-00000002" in err
    assert "for 2 steps on 1 rank(s)" in out  # steps 3 and 4
    assert not dist.is_initialized()
    assert _losses(log) == _losses(single)


def test_a_resumed_log_keeps_its_entries_on_disk_from_the_moment_it_is_opened(tmp_path):
    """A restart (or --resume) cuts the log back to the step it resumes from, in place: a kill before the next
    entry is flushed must not leave an empty log, and a line torn by the kill that ended the last attempt ends it."""
    log = tmp_path / "log.jsonl"
    lines = [json.dumps({"step": step, "loss": 1.0}) + "\n" for step in (1, 2, 3)]
    log.write_text("".join(lines) + '{"step": 4, "lo')
    opened = _open_log(str(log), 2)
    try:
        assert log.read_text() == "".join(lines[:2])  # before anything is written or flushed
        opened.write(lines[2])
    finally:
        opened.close()
    assert log.read_text() == "".join(lines)
