"""lab.calc.inference against How to Scale Your Model's worked numbers (ch. 4, "All the
Transformer Math You Need"; ch. 7 and 8, inference), and `python -m lab calc inference`.

The book's TPU v5e numbers use 1.97e14 FLOP/s, 8.2e11 B/s of HBM bandwidth (ch. 7's B_crit = 240; lab.calc.hardware
holds the chip table's 8.1e11) and "16 GB" per chip: `V5E_BOOK` is that chip, so the book's arithmetic is
reproduced as printed. Where the book's arithmetic is wrong the corrected value is tested and said so.
"""

import json
import math

import pytest

from lab.calc.cli import main
from lab.calc.hardware import HARDWARE, Accelerator
from lab.calc.inference import (
    critical_batch,
    decode_step,
    ep_counts_exchange,
    ep_decode,
    forward_flops_per_token,
    inference_roofline,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    kv_sharding,
    max_sequences,
    prefill_time,
    serving_plan,
    step_time,
    throughput_latency,
    weight_bytes_read,
)
from lab.calc.params import count_params, param_breakdown
from lab.config import PRESETS, ModelConfig

V5E_BOOK = Accelerator("TPU v5e, as ch. 7-8 compute with it", 1.97e14, None, 3.94e14, 16 * 10**9, 8.2e11,
                       "How to Scale Your Model ch. 7 (1.97e14 / 8.2e11 = 240) and ch. 8 (16 GB per chip)")
H100_BOOK = Accelerator("H100, rounded as ch. 1 does", 1e15, None, None, 80 * 10**9, 3.35e12,
                        "How to Scale Your Model ch. 1 problem 5: 1e15 dense bf16, 3.35e12 B/s")
LLAMA70B = PRESETS["llama3-70b"]
# LLaMA-2-13B (ch. 7's tables): L 40, D 5120, 40 heads of 128, F 13824, V 32000; context raised to the tables' 8192
LLAMA2_13B = ModelConfig(name="llama2-13b", vocab_size=32000, d_model=5120, n_layers=40, n_heads=40, n_kv_heads=40,
                         d_ff=13824, max_seq_len=8192)
# ch. 7's problem-set model ("based on LLaMA-2 13B"): L 64, D 4096, F 16384, N 32, K 8, H 256, V 32128, shared embedding
CH7_MODEL = ModelConfig(name="ch7", vocab_size=32128, d_model=4096, n_layers=64, n_heads=32, n_kv_heads=8,
                        head_dim=256, d_ff=16384, max_seq_len=131072, tie_embeddings=True)


# --- the KV cache -------------------------------------------------------------------------------------------

def test_llama3_70b_kv_per_token():
    # ch. 8, worked question 1: int8 KV per token = 2·K·H·L = 2·8·128·80 = 160 kB, exactly 163,840 B; bf16 twice
    # that (the ch. 8 table's "324 kB" is 327,680 B: kB vs KiB)
    assert kv_bytes_per_token(LLAMA70B, kv_bytes=1) == 163_840
    assert kv_bytes_per_token("llama3-70b") == 327_680
    # same question: ≈ 5.3 GB per 32k-token sequence, and 240 of them ≈ 1.3 TB
    assert kv_bytes_per_sequence(LLAMA70B, 32768, kv_bytes=1) == pytest.approx(5.3e9, rel=0.02)
    assert 240 * kv_bytes_per_sequence(LLAMA70B, 32768, kv_bytes=1) == pytest.approx(1.3e12, rel=0.02)


def test_mha_kv_examples_of_chapter_4():
    # ch. 4 problem 1: D = 4096, L = 64, MHA (N·H = D), int8: KV per token = 2·L·N·H = 512 kB (524,288 B)
    ch4 = ModelConfig(name="ch4-q1", vocab_size=32000, d_model=4096, n_layers=64, n_heads=32, n_kv_heads=32,
                      d_ff=16384, max_seq_len=8192)
    assert kv_bytes_per_token(ch4, kv_bytes=1) == 524_288
    # ch. 4, KV cache section: 8k context, 64 layers, K·H = D = 8192, int8: 2·8192·64·8192 B = 8 GiB per sequence
    wide = ModelConfig(name="ch4-kv", vocab_size=32000, d_model=8192, n_layers=64, n_heads=64, n_kv_heads=64,
                       d_ff=32768, max_seq_len=8192)
    assert kv_bytes_per_sequence(wide, 8192, kv_bytes=1) == 8 * 2**30


