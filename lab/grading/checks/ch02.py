"""Chapter 02, collectives. Ring collectives on real gloo ranks, the α–β cost model, a sharded matmul in JAX.

The two multi-rank exercise cells end with a given driver (`run_ring`, `run_reduce_scatter`): on every rank it
fills a random tensor from a seed and the rank, calls the student's collective inside `count_collectives`, and
reports the tensor afterwards and the messages it counted. The checks rebuild the same tensors here, reduce them
with torch (what `dist.all_reduce` and `dist.reduce_scatter_single` compute) and count what the ring must send
with `lab.calc.comms`. Sizes are random and, where it matters, not divisible by the world size.

The cost-model exercises are compared with `lab.calc.comms` on random sizes, world sizes, latencies and
bandwidths. The JAX exercise's driver returns the product, where each device's shard sits, and the collectives
of the program XLA compiled; the check multiplies the matrices here in float64.

The worked problems (02.problems) are plain Python functions of random numbers, compared with `lab.calc.comms`
to 1%: the sandbox does not see lab.calc, so the learner writes each formula.

torch is imported inside the functions: `lab.check` of other chapters loads this module too.
"""

from __future__ import annotations

import math
import random

from lab.calc.comms import (
    bus_factor,
    collective_time,
    dp_critical_batch,
    latency_bandwidth_crossover,
    ring_tree_crossover,
)
from lab.calc.network import Link, System
from lab.grading.checks import (
    RANKS,
    CheckFailed,
    Mistake,
    exercise,
    expect_allclose,
    expect_close,
    expect_dict,
    expect_equal,
    expect_number,
    per_rank,
    point_to_point_sent,
)

SEED_STRIDE = 7919  # rank r's tensor comes from seed + SEED_STRIDE * r: the drivers use the same rule


def cost(op: str, nbytes: float, world: int, alpha: float = 0.0, bandwidth: float = 1.0,
         algorithm: str = "ring"):
    """`lab.calc.comms`' prediction for one collective on one link."""
    return collective_time(op, nbytes, world, Link("check", bandwidth, alpha, "grader"), algorithm)


def rank_tensors(shape: list[int], seed: int, world: int) -> list:
    """Every rank's input, as the drivers build it (float32, one generator per rank)."""
    import torch

    return [torch.randn(shape, generator=torch.Generator().manual_seed(seed + SEED_STRIDE * rank))
            for rank in range(world)]


def _messages(results: list[dict], world: int, what: str) -> tuple[list[int], int]:
    """(messages each rank sent, bytes all ranks sent together); fails on any collective call."""
    counted = [point_to_point_sent(got, rank, what) for rank, got in enumerate(results)]
    return [messages for messages, _ in counted], sum(nbytes for _, nbytes in counted)


def _random_shape(rng: random.Random, world: int, uneven: bool) -> list[int]:
    """A 2-D shape with at least `world` elements, a number that `world` divides or (`uneven`) does not."""
    while True:
        shape = [rng.randrange(1, 7), rng.randrange(2, 61)]
        numel = shape[0] * shape[1]
        if numel >= world and bool(numel % world) == uneven:
            return shape


# --- 02.ring_all_reduce ----------------------------------------------------------------------------------------

RING = exercise("02.ring_all_reduce", entry=("ring_all_reduce", "run_ring"), **RANKS)


def _ring(student, rng: random.Random, world: int, op: str = "sum", uneven: bool = False) -> tuple[list, dict]:
    shape, seed = _random_shape(rng, world, uneven), rng.randrange(10**6)
    call = f"run_ring(shape={shape}, seed={seed}, op={op!r}) on {world} ranks"
    results = per_rank(student.ranks("run_ring", world, shape, seed, op), world, call)
    return results, {"shape": shape, "seed": seed, "call": call, "world": world}


def _ring_values(student, rng: random.Random, world: int, op: str = "sum", uneven: bool = False) -> None:
    results, run = _ring(student, rng, world, op, uneven)
    import torch

    total = torch.stack(rank_tensors(run["shape"], run["seed"], world)).double().sum(0)
    expected = (total / world if op == "avg" else total).flatten().tolist()
    for rank, got in enumerate(results):
        expect_allclose(got.get("result"), expected, f"{run['call']}: rank {rank}'s tensor after the all-reduce",
                        tol=1e-5)


