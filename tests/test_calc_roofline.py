"""lab.calc.roofline against How to Scale Your Model ch. 1 (roofline) and lab.calc.flops' own counting."""

import pytest

from lab.calc import HARDWARE, training_flops
from lab.calc.roofline import (
    Op,
    attainable_flops,
    elementwise,
    intensity,
    llama_block_ops,
    matmul,
    peak_flops,
    place,
    ridge_point,
    rms_norm_fusion,
    softmax_fusion,
    swiglu_fusion,
)
from lab.config import PRESETS

LLAMA8B = PRESETS["llama3-8b"]


def test_ridge_points_are_the_books():
    # scaling book ch. 1, problem 5: H100 dense bf16 9.89e14 FLOP/s over 3.35e12 B/s HBM, B_crit ≈ 298 with the
    # rounded 1e15 (~295 with 989 TFLOP/s); TPU v5e 1.97e14 / 8.1e11 ≈ 240 ("batch > 240")
    assert ridge_point("h100") == pytest.approx(989.4e12 / 3.35e12) == pytest.approx(295, abs=1)
    assert ridge_point("tpu-v5e") == pytest.approx(240, abs=5)
    # fp16 runs at the bf16 rate on NVIDIA tensor cores; fp8 doubles the FLOP/s and so the ridge
    assert ridge_point("h100", "fp16") == ridge_point("h100")
    assert ridge_point("h100", "fp8") == pytest.approx(2 * ridge_point("h100"), rel=1e-3)


def test_dot_product_intensity_tends_to_one_half():
    # ch. 1: bf16[N]·bf16[N] -> bf16[1] does 2N − 1 FLOPs over 2N + 2N + 2 bytes
    n = 10**8
    assert intensity(2 * n - 1, 4 * n + 2) == pytest.approx(0.5, rel=1e-6)


def test_matmul_counts_and_the_batch_rule():
    # ch. 1: X bf16[B,D] · Y bf16[D,F] -> Z bf16[B,F]: 2BDF FLOPs, 2BD + 2DF + 2BF bytes, intensity ≈ B for B << D, F
    B, D, F = 64, 8192, 8192
    op = matmul("x", B, D, F, "bf16")
    assert op.flops == 2 * B * D * F
    assert op.bytes_moved == 2 * B * D + 2 * D * F + 2 * B * F
    assert op.intensity == pytest.approx(B, rel=0.02)
    # compute-bound only above the ridge: B = 256 is below H100's ~295, B = 512 above it
    assert place(matmul("x", 256, D, F), "h100").bound == "memory"
    assert place(matmul("x", 512, D, F), "h100").bound == "compute"
    assert matmul("x", 4, 8, 16, "fp32", batch=3).bytes_moved == 3 * 4 * (4 * 8 + 8 * 16 + 4 * 16)


def test_worked_example_v5e_memory_bound_168us():
    # ch. 1 graded exercise: B=64, D=F=8192 on TPU v5e is memory-bound; bytes 2(64·8192·2 + 8192²) ≈ 1.363e8 take
    # ≈ 168 µs at 8.1e11 B/s, the 8.6e9 FLOPs only ≈ 43.6 µs
    p = place(matmul("x", 64, 8192, 8192), "tpu-v5e")
    assert p.bound == "memory"
    assert p.time_s == pytest.approx(168e-6, rel=0.01)
    assert p.compute_s == pytest.approx(43.6e-6, rel=0.01)
    # ch. 1: 1e12 FLOPs take 1e12 / 9.89e14 = 1.01 ms on an H100
    assert place(Op("big", 1e12, 1.0, "matmul"), "h100").time_s == pytest.approx(1.01e-3, rel=0.01)


def test_attainable_is_the_roofline():
    h100 = HARDWARE["h100"]
    ridge = ridge_point(h100)
    assert attainable_flops(10, h100) == pytest.approx(10 * 3.35e12)
    assert attainable_flops(ridge, h100) == pytest.approx(peak_flops(h100))
    assert attainable_flops(10 * ridge, h100) == peak_flops(h100)
    p = place(matmul("x", 4096, 4096, 4096), h100)
    assert p.attainable == peak_flops(h100) and p.time_s == p.compute_s


def test_elementwise_ops_read_and_write():
    # a residual add reads two tensors and writes one: 3 x 2 bytes per bf16 element
    op = elementwise("add", 1, 1000, 2000, 1000, "bf16")
    assert (op.flops, op.bytes_moved) == (1000, 6000)
    ops = {op.name: op for op in llama_block_ops(LLAMA8B, 2, 512, "fp32")}
    n = 2 * 512 * LLAMA8B.d_model
    assert ops["attn_residual"].bytes_moved == 4 * 3 * n
    assert ops["attn_norm"].bytes_moved == 4 * (2 * n + LLAMA8B.d_model)
    assert ops["softmax"].bytes_moved == 4 * 2 * 2 * LLAMA8B.n_heads * 512**2


