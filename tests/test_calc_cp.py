"""`lab.calc.cp`: when a ring-attention step hides its K/V transfer."""

import pytest

from lab.calc.cp import ring_step, tokens_to_hide_ring
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