@RING.check(points=1, hint="a ring all-reduce is two phases of W-1 steps each: one that sums chunks, one that "
                           "spreads the finished ones")
def two_ranks(student, rng):
    """2 ranks: every rank ends with the sum of every rank's tensor"""
    _ring_values(student, rng, 2, uneven=False)


@RING.check(points=2, hint="with W >= 3 every rank must send one way round the ring and receive from the other; and "
                           "the chunks must cover every element when W does not divide numel (a rank killed by "
                           "SIGABRT received a message of another size than it expected)")
def three_and_four_ranks(student, rng):
    """3 and 4 ranks, sizes the world size divides and sizes it does not"""
    _ring_values(student, rng, 3, uneven=False)  # first, so that a wrong schedule shows as wrong values
    _ring_values(student, rng, 3, uneven=True)
    _ring_values(student, rng, 4, uneven=True)


@RING.check(points=1, hint="op='avg' is the sum divided by the world size: what data parallelism needs for "
                           "gradients")
def average(student, rng):
    """op='avg': every rank ends with the mean"""
    _ring_values(student, rng, rng.choice([2, 3, 4]), op="avg", uneven=rng.random() < 0.5)


@RING.check(points=1, hint="only dist.isend/dist.irecv (or dist.send/dist.recv), looked up on dist at call time; "
                           "each step sends one chunk: 2(W-1) messages per rank")
def point_to_point_only(student, rng):
    """only point-to-point messages: 2(W−1) per rank, 2(W−1)·B bytes over all ranks"""
    world = rng.choice([3, 4])
    results, run = _ring(student, rng, world, uneven=True)
    sent, total = _messages(results, world, run["call"])
    nbytes = 4 * math.prod(run["shape"])
    expect_equal(sent, [cost("all_reduce", nbytes, world).steps] * world, f"{run['call']}: messages sent per rank")
    expect_equal(total, round(world * cost("all_reduce", nbytes, world).bytes_sent_per_rank),
                 f"{run['call']}: bytes sent by all ranks together")


# --- 02.reduce_scatter -----------------------------------------------------------------------------------------

REDUCE_SCATTER = exercise("02.reduce_scatter", entry=("ring_reduce_scatter", "run_reduce_scatter"), **RANKS)


def _reduce_scatter(student, rng: random.Random, world: int) -> tuple[list, dict]:
    block, seed = [rng.randrange(1, 5), rng.randrange(1, 41)], rng.randrange(10**6)
    call = f"run_reduce_scatter(block_shape={block}, seed={seed}) on {world} ranks"
    results = per_rank(student.ranks("run_reduce_scatter", world, block, seed), world, call)
    return results, {"block": block, "seed": seed, "call": call, "world": world}


def _reduce_scatter_values(student, rng: random.Random, world: int) -> None:
    results, run = _reduce_scatter(student, rng, world)
    import torch

    shape = [world * run["block"][0], run["block"][1]]
    blocks = torch.stack(rank_tensors(shape, run["seed"], world)).double().sum(0).chunk(world)
    for rank, got in enumerate(results):
        expect_allclose(got.get("result"), blocks[rank].flatten().tolist(),
                        f"{run['call']}: rank {rank}'s output (the sum of every rank's block {rank})", tol=1e-5)


@REDUCE_SCATTER.check(points=1, hint="rank r must end with block r complete: work backwards from the last step to "
                                     "find which block it sends first")
def rs_two_ranks(student, rng):
    """2 ranks: rank r receives the sum of every rank's block r"""
    _reduce_scatter_values(student, rng, 2)


@REDUCE_SCATTER.check(points=1, hint="after W-1 steps only the last chunk a rank added into is complete: which one "
                                     "is it for your step indexing?")
def rs_three_and_four_ranks(student, rng):
    """3 and 4 ranks: rank r receives the sum of every rank's block r"""
    _reduce_scatter_values(student, rng, 3)
    _reduce_scatter_values(student, rng, 4)


@REDUCE_SCATTER.check(points=1, hint="no library collective: W-1 ring steps of one block each, (W-1)/W of the "
                                     "input per rank")
