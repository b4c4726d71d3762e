"""lab.calc.flops and lab.calc.hardware: against torch's FLOP counter on lab.model, and published numbers."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lab.calc import HARDWARE, count_params, get_accelerator, hfu, mfu, training_flops, utilization
from lab.config import PRESETS, ModelConfig
from lab.model import build_model, materialize, set_recompute

TINY = dataclasses.replace(PRESETS["tiny"], n_layers=2)
TINY_MOE = dataclasses.replace(PRESETS["tiny-moe"], n_layers=2)
TIED_MHA = dataclasses.replace(TINY, name="tied-mha", n_kv_heads=4, tie_embeddings=True)
# DeepSeek-V3 in miniature: MLA with a low-rank query, a dense first layer, then routed + shared experts
TINY_DEEPSEEK = ModelConfig(
    name="tiny-deepseek", vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=24, d_ff=128,
    attention="mla", q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    n_experts=4, top_k=2, d_ff_expert=32, n_shared_experts=1, n_dense_layers=1)


@pytest.mark.parametrize("cfg", [TINY, TINY_MOE, TIED_MHA, TINY_DEEPSEEK], ids=lambda c: c.name)
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_exact_counting_equals_flop_counter(cfg, recompute):
    """One training step of lab.model under FlopCounterMode. The math attention kernel is used because the
    counter has no formula for the CPU flash kernel (it would count attention as 0)."""
    model = materialize(build_model(cfg), seed=0)
    set_recompute(model, recompute)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    est = training_flops(cfg, 16, tokens.numel(), recompute=recompute, counting="exact")
    assert est.hardware_flops == counter.get_total_flops()
    if recompute == "none":
        assert est.model_flops == est.hardware_flops


def test_six_n_plus_attention():
    # PaLM (Chowdhery et al. 2022), Appendix B: FLOPs per sequence 6·s·N + 12·L·h·s²
    # (per token 6N + 12·L·h·s)
    cfg, s = PRESETS["llama3-8b"], 4096
    est = training_flops(cfg, s, 10 * s)
    assert est.model_flops_per_token == 6 * count_params(cfg) + 12 * cfg.n_layers * cfg.d_model * s
    assert est.model_flops == 10 * s * est.model_flops_per_token


def test_full_recompute_hfu_is_four_thirds_of_mfu():
    # playbook, "Activation recomputation": with full recompute the extra forward gives HFU = MFU·8/6
    # (scaling book ch. 4: block remat takes 6ND to ~8ND)
    est = training_flops(PRESETS["llama3-8b"], 4096, 2**22, recompute="full")
    assert hfu(est, 10.0, 64) / mfu(est, 10.0, 64) == pytest.approx(8 / 6)
    selective = training_flops(PRESETS["llama3-8b"], 4096, recompute="selective")
    assert 1 < selective.hardware_flops / selective.model_flops < 8 / 6


def test_mfu_matches_hand_computation():
    est = training_flops(PRESETS["llama3-8b"], 4096, 2**20)
    expected = est.model_flops / (2.0 * 8 * 989.4e12)
    assert mfu(est, 2.0, 8, "h100") == pytest.approx(expected)
    assert mfu(est, 2.0, 8, 989.4e12) == pytest.approx(expected)


def test_deepseek_v3_mfu():
    # How to Scale Your Model ch. 4, question 7: 6·37e9·14.8e12 FLOPs in 2.79M H800-hours at 1.513e15 fp8 dense = 21.7%
    # (3.3e24 / 1.52e25 with rounded factors; unrounded 21.6%)
    assert utilization(6 * 37e9 * 14.8e12, 2.79e6 * 3600, 1, 1.513e15) == pytest.approx(0.217, abs=1e-3)


def test_hardware_table():
    # How to Scale Your Model ch. 1: 1e12 FLOPs take 1.01 ms on an H100; critical intensity ~240 on TPU v5e
    # (1.97e14 / 8.1e11 = 243), ~298 on H100 (1e15 / 3.35e12; 295 with the exact dense 989.4 TFLOP/s)
    assert 1e12 / get_accelerator("h100").peak_flops() == pytest.approx(1.01e-3, abs=5e-6)
    assert round(HARDWARE["tpu-v5e"].critical_intensity()) == 243
    assert round(HARDWARE["h100"].critical_intensity()) == 295
    assert HARDWARE["h100"].peak_flops("fp8") == pytest.approx(2 * HARDWARE["h100"].peak_flops("bf16"), rel=1e-4)
    assert all(acc.source for acc in HARDWARE.values())


@pytest.mark.parametrize("call, message", [
    (lambda: training_flops(PRESETS["tiny"], 0), "seq=0 must be an integer >= 1"),
    (lambda: training_flops(PRESETS["tiny"], 32, recompute="most"), "recompute='most' must be one of"),
    (lambda: training_flops(PRESETS["tiny"], 32, counting="7N"), "counting='7N' must be one of"),
    (lambda: utilization(1e12, 0, 1, "h100"), "step_time=0 must be > 0"),
    (lambda: utilization(1e12, 1, 1, "h800"), "gpu='h800' must be one of"),
    (lambda: HARDWARE["a100"].peak_flops("fp8"), "dtype='fp8' has no peak on NVIDIA A100"),
])
def test_invalid_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()
