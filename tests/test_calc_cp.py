"""`lab.calc.cp`: when a ring-attention step hides its K/V transfer."""

import pytest

from lab.calc.cp import (
    allgather_kv_bytes,
    attention_core_flops,
    attention_matches_mlp,
    attention_share,
    attention_work,
    block_kind,
    block_work,
    hide_tokens,
    kv_block_bytes,
    layer_matmul_flops,
    ring_bytes,
    ring_step,
    step_work,
    striped_chunks,
    tokens_to_hide_ring,
    ulysses_bytes,
    ulysses_max_cp,
)
from lab.calc.hardware import HARDWARE
from lab.calc.network import LINKS, SYSTEMS
from lab.config import PRESETS

LLAMA_8B = PRESETS["llama3-8b"]


def test_threshold_for_llama3_8b_on_h100():
    """c* = G·β·F/(H·W) = 8·2·989.4e12/(32·450e9) ≈ 1.1k tokens per rank on NVLink, 9.9k on 400 Gb/s IB."""
    assert tokens_to_hide_ring(LLAMA_8B) == pytest.approx(8 * 2 * 989.4e12 / (32 * 450e9))
    assert tokens_to_hide_ring(LLAMA_8B) == pytest.approx(1099, rel=1e-3)
    assert tokens_to_hide_ring(LLAMA_8B, link="ib-ndr400") == pytest.approx(9894, rel=1e-3)
    # a ring step's hop across nodes is one GPU's NIC, not the node's 8 (the multi-rail bound of calc.comms)
    assert LINKS["ib-ndr400"].bandwidth == SYSTEMS["h100"].nic.bandwidth == SYSTEMS["h100"].node_bandwidth / 8


@pytest.mark.parametrize("gpu, link", [("h100", "nvlink4"), ("a100", "ib-hdr200"), ("b200", "nvlink5")])
def test_the_threshold_is_where_compute_time_meets_transfer_time(gpu, link):
    threshold = tokens_to_hide_ring(LLAMA_8B, gpu=gpu, link=link)
    # (the threshold neglects the link's latency, a few microseconds: hence the margin above it)
    below, above = (ring_step(LLAMA_8B, c * 8, 8, gpu=gpu, link=link) for c in (int(threshold * 0.8),
                                                                                 int(threshold * 2)))
    assert not below.hidden and above.hidden
    step = ring_step(LLAMA_8B, 8 * 1024, 8, gpu=gpu, link=link)
    assert step.compute_s == pytest.approx(step.flops / HARDWARE[gpu].bf16_flops)
    assert step.comm_s == pytest.approx(LINKS[link].latency + step.kv_bytes / LINKS[link].bandwidth)


def test_counts_of_one_step():
    step = ring_step(LLAMA_8B, 32768, 8, mbs=2, causal=False)
    c, d = 4096, LLAMA_8B.head_dim
    assert step.tokens_per_rank == c
    assert step.flops == 4 * 2 * c * c * 32 * d
    assert step.kv_bytes == 2 * 2 * c * 8 * d * 2
    assert ring_step(LLAMA_8B, 32768, 8, mbs=2).flops == step.flops / 2  # causal: half a block on average
    tp2 = ring_step(LLAMA_8B, 32768, 8, mbs=2, tp=2, causal=False)
    assert (tp2.flops, tp2.kv_bytes) == (step.flops / 2, step.kv_bytes / 2)


