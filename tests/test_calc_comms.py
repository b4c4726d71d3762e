"""The alpha-beta model of collectives: bytes per rank, nccl-tests' bus bandwidth, ring vs tree vs hierarchy."""


import pytest

from lab.calc.comms import bus_factor, collective_time
from lab.calc.network import LINKS


def test_ring_all_reduce_sends_2_w_minus_1_over_w_of_the_tensor():
    # the ring is bandwidth-optimal: bytes per rank do not grow with W (others-digest: 2(N-1)/N)
    for w in (2, 4, 8, 64):
        cost = collective_time("all_reduce", 1e9, w, LINKS["nvlink4"])
        assert cost.bytes_sent_per_rank == pytest.approx(2 * (w - 1) / w * 1e9)
        assert cost.steps == 2 * (w - 1)
    assert collective_time("all_gather", 1e9, 8, LINKS["nvlink4"]).bytes_sent_per_rank == pytest.approx(7 / 8 * 1e9)


def test_all_reduce_is_reduce_scatter_plus_all_gather():
    link = LINKS["ib-ndr400"]
    ar = collective_time("all_reduce", 4e8, 16, link)
    rs, ag = (collective_time(op, 4e8, 16, link) for op in ("reduce_scatter", "all_gather"))
    assert ar.time_s == pytest.approx(rs.time_s + ag.time_s)


def test_bus_bandwidth_reaches_the_link_for_large_messages():
    # nccl-tests: busbw = algbw * 2(n-1)/n for all-reduce, comparable with the link's peak
    cost = collective_time("all_reduce", 1e12, 8, LINKS["nvlink4"])
    assert cost.busbw == pytest.approx(450e9, rel=1e-3)
    assert cost.algbw == pytest.approx(cost.busbw / bus_factor("all_reduce", 8))


def test_latency_bound_small_messages_prefer_the_tree():
    small = [collective_time("all_reduce", 1024, 64, LINKS["ib-ndr400"], algorithm=a).time_s for a in ("ring", "tree")]
    large = [collective_time("all_reduce", 1e9, 64, LINKS["ib-ndr400"], algorithm=a).time_s for a in ("ring", "tree")]
    assert small[1] < small[0] / 5  # 12 tree steps vs 126 ring steps
    assert large[0] < large[1] / 5  # the tree pushes the whole message 12 times


def test_across_nodes_the_slow_link_dominates_and_hierarchy_helps():
    inside = collective_time("all_reduce", 1e9, 8, system="h100")
    across = collective_time("all_reduce", 1e9, 16, system="h100")
    hierarchical = collective_time("all_reduce", 1e9, 16, system="h100", algorithm="hierarchical")
    assert across.time_s > 8 * inside.time_s  # NVLink 450 GB/s vs InfiniBand 50 GB/s per direction
    assert hierarchical.time_s < across.time_s / 4


@pytest.mark.parametrize("kwargs, message", [
    (dict(op="allreduce", nbytes=1, ranks=2, system="h100"), "op='allreduce' must be one of all_reduce"),
    (dict(op="all_reduce", nbytes=-1, ranks=2, system="h100"), "bytes=-1 must be >= 0"),
    (dict(op="all_reduce", nbytes=1, ranks=0, system="h100"), "ranks=0 must be an integer >= 1"),
    (dict(op="all_reduce", nbytes=1, ranks=12, system="h100"), "ranks=12 must be a multiple of gpus_per_node=8"),
    (dict(op="all_reduce", nbytes=1, ranks=2, system="tpu"), "system='tpu' must be one of a100, h100"),
    (dict(op="all_reduce", nbytes=1, ranks=2, system="h100", algorithm="star"), "algorithm='star' must be one of"),
])
def test_bad_input(kwargs, message):
    with pytest.raises(ValueError) as err:
        collective_time(**kwargs)
    assert message in str(err.value)


def test_fit_recovers_alpha_and_beta():
    from lab.calc.comms import fit_alpha_beta

    alpha, beta = 2e-4, 1 / 3e9
    points = [(6, b, 6 * alpha + b * beta) for b in (1e3, 1e5, 1e7, 1e8)]
    fitted = fit_alpha_beta(points)
    assert fitted[0] == pytest.approx(alpha) and fitted[1] == pytest.approx(beta)
    with pytest.raises(ValueError, match="need at least 2 measurements"):
        fit_alpha_beta(points[:1])


def test_cli_json_and_errors():
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "lab", "calc", "comms", "--op", "all_reduce", "--bytes", "1e9", "--ranks", "64",
           "--gpus-per-node", "8", "--hardware", "h100"]
    done = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=60)
    out = json.loads(done.stdout)
    assert {"bytes_sent_per_rank", "time_s", "algbw", "busbw"} <= set(out)
    assert out["bytes_sent_per_rank"] == pytest.approx(2 * 63 / 64 * 1e9)
    bad = subprocess.run([*cmd[:-6], "--ranks", "12"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "ranks=12 must be a multiple of gpus_per_node=8" in bad.stderr
