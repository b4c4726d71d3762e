"""The alpha-beta model of collectives: bytes per rank, nccl-tests' bus bandwidth, ring vs tree vs hierarchy,
multi-rail across nodes against the playbook's measurements."""


import pytest

from lab.calc.comms import (
    OPS,
    bus_factor,
    collective_time,
    dp_critical_batch,
    latency_bandwidth_crossover,
    ring_tree_crossover,
)
from lab.calc.network import LINKS, PLAYBOOK_BUSBW, SYSTEMS, System


def test_ring_all_reduce_sends_2_w_minus_1_over_w_of_the_tensor():
    # the ring is bandwidth-optimal: bytes per rank do not grow with W (Patarasuk & Yuan 2009: 2(N-1)/N of the data)
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


# Textbook cost of each op on W ranks (ring / pairwise; broadcast and reduce as a pipelined ring): steps, bytes
# each rank sends as a multiple of B, and nccl-tests' bus factor (nccl-tests doc/PERFORMANCE.md: all-reduce
# 2(n-1)/n; all-gather, reduce-scatter and all-to-all (n-1)/n; broadcast, reduce and send 1).
TEXTBOOK = {
    "all_reduce": (lambda w: 2 * (w - 1), lambda w: 2 * (w - 1) / w, lambda w: 2 * (w - 1) / w),
    "all_gather": (lambda w: w - 1, lambda w: (w - 1) / w, lambda w: (w - 1) / w),
    "reduce_scatter": (lambda w: w - 1, lambda w: (w - 1) / w, lambda w: (w - 1) / w),
    "all_to_all": (lambda w: w - 1, lambda w: (w - 1) / w, lambda w: (w - 1) / w),
    "broadcast": (lambda w: w - 1, lambda w: 1.0, lambda w: 1.0),
    "reduce": (lambda w: w - 1, lambda w: 1.0, lambda w: 1.0),
    "send": (lambda w: 1, lambda w: 1.0, lambda w: 1.0),
}


def test_the_textbook_table_covers_every_op():
    assert set(TEXTBOOK) == set(OPS)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("ranks", [2, 4, 16])
def test_every_op_costs_its_textbook_steps_bytes_and_bus_factor(op, ranks):
    if op == "send" and ranks != 2:
        pytest.skip("send has 2 ranks")
    steps, per_rank, factor = (f(ranks) for f in TEXTBOOK[op])
    link = LINKS["ib-ndr400"]
    cost = collective_time(op, 1e9, ranks, link)
    assert cost.steps == steps
    assert cost.bytes_sent_per_rank == pytest.approx(per_rank * 1e9)
    assert cost.time_s == pytest.approx(steps * link.latency + per_rank * 1e9 / link.bandwidth)
    assert bus_factor(op, ranks) == pytest.approx(factor)
    assert cost.busbw == pytest.approx(cost.algbw * factor)
    across = collective_time(op, 1e9, 8 * ranks, system="h100") if op != "send" else None
    if across is not None:  # the node-aware model keeps the same steps, bytes and factor
        steps, per_rank, factor = (f(8 * ranks) for f in TEXTBOOK[op])
        assert (across.steps, across.bytes_sent_per_rank) == (steps, pytest.approx(per_rank * 1e9))
        assert across.busbw == pytest.approx(across.algbw * factor)


def test_systems_carry_their_nics_with_a_vendor_source():
    # NVIDIA DGX BasePOD reference architecture: DGX H100/H200 and DGX B200 have eight single-port 400 Gb/s
    # ConnectX-7 for the compute fabric; DGX A100 datasheet: eight 200 Gb/s ConnectX-6
    for spec in SYSTEMS.values():
        assert spec.nics_per_node >= 1 and spec.source
    assert SYSTEMS["h100"].node_bandwidth == SYSTEMS["b200"].node_bandwidth == 8 * 50e9
    assert SYSTEMS["a100"].node_bandwidth == 8 * 25e9


# The Ultra-Scale Playbook, "Pipeline Parallelism", figure pp_comm_bandwidth: all-reduce bus bandwidth of a 256 MB
# message on H100 nodes of 8 GPUs, 436.0 GB/s on 1 node and 361.7 GB/s on 2 nodes.
PLAYBOOK_ONE_NODE, PLAYBOOK_TWO_NODES = 436.0e9, 361.7e9


def test_the_stored_playbook_figure_is_the_published_one():
    assert PLAYBOOK_BUSBW["all_reduce"][:2] == (PLAYBOOK_ONE_NODE / 1e9, PLAYBOOK_TWO_NODES / 1e9)
    assert PLAYBOOK_BUSBW["nodes"][:2] == (1, 2)


@pytest.mark.parametrize("nodes, measured", [(1, PLAYBOOK_ONE_NODE), (2, PLAYBOOK_TWO_NODES)])
def test_all_reduce_bus_bandwidth_matches_the_playbook_on_one_and_two_nodes(nodes, measured):
    # within 10%: the alpha-beta model with NVLink inside and multi-rail InfiniBand between the nodes
    cost = collective_time("all_reduce", 2**28, 8 * nodes, system="h100")
    assert cost.busbw == pytest.approx(measured, rel=0.10)