def rs_point_to_point_only(student, rng):
    """only point-to-point messages: W−1 per rank, (W−1)/W of the input each"""
    world = rng.choice([3, 4])
    results, run = _reduce_scatter(student, rng, world)
    sent, total = _messages(results, world, run["call"])
    nbytes = 4 * world * math.prod(run["block"])
    expect_equal(sent, [cost("reduce_scatter", nbytes, world).steps] * world, f"{run['call']}: messages sent per rank")
    expect_equal(total, round(world * cost("reduce_scatter", nbytes, world).bytes_sent_per_rank),
                 f"{run['call']}: bytes sent by all ranks together")


# --- 02.ring_bytes ---------------------------------------------------------------------------------------------

RING_BYTES = exercise("02.ring_bytes", entry=("bytes_sent_per_rank",))


def _ring_bytes(student, rng: random.Random, op: str) -> None:
    for world in (1, rng.randrange(2, 9), rng.randrange(9, 2049)):
        nbytes = rng.randrange(1, 2**34)
        expect_close(student.bytes_sent_per_rank(op, nbytes, world), cost(op, nbytes, world).bytes_sent_per_rank,
                     f"bytes_sent_per_rank({op!r}, nbytes={nbytes}, world_size={world})", rel=1e-9)


@RING_BYTES.check(points=1, hint="all-reduce = reduce-scatter + all-gather: 2(W-1) steps, each sending one "
                                 "chunk of B/W bytes")
def bytes_all_reduce(student, rng):
    """all_reduce: 2(W−1)/W·B"""
    _ring_bytes(student, rng, "all_reduce")


@RING_BYTES.check(points=1, hint="a rank never sends its own finished chunk in reduce-scatter: W-1 steps, not W")
def bytes_reduce_scatter(student, rng):
    """reduce_scatter: (W−1)/W·B of its input"""
    _ring_bytes(student, rng, "reduce_scatter")


@RING_BYTES.check(points=1, hint="B is the all-gather's output (all W shards): each step passes one shard of B/W bytes")
def bytes_all_gather(student, rng):
    """all_gather: (W−1)/W·B of its output"""
    _ring_bytes(student, rng, "all_gather")


# --- 02.alpha_beta ---------------------------------------------------------------------------------------------

ALPHA_BETA = exercise("02.alpha_beta", entry=("predicted_time",), requires=("02.ring_bytes",))


def _alpha_beta(student, rng: random.Random, op: str, algorithm: str, worlds: tuple[int, ...]) -> None:
    for world in worlds:
        nbytes, alpha = rng.randrange(2**10, 2**32), rng.uniform(1e-6, 1e-3)
        bandwidth = rng.uniform(1e9, 9e11)
        expected = cost(op, nbytes, world, alpha, bandwidth, algorithm).time_s
        expect_close(student.predicted_time(op, nbytes, world, alpha, bandwidth, algorithm), expected,
                     f"predicted_time({op!r}, nbytes={nbytes}, world_size={world}, alpha={alpha!r}, "
                     f"bandwidth={bandwidth!r}, algorithm={algorithm!r})", rel=1e-9)


def _not_power_of_two(rng: random.Random) -> int:
    return rng.choice([w for w in range(3, 200) if w & (w - 1)])


@ALPHA_BETA.check(points=1, hint="count the ring's steps (each pays the latency) and the bytes each rank pushes "
                                 "through its link")
def time_ring_all_reduce(student, rng):
    """ring all-reduce: 2(W−1)·α + 2(W−1)/W·B / bandwidth"""
    _alpha_beta(student, rng, "all_reduce", "ring", (2, rng.randrange(3, 9), rng.randrange(9, 1025)))


@ALPHA_BETA.check(points=1, hint="reduce-scatter and all-gather are half an all-reduce: W-1 steps")
def time_ring_halves(student, rng):
    """ring reduce-scatter and all-gather: (W−1)·α + (W−1)/W·B / bandwidth"""
    for op in ("reduce_scatter", "all_gather"):
        _alpha_beta(student, rng, op, "ring", (rng.randrange(2, 9), rng.randrange(9, 1025)))