@pytest.mark.parametrize("kwargs, message", [
    ({"seq": 1000, "cp": 3}, "cp=3 must divide seq=1000"),
    ({"seq": 0, "cp": 1}, "seq=0 must be an integer >= 1"),
    ({"seq": 1024, "cp": 2, "link": "carrier-pigeon"}, "link='carrier-pigeon' must be one of"),
    ({"seq": 1024, "cp": 2, "gpu": "h900"}, "gpu='h900' must be one of"),
    ({"seq": 1024, "cp": 2, "efficiency": 0}, "efficiency=0 must be in (0, 1]"),
    ({"seq": 1024, "cp": 2, "tp": 3}, "tp=3 must divide n_heads=32"),
])
def test_bad_input_is_one_clear_line(kwargs, message):
    with pytest.raises(ValueError) as info:
        ring_step(LLAMA_8B, **kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_hide_tokens_is_the_formula_behind_tokens_to_hide_ring():
    assert hide_tokens(32, 8, 2, 989.4e12, 450e9) == pytest.approx(tokens_to_hide_ring(LLAMA_8B))
    assert hide_tokens(64, 64, 2, 1e15, 1e11) == pytest.approx(2e4)  # MHA: G = H, c* = β·F/W


def test_ring_ulysses_and_all_gather_bytes():
    """Per layer and rank, Llama-3-8B (32 heads, 8 KV heads of 128) at 128K tokens over cp = 8, bf16."""
    seq, cp, d = 131072, 8, 128
    block = kv_block_bytes(1, seq // cp, 8, d)
    assert block == 2 * 16384 * 8 * 128 * 2 == ring_step(LLAMA_8B, seq, cp).kv_bytes
    assert ring_bytes(seq, cp, 8, d) == 7 * block
    assert ulysses_bytes(seq, cp, 32, 8, d) == pytest.approx(7 / 8 * 16384 * (64 + 16) * 128 * 2)
    # ring / Ulysses = cp·G / (H + G): 1.6 here, cp/2 without GQA
    assert ring_bytes(seq, cp, 8, d) / ulysses_bytes(seq, cp, 32, 8, d) == pytest.approx(8 * 8 / 40)
    assert ring_bytes(seq, cp, 32, d) / ulysses_bytes(seq, cp, 32, 32, d) == pytest.approx(cp / 2)
    assert allgather_kv_bytes(seq, 8, d) == cp * block
    assert ulysses_max_cp(32) == 32 and ulysses_max_cp(128, tp=8) == 16


def test_attention_flops_against_the_layer():
    cfg = LLAMA_8B
    dims = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff)
    assert attention_core_flops(8192, 32, 128, causal=False) == 4 * 8192**2 * 4096
    assert attention_core_flops(8192, 32, 128) == 2 * 8192**2 * 4096
    # the weights: q, k, v, o (4096·(32+32+8+8)·128) and the MLP (3·4096·14336), 2 FLOPs each per token
    assert layer_matmul_flops(1, *dims) == 2 * (4096 * 80 * 128 + 3 * 4096 * 14336)
    assert attention_share(8192, *dims) == pytest.approx(0.1333, abs=1e-3)
    assert attention_share(131072, *dims) == pytest.approx(0.711, abs=1e-3)
    s = attention_matches_mlp(cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_ff)
    assert s == 3 * 14336  # h = H·d: 3·d_ff
    assert attention_core_flops(round(s), 32, 128) == pytest.approx(2 * round(s) * 3 * 4096 * 14336)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
def test_step_work_adds_up_to_the_causal_triangle(layout):
    seq, cp = 48, 4
    steps = step_work(seq, cp, layout)
    assert sum(map(sum, steps)) == seq * (seq + 1) // 2
    if layout != "striped":
        assert [sum(column) for column in zip(*steps, strict=True)] == attention_work(seq, cp, layout)


def test_striped_work_counted_token_by_token():
    """The striped closed form against every (query token, key token) pair of each step's block."""
    seq, cp = 24, 4
    chunks = striped_chunks(seq, cp)
    assert chunks[1] == [1, 5, 9, 13, 17, 21]
    brute = [[sum(block_work(block_kind(q, k, True), 1, 1) for q in chunks[r] for k in chunks[(r - i) % cp])
              for r in range(cp)] for i in range(cp)]
    assert step_work(seq, cp, "striped") == brute
    # balanced to within one token per step, where contiguous chunks leave rank 0 idle after step 0
    assert max(map(max, brute)) - min(map(min, brute)) == seq // cp


@pytest.mark.parametrize("call, message", [
    (lambda: ring_bytes(1000, 3, 8, 128), "cp=3 must divide seq=1000"),
    (lambda: ulysses_bytes(1000, 3, 8, 8, 128), "cp=3 must divide seq=1000"),
    (lambda: ulysses_max_cp(32, 3), "tp=3 must divide n_heads=32"),
    (lambda: striped_chunks(10, 4), "seq_len=10 must be divisible by cp = 4"),
    (lambda: step_work(10, 4, "zigzag"), "seq_len=10 must be divisible by 2*cp = 8"),
    (lambda: step_work(16, 4, "spiral"), "layout='spiral' must be one of 'contiguous', 'zigzag', 'striped'"),
])
def test_new_bad_input_is_one_clear_line(call, message):
    with pytest.raises(ValueError) as info:
        call()
    assert message in str(info.value) and "\n" not in str(info.value)