def test_gqa_kv_of_the_other_worked_models():
    # ch. 7, problem 1 (its KV part, derived here: 2·L·K·H): 2·64·8·256 = 262,144 B int8
    assert kv_bytes_per_token(CH7_MODEL, kv_bytes=1) == 262_144
    # ch. 7 table: LLaMA-2-13B (MHA) holds 6.7 GB per 8192-token sequence in bf16; 1.34 GB with 8 KV heads
    assert kv_bytes_per_sequence(LLAMA2_13B, 8192) == pytest.approx(6.7e9, rel=0.01)
    gqa = ModelConfig(**{**LLAMA2_13B.__dict__, "n_kv_heads": 8})
    assert kv_bytes_per_sequence(gqa, 8192) == pytest.approx(1.34e9, rel=0.01)
    # ch. 8, end-of-chapter problems 2 and 3 ([derived]): LLaMA-3 8B 65,536 B and 405B ≈ 258 kB per token, int8
    assert kv_bytes_per_token("llama3-8b", kv_bytes=1) == 65_536
    assert kv_bytes_per_token("llama3-405b", kv_bytes=1) == pytest.approx(258e3, rel=0.001)


def test_mla_keeps_one_latent_per_token_and_layer():
    # DeepSeek-V2 §2.1.4 / V3: MLA caches (d_c + d_h^R)·l elements per token = (512 + 64)·61, not 2·128·128·61
    assert kv_bytes_per_token("deepseek-v3") == (512 + 64) * 61 * 2 == 70_272
    assert kv_sharding("deepseek-v3", 8) == (1, 8)  # one latent for all heads: sharded over the batch only


# --- the critical batch -----------------------------------------------------------------------------------------

def test_critical_batch_is_the_ridge_scaled_by_weight_bytes():
    # ch. 7 "linear ops": B_crit = 1.97e14 / 8.2e11 = 240 on a v5e in bf16 (lab's chip table, 8.1e11: 243);
    # ch. 1 problem 5: H100 dense 1e15 / 3.35e12 ≈ 298 (295 with 989.4 TFLOP/s)
    assert critical_batch(V5E_BOOK) == pytest.approx(240, rel=0.002)
    assert critical_batch("tpu-v5e") == pytest.approx(243, abs=0.5)
    assert critical_batch(H100_BOOK) == pytest.approx(298, abs=0.6)
    assert critical_batch("h100") == pytest.approx(295, abs=0.5)
    # ch. 7 and ch. 8 worked question 4: int8 weights with bf16 compute halve it to 120; int8 x int8 is 240 again
    assert critical_batch(V5E_BOOK, weight_bytes=1) == pytest.approx(120, rel=0.002)
    assert critical_batch(V5E_BOOK, weight_bytes=1, precision="int8") == pytest.approx(240, rel=0.002)
    # the same reasoning on an H100 with fp8 weights: bf16 compute halves it, fp8 compute restores it
    assert critical_batch("h100", 1) == pytest.approx(critical_batch("h100") / 2)
    assert critical_batch("h100", 1, "fp8") == pytest.approx(critical_batch("h100"), rel=0.001)


def test_moe_critical_batch_grows_by_e_over_k():
    # ch. 4 problem 8: int8 weights, bf16 FLOPs on a v5e: B > 120·E/k = 3840 for DeepSeek (E = 256 routed, k = 8)
    assert critical_batch(V5E_BOOK, weight_bytes=1, model="deepseek-v3") == pytest.approx(3840, rel=0.002)
    # ch. 7 problem 5 ([derived]): the problem model as an MoE of E = 16, k = 2: 960 (int8), 1920 (bf16)
    moe = ModelConfig(**{**CH7_MODEL.__dict__, "n_experts": 16, "top_k": 2})
    assert critical_batch(V5E_BOOK, 1, model=moe) == pytest.approx(960, rel=0.002)
    assert critical_batch(V5E_BOOK, 2, model=moe) == pytest.approx(1920, rel=0.002)
    assert critical_batch(V5E_BOOK, model="llama3-70b") == critical_batch(V5E_BOOK)  # dense: no factor


