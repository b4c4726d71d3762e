"""Chapter 02's checks: the solutions pass with any secret, the released stubs score nothing, and every
plausible-but-wrong answer (mutant) fails the checks named for it.

The two ring exercises run the student's collective on real gloo ranks (2, 3 and 4) inside the sandbox; the
JAX exercise runs on 8 simulated CPU devices there. A mutant is the solution cell with one classic mistake — a
ring that forgets to average, a ring that turns the wrong way, a chunk index off by one, a remainder that no
chunk covers, a library collective instead of messages, an all-reduce where a reduce-scatter would do — and only
the checks that must catch it are run, to keep this file fast.

The worked problems (02.problems) are one exercise over nine answer cells: a mutant's (old, new) is applied in
the one cell that holds `old`.
"""

from __future__ import annotations

import random

from grading_support import Chapter, chapter_tests

from lab.grading import checks
from lab.grading.checks import ch02
from lab.grading.runner import run_exercise, seed

EXERCISES = ("02.ring_all_reduce", "02.reduce_scatter", "02.ring_bytes", "02.alpha_beta", "02.sharded_matmul",
             "02.problems")

RING_TWO = "2 ranks: every rank ends with the sum of every rank's tensor"
RING_UNEVEN = "3 and 4 ranks, sizes the world size divides and sizes it does not"
RING_AVG = "op='avg': every rank ends with the mean"
RING_P2P = "only point-to-point messages: 2(W−1) per rank, 2(W−1)·B bytes over all ranks"
RS_TWO = "2 ranks: rank r receives the sum of every rank's block r"
RS_MORE = "3 and 4 ranks: rank r receives the sum of every rank's block r"
RS_P2P = "only point-to-point messages: W−1 per rank, (W−1)/W of the input each"
MM_VALUES = "C = A·B on 2 and 4 devices"
MM_ROWS = "C ends sharded by rows: device d holds rows d·M/n to (d+1)·M/n, every column"
MM_ONE_RS = "the compiled program has one reduce-scatter and no other collective"
RING_DIRECTION = ("right, left = (rank + 1) % world, (rank - 1) % world",
                  "right, left = (rank - 1) % world, (rank + 1) % world")
PSUM_SCATTER = 'return jax.lax.psum_scatter(partial_c, "x", scatter_dimension=0, tiled=True)'
OUT_ROWS = 'out_specs=P("x", None)'

