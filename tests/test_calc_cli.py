"""`python -m lab calc memory|flops|params`: tables, JSON, and one-line errors with exit status 2."""

import json
import subprocess
import sys

import pytest

from lab.calc import estimate_memory, training_flops
from lab.calc.cli import main
from lab.config import PRESETS, ParallelConfig


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_memory_json_matches_the_library(capsys):
    code, out, _ = run(capsys, "memory", "--model", "llama3-8b", "--seq", "4096", "--dp", "8", "--zero", "1",
                       "--tp", "2", "--sp", "--pp", "2", "--grad-accum", "4", "--recompute", "selective",
                       "--flash", "--json")
    assert code == 0
    data = json.loads(out)
    parallel = ParallelConfig(dp=8, zero=1, tp=2, sp=True, pp=2, grad_accum=4, recompute="selective")
    assert data == estimate_memory(PRESETS["llama3-8b"], 4096, 1, parallel, flash=True).as_dict()
    assert set(data["per_gpu_bytes"]) == {"params", "grads", "optimizer", "activations", "total"}
    assert set(data["activations_breakdown"]) == {"layers", "embedding", "logits"}
    assert isinstance(data["num_params"], int) and data["num_params"] == 8_030_261_248


def test_memory_table_labels_units(capsys):
    code, out, _ = run(capsys, "memory", "--model", "tiny", "--seq", "64", "--precision", "fp32",
                       "--activation-model", "exact")
    assert code == 0
    assert "GiB (2^30 B)" in out and "GB (10^9 B)" in out
    for row in ("params", "grads", "optimizer", "activations", "layers", "embedding", "logits", "total"):
        assert any(line.split()[0] == row for line in out.splitlines() if line.strip())


def test_flops_json_with_mfu(capsys):
    code, out, _ = run(capsys, "flops", "--model", "llama3-8b", "--seq", "4096", "--dp", "64", "--grad-accum", "4",
                       "--recompute", "full", "--step-time", "5.0", "--gpu", "h100", "--json")
    assert code == 0
    data = json.loads(out)
    est = training_flops(PRESETS["llama3-8b"], 4096, 4096 * 64 * 4, recompute="full")
    assert data["tokens_per_step"] == 4096 * 64 * 4 and data["n_gpus"] == 64
    assert data["flops_per_step"] == {"model": est.model_flops, "hardware": est.hardware_flops}
    assert data["mfu"] == pytest.approx(est.model_flops / (5.0 * 64 * 989.4e12))
    assert data["hfu"] / data["mfu"] == pytest.approx(8 / 6)


def test_flops_table(capsys):
    code, out, _ = run(capsys, "flops", "--model", "llama3-8b", "--gpu", "h100", "--step-time", "1")
    assert code == 0 and "MFU" in out and "HFU" in out and "tokens per step" in out


@pytest.mark.parametrize("argv, message", [
    (["memory", "--model", "llama3-8b", "--tp", "3"], "tp=3 must divide n_heads=32"),
    (["memory", "--model", "llama3-8b", "--zero", "4"], "zero=4 must be one of 0, 1, 2, 3"),
    (["memory", "--model", "llama3-8b", "--seq", "-1"], "seq=-1 must be an integer >= 1"),
    (["memory", "--model", "llama3-8b", "--sp"], "sp=True needs tp > 1"),
    (["memory", "--model", "llama3-8b", "--activation-model", "exact"], "precision='mixed' must be 'fp32'"),
    (["flops", "--model", "llama3-8b", "--step-time", "2"], "--step-time=2.0 needs --gpu"),
    (["flops", "--model", "gpt-17"], "unknown model preset 'gpt-17'"),
])
def test_bad_values_exit_2_with_one_line(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1


def test_argparse_errors_and_params_through_python_m_lab():
    def lab(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "lab", "calc", *args], capture_output=True, text=True,
                              timeout=120)
    bad = lab("memory", "--model", "llama3-8b", "--precision", "fp16")
    assert bad.returncode == 2 and "--precision: invalid choice: 'fp16'" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    done = lab("params", "--model", "llama3-8b")
    assert done.returncode == 0 and "8,030,261,248 parameters" in done.stdout


# --- python -m lab calc bubble -----------------------------------------------------------------------------

@pytest.mark.parametrize("schedule, chunks", [("afab", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4),
                                              ("zb-h1", 1)])
def test_bubble_json_is_the_simulator_and_the_closed_form(capsys, schedule, chunks):
    """The playbook's PP=8, m=32 figure: (p-1)/(v·m) = 0.21875 without interleaving, 0.0547 with v = 4."""
    from lab.calc.bubble import bubble_ratio, explore, zb_h1_bubble

    code, out, _ = run(capsys, "bubble", "--schedule", schedule, "--pp", "8", "--microbatches", "32",
                       *(["--chunks", str(chunks)] if schedule == "interleaved" else []), "--json")
    assert code == 0
    data = json.loads(out)
    sim = explore(schedule, 8, 32, chunks)
    assert {k: data[k] for k in sim.as_dict()} == sim.as_dict()
    assert data["bubble_ratio"] == pytest.approx(sim.idle[0] / sim.busy[0])
    assert data["idle_fraction"] == pytest.approx(sum(sim.idle) / (8 * data["makespan"]))
    assert len(data["peak_activations"]) == 8 and data["closed_form_exact"] is True
    if schedule == "zb-h1":
        assert data["idle_closed_form"] == zb_h1_bubble(8, 1, 2, 1) == max(data["idle"])
        assert data["bubble_ratio_closed_form"] == pytest.approx(7 * (1 + 2 - 2) / (32 * (1 + 2)))
    else:
        assert data["bubble_ratio_closed_form"] == bubble_ratio(8, 32, chunks) == pytest.approx(data["bubble_ratio"])
    assert {"p2p_messages", "tf", "tb", "tw", "p2p", "busy", "idle", "chunks"} <= set(data)


