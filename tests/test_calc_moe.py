"""lab.calc.moe's all-to-all time and its ratio to the experts' compute, inside a node and across nodes."""

import pytest

from lab.calc.hardware import HARDWARE
from lab.calc.moe import (
    active_params,
    all_to_all_seconds,
    comm_compute_ratio,
    comm_compute_ratio_on,
    cross_node_comm_compute_ratio,
    dropped_assignments,
    ep_where_comm_dominates,
    expected_all_to_all_bytes,
    expert_bytes_per_gpu,
    nodes_reached,
    routed_expert_flops,
    rows_per_expert,
)
from lab.calc.network import SYSTEMS
from lab.calc.params import param_breakdown
from lab.config import PRESETS

T, K, D, F_EXPERT = 4096, 8, 7168, 2048  # DeepSeek-V3's routed layer, 4,096 tokens per rank


def test_inside_a_node_the_all_to_alls_ride_nvlink():
    nvlink = SYSTEMS["h100"].intra
    buffer = T * K * D * 2
    expected = 4 * (7 * nvlink.latency + 7 / 8 * buffer / nvlink.bandwidth)
    assert all_to_all_seconds(T, K, D, 8) == pytest.approx(expected)


def test_across_nodes_each_gpu_has_one_nic_not_the_nodes_eight():
    # ep = 64 on 8 DGX H100: 56 of every 64 rows leave the node, through the sending GPU's own 50 GB/s NIC
    h100 = SYSTEMS["h100"]
    buffer = T * K * D * 2
    bandwidth_part = 4 * 56 / 64 * buffer / h100.nic.bandwidth
    latency_part = 4 * 63 * h100.nic.latency
    assert all_to_all_seconds(T, K, D, 64) == pytest.approx(bandwidth_part + latency_part)
    assert all_to_all_seconds(T, K, D, 64) > 4 * bandwidth_part * h100.nic.bandwidth / h100.node_bandwidth
    # the bytes on the wire are expected_all_to_all_bytes' (the rows for other ranks, on or off the node)
    assert expected_all_to_all_bytes(T, K, D, 64) == pytest.approx(4 * 63 / 64 * buffer)


def test_comm_compute_ratio_follows_the_closed_form():
    # bandwidth part 2·β·F/(9·f·W) times the share of rows that leave the node; the tokens cancel
    flops = HARDWARE["h100"].bf16_flops
    closed = 56 / 64 * 2 * 2 * flops / (9 * F_EXPERT * SYSTEMS["h100"].nic.bandwidth)
    ratio = comm_compute_ratio(T, K, D, F_EXPERT, 64)
    assert ratio == pytest.approx(closed, rel=0.05) and ratio > closed
    assert comm_compute_ratio(4 * T, K, D, F_EXPERT, 64) == pytest.approx(closed, rel=0.02)
    assert routed_expert_flops(T, K, D, F_EXPERT) == 6 * T * K * 3 * D * F_EXPERT


def test_ratio_on_a_flat_link_is_the_closed_form_and_the_tokens_cancel():
    flops, bandwidth = 400e12, 450e9
    closed = 2 * 2 * flops * 63 / (9 * F_EXPERT * bandwidth * 64)
    assert comm_compute_ratio_on(T, K, D, F_EXPERT, 64, bandwidth, flops) == pytest.approx(closed)
    assert comm_compute_ratio_on(8 * T, K, D, F_EXPERT, 64, bandwidth, flops) == pytest.approx(closed)


def test_the_ep_where_comm_dominates_is_the_first_ratio_above_one():
    flops, bandwidth, latency = 400e12, 450e9, 5e-6
    ep = ep_where_comm_dominates(T, K, D, F_EXPERT, bandwidth, flops, latency)
    assert comm_compute_ratio_on(T, K, D, F_EXPERT, ep, bandwidth, flops, latency) >= 1
    assert comm_compute_ratio_on(T, K, D, F_EXPERT, ep - 1, bandwidth, flops, latency) < 1
    # by hand: 4·[(ep−1)·α + (ep−1)/ep·B/W] = 18·T·k·d·f/F, B = T·k·d·2 bytes; a quadratic in ep
    compute_s = 18 * T * K * D * F_EXPERT / flops
    b_over_w = T * K * D * 2 / bandwidth
    a, b, c = latency, b_over_w - latency - compute_s / 4, -b_over_w
    assert ep == int((-b + (b * b - 4 * a * c) ** 0.5) / (2 * a)) + 1
    # with NVLink-class bandwidth the bandwidth part alone stays below 1 (0.24): only latency makes it cross
    assert comm_compute_ratio_on(T, K, D, F_EXPERT, 10**6, bandwidth, flops) < 0.25