def test_moe_step_reads_the_experts_its_tokens_touch():
    parts = param_breakdown(PRESETS["deepseek-v3"])
    assert weight_bytes_read("deepseek-v3", 1) == 2 * parts["active"]  # batch 1 reads the active parameters
    assert weight_bytes_read("deepseek-v3", 4096) == pytest.approx(2 * parts["total"], rel=1e-9)
    assert weight_bytes_read("llama3-70b", 1, weight_bytes=1) == count_params(LLAMA70B)


# --- decode and prefill on LLaMA-3 70B (ch. 8) ------------------------------------------------------------------

def test_llama3_70b_decode_on_v5e_slices():
    # ch. 8, worked question 3: batch 32 at 8192 context, int8 weights and KV, bf16 FLOPs. On 4x2 (8 chips):
    # B_crit ≈ 120 so memory-bound, (KV + params) / (8·HBM) = 112e9 / (8·8.1e11) ≈ 17 ms, 235 tokens/s/chip
    # (70.55e9 parameters, not 70e9, read 1.3 % more); on 4x4, 8.5 ms at the same per-chip throughput.
    step = decode_step(LLAMA70B, V5E_BOOK, 32, 8192, tp=8, kv_bytes=1, weight_bytes=1)
    assert step.bound == "memory" and step.time_s == step.latency_bound_s
    assert 8 * (step.weight_bytes + step.kv_bytes) == pytest.approx(112e9, rel=0.02)  # ch. 8 question 2: ≈ 112 GB
    assert step.time_s == pytest.approx(0.017, rel=0.03)
    assert step.tokens_per_s_per_chip == pytest.approx(235, rel=0.03)
    wider = decode_step(LLAMA70B, V5E_BOOK, 32, 8192, tp=16, kv_bytes=1, weight_bytes=1)
    assert wider.time_s == pytest.approx(0.0085, rel=0.03)
    assert wider.tokens_per_s_per_chip == pytest.approx(step.tokens_per_s_per_chip)
    # 16 chips split the KV over 8 heads x 2 batch halves: each holds 16 sequences' KV for one head
    assert kv_sharding(LLAMA70B, 16) == (8, 2)
    assert wider.kv_bytes == 16 * kv_bytes_per_sequence(LLAMA70B, 8192, 1) / 8


def test_latency_at_the_largest_batch_is_one_full_hbm_read():
    # ch. 8, worked question 6: with HBM full of weights and KV, a step reads all of it: 16e9 / 8.2e11 ≈ 19 ms
    plan = serving_plan("llama3-70b", V5E_BOOK, tp=8, context=8192, kv_bytes=1, weight_bytes=1)
    assert plan["batch"] == plan["max_sequences"] == 42
    assert plan["step"]["time_s"] == pytest.approx(16e9 / 8.2e11, rel=0.03)
    assert plan["step"]["time_s"] < 16e9 / 8.2e11


def test_general_step_time_of_the_ch7_quiz():
    # ch. 7 quiz: 30B dense, int8 weights, bf16 FLOPs, 16 v5e, 8192 context, 100 kB of KV per token.
    # B = 4: (4·819e6 + 30e9) / (16·8.1e11) ≈ 2.5 ms; B = 256: the MLP is compute-bound, 256·819e6 / (16·8.1e11)
    # + 2·256·30e9 / (16·1.97e14) ≈ 21 ms. The quiz's chip has 8.1e11 B/s: lab's tpu-v5e entry.
    kv_seq = 100e3 * 8192
    small = step_time(4, 30e9 / 16, 4 * kv_seq / 16, 2 * 30e9 * 4 / 16, "tpu-v5e", chips=16)
    assert small.bound == "memory" and small.time_s == pytest.approx(2.5e-3, rel=0.03)
    large = step_time(256, 30e9 / 16, 256 * kv_seq / 16, 2 * 30e9 * 256 / 16, "tpu-v5e", chips=16)
    assert large.bound == "compute" and large.time_s == pytest.approx(21e-3, rel=0.02)
    assert large.time_s > large.latency_bound_s  # past B_crit the bandwidth bound no longer holds


