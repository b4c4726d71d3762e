"""lab.calc.moe's all-to-all time and its ratio to the experts' compute, inside a node and across nodes."""

import pytest

from lab.calc.hardware import HARDWARE
from lab.calc.moe import all_to_all_seconds, comm_compute_ratio, expected_all_to_all_bytes, routed_expert_flops
from lab.calc.network import SYSTEMS

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


@pytest.mark.parametrize("call, message", [
    (lambda: all_to_all_seconds(T, K, D, 12), "ranks=12 must be a multiple of gpus_per_node=8"),
    (lambda: all_to_all_seconds(0, K, D, 8), "tokens=0 must be an integer >= 1"),
    (lambda: comm_compute_ratio(T, K, D, F_EXPERT, 8, efficiency=0), "efficiency=0 must be in (0, 1]"),
])
def test_bad_input(call, message):
    with pytest.raises(ValueError) as err:
        call()
    assert message in str(err.value)