MUTANTS = {  # name: (exercise, [(old, new) in the solution cell], checks that must fail)
    "ring_forgets_to_average": ("02.ring_all_reduce", [("    if op == \"avg\":\n        flat /= world\n", "")],
                                {RING_AVG}),
    "ring_in_the_wrong_direction": ("02.ring_all_reduce", [RING_DIRECTION], {RING_UNEVEN}),
    "ring_all_gather_one_chunk_off": (  # believes rank r owns chunk r after the reduce-scatter
        "02.ring_all_reduce", [("swap(chunks[(rank - step + 1) % world], chunks[(rank - step) % world])",
                                "swap(chunks[(rank - step) % world], chunks[(rank - step - 1) % world])")],
        {RING_TWO, RING_UNEVEN}),
    "ring_remainder_in_no_chunk": ("02.ring_all_reduce", [("bounds = [numel * i // world for i in range(world + 1)]",
                                                           "bounds = [numel // world * i for i in range(world + 1)]")],
                                   {RING_UNEVEN}),
    "ring_calls_dist_all_reduce": ("02.ring_all_reduce", [("    numel = flat.numel()\n",
                                                           "    dist.all_reduce(tensor)\n    if op == \"avg\":\n"
                                                           "        tensor /= world\n    return tensor\n")],
                                   {RING_P2P}),
    "reduce_scatter_ends_one_block_off": (  # the all-reduce's schedule: rank r completes block r + 1
        "02.reduce_scatter", [("chunks[(rank - step - 1) % world], chunks[(rank - step - 2) % world]",
                               "chunks[(rank - step) % world], chunks[(rank - step - 1) % world]")],
        {RS_TWO, RS_MORE}),
    "reduce_scatter_in_the_wrong_direction": ("02.reduce_scatter", [RING_DIRECTION], {RS_MORE}),
    "reduce_scatter_calls_the_library": ("02.reduce_scatter", [(
        "    chunks = list(", "    from lab.distributed import reduce_scatter_single\n"
                             "    reduce_scatter_single(output, input)\n    return output\n    chunks = list(")],
        {RS_P2P}),
    "bytes_all_reduce_without_all_gather": ("02.ring_bytes", [('"all_reduce": 2 * (world_size - 1)',
                                                               '"all_reduce": world_size - 1')],
                                            {"all_reduce: 2(W−1)/W·B"}),
    "bytes_reduce_scatter_sends_own_chunk": ("02.ring_bytes", [('"reduce_scatter": world_size - 1',
                                                                '"reduce_scatter": world_size')],
                                             {"reduce_scatter: (W−1)/W·B of its input"}),
    "bytes_all_gather_B_taken_as_the_shard": ("02.ring_bytes", [('"all_gather": world_size - 1}',
                                                                 '"all_gather": world_size * (world_size - 1)}')],
                                              {"all_gather: (W−1)/W·B of its output"}),
    "bytes_whole_tensor_every_step": ("02.ring_bytes", [("chunk = nbytes / world_size", "chunk = nbytes")],
                                      {"all_reduce: 2(W−1)/W·B", "reduce_scatter: (W−1)/W·B of its input",
                                       "all_gather: (W−1)/W·B of its output"}),
    "time_all_reduce_half_the_steps": ("02.alpha_beta", [("steps = 2 * (world_size - 1) if op == \"all_reduce\" "
                                                          "else world_size - 1", "steps = world_size - 1")],
                                       {"ring all-reduce: 2(W−1)·α + 2(W−1)/W·B / bandwidth"}),
    "time_whole_message_every_step": ("02.alpha_beta", [("bytes_sent_per_rank(op, nbytes, world_size) / bandwidth",
                                                         "steps * nbytes / bandwidth")],
                                      {"ring all-reduce: 2(W−1)·α + 2(W−1)/W·B / bandwidth",
                                       "ring reduce-scatter and all-gather: (W−1)·α + (W−1)/W·B / bandwidth"}),
    "time_tree_log_without_ceil": ("02.alpha_beta", [("2 * math.ceil(math.log2(world_size))",
                                                      "2 * math.log2(world_size)")],
                                   {"tree all-reduce: 2⌈log₂W⌉ steps, each moving the whole message"}),
    "time_tree_reduce_only": ("02.alpha_beta", [("steps = 2 * math.ceil(", "steps = math.ceil(")],
                              {"tree all-reduce: 2⌈log₂W⌉ steps, each moving the whole message"}),
    "matmul_partial_sums_never_added": ("02.sharded_matmul", [(PSUM_SCATTER, "return partial_c")], {MM_VALUES}),
    "matmul_psum_leaves_c_replicated": ("02.sharded_matmul", [(PSUM_SCATTER, 'return jax.lax.psum(partial_c, "x")'),
                                                              (OUT_ROWS, "out_specs=P()")], {MM_ROWS, MM_ONE_RS}),
    "matmul_psum_then_keeps_its_rows": ("02.sharded_matmul", [(PSUM_SCATTER, (
        'rows = partial_c.shape[0] // mesh.shape["x"]\n'
        '        total = jax.lax.psum(partial_c, "x")\n'
        '        return jax.lax.dynamic_slice_in_dim(total, jax.lax.axis_index("x") * rows, rows)'))], {MM_ONE_RS}),
    "matmul_scattered_by_columns": ("02.sharded_matmul", [("scatter_dimension=0", "scatter_dimension=1"),
                                                          (OUT_ROWS, 'out_specs=P(None, "x")')], {MM_ROWS}),
}

P1, P2, P3 = ("P1 — ring all-reduce time, bandwidth-bound: 2(W−1)/W·B/β",
              "P2 — ZeRO-3's bytes per rank and step: 2 all-gathers + 1 reduce-scatter",
              "P3 — the α–β crossover: the all-reduce size where latency and bandwidth cost the same")
P4, P5, P6 = ("P4 — the all-reduce size above which the ring beats the tree",
              "P5 — nccl-tests' bus bandwidth from a measured time",
              "P6 — the DP condition B/X > C/W: the smallest compute-bound global batch")