def test_deepseek_v3_node_limited_fp8_dispatch_is_near_one_to_one():
    """DeepSeek-V3 report (arXiv:2412.19437) §3.2.1: cross-node expert parallelism gives a computation-to-
    communication ratio of about 1:1; §3.2.2: each token goes to at most 4 nodes, once over IB per node, then
    over NVLink to its experts; §3.3.3: the dispatch is sent in FP8, the combine kept in BF16. EP64 on 8 nodes,
    one 50 GB/s NIC per GPU. The plain bf16 model (every remote expert's row over IB) gives the chapter's ~4x."""
    plain = cross_node_comm_compute_ratio(K, D, F_EXPERT, 256, 64)
    deepseek = cross_node_comm_compute_ratio(K, D, F_EXPERT, 256, 64, max_nodes=4, dispatch_bytes=1, combine_bytes=2)
    assert 3.5 < plain < 4.5
    assert 0.7 < deepseek < 1.5 and deepseek < plain / 2.5
    assert nodes_reached(K, 256, 8) == pytest.approx(5.29, abs=0.01) and nodes_reached(K, 256, 8, 4) == 4
    # per node reached: 4 nodes, 7/8 of them remote, 2 directions x 2 passes at 1 + 2 bytes, over 18·k·d·f FLOPs
    peak = HARDWARE["h100"].peak_flops("bf16")
    assert deepseek == pytest.approx(4 * 7 / 8 * 2 * 3 * D / 50e9 / (18 * K * D * F_EXPERT / peak))


def test_layout_sizes():
    assert rows_per_expert(4096, 8, 256, 64) == 64 * 4096 * 8 / 256  # 8,192 rows: ep keeps an expert's matmul big
    # 1,000 tokens, top-2 of 8 experts, capacity ceil(1.25·2000/8) = 313; 30% of the 2,000 assignments to one:
    # 600 − 313 = 287 dropped there, the other 7 get 200 each and drop none
    assert dropped_assignments(1000, 2, 8, 1.25, 0.3) == pytest.approx(287)
    assert dropped_assignments(1000, 2, 8, 0.5, 1 / 8) == pytest.approx(8 * (250 - 125))
    assert expert_bytes_per_gpu(58, 256, 7168, 2048, 64, 2) == 58 * 4 * 3 * 7168 * 2048 * 2


def test_deepseek_v3_active_params_match_the_paper():
    # DeepSeek-V3 technical report (arXiv:2412.19437), abstract: 671B total parameters, 37B activated per token
    cfg = PRESETS["deepseek-v3"]
    parts = param_breakdown(cfg)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    active = active_params(parts["total"], moe_layers, cfg.n_experts, cfg.top_k, cfg.d_model, cfg.d_ff_expert)
    assert active == parts["active"]
    assert parts["total"] / 1e9 == pytest.approx(671, rel=0.005) and active / 1e9 == pytest.approx(37, rel=0.02)


@pytest.mark.parametrize("call, message", [
    (lambda: rows_per_expert(T, K, 256, 48), "ep=48 must divide n_experts=256"),
    (lambda: dropped_assignments(T, K, 8, 1.0, 1.5), "hot_share=1.5 must be in [0, 1]"),
    (lambda: expert_bytes_per_gpu(58, 256, D, F_EXPERT, 64, 0), "bytes_per_param=0 must be a number > 0"),
    (lambda: active_params(10**9, 1, 8, 9, D, F_EXPERT), "top_k=9 must be at most n_experts=8"),
    (lambda: comm_compute_ratio_on(T, K, D, F_EXPERT, 8, 1e9, 1e12, latency=-1), "latency=-1 must be >= 0"),
    (lambda: ep_where_comm_dominates(T, K, D, F_EXPERT, 1e9, 1e12, 0.0), "latency=0.0 must be a number > 0"),
    (lambda: all_to_all_seconds(T, K, D, 12), "ranks=12 must be a multiple of gpus_per_node=8"),
    (lambda: all_to_all_seconds(0, K, D, 8), "tokens=0 must be an integer >= 1"),
    (lambda: comm_compute_ratio(T, K, D, F_EXPERT, 8, efficiency=0), "efficiency=0 must be in (0, 1]"),
])
def test_bad_input(call, message):
    with pytest.raises(ValueError) as err:
        call()
    assert message in str(err.value)