@pytest.mark.parametrize("device", list(HARDWARE))
@pytest.mark.parametrize(("batch", "seq"), [(1, 128), (64, 32768)])
def test_norms_softmax_activations_are_memory_bound_at_any_size(device, batch, seq):
    for op in llama_block_ops(LLAMA8B, batch, seq, "bf16"):
        if op.kind == "elementwise":
            assert op.intensity < 5 and place(op, device).bound == "memory", op.name


def test_projections_cross_the_ridge_with_tokens():
    # one token (decode) reads every weight for 2 FLOPs per weight: intensity ~1; 8 x 4096 tokens: compute-bound
    for op in llama_block_ops(LLAMA8B, 1, 1):
        if op.name.endswith("proj"):
            assert op.intensity < 2 and place(op, "h100").bound == "memory"
    for op in llama_block_ops(LLAMA8B, 8, 4096):
        if op.name.endswith("proj"):
            assert place(op, "h100").bound == "compute"


def test_flash_attention_moves_no_scores():
    naive = {op.name: op for op in llama_block_ops(LLAMA8B, 1, 8192, attention="naive")}
    flash = {op.name: op for op in llama_block_ops(LLAMA8B, 1, 8192, attention="flash")}
    core = ("scores", "softmax", "probs_v")
    assert flash["flash_attention"].flops == sum(naive[k].flops for k in core)
    assert sum(naive[k].bytes_moved for k in core) > 100 * flash["flash_attention"].bytes_moved
    # q·kᵀ with head_dim 128 in bf16 does 2·128 FLOPs per 2-byte score it writes: never above ~128, below the
    # H100 ridge, while the fused kernel is compute-bound
    assert place(naive["scores"], "h100").bound == "memory"
    assert place(flash["flash_attention"], "h100").bound == "compute"
    assert sum(place(naive[k], "h100").time_s for k in core) > 4 * place(flash["flash_attention"], "h100").time_s


@pytest.mark.parametrize("name", ["llama3-8b", "smollm-135m", "tiny"])
def test_block_matmuls_match_lab_calc_flops(name):
    """The block's matmul FLOPs x layers + the output layer = lab.calc.flops' exact forward count (a third of
    training), which is itself checked against torch's FlopCounterMode on lab.model."""
    cfg = PRESETS[name]
    batch, seq = 2, 64
    block = sum(op.flops for op in llama_block_ops(cfg, batch, seq, attention="flash") if op.kind == "matmul")
    softmax = 5 * batch * cfg.n_heads * seq * seq  # the flash op's softmax work, not a matmul
    forward = training_flops(cfg, seq, batch * seq, counting="exact").model_flops / 3
    assert (block - softmax) * cfg.n_layers + 2 * batch * seq * cfg.vocab_size * cfg.d_model == pytest.approx(forward)


def test_fusion_bytes():
    t, d = 4096, 4096
    norm = rms_norm_fusion(t, d, "bf16")
    # fused: read x and w, write y; unfused: pow, mean, +eps, rsqrt, x·r, ·w each read and write
    assert norm.fused_bytes == 2 * (2 * t * d + d)
    assert norm.unfused_bytes == 2 * (7 * t * d + 6 * t + d)  # x² and x·r written and read back
    assert norm.saving == pytest.approx(3.5, rel=0.01)
    assert softmax_fusion(1024, 32768).saving == pytest.approx(4, rel=0.001)
    assert swiglu_fusion(10, 10).saving == pytest.approx(5 / 3)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: llama_block_ops(LLAMA8B, 0, 128), "batch=0 must be an integer >= 1"),
    (lambda: llama_block_ops(LLAMA8B, 1, 2.5), "seq=2.5 must be an integer >= 1"),
    (lambda: llama_block_ops(LLAMA8B, 1, 8, "fp4"), "dtype='fp4' must be one of 'fp32', 'bf16', 'fp16', 'fp8', 'int8'"),
    (lambda: llama_block_ops(LLAMA8B, 1, 8, attention="sparse"), "attention='sparse' must be one of 'naive', 'flash'"),
    (lambda: llama_block_ops(PRESETS["mixtral-8x7b"], 1, 8), "model 'mixtral-8x7b' must be a dense GQA model"),
    (lambda: ridge_point("a100", "fp8"), "dtype='fp8' has no peak on NVIDIA A100 80GB SXM; valid: bf16, fp16, int8"),
    (lambda: ridge_point("h100", "fp32"), "dtype='fp32' has no peak on NVIDIA H100 SXM; valid: bf16, fp16, fp8, int8"),
    (lambda: ridge_point("v100"), "gpu='v100' must be one of h100"),
    (lambda: intensity(1.0, 0), "bytes_moved=0 must be > 0"),
    (lambda: attainable_flops(-1, "h100"), "intensity=-1 must be >= 0 FLOPs/byte"),
    (lambda: matmul("x", 0, 1, 1), "m=0 must be an integer >= 1"),
    (lambda: rms_norm_fusion(8, -1), "d_model=-1 must be an integer >= 1"),
])
def test_bad_input_is_one_clear_line(call, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        call()
    assert "\n" not in str(err.value)