@ALPHA_BETA.check(points=1, hint="a tree all-reduce is two passes over a tree of depth log2 W (rounded up), and a "
                                 "tree step moves the whole buffer")
def time_tree_all_reduce(student, rng):
    """tree all-reduce: 2⌈log₂W⌉ steps, each moving the whole message"""
    _alpha_beta(student, rng, "all_reduce", "tree", (2, _not_power_of_two(rng), _not_power_of_two(rng)))


# --- 02.sharded_matmul -----------------------------------------------------------------------------------------

SHARDED_MATMUL = exercise("02.sharded_matmul", entry=("matmul_reduce_scatter", "run_matmul"),
                          modules=("lab.config", "lab.jaxtrack.sim"), packages=("jax",), memory_mb=4096)


def _matmul(student, rng: random.Random, n: int) -> tuple[dict, dict]:
    m, k, cols = n * rng.randrange(1, 5), n * rng.randrange(1, 6), rng.randrange(1, 9)
    a = [[round(rng.uniform(-1, 1), 4) for _ in range(k)] for _ in range(m)]
    b = [[round(rng.uniform(-1, 1), 4) for _ in range(cols)] for _ in range(k)]
    call = f"run_matmul(a of shape ({m}, {k}), b of shape ({k}, {cols}), n_devices={n})"
    got = expect_dict(student.run_matmul(a, b, n), call)
    return got, {"a": a, "b": b, "m": m, "n_cols": cols, "n": n, "call": call}


@SHARDED_MATMUL.check(points=1, hint="each device multiplies its column block of A by its row block of B: a partial "
                                     "product of the whole C; the partial products must be summed over devices")
def matmul_values(student, rng):
    """C = A·B on 2 and 4 devices"""
    import torch

    for n in (2, 4):
        got, run = _matmul(student, rng, n)
        expected = (torch.tensor(run["a"], dtype=torch.float64) @ torch.tensor(run["b"], dtype=torch.float64))
        c = got.get("c")
        flat = [v for row in c for v in row] if isinstance(c, list) and all(isinstance(r, list) for r in c) else c
        expect_allclose(flat, expected.flatten().tolist(), f"{run['call']}: C (row by row)", tol=1e-4)


@SHARDED_MATMUL.check(points=1, hint="the result must come out split by rows: the reduction and out_specs must agree "
                                     "on which dimension is sharded")
def matmul_row_shards(student, rng):
    """C ends sharded by rows: device d holds rows d·M/n to (d+1)·M/n, every column"""
    n = rng.choice([2, 4])
    got, run = _matmul(student, rng, n)
    rows = run["m"] // n
    expected = [[d * rows, (d + 1) * rows, 0, run["n_cols"]] for d in range(n)]
    expect_equal(got.get("shards"), expected, f"{run['call']}: [first row, end row, first column, end column] "
                                              f"of each device's shard of C")


@SHARDED_MATMUL.check(points=1, hint="psum is an all-reduce: every device gets all of C (twice the bytes of a "
                                     "reduce-scatter) and then keeps a slice; psum_scatter sends only what is kept")
def matmul_one_reduce_scatter(student, rng):
    """the compiled program has one reduce-scatter and no other collective"""
    n = rng.choice([2, 4])
    got, run = _matmul(student, rng, n)
    collectives = got.get("collectives")
    if collectives != {"reduce-scatter": 1}:
        raise CheckFailed(f"{run['call']}: the compiled program's collectives returned {collectives!r}, "
                          f"expected {{'reduce-scatter': 1}}")


# --- 02.problems -----------------------------------------------------------------------------------------------
# Back-of-envelope problems: plain Python in the sandbox (no lab.calc there), compared with lab.calc to 1%.

PROBLEMS = exercise("02.problems", entry=(
    "ring_all_reduce_time", "fsdp_bytes_per_rank", "alpha_beta_crossover", "ring_beats_tree_above", "bus_bandwidth",
    "dp_min_batch", "moe_dispatch_bytes", "hierarchical_all_reduce_time", "two_node_all_reduce_time"))