def test_bubble_defaults_costs_and_latency(capsys):
    """--chunks defaults to 2 for interleaved; costs and latency reach the simulator; the closed form says when it
    does not hold (latency; ZB-H1 with W longer than B)."""
    from lab.calc.bubble import explore

    data = json.loads(run(capsys, "bubble", "--schedule", "interleaved", "--pp", "4", "--microbatches", "8",
                          "--json")[1])
    assert data["chunks"] == 2 and data["bubble_ratio"] == pytest.approx(3 / 16)
    data = json.loads(run(capsys, "bubble", "--schedule", "zb-h1", "--pp", "4", "--microbatches", "8", "--tf", "2",
                          "--tb", "3", "--tw", "1", "--p2p", "0.5", "--json")[1])
    assert data["makespan"] == explore("zb-h1", 4, 8, tf=2, tb=3, tw=1, p2p=0.5).makespan
    assert data["closed_form_exact"] is False and data["makespan"] > 8 * 5 + 3 * (2 + 3 - 2)
    data = json.loads(run(capsys, "bubble", "--schedule", "zb-h1", "--pp", "2", "--microbatches", "2", "--tf", "1",
                          "--tb", "1", "--tw", "1", "--json")[1])
    assert data["closed_form_exact"] is False and data["idle_closed_form"] == 0 < max(data["idle"])


def test_bubble_table_has_the_numbers_and_a_timeline(capsys):
    """Playbook exercise: p = 4, m = 8, t_f = 1, t_b = 2: step time 33, 9 idle per rank; rank 3 starts 3 t_f late."""
    code, out, _ = run(capsys, "bubble", "--schedule", "afab", "--pp", "4", "--microbatches", "8")
    assert code == 0
    for label in ("bubble ratio (idle / useful)  0.375", "closed form 0.375", "idle fraction (idle / total)",
                  "makespan                      33 time units", "peak activations", "(p-1)/(v·m)",
                  "timeline: 1 column = 0.5 time units"):
        assert label in out, label
    timeline = [line.strip() for line in out.splitlines() if line.strip().startswith("rank ") and "|" in line]
    assert len(timeline) == 4
    assert timeline[3] == "rank  3 |" + "." * 6 + "Ff" * 8 + "Bbbb" * 8 + "." * 12 + "|"
    for line in timeline:  # 9 idle time units per rank = 18 columns of 0.5
        assert line.count(".") == 18 and line.count("F") == line.count("B") == 8
    out = run(capsys, "bubble", "--schedule", "zb-h1", "--pp", "4", "--microbatches", "8")[1]
    assert "W = weight gradient" in out and all(line.count("W") == 8 for line in out.splitlines() if " |" in line)


def test_bubble_help_states_the_time_model(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bubble", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for phrase in ("--tf the forward of one micro-batch through one stage", "--tb its whole backward",
                   "--tw the weight-gradient part of tb", "--p2p the latency", "afab,1f1b,interleaved,zb-h1"):
        assert phrase in text, phrase


@pytest.mark.parametrize("argv, message", [
    (["--pp", "0"], "pp=0 must be an integer >= 1"),
    (["--microbatches", "0"], "microbatches=0 must be an integer >= 1"),
    (["--schedule", "interleaved", "--pp", "4", "--microbatches", "6"], "microbatches=6 must be a multiple of pp=4"),
    (["--schedule", "interleaved", "--chunks", "1"], "chunks=1 must be >= 2 for the interleaved schedule"),
    (["--schedule", "1f1b", "--chunks", "2"], "chunks=2: only the interleaved schedule runs several chunks"),
    (["--schedule", "zb-h1", "--tb", "1", "--tw", "2"], "tw=2.0 must be <= tb=1.0"),
    (["--tf", "-1"], "tf=-1.0 must be a finite number >= 0"),
    (["--tf", "inf"], "tf=inf must be a finite number >= 0"),
    (["--tw", "nan"], "tw=nan must be a finite number >= 0"),
    (["--tf", "0", "--tb", "0", "--tw", "0"], "tf=0 and tb=0: at least one of the forward and the backward"),
    (["--p2p", "-0.5"], "p2p=-0.5 must be a finite number >= 0"),
    (["--pp", "1024", "--microbatches", "1024"], "pp x microbatches x chunks = 1,048,576 must be at most 65,536"),
])
def test_bubble_bad_values_exit_2_with_one_line(capsys, argv, message):
    code, out, err = run(capsys, "bubble", *argv)
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1
    assert err.startswith("python -m lab calc bubble: error: ")


@pytest.mark.parametrize("argv, message", [
    (["--schedule", "gpipe"], "argument --schedule: invalid choice: 'gpipe' (choose from 'afab', '1f1b',"),
    (["--pp", "2.5"], "argument --pp: invalid int value: '2.5'"),
])
def test_bubble_argparse_errors_exit_2_with_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(["bubble", *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1