def test_a_ring_across_nodes_uses_all_the_nics_of_a_node_not_one():
    # DGX H100: 8 NICs of 50 GB/s, NVLink 450 GB/s: a large all-reduce over 2 nodes runs at min(8 x 50, 450)
    h100 = SYSTEMS["h100"]
    big = collective_time("all_reduce", 1e12, 16, system="h100")
    assert big.busbw == pytest.approx(min(h100.node_bandwidth, h100.intra.bandwidth), rel=1e-3)
    assert big.busbw > 4 * h100.nic.bandwidth  # a single-NIC ring would give 50 GB/s
    one_nic = collective_time("all_reduce", 1e12, 16, LINKS["ib-ndr400"])
    assert big.time_s < one_nic.time_s / 4
    # fewer GPUs per node, fewer rails: one GPU per node crosses on its own NIC alone
    single = collective_time("all_reduce", 1e12, 16, system="h100", gpus_per_node=1)
    assert single.busbw == pytest.approx(h100.nic.bandwidth, rel=1e-3)


def test_from_four_nodes_on_the_model_overestimates_the_measured_bandwidth():
    # what the chapter says the alpha-beta model leaves out (congestion, topology): it stays >= 1.5x too high
    for nodes, measured in zip(PLAYBOOK_BUSBW["nodes"], PLAYBOOK_BUSBW["all_reduce"], strict=True):
        if nodes >= 4:
            model = collective_time("all_reduce", PLAYBOOK_BUSBW["message_bytes"], 8 * nodes, system="h100")
            assert model.busbw > 1.5 * measured * 1e9, nodes


def test_all_to_all_across_nodes_gets_one_nic_per_gpu():
    # no ring to share the NICs: each GPU sends (W-g)/W of its buffer off the node through its own NIC
    nic = SYSTEMS["h100"].nic.bandwidth
    for ranks in (16, 64):
        cost = collective_time("all_to_all", 1e12, ranks, system="h100")
        assert cost.time_s == pytest.approx((ranks - 8) / ranks * 1e12 / nic, rel=1e-3)


def test_hierarchical_all_reduce_saves_latency_steps_not_bandwidth():
    small, large = 2**20, 2**30
    flat = {size: collective_time("all_reduce", size, 16, system="h100") for size in (small, large)}
    hier = {size: collective_time("all_reduce", size, 16, system="h100", algorithm="hierarchical")
            for size in (small, large)}
    assert hier[small].steps == 7 + 2 + 7 and flat[small].steps == 30
    assert hier[small].time_s < flat[small].time_s / 2  # latency-bound: fewer steps win
    assert hier[large].time_s > flat[large].time_s  # bandwidth-bound: its phases do not overlap
    # across nodes each GPU's 1/8 slice rides its own NIC: 2(n-1)/n * B/8 at 50 GB/s
    inside = collective_time("reduce_scatter", large, 8, system="h100").time_s
    across = 2 * 5e-6 + large / 8 / 50e9
    assert hier[large].time_s == pytest.approx(2 * inside + across)


def test_cli_prices_two_dgx_h100_at_the_playbook_bandwidth():
    # the acceptance command: a 16-GPU all-reduce of 256 MiB, of the order of the 2-node measurement
    import json
    import re
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "lab", "calc", "comms", "--op", "all_reduce", "--ranks", "16", "--hardware", "h100",
           "--bytes", "268435456"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    busbw = float(re.search(r"busbw ([\d.]+) GB/s", done.stdout).group(1))
    assert busbw == pytest.approx(PLAYBOOK_TWO_NODES / 1e9, rel=0.10)
    assert "priced on multi-rail: 8 x InfiniBand NDR NIC" in done.stdout  # the reader sees which link it used
    out = json.loads(subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=60).stdout)
    assert out["busbw"] == pytest.approx(PLAYBOOK_TWO_NODES, rel=0.10)