def test_prefill_of_8k_tokens_at_40_percent_mfu():
    # ch. 8, worked question 10: 8192 tokens of LLaMA-3 70B on 16 v5e at 40 % MFU: 2·70e9·8192 / (16·1.97e14·0.4)
    # ≈ 0.91 s. The book counts the weight matmuls only; attention over the prompt adds 4·D·T·L per token (~15 %).
    prefill = prefill_time(LLAMA70B, V5E_BOOK, 8192, tp=16, mfu=0.4)
    assert prefill.linear_flops / (16 * 1.97e14 * 0.4) == pytest.approx(0.91, rel=0.02)
    assert prefill.attention_flops == 8192 * 4 * 8192 * 8192 * 80
    assert prefill.time_s == pytest.approx((prefill.linear_flops + prefill.attention_flops) / (16 * 1.97e14 * 0.4))
    assert prefill_time(LLAMA70B, V5E_BOOK, 8192, tp=16, mfu=0.8).time_s == pytest.approx(prefill.time_s / 2)


def test_forward_flops_are_the_6n_count_of_lab_calc_flops():
    linear, attention = forward_flops_per_token(LLAMA70B, 1000)
    assert linear == 2 * param_breakdown(LLAMA70B)["active"] and attention == 4 * 8192 * 1000 * 80


# --- memory: how many sequences fit, and the minimum topology ---------------------------------------------------

def test_sequences_that_fit_a_v5e_slice():
    # ch. 7 problem 2 ([derived]): the problem model, int8 everywhere, on 4x4 v5e (16 GB each) at 8192 tokens:
    # (256e9 - 18.4e9) / (262,144·8192) ≈ 110 sequences
    assert count_params(CH7_MODEL) == pytest.approx(18.4e9, rel=0.002)  # ch. 7 problem 1
    assert max_sequences(CH7_MODEL, V5E_BOOK, 8192, tp=16, kv_bytes=1, weight_bytes=1) == 110
    # ch. 8 minimum-topology table, bf16 on 4x4: 256 GB - 140 GB = 116 GB free, 43 caches of 8k tokens. The
    # preset's 70.55e9 parameters (not 70e9) leave 114.9 GB: 42
    assert max_sequences(LLAMA70B, V5E_BOOK, 8192, tp=16) == 42
    assert max_sequences(LLAMA70B, V5E_BOOK, 8192, tp=4) == 0  # 141 GB of weights on 64 GB


def test_minimum_chips_for_the_weights():
    # ch. 8 worked question 5 / table: params·bytes / 16 GB = 8.75 chips in bf16, 4.38 in int8. The int4 row prints
    # 45 GB and 2.81 chips; but 70e9 x 0.5 B = 35 GB, 2.19 chips. The corrected value is tested.
    chips = {dtype: serving_plan("llama3-70b", V5E_BOOK, tp=16, batch=1, weight_bytes=b)["min_chips_for_weights"]
             for dtype, b in (("bf16", 2), ("int8", 1), ("int4", 0.5))}
    assert chips["bf16"] == pytest.approx(8.75, rel=0.01) and chips["int8"] == pytest.approx(4.38, rel=0.01)
    assert chips["int4"] == pytest.approx(2.19, rel=0.01)


# --- the throughput-latency curve (ch. 7 tables) ----------------------------------------------------------------

BATCHES = [1, 8, 16, 32, 64, 240]


