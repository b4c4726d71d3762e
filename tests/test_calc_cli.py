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
