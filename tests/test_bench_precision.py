"""benchmarks/precision_side_by_side.py, small: `lab.train --precision bf16` against FSDP2's MixedPrecisionPolicy on 2
ranks for 3 steps, the comparison catching bugs planted on either side, lab's fp8-tensorwise against torchao's
float8 where torchao is installed, and the rows that say why a reference did not run."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from bench_support import load_benchmark

# From the same fp32 masters, lab and the reference do the same arithmetic: the same bf16 weights, the same bf16
# forward and backward ops, per-rank bf16 gradients summed in fp32 (two bf16 values add exactly in fp32) and the same
# AdamW on fp32 masters; for FP8, the same tensorwise recipe (e4m3 x and W, e5m2 dy, scale = 448 / amax in float64)
# through the same torch._scaled_mm. Measured: bit-identical losses and gradient norms at every step (10 steps too).
# The tolerances leave room for the order of fp32 additions only (the norm over shards, AdamW's foreach groups):
# 2 ulps of a loss near 5.5 (ulp 4.8e-7) and 1e-6 relative on the norm.
LOSS_TOL = 1e-6
NORM_TOL = 1e-6


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("precision_side_by_side")


@pytest.fixture(scope="module")
def config(bench):
    return bench.build_config(steps=3, nproc=2)


@pytest.fixture(scope="module")
def lab_bf16(bench, config):
    return bench.run_lab(config, "bf16")


@pytest.fixture(scope="module")
def bf16_row(bench, config, lab_bf16):
    return bench.compare("bf16", lab_bf16, bench.run_torch(config))


def test_lab_bf16_is_fsdp2_mixed_precision(bf16_row):
    row = bf16_row
    assert row["status"] == "ok" and [s["step"] for s in row["steps"]] == [1, 2, 3]
    assert row["step1_grad_norm_rel_diff"] <= NORM_TOL, row
    assert row["max_abs_diff"] <= LOSS_TOL, row
    assert all(abs(s["lab_grad_norm"] - s["ref_grad_norm"]) <= NORM_TOL * s["ref_grad_norm"] for s in row["steps"])
    losses = [s["lab_loss"] for s in row["steps"]]
    assert losses[-1] < losses[0]  # it trains


@pytest.mark.parametrize("plant, noticed_by", [
    # logits left in bf16: the loss itself is rounded to bf16 (2^-5 apart near 5.5): ~3e-2 off at step 1
    ({"fp32_logits": False}, "step-1 loss"),
    # gradients reduce-scattered in bf16: each summed gradient rounded to 8 bits, the step-1 norm by ~1e-5
    ({"reduce_dtype": torch.bfloat16}, "step-1 norm"),
    # masters from the bf16-rounded weights (lab's before issue 33): the same step 1, then a weight in four one bf16
    # step apart: measured max |diff| 2.4e-4 over 3 steps
    ({"rounded_masters": True}, "later loss"),
])
def test_a_bug_planted_in_the_reference_is_noticed(bench, config, lab_bf16, plant, noticed_by):
    row = bench.compare("bf16", lab_bf16, bench.run_torch(config, **plant))
    step1 = row["steps"][0]
    found = {"step-1 loss": step1["abs_diff"] > LOSS_TOL,  # what test_lab_bf16_is_fsdp2_mixed_precision holds
             "step-1 norm": row["step1_grad_norm_rel_diff"] > NORM_TOL,
             "later loss": row["max_abs_diff"] > LOSS_TOL}
    assert found[noticed_by], row


def test_a_bug_planted_in_lab_is_noticed(bench, config, bf16_row):
    """lab summing the ranks' gradients in bf16 (train.reduce_dtype, a supported setting) is not FSDP2's fp32
    reduction: the step-1 gradient norm differs by ~1e-5."""
    data = config.to_dict()
    coarse = bench.Config.from_dict({**data, "train": {**data["train"], "precision": "bf16", "reduce_dtype": "bf16"}})
    reference = [{"step": s["step"], "loss": s["ref_loss"], "grad_norm": s["ref_grad_norm"]}
                 for s in bf16_row["steps"]]
    row = bench.compare("bf16", bench.run_lab(coarse, "bf16"), reference)
    assert row["step1_grad_norm_rel_diff"] > NORM_TOL, row


def test_lab_fp8_tensorwise_is_torchao_float8(bench, config):
    pytest.importorskip("torchao.float8")
    (row,) = bench.precision_rows(config, "fp8-tensorwise")
    if row["status"] != "ok":  # a torchao that refuses this machine: the row must say so, and why
        assert row["status"].startswith("not run: torchao's float8 training failed here: "), row
        return
    assert row["max_abs_diff"] <= LOSS_TOL and row["step1_grad_norm_rel_diff"] <= NORM_TOL, row


def test_a_missing_torchao_is_a_row_that_says_why(bench, config, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao...` now raises ImportError
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    reason = bench.torchao_missing()
    assert reason.startswith("torchao is not installed") and "pip install" in reason
    rows = bench.precision_rows(config, "fp8-tensorwise", lab=pytest.fail, reference=pytest.fail)  # nothing runs
    assert rows == [{"precision": "fp8-tensorwise", "reference": bench.REFERENCES["fp8-tensorwise"],
                     "status": f"not run: {reason}"}]
    assert bench.torchao_tilewise_refusal(config) == reason


def test_a_failing_torchao_is_a_row_that_says_why(bench, config, monkeypatch):
    monkeypatch.setattr(bench, "torchao_missing", lambda: None)

    def refuse(config, **options):
        raise RuntimeError("rank 0 failed: NotImplementedError: _scaled_mm on cpu\ntraceback")

    (row,) = bench.precision_rows(config, "fp8-tensorwise", lab=pytest.fail, reference=refuse)
    assert row["status"] == ("not run: torchao's float8 training failed here: RuntimeError: rank 0 failed: "
                             "NotImplementedError: _scaled_mm on cpu")
    with pytest.raises(RuntimeError, match="rank 0 failed"):  # a failing FSDP2 is a bug to see, not a row
        bench.precision_rows(config, "bf16", lab=pytest.fail, reference=refuse)


def test_torchao_tilewise_refuses_a_cpu(bench, config):
    pytest.importorskip("torchao.prototype.blockwise_fp8_training.linear")
    reason = bench.torchao_tilewise_refusal(config)
    assert reason.startswith("torchao.prototype.blockwise_fp8_training refuses on this machine: ")
    assert "divisible by 128" in reason  # the tiny model's 64-wide linears are too narrow for it as well


def test_main_prints_and_writes_the_rows(bench, bf16_row, monkeypatch, tmp_path, capsys):
    """The CLI around the rows (the runs are the fixture's, not made again)."""
    found = [bf16_row, bench.not_run("fp8-tilewise", "no Hopper here")]
    monkeypatch.setattr(bench, "rows", lambda config: found)
    out = tmp_path / "precision.json"
    assert bench.main(["--steps", "3", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["torch"] == torch.__version__ and record["config"]["parallel"]["dp"] == 2
    assert record["config"]["model"]["n_layers"] == 2 and record["rows"] == found
    printed = capsys.readouterr().out
    assert f"{bf16_row['steps'][2]['ref_loss']:.6f}" in printed and "not run: no Hopper here" in printed


def test_layouts_fsdp2_alone_cannot_reproduce_are_refused(bench):
    with pytest.raises(ValueError, match=r"parallel \{'tp': 2\}: this benchmark compares plain data parallelism"):
        bench.build_config(sets=["parallel.tp=2"])
    with pytest.raises(ValueError, match="grad_accum"):
        bench.build_config(sets=["parallel.grad_accum=2"])
    with pytest.raises(ValueError, match="nproc=0 must be an integer >= 1"):
        bench.build_config(nproc=0)
