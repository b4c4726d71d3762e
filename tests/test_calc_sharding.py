"""lab.calc.sharding's tensor-parallel arithmetic and lab.calc.roofline's TP matmuls: the published numbers they
reproduce, their agreement with the rest of lab.calc, and one clear line for bad input."""

from __future__ import annotations

import pytest

from lab.calc import sharding
from lab.calc.comms import bus_factor
from lab.calc.hardware import get_accelerator
from lab.calc.memory import korthikanti_layer_bytes
from lab.calc.network import LINKS
from lab.calc.roofline import matmul, ridge_point, tp_mlp_matmuls

V5P = get_accelerator("tpu-v5p")


def test_tp_bound_is_the_scaling_books():
    """How to Scale Your Model ch. 5: on TPU v5p (C/W = 4.59e14/1.8e11 ≈ 2,550) TP stays compute-bound below
    Y ≈ F/2550 — 11 for LLaMA-3 70B's F = 28,672 ("TP max Y for F = 28,672 on 1 axis → 11"), 3 axes triple it."""
    assert sharding.tp_max_degree(28672, V5P.bf16_flops, 1.8e11) == pytest.approx(11.24, abs=0.01)
    assert sharding.tp_max_degree(28672, V5P.bf16_flops, 1.8e11, n_axes=3) == pytest.approx(3 * 11.24, abs=0.03)


def test_tp_fits_in_a_node_not_across():
    """On H100s NVLink keeps tp = 8 compute-bound for a 70B MLP; 50 GB/s InfiniBand does not even allow tp = 2."""
    h100 = get_accelerator("h100").bf16_flops
    assert sharding.tp_max_degree(28672, h100, LINKS["nvlink4"].bandwidth) > 8
    assert sharding.tp_max_degree(28672, h100, LINKS["ib-ndr400"].bandwidth) < 2


def test_comm_to_compute_crosses_one_at_the_bound():
    """The ratio is (tp − 1)·C/(F·W): 1 at tp − 1 = the Scaling Book's bound, and it grows with tp."""
    y = sharding.tp_max_degree(28672, V5P.bf16_flops, 1.8e11)
    assert sharding.tp_comm_to_compute(28672, 2, V5P.bf16_flops, 1.8e11) == pytest.approx(1 / y)
    ratios = [sharding.tp_comm_to_compute(28672, tp, V5P.bf16_flops, 1.8e11) for tp in (2, 4, 8, 16)]
    assert ratios == sorted(ratios) and ratios[0] < 1 < ratios[-1]


def test_layer_bytes_are_four_ring_all_reduces():
    b, s, h, tp = 2, 4096, 8192, 8
    assert sharding.tp_layer_comm_bytes(b, s, h, tp) == 4 * bus_factor("all_reduce", tp) * b * s * h * 2
    assert sharding.tp_layer_comm_bytes(b, s, h, 1) == 0


def test_sp_saving_is_korthikantis_difference():
    """Korthikanti et al. 2022, eqs. 2 and 4 as lab.calc.memory implements them."""
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    without = korthikanti_layer_bytes(s, b, h, a, tp=t)
    with_sp = korthikanti_layer_bytes(s, b, h, a, tp=t, sp=True)
    assert sharding.sp_activation_saving(s, b, h, t) == pytest.approx(without - with_sp)


def test_partial_sums_reduce_scatter_half_the_all_reduce():
    args = (1024, 4096, 4, 2)
    assert sharding.partial_sum_bytes(*args) == 2 * sharding.partial_sum_bytes(*args, reduce_scatter=True)
    assert sharding.partial_sum_bytes(*args) == bus_factor("all_reduce", 4) * 1024 * 4096 * 2


def test_vocab_ce_and_kv_weights():
    assert sharding.vocab_ce_saving(128256, 2) == pytest.approx(10688)
    # Llama 3 70B: 8 KV heads of 128 over d_model 8192; tp 8 → one head per rank, tp 16 → still one (copied)
    one_head = 2 * 8192 * 128 * 2
    assert sharding.kv_weight_bytes(8192, 8, 128, 4) == 2 * one_head
    assert sharding.kv_weight_bytes(8192, 8, 128, 8) == sharding.kv_weight_bytes(8192, 8, 128, 16) == one_head


def test_tp_shrinks_the_per_gpu_matmuls():
    """The column matmul is x[T, D] · W1[D, F/tp]: its intensity falls with tp, below the H100's ridge at tp = 64
    for a 512-token micro-batch of a 70B MLP (D = 8192, F = 28,672)."""
    column, row = tp_mlp_matmuls(4096, 8192, 28672, 8)
    assert column.flops == row.flops == matmul("x", 4096, 8192, 28672).flops / 8
    intensities = [tp_mlp_matmuls(512, 8192, 28672, tp)[0].intensity for tp in (1, 8, 64)]
    assert intensities == sorted(intensities, reverse=True)
    assert intensities[1] > ridge_point("h100") > intensities[2]


@pytest.mark.parametrize(("call", "message"), [
    (lambda: sharding.tp_max_degree(0, 1e15, 4e11), "d_ff=0 must be > 0"),
    (lambda: sharding.tp_layer_comm_bytes(1, 1, 1, 0), "tp=0 must be an integer >= 1"),
    (lambda: sharding.kv_weight_bytes(8192, 8, 128, 3), "tp=3 must divide n_kv_heads=8 or be a multiple of it"),
    (lambda: tp_mlp_matmuls(16, 64, 100, 3), "tp=3 must divide d_ff=100"),
])
def test_bad_input_is_one_clear_line(call, message):
    with pytest.raises(ValueError) as raised:
        call()
    assert str(raised.value) == message