P7, P8, P9 = ("P7 — the bytes one rank sends in an MoE dispatch all-to-all",
              "P8 — hierarchical all-reduce: NVLink inside the node, one NIC per GPU across",
              "P9 — bf16 gradients of a model all-reduced over 2 nodes of 8 GPUs")
MUTANTS |= {  # the problems: each mistake in every cell where a learner would make it
    "problems_all_reduce_without_the_2": ("02.problems", [
        ("return 2 * (world_size - 1) / world_size * nbytes", "return (world_size - 1) / world_size * nbytes"),
        ("across = 2 * (nodes - 1)", "across = (nodes - 1)"),
        ("return 2 * (world - 1) / world", "return (world - 1) / world")], {P1, P8, P9}),
    "problems_fsdp_forgets_the_backward_gather": ("02.problems", [("return 3 * (world_size", "return 2 * (world_size")],
                                                  {P2}),
    "problems_whole_message_not_its_w_minus_1_over_w": ("02.problems", [
        ("3 * (world_size - 1) / world_size * model", "3 * model"),
        ("(world_size - 1) / world_size * copies", "copies")], {P2, P7}),
    "problems_crossover_without_the_world_size": ("02.problems", [("return world_size * alpha * bandwidth",
                                                                   "return alpha * bandwidth")], {P3}),
    "problems_tree_depth_without_ceil": ("02.problems", [("depth = math.ceil(math.log2(world_size))",
                                                          "depth = math.log2(world_size)")], {P4}),
    "problems_busbw_is_algbw": ("02.problems", [("return nbytes / seconds * factor", "return nbytes / seconds")], {P5}),
    "problems_dp_condition_per_chip": ("02.problems", [("return dp * peak_flops / bandwidth",
                                                        "return peak_flops / bandwidth")], {P6}),
    "problems_every_gpu_sends_the_whole_tensor_across": ("02.problems", [("(nbytes / g) / nic_bandwidth",
                                                                          "nbytes / nic_bandwidth")], {P8}),
    "problems_nic_bits_taken_as_bytes": ("02.problems", [("nic_gbits * 1e9 / 8", "nic_gbits * 1e9")], {P9}),
    "problems_nvlink_in_gib": ("02.problems", [("min(nvlink_gbytes * 1e9", "min(nvlink_gbytes * 2**30")], {P9}),
}


CHAPTER = Chapter("02_collectives.ipynb", EXERCISES, MUTANTS)
globals().update(chapter_tests(CHAPTER))


def test_answers_memorised_from_the_public_seed_fail_with_a_class_secret():
    """A learner can see the public inputs; hard-coding the answers to them earns nothing when graded."""
    ex = checks.get("02.ring_bytes")
    table = {}

    class Recorder:  # stands in for the student: records the inputs each check asks about, answers right
        def bytes_sent_per_rank(self, op, nbytes, world_size):
            table[(op, nbytes, world_size)] = ch02.cost(op, nbytes, world_size).bytes_sent_per_rank
            return table[(op, nbytes, world_size)]

    for check in ex.checks:
        check.fn(Recorder(), random.Random(seed(None, ex.id, check.name)))
    cheat = f"TABLE = {table!r}\n\ndef bytes_sent_per_rank(op, nbytes, world_size):\n" \
            f"    return TABLE.get((op, nbytes, world_size), -1.0)\n"
    assert run_exercise(ex, [("cheat", cheat)]).points == ex.points  # the public inputs: all right
    assert run_exercise(ex, [("cheat", cheat)], secret="class-of-2026").points == 0


def test_random_sizes_are_awkward_and_drivers_seed_ranks_as_the_checks_do():
    rng = random.Random(0)
    for world in (2, 3, 4):
        shapes = [ch02._random_shape(rng, world, uneven=True) for _ in range(50)]
        assert all(r * c % world and r * c >= world for r, c in shapes)
        shapes = [ch02._random_shape(rng, world, uneven=False) for _ in range(50)]
        assert all(r * c % world == 0 and r * c >= world for r, c in shapes)
    for exercise_id in ("02.ring_all_reduce", "02.reduce_scatter"):
        assert f"manual_seed(seed + {ch02.SEED_STRIDE} * rank)" in CHAPTER.cell(exercise_id), exercise_id