@pytest.mark.parametrize("kv_bytes, step_ms, tokens_per_s, fits", [
    # ch. 7, LLaMA-2-13B on 8 TPU v5e, 8192 context, bf16: the MHA table (batch >= 16 does not fit 128 GB)
    (2, [4.98, 12.13, 20.30, 36.65, 69.33, 249.09], [200.61, 659.30, 787.99, 873.21, 923.13, 963.53],
     [True, True, False, False, False, False]),
    # ... and the table "with 5x smaller KV" (GQA, 8 KV heads for 40): batch 64 fits. The book keeps the 26 GB of
    # parameters, so the KV is shrunk by its bytes (2/5 per element) rather than by a model with 8 KV heads, which
    # would also lose 1.7e9 parameters of W_K and W_V
    (2 / 5, [4.17, 5.60, 7.23, 10.50, 17.04, 52.99], [239.94, 1429.19, 2212.48, 3047.62, 3756.62, 4529.34],
     [True, True, True, True, True, False]),
])
def test_throughput_latency_rows_are_the_books_tables(kv_bytes, step_ms, tokens_per_s, fits):
    rows = throughput_latency(LLAMA2_13B, V5E_BOOK, 8192, BATCHES, tp=8, kv_bytes=kv_bytes)
    assert [r["batch"] for r in rows] == BATCHES
    assert [r["step_ms"] for r in rows] == pytest.approx(step_ms, rel=0.01)
    assert [r["tokens_per_s"] for r in rows] == pytest.approx(tokens_per_s, rel=0.01)
    assert [r["fits"] for r in rows] == fits
    assert all(r["tokens_per_s_per_chip"] == pytest.approx(r["tokens_per_s"] / 8) for r in rows)
    assert [r["memory_bytes"] for r in rows][:2] == pytest.approx([32.7e9, 79.6e9] if kv_bytes == 2
                                                                  else [27.34e9, 36.72e9], rel=0.01)


def test_comms_term_adds_tp_all_reduces_on_nvlink():
    base = decode_step("llama3-70b", "h100", 32, 8192, tp=8)
    with_comms = decode_step("llama3-70b", "h100", 32, 8192, tp=8, comms=True)
    assert base.comms_s == 0 and with_comms.time_s == pytest.approx(base.time_s + with_comms.comms_s)
    assert 0 < with_comms.comms_s < base.time_s  # 160 small all-reduces: latency, a fraction of the step
    with pytest.raises(ValueError, match="hardware='tpu-v5e' has no interconnect model"):
        decode_step("llama3-70b", "tpu-v5e", 32, 8192, tp=8, comms=True)


# --- the widget's function ---------------------------------------------------------------------------------------

def test_inference_roofline_crosses_from_memory_to_compute_at_the_critical_batch():
    tiny, large = (inference_roofline("llama3-8b", "h100", b, 512) for b in (8, 1024))
    assert tiny["bound"] == "memory" and large["bound"] == "compute"
    assert tiny["critical_batch"] == pytest.approx(295.3, abs=0.1) and tiny["ridge"] == pytest.approx(295.3, abs=0.1)
    assert tiny["intensity"] < large["intensity"] and tiny["step_s"] == tiny["latency_bound_s"]
    assert large["step_s"] > large["latency_bound_s"] and large["tokens_per_s"] > tiny["tokens_per_s"]
    assert set(tiny) == {"intensity", "ridge", "latency_bound_s", "compute_s", "step_s", "bound", "tokens_per_s",
                         "tokens_per_s_per_chip", "critical_batch"}
    # the decode step's intensity is its FLOPs per HBM byte: ~1 FLOP per weight byte at batch 1 in bf16
    assert inference_roofline("llama3-8b", "h100", 1, 128)["intensity"] == pytest.approx(1, rel=0.05)


def test_chip_is_a_parameter_of_the_serving_plan():
    h100, h200 = (serving_plan("llama3-70b", chip, tp=8, context=8192, batch=32, kv_bytes=1) for chip in ("h100",
                                                                                                         "h200"))
    assert h200["max_sequences"] > h100["max_sequences"] and h200["tokens_per_s"] > h100["tokens_per_s"]
    assert h100["weight_bytes_per_chip"] == count_params(LLAMA70B) * 2 / 8
    assert h100["hardware"] == HARDWARE["h100"].name and h100["fits"] is True