@pytest.mark.parametrize("kwargs, message", [
    (dict(op="allreduce", nbytes=1, ranks=2, system="h100"), "op='allreduce' must be one of all_reduce"),
    (dict(op="all_reduce", nbytes=-1, ranks=2, system="h100"), "bytes=-1 must be >= 0"),
    (dict(op="all_reduce", nbytes=1, ranks=0, system="h100"), "ranks=0 must be an integer >= 1"),
    (dict(op="all_reduce", nbytes=1, ranks=12, system="h100"), "ranks=12 must be a multiple of gpus_per_node=8"),
    (dict(op="all_reduce", nbytes=1, ranks=2, system="tpu"), "system='tpu' must be one of a100, h100"),
    (dict(op="all_reduce", nbytes=1, ranks=2, system="h100", algorithm="star"), "algorithm='star' must be one of"),
    (dict(op="all_reduce", nbytes=1, ranks=16, system="h100", gpus_per_node=0),
     "gpus_per_node=0 must be an integer >= 1"),
    (dict(op="all_reduce", nbytes=1, ranks=16, system="llama3-roce", pods=3),
     "pods=3 must be an integer from 1 to the group's 2 nodes"),
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


def test_latency_and_bandwidth_terms_are_equal_at_the_crossover():
    link = LINKS["ib-ndr400"]
    for w in (2, 8, 64):
        size = latency_bandwidth_crossover("all_reduce", w, link)
        cost = collective_time("all_reduce", size, w, link)
        assert cost.steps * link.latency == pytest.approx(cost.bytes_sent_per_rank / link.bandwidth)
        assert size == pytest.approx(w * link.latency * link.bandwidth)  # the ring all-reduce's W·alpha·bandwidth
    with pytest.raises(ValueError, match="ranks=1"):
        latency_bandwidth_crossover("all_reduce", 1, link)


def test_ring_and_tree_take_the_same_time_at_their_crossover():
    link = LINKS["ib-ndr400"]
    for w in (5, 16, 100):
        size = ring_tree_crossover(w, link)
        ring, tree = (collective_time("all_reduce", size, w, link, algorithm=a).time_s for a in ("ring", "tree"))
        assert ring == pytest.approx(tree)
        assert collective_time("all_reduce", 2 * size, w, link).time_s < collective_time(
            "all_reduce", 2 * size, w, link, algorithm="tree").time_s
    assert ring_tree_crossover(2, link) == ring_tree_crossover(3, link) == 0  # as few ring steps as tree steps


def test_dp_critical_batch_is_the_scaling_books_2550_tokens_per_v5p_chip():
    # How to Scale Your Model ch. 5 (Data parallelism): B/X > C/W_ici = 4.59e14 / 1.8e11 = 2550 on TPU v5p
    assert dp_critical_batch(4.59e14, 1.8e11, 1) == pytest.approx(2550)
    assert dp_critical_batch(4.59e14, 1.8e11, 8960) == pytest.approx(8960 * 2550)
    with pytest.raises(ValueError, match="dp=0"):
        dp_critical_batch(4.59e14, 1.8e11, 0)


def test_a_system_of_ones_own_prices_like_a_named_one():
    own = System("mine", LINKS["nvlink4"], LINKS["ib-ndr400"], 8, 8, "test")
    for algorithm in ("ring", "hierarchical"):
        assert collective_time("all_reduce", 1e9, 16, system=own, algorithm=algorithm) == collective_time(
            "all_reduce", 1e9, 16, system="h100", algorithm=algorithm)


def test_llama3s_cluster_is_the_papers():
    # The Llama 3 Herd of Models, §3.3.1: 8 GPUs on NVLink a server, 400 Gbps RoCE between GPUs, pods of 3,072
    # GPUs with full bisection bandwidth joined at 1:7
    spec = SYSTEMS["llama3-roce"]
    assert (spec.gpus_per_node, spec.nics_per_node, spec.nic.bandwidth) == (8, 8, 50e9)
    assert (spec.fabric.pod_gpus, spec.fabric.oversubscription) == (3072, 7.0)
    assert all("Llama 3" in source for source in (spec.source, spec.fabric.source, spec.nic.source))


def test_a_ring_through_pods_slows_only_where_a_group_has_fewer_nodes_in_a_pod_than_the_oversubscription():
    """Every group runs its ring at once; ordered pod by pod, a ring leaves each pod once, so a pod's uplinks (1/7
    of its NICs') carry one send in n, n the group's nodes in the pod: data parallelism's 128 ranks one a node over
    6 pods (Llama 3 at 16K GPUs, 21 nodes a pod) keep the NICs' rate, 12 ranks over 6 pods (2 a pod) get 2/7 of
    it. An all-to-all sends 5/6 of its bytes off the pod: 6/35 of the NICs'. Without a fabric, pods change nothing."""
    from lab.calc.comms import pod_share

    spec = SYSTEMS["llama3-roce"]
    assert pod_share(spec, 128, 1, 1) == pod_share(spec, 128, 1, 6) == 1.0
    assert pod_share(spec, 12, 1, 6) == pytest.approx(2 / 7)
    assert pod_share(spec, 128, 1, 6, "all_to_all") == pytest.approx(6 / 5 / 7)
    assert pod_share(SYSTEMS["h100"], 12, 1, 6) == 1.0
    size = 2**28
    one, six = (collective_time("reduce_scatter", size, 12, system="llama3-roce", gpus_per_node=1, pods=p)
                for p in (1, 6))
    bandwidth = (six.time_s - six.steps * spec.nic.latency) / six.bytes_sent_per_rank
    assert 1 / bandwidth == pytest.approx(2 / 7 * spec.nic.bandwidth) and six.time_s > one.time_s
    assert "29% of it across pods" in six.link
    wide = collective_time("reduce_scatter", size, 128, system="llama3-roce", gpus_per_node=1, pods=6)
    assert wide == collective_time("reduce_scatter", size, 128, system="llama3-roce", gpus_per_node=1)
    hierarchical = [collective_time("all_reduce", size, 96, system="llama3-roce", algorithm="hierarchical", pods=p)
                    for p in (1, 6)]
    assert hierarchical[1].time_s > hierarchical[0].time_s  # 12 nodes over 6 pods: 2 a pod, 2/7 across
