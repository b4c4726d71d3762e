"""`python -m lab serve` refuses ordinary bad input in one line before it starts work, and its tensor-parallel ranks
have no wall-clock limit: only a hang (no progress for --hang-timeout) stops them (issue 33)."""

import pytest

import lab.serve
from lab.config import load_config
from lab.distributed.launch import HANG_TIMEOUT_S
from lab.inference.engine import EngineConfig
from lab.inference.sampling import SamplingParams
from lab.serve import main, serve


@pytest.mark.parametrize("args, message", [
    (["--checkpoint", "{tmp}/nope"], "--checkpoint {tmp}/nope: no such directory (give a lab train --checkpoint-dir, "
                                     "or one of its step-N directories)"),
    (["--checkpoint", "{tmp}"], "--checkpoint {tmp}: no complete lab train checkpoint there (a step-N directory "
                                "holding .metadata and lab.json)"),
    (["--tp", "3"], "tp=3 must divide n_heads=4"),  # as lab train says it
    (["--json", "{tmp}/missing/report.json"], "--json {tmp}/missing/report.json: its directory {tmp}/missing does "
                                              "not exist"),
    (["--json", "{tmp}"], "--json {tmp}: is a directory; give a file path"),
    (["--prompt-len", "8", "300"], "--prompt-len MAX=300 + --max-tokens=32 = 332 tokens must be <= the model's "
                                   "max_seq_len=256"),
    (["--prompt-len", "8", "250", "--max-tokens", "7"], "--prompt-len MAX=250 + --max-tokens=7 = 257 tokens must be "
                                                        "<= the model's max_seq_len=256"),
    (["--hang-timeout", "0"], "--hang-timeout=0.0 must be a number of seconds > 0 (inf: no limit)"),
    (["--time-limit", "-5"], "--time-limit=-5.0 must be a number of seconds > 0 (inf: no limit)"),
])
def test_bad_input_is_one_line_and_exit_2_before_any_work(tmp_path, capsys, monkeypatch, args, message):
    """Formerly: a missing checkpoint was a 25-line traceback, --tp 3 two tracebacks from the ranks, a bad --json
    path failed after serving everything, and prompts past max_seq_len were served."""
    monkeypatch.setattr(lab.serve, "serve", lambda *args, **kwargs: pytest.fail("work started"))
    argv = ["--config", "configs/tiny.toml", "--requests", "2", *(a.format(tmp=tmp_path) for a in args)]
    assert main(argv) == 2
    assert capsys.readouterr().err == f"python -m lab serve: error: {message.format(tmp=tmp_path)}\n"


def test_tensor_parallel_ranks_have_no_wall_clock_limit_unless_asked(monkeypatch):
    """`lab serve --tp 2` died after 120 s (the launcher's old default) while it progressed."""
    calls = []
    monkeypatch.setattr(lab.serve.lab_dist, "run", lambda *args, **kwargs: calls.append(kwargs) or ["report"])
    config, engine, params = load_config("configs/tiny.toml"), EngineConfig(num_blocks=64), SamplingParams(4)
    assert serve(config, engine, params, 2, (4, 8), tp=2) == "report"
    assert serve(config, engine, params, 2, (4, 8), tp=2, hang_timeout_s=5, time_limit_s=60) == "report"
    assert [(kwargs["timeout_s"], kwargs["hang_timeout_s"]) for kwargs in calls] == [(None, HANG_TIMEOUT_S), (60, 5)]