def test_weight_only_quantisation_computes_in_bf16_and_w8a8_at_the_fp8_peak():
    # Chapter 11's H100 node plans: precision="bf16" (the default) is weight-only quantisation — fp8 or int4
    # weights dequantised to bf16, their matmuls at the bf16 peak — so past the critical batch int4 weights give
    # the same tokens/s as fp8 (the step's compute and KV terms both grow with the batch). W8A8 (precision="fp8")
    # prices the weight matmuls at the FP8 peak, 2x bf16's on an H100; attention stays at the bf16 peak.
    h100 = HARDWARE["h100"]
    ratio = h100.peak_flops("fp8") / h100.peak_flops("bf16")
    assert ratio == pytest.approx(2, rel=1e-3)  # 1,979 / 989.4 TFLOP/s dense
    plan = {name: serving_plan("llama3-70b", "h100", tp=8, context=8192, kv_bytes=1, weight_bytes=w, precision=p)
            for name, w, p in (("w8a16", 1, "bf16"), ("w4a16", 0.5, "bf16"), ("w8a8", 1, "fp8"))}
    assert plan["w4a16"]["tokens_per_s"] == pytest.approx(plan["w8a16"]["tokens_per_s"], rel=1e-9)
    assert plan["w8a8"]["batch"] == plan["w8a16"]["batch"]  # same bytes stored: the same sequences fit
    w8a16, w8a8 = plan["w8a16"]["step"], plan["w8a8"]["step"]
    assert w8a16["bound"] == w8a8["bound"] == "compute"  # 459 sequences: past both critical batches
    assert w8a8["linear_s"] == pytest.approx(w8a16["linear_s"] / ratio)  # the weight matmuls at the FP8 peak
    assert w8a8["attention_s"] == w8a16["attention_s"]
    assert w8a8["kv_bytes"] == w8a16["kv_bytes"] and w8a8["attention_flops"] == w8a16["attention_flops"]
    assert plan["w8a8"]["tokens_per_s"] == pytest.approx(16_951, rel=1e-3)  # +15 %: the KV reads are the rest
    assert plan["w8a16"]["tokens_per_s"] == pytest.approx(14_726, rel=1e-3)
    # B_crit: fp8 weights with bf16 compute turn compute-bound at half the bf16 batch; W8A8 at the bf16 one
    assert plan["w8a8"]["critical_batch"] == pytest.approx(ratio * plan["w8a16"]["critical_batch"])
    # prefill is compute-bound: W8A8 halves the weight matmuls' part, not attention's
    bf16, fp8 = (prefill_time("llama3-70b", "h100", 8192, tp=8, precision=p, mfu=0.4) for p in ("bf16", "fp8"))
    peak = h100.peak_flops("bf16") * 8 * 0.4
    assert fp8.time_s == pytest.approx((bf16.linear_flops / ratio + bf16.attention_flops) / peak)


# --- bad input: one line naming the value and the valid range ---------------------------------------------------

@pytest.mark.parametrize("call, message", [
    (lambda: kv_bytes_per_token("llama3-8b", 0), "kv_bytes=0 must be a finite number > 0"),
    (lambda: kv_bytes_per_sequence("llama3-8b", 0), "context=0 must be an integer >= 1"),
    (lambda: kv_bytes_per_sequence("llama3-8b", 200_000), "context=200000 must be <= max_seq_len=131072"),
    (lambda: kv_bytes_per_token("gpt-17"), "unknown model preset 'gpt-17'"),
    (lambda: decode_step("llama3-8b", "h100", 0, 128), "batch=0 must be an integer >= 1"),
    (lambda: decode_step("llama3-8b", "h100", 1, 128, tp=3), "tp=3 must divide n_heads=32"),
    (lambda: decode_step("llama3-8b", "h100", 1, 128, tp=0), "tp=0 must be an integer >= 1"),
    (lambda: decode_step("llama3-8b", "h9000", 1, 128), "gpu='h9000' must be one of"),
    (lambda: decode_step("llama3-8b", "a100", 1, 128, precision="fp8"), "dtype='fp8' has no peak on NVIDIA A100"),
    (lambda: weight_bytes_read("llama3-8b", 1, weight_bytes=-1), "weight_bytes=-1 must be a finite number > 0"),
    (lambda: prefill_time("llama3-8b", "h100", 128, mfu=1.5), "mfu=1.5 must be in (0, 1]"),
    (lambda: prefill_time("llama3-8b", "h100", 0), "tokens=0 must be an integer >= 1"),
    (lambda: critical_batch("h100", weight_bytes=math.nan), "weight_bytes=nan must be a finite number > 0"),
    (lambda: max_sequences("llama3-8b", "h100", 128, hbm_bytes=0), "hbm_bytes=0 must be a finite number > 0"),
    (lambda: step_time(1, 1e9, -1.0, 1e9, "h100"), "kv_bytes=-1.0 must be a finite number >= 0"),
    (lambda: throughput_latency("llama3-8b", "h100", 128, []), "batches=[] must list at least one batch size"),
    (lambda: serving_plan("llama3-70b", "h100", tp=1), "no sequence of context=8192 fits on tp=1"),
])
def test_bad_input_is_one_clear_line(call, message):
    with pytest.raises(ValueError) as info:
        call()
    assert message in str(info.value) and "\n" not in str(info.value)