TOLERANCE = 0.01
MISSING_TWO = Mistake(0.5, "a factor 2", "an all-reduce is a reduce-scatter and an all-gather: twice (W-1)/W")
BITS = Mistake(1 / 8, "bits taken for bytes", "a NIC's 400 Gb/s is 400e9 bits: divide by 8 for bytes")


def _bandwidth_only(bandwidth: float) -> Link:
    return Link("problem", bandwidth, 0.0, "grader")


def _node_pair(nvlink: float, nic: float, gpus_per_node: int, nics_per_node: int) -> System:
    """A cluster of the problem's numbers, latency left out (the problems are bandwidth-bound)."""
    return System("problem", _bandwidth_only(nvlink), _bandwidth_only(nic), gpus_per_node, nics_per_node, "grader")


@PROBLEMS.check(points=1, hint="a ring all-reduce sends 2(W-1)/W of the tensor through each rank's link")
def p1_ring_time(student, rng):
    """P1 — ring all-reduce time, bandwidth-bound: 2(W−1)/W·B/β"""
    for world in (rng.randrange(2, 9), rng.randrange(9, 4097)):
        nbytes, bandwidth = rng.uniform(1e6, 2e11), rng.uniform(1e10, 1e12)
        expect_close(student.ring_all_reduce_time(nbytes, world, bandwidth),
                     cost("all_reduce", nbytes, world, bandwidth=bandwidth).time_s,
                     f"ring_all_reduce_time({nbytes:.6g}, {world}, {bandwidth:.6g})", TOLERANCE, [MISSING_TWO])


@PROBLEMS.check(points=1, hint="ZeRO-3 gathers each unit's parameters twice (forward, and again in the backward) "
                               "and reduce-scatters its gradients once; each moves (W-1)/W of the unit's bytes")
def p2_fsdp_bytes(student, rng):
    """P2 — ZeRO-3's bytes per rank and step: 2 all-gathers + 1 reduce-scatter"""
    for world in (rng.randrange(2, 9), rng.randrange(9, 1025)):
        params, width = rng.randrange(10**6, 10**11), rng.choice([2, 4])
        nbytes = params * width
        expected = (2 * cost("all_gather", nbytes, world).bytes_sent_per_rank
                    + cost("reduce_scatter", nbytes, world).bytes_sent_per_rank)
        expect_close(student.fsdp_bytes_per_rank(params, world, width), expected,
                     f"fsdp_bytes_per_rank({params}, {world}, {width})", TOLERANCE)


@PROBLEMS.check(points=1, hint="the crossover is where the latency term and the bandwidth term of the α–β time are "
                               "equal")
def p3_crossover(student, rng):
    """P3 — the α–β crossover: the all-reduce size where latency and bandwidth cost the same"""
    for world in (rng.randrange(2, 9), rng.randrange(9, 2049)):
        alpha, bandwidth = rng.uniform(1e-6, 5e-5), rng.uniform(1e10, 1e12)
        expect_close(student.alpha_beta_crossover(world, alpha, bandwidth),
                     latency_bandwidth_crossover("all_reduce", world, Link("problem", bandwidth, alpha, "grader")),
                     f"alpha_beta_crossover({world}, {alpha:.6g}, {bandwidth:.6g})", TOLERANCE)


@PROBLEMS.check(points=1, hint="write both α–β times (tree and ring) and find the size where they meet (0 when the "
                               "ring never loses)")
def p4_ring_vs_tree(student, rng):
    """P4 — the all-reduce size above which the ring beats the tree"""
    for world in (rng.choice([3, 2]), _not_power_of_two(rng), 2 ** rng.randrange(3, 12)):
        alpha, bandwidth = rng.uniform(1e-6, 5e-5), rng.uniform(1e10, 1e12)
        expected = ring_tree_crossover(world, Link("problem", bandwidth, alpha, "grader"))
        got = student.ring_beats_tree_above(world, alpha, bandwidth)
        what = f"ring_beats_tree_above({world}, {alpha:.6g}, {bandwidth:.6g})"
        if expected == 0:
            expect_number(got, 0.0, what, tol=1e-9)
        else:
            expect_close(got, expected, what, TOLERANCE)


@PROBLEMS.check(points=1, hint="busbw corrects algbw by the fraction of the buffer each rank really sends, which "
                               "differs per collective")
