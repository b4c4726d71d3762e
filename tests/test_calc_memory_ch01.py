"""The formulas chapter 01's worked problems are checked against: bytes per parameter under ZeRO, gradient
accumulation, 6N FLOPs from the sizes alone, training time and throughput from MFU."""

import pytest

from lab.calc import static_bytes, training_flops
from lab.calc.flops import six_n_flops_per_token, tokens_per_second, training_time_s
from lab.calc.memory import bytes_per_param, grad_accum_steps
from lab.calc.params import param_breakdown
from lab.config import PRESETS


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_bytes_per_param_is_static_bytes_per_parameter(zero):
    n, dp = 8 * 10**9, 8  # dp divides n: no padding
    assert bytes_per_param("mixed", zero=zero, dp=dp) == sum(static_bytes(n, "mixed", zero=zero, dp=dp).values()) / n


def test_zero_paper_bytes_per_param():
    """ZeRO (Rajbhandari et al. 2019, Figure 1): 7.5B parameters on 64 GPUs take 120 GB without ZeRO, 31.4 GB
    with P_os, 16.6 GB with P_os+g, 1.9 GB with P_os+g+p (K = 12)."""
    got = [7.5e9 * bytes_per_param("mixed", zero=z, dp=64) / 1e9 for z in range(4)]
    assert got == pytest.approx([120, 31.4, 16.6, 1.9], abs=0.06)


def test_eight_a100s_largest_model():
    """The worked problem's numbers: 80 GiB A100s, mixed-precision Adam, 8 GPUs."""
    got = [80 * 2**30 / bytes_per_param("mixed", zero=z, dp=8) / 1e9 for z in range(3)]
    assert got == pytest.approx([5.37, 15.62, 22.91], abs=0.01)


def test_grad_accum_steps():
    assert grad_accum_steps(4 * 2**20, 4096, 2, 64) == 8


def test_six_n_from_sizes_equals_training_flops():
    cfg = PRESETS["llama3-8b"]
    n = param_breakdown(cfg)["active"]
    for recompute in ("none", "selective", "full"):
        estimate = training_flops(cfg, 8192, recompute=recompute)
        assert six_n_flops_per_token(n, cfg.n_layers, cfg.d_model, 8192, recompute) == (
            estimate.model_flops_per_token, estimate.hardware_flops_per_token)


def test_training_time_and_throughput_from_mfu():
    flops = 6 * 8.03e9 * 15e12
    assert training_time_s(flops, 1024, 989.4e12, 0.4) / 86_400 == pytest.approx(20.64, abs=0.01)
    per_token = six_n_flops_per_token(8.03e9, 32, 4096, 8192)[0]
    assert tokens_per_second(0.4, per_token, 989.4e12) == pytest.approx(6481, abs=1)


@pytest.mark.parametrize("call, message", [
    (lambda: bytes_per_param("fp8"), "precision='fp8' must be one of 'fp32', 'mixed'"),
    (lambda: bytes_per_param(zero=4), "zero=4 must be 0, 1, 2 or 3"),
    (lambda: bytes_per_param(dp=0), "dp=0 must be an integer >= 1"),
    (lambda: grad_accum_steps(1000, 4096, 1, 1), "global_batch_tokens=1000 must be a multiple of seq·micro_batch·dp"),
    (lambda: grad_accum_steps(4096, 0, 1, 1), "seq=0 must be an integer >= 1"),
    (lambda: six_n_flops_per_token(0), "n_params=0 must be > 0"),
    (lambda: six_n_flops_per_token(1e9, recompute="some"), "recompute='some' must be one of"),
    (lambda: training_time_s(1e20, 8, 1e15, 1.5), "mfu=1.5 must be in (0, 1]"),
    (lambda: training_time_s(-1.0, 8, 1e15, 0.5), "flops=-1.0 must be >= 0"),
    (lambda: tokens_per_second(0.5, 0, 1e15), "flops_per_token=0 must be > 0"),
])
def test_invalid_input(call, message):
    with pytest.raises(ValueError) as error:
        call()
    assert message in str(error.value) and "\n" not in str(error.value)