# --- python -m lab calc inference ---------------------------------------------------------------------------------

ARGV = ["inference", "--model", "llama3-70b", "--hardware", "h100", "--tp", "8", "--seq", "8192", "--batch", "32",
        "--kv-dtype", "int8"]


def test_cli_json_is_the_serving_plan_and_the_table_names_each_number(capsys):
    assert main([*ARGV, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data == json.loads(json.dumps(serving_plan("llama3-70b", "h100", 8, 8192, 32, kv_bytes=1)))
    assert data["kv_bytes_per_token"] == 163_840 and data["fits"] is True
    assert main(ARGV) == 0
    out = capsys.readouterr().out
    for label in ("KV cache per token       163,840 B", "KV cache per sequence    1.342 GB", "weights per chip",
                  "sequences that fit       406", "decode step bound", "critical batch           295",
                  "tokens/s", "prefill of one sequence"):
        assert label in out, label


@pytest.mark.parametrize("argv, message", [
    (["--tp", "3"], "tp=3 must divide n_heads=64"),
    (["--batch", "0"], "batch=0 must be an integer >= 1"),
    (["--mfu", "0"], "mfu=0.0 must be in (0, 1]"),
    (["--hardware", "tpu-v5e", "--comms"], "has no interconnect model for the comms term"),
])
def test_cli_bad_values_exit_2_with_one_line(capsys, argv, message):
    assert main([*ARGV, *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err and len(err.strip().splitlines()) == 1
    assert err.startswith("python -m lab calc inference: error: ")


EP_ARGV = ["inference", "--model", "deepseek-v3", "--hardware", "h100", "--batch", "16", "--ep", "32"]


def test_cli_ep_adds_the_expert_parallel_decode_and_keeps_every_other_key(capsys):
    assert main([*EP_ARGV, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    plan = json.loads(json.dumps(serving_plan("deepseek-v3", "h100", 1, 4096, 16)))
    assert {k: v for k, v in data.items() if k not in ("ep_decode", "ep_counts_exchange")} == plan
    assert data["ep_decode"] == json.loads(json.dumps(ep_decode("deepseek-v3", 16, 32).as_dict()))
    assert data["ep_counts_exchange"] == json.loads(json.dumps(ep_counts_exchange("deepseek-v3", 32).as_dict()))
    assert main(EP_ARGV) == 0
    out = capsys.readouterr().out
    step = ep_decode("deepseek-v3", 16, 32)
    for label in (f"EP32 all-to-alls         {step.step_s * 1e3:,.2f} ms a decode step: 2 x 58 MoE layers",
                  f"their latency floor    {step.latency_floor_s * 1e3:,.2f} ms", "tokens/s they allow"):
        assert label in out, label


@pytest.mark.parametrize("argv, message", [
    (["--model", "llama3-8b"], "ep=32 needs a mixture-of-experts model"),
    (["--ep", "3"], "ep=3 must divide n_experts=256"),
    (["--hardware", "tpu-v5e"], "hardware='tpu-v5e' must be one of"),
])
def test_cli_ep_bad_values_exit_2_with_one_line(capsys, argv, message):
    assert main([*EP_ARGV, *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err and len(err.strip().splitlines()) == 1


def test_ep_decode_all_to_alls_by_hand():
    """DeepSeek-V3 (d_model 7168, top-8, 58 MoE layers after 3 dense ones) on DGX H100s. EP8 inside a node, one
    sequence per GPU: each all-to-all carries 8 × 7168 × 2 = 114,688 bytes a GPU, 7/8 of it over NVLink (450 GB/s)
    in 7 pairwise steps of 3 µs: 21.2 µs, 21 of them latency; two a layer, 58 layers: 2.46 ms a token, 406 tokens/s
    a sequence. EP64 over 8 nodes at 256 sequences a GPU: 29.4 MB, 7/8 of it off the node through one 50 GB/s NIC
    a GPU, after 63 steps of 5 µs: 829 µs."""
    small = ep_decode("deepseek-v3", 1, 8)
    assert small.moe_layers == 58 and small.dispatch.bytes == small.combine.bytes == 8 * 7168 * 2 == 114_688
    one = 7 * 3e-6 + 7 / 8 * 114_688 / 450e9
    assert small.dispatch.time_s == pytest.approx(one) == pytest.approx(21.22e-6, abs=0.01e-6)
    assert small.step_s == pytest.approx(58 * 2 * one) and small.tokens_per_s_per_sequence == pytest.approx(406.2,
                                                                                                             abs=0.1)
    assert small.latency_floor_s == pytest.approx(58 * 2 * 7 * 3e-6) and small.tokens_per_s == pytest.approx(
        8 / small.step_s)
    big = ep_decode("deepseek-v3", 256, 64)
    nbytes = 256 * 8 * 7168 * 2
    assert big.dispatch.time_s == pytest.approx(63 * 5e-6 + 56 / 64 * nbytes / 50e9) == pytest.approx(828.8e-6,
                                                                                                   abs=0.1e-6)
    assert big.tokens_per_s == pytest.approx(64 * 256 / (58 * 2 * big.dispatch.time_s))


@pytest.mark.parametrize("ep", [8, 32, 64])
def test_ep_decode_latency_floor_dominates_at_small_batch(ep):
    """The floor (the α of every hop) does not depend on the batch; at one sequence a GPU it is 98 % of the
    all-to-all time, so sixteen sequences cost barely more than one; at 256 the bytes dominate. FP8 dispatch
    halves the dispatched bytes."""
    steps = {b: ep_decode("deepseek-v3", b, ep) for b in (1, 16, 256)}
    assert len({s.latency_floor_s for s in steps.values()}) == 1
    assert steps[1].latency_share > 0.98 and steps[256].latency_share < 0.5
    assert steps[16].step_s < 1.25 * steps[1].step_s and steps[16].tokens_per_s > 12 * steps[1].tokens_per_s
    fp8 = ep_decode("deepseek-v3", 256, ep, dispatch_bytes=1)
    assert fp8.dispatch.bytes == steps[256].dispatch.bytes / 2 and fp8.combine == steps[256].combine


@pytest.mark.parametrize("call, message", [
    (lambda: ep_decode("llama3-8b", 1, 8), "needs a mixture-of-experts model"),
    (lambda: ep_decode("deepseek-v3", 1, 3), "ep=3 must divide n_experts=256"),
    (lambda: ep_decode("deepseek-v3", 0, 8), "batch=0"),
    (lambda: ep_decode("deepseek-v3", 1, 8, "tpu"), "hardware='tpu' must be one of"),
])
def test_ep_decode_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_ep_counts_exchange_is_one_more_floor_of_a_few_bytes():
    """lab.parallel.ep sends n_experts int64 counts before each dispatch: DeepSeek-V3's 256 × 8 = 2 kB at EP8,
    7 pairwise steps of 3 µs inside a node — a third of a layer's latency floor again."""
    counts = ep_counts_exchange("deepseek-v3", 8)
    assert counts.bytes == 256 * 8 == 2048
    assert counts.time_s == pytest.approx(7 * 3e-6 + 7 / 8 * 2048 / 450e9)
    assert counts.time_s == pytest.approx(ep_decode("deepseek-v3", 1, 8).floor_per_layer_s / 2, rel=1e-3)
    with pytest.raises(ValueError, match="ep=3 must divide n_experts=256"):
        ep_counts_exchange("deepseek-v3", 3)