def p5_bus_bandwidth(student, rng):
    """P5 — nccl-tests' bus bandwidth from a measured time"""
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
        world, nbytes, seconds = rng.randrange(2, 65), rng.uniform(1e6, 1e10), rng.uniform(1e-4, 1.0)
        expect_close(student.bus_bandwidth(op, nbytes, world, seconds), nbytes / seconds * bus_factor(op, world),
                     f"bus_bandwidth({op!r}, {nbytes:.6g}, {world}, {seconds:.6g})", TOLERANCE)


@PROBLEMS.check(points=1, hint="compare the backward's compute time with the gradient all-reduce's time for one "
                               "layer: the layer's shape cancels")
def p6_dp_condition(student, rng):
    """P6 — the DP condition B/X > C/W: the smallest compute-bound global batch"""
    for dp in (rng.randrange(2, 65), rng.randrange(65, 10001)):
        flops, bandwidth = rng.uniform(1e14, 2e15), rng.uniform(2e10, 1e12)
        expect_close(student.dp_min_batch(flops, bandwidth, dp), dp_critical_batch(flops, bandwidth, dp),
                     f"dp_min_batch({flops:.6g}, {bandwidth:.6g}, {dp})", TOLERANCE)


@PROBLEMS.check(points=1, hint="with uniform routing, what share of a token's top_k copies stays on its own rank?")
def p7_all_to_all(student, rng):
    """P7 — the bytes one rank sends in an MoE dispatch all-to-all"""
    for world in (rng.randrange(2, 9), rng.randrange(9, 257)):
        tokens, hidden, top_k, width = rng.randrange(512, 65537), rng.randrange(256, 8193), rng.randrange(1, 9), \
            rng.choice([1, 2])
        expected = cost("all_to_all", tokens * top_k * hidden * width, world).bytes_sent_per_rank
        expect_close(student.moe_dispatch_bytes(tokens, hidden, top_k, world, width), expected,
                     f"moe_dispatch_bytes({tokens}, {hidden}, {top_k}, {world}, {width})", TOLERANCE)


@PROBLEMS.check(points=1, hint="the hierarchical all-reduce is three phases, one of them across nodes on a slice "
                               "only: time each and add them")
def p8_hierarchical(student, rng):
    """P8 — hierarchical all-reduce: NVLink inside the node, one NIC per GPU across"""
    for nodes in (2, rng.randrange(3, 257)):
        g, nbytes = rng.choice([4, 8]), rng.uniform(1e8, 1e11)
        nvlink, nic = rng.uniform(2e11, 9e11), rng.uniform(1e10, 1e11)
        expected = collective_time("all_reduce", nbytes, nodes * g, system=_node_pair(nvlink, nic, g, g),
                                   algorithm="hierarchical").time_s
        expect_close(student.hierarchical_all_reduce_time(nbytes, nodes, g, nvlink, nic), expected,
                     f"hierarchical_all_reduce_time({nbytes:.6g}, {nodes}, {g}, {nvlink:.6g}, {nic:.6g})", TOLERANCE)


@PROBLEMS.check(points=1, hint="bf16 gradients are 2 bytes a parameter; a ring over 2 nodes of 8 runs on "
                               "min(NVLink, NICs·NIC): every NIC carries a ring (multi-rail); Gb/s / 8 = GB/s")
def p9_two_nodes(student, rng):
    """P9 — bf16 gradients of a model all-reduced over 2 nodes of 8 GPUs"""
    params = rng.randrange(10**9, 10**11)
    for nics in (1, rng.randrange(2, 5), 8):  # NICs the bottleneck, then (8 fast NICs) NVLink
        nvlink, nic_gbits = rng.uniform(150, 900), rng.choice([100, 200, 400, 800]) * (4 if nics == 8 else 1)
        expected = collective_time("all_reduce", 2 * params, 16,
                                   system=_node_pair(nvlink * 1e9, nic_gbits * 1e9 / 8, 8, nics)).time_s
        expect_close(student.two_node_all_reduce_time(params, nvlink, nic_gbits, nics), expected,
                     f"two_node_all_reduce_time({params}, {nvlink:.6g}, {nic_gbits}, {nics})", TOLERANCE, [BITS])
