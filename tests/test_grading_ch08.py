"""Chapter 08's checks: the solutions pass with any secret, the released stubs score nothing, and every
plausible-but-wrong answer (mutant) fails the checks named for it.

The mesh exercises are compared with `lab.distributed.layout` and `lab.distributed.axis_groups`, the memory of a
layout with
`lab.calc.memory`, the batch budget and the failing configs with `lab.config`. A mutant is the solution cell with one
classic mistake — the first axis taken as the fastest, lab's order assumed whatever the order given, a group taken
as consecutive ranks, dense gradients reduced over dp without cp, EP groups strided, K/V heads split below one per
rank, norms split by TP, ZeRO over dp alone or rounded down, the output layer on every stage, a batch that ignores
CP or the pipeline's micro-batches, a fix that loses ranks, edits the batch or its input, the search read from
the wrong end or a reason read from the family alone — and only the checks that
must catch it are run, to keep this file fast.
"""

from __future__ import annotations

import random

import pytest
from grading_support import Chapter, chapter_tests

from lab.grading.checks import ch08

EXERCISES = ("08.mesh_coords", "08.collective_group", "08.layout_memory", "08.batch_budget", "08.fix_config",
             "08.best_layout", "08.llama3_layout")

COORDS_LAB = "lab's order (dp, pp, cp, tp): each rank's coordinates, as lab.distributed.layout lays them out"
COORDS_ANY = "other axis orders (Megatron's pp outermost, random ones): coordinates, and the rank back from them"
GROUPS = ("the group along each axis, by coordinate: lab.distributed.axis_groups for lab's order, the grid's lines "
          "for others")
MESH_BIG = "Llama 3 405B's 16,384 ranks (tp8, cp1 or 16, pp16, dp128 or 8)"
TP_CP_PP = "tensor, context and pipeline parallelism: the op, and the tp, cp or pp line through the rank"
DP_CP = "dense gradients and ZeRO-3 weights: the dp × cp ranks, not dp alone"
EXPERTS = "experts: tokens over the ep group (consecutive dp × cp ranks), gradients over ep_dp"
GROUPS_BIG = "DeepSeek-V3's 2,048 ranks (pp16, ep64 over dp128) and Llama 3's 16,384 (cp16)"
MEM_ONE = "no parallelism: 2 + 2 + 12 bytes per parameter, tied and untied embeddings"
MEM_TP = "tensor parallelism: matrices split, norms replicated, K/V heads replicated beyond n_kv_heads ranks"
MEM_PP = "pipeline stages: the first holds the embedding, the last the final norm and the output layer"
MEM_ZERO = "ZeRO-1/2/3 over the dp × cp ranks, each unit's shard rounded up"
MEM_BIG = "Llama 3 70B (tp8 pp4 dp8 ZeRO-1) and 405B (tp16 over its 8 K/V heads, pp2, dp16, ZeRO-1)"
BUDGET = "the playbook's example (1 M tokens, seq 4096, 8 GPUs, pp 4) and random clusters with tp and cp"
BUDGET_PP = "pipelines need at least pp − 1 micro-batches; too small a batch, or not whole sequences, gives no layout"
BUDGET_BAD = "GPUs that tp·pp·cp does not divide: a ValueError"
DIAGNOSE = "diagnose: the rule each broken config breaks, and None for one lab runs"
FIX_SHAPES = "fix tp, pp and ep that do not divide the model: same ranks, dp takes what the degree gives up"
FIX_REFUSED = "fix the layouts lab.train refuses: ZeRO with PP or EP, TP with MLA, PP with tied embeddings"
FIX_BATCH = "fix the batch split, SP without TP and ZeRO without DP, leaving the global batch as it is"
BEST = "the best layout: the search's first candidate (degrees, ZeRO, schedule, recompute, mbs, grad_accum)"
WHY_REJECTED = "why not a family the search rejected: the reason that stops its layouts closest to running"
L3_STAGES = ("Llama 3 405B on 8,192 and 16,384 GPUs (126 layers, TP8 · PP16), and random models split Llama 3's "
             "way")
L3_BUBBLE = "the micro-batches of a replica and the bubble, with micro-batches of more than one sequence and nodes of 4"
L3_REFUSES = "what does not split: GPUs, layers (Llama 3's rule, or stages of one layer) and the batch: a ValueError"
WHY_SLOWER = "why not a family that runs but is slower: the part of the step time where it loses most to the best"

PEEL = "    for axis in reversed(order):  # the last axis varies fastest"
STRIP_DP = 'p["dp"] *= p[name] // new'

MUTANTS = {  # name: (exercise, [(old, new) in the solution cell], checks that must fail)
    "coords_first_axis_fastest": ("08.mesh_coords", [(PEEL, "    for axis in order:")],
                                  {COORDS_LAB, COORDS_ANY, GROUPS, MESH_BIG}),
    "coords_assume_lab_order": (  # right for ("dp", "pp", "cp", "tp") only
        "08.mesh_coords", [(PEEL, '    for axis in reversed(("dp", "pp", "cp", "tp")):')], {COORDS_ANY}),
    "rank_of_reads_the_order_backwards": (
        "08.mesh_coords", [("    for axis in order:\n        rank = rank * sizes[axis]",
                            "    for axis in reversed(order):\n        rank = rank * sizes[axis]")],
        {COORDS_ANY, GROUPS}),
    "group_is_consecutive_ranks": (  # stride 1 whatever the axis: right for the fastest axis only
        "08.mesh_coords", [("    return [rank_of({**here, axis: i}, sizes, order) for i in range(sizes[axis])]",
                            "    return list(range(rank - here[axis], rank - here[axis] + sizes[axis]))")],
        {GROUPS, MESH_BIG}),
    "dense_grads_over_dp_only": (  # the mistake: CP ranks forgotten
        "08.collective_group", [('"dense_grads": ("all_reduce", "dp_cp")', '"dense_grads": ("all_reduce", "dp")')],
        {DP_CP, GROUPS_BIG}),
    "zero3_params_all_reduced": (
        "08.collective_group", [('"zero3_params": ("all_gather", "dp_cp")', '"zero3_params": ("all_reduce", "dp_cp")')],
        {DP_CP}),
    "ring_kv_over_tp": (
        "08.collective_group", [('"ring_kv": ("send", "cp")', '"ring_kv": ("send", "tp")')], {TP_CP_PP}),
    "ep_groups_strided": (  # EP ranks taken every dp·cp/ep instead of consecutive
        "08.collective_group", [("members = flat[position - position % ep:position - position % ep + ep]",
                                 "members = flat[position % (len(flat) // ep)::len(flat) // ep]")],
        {EXPERTS, GROUPS_BIG}),
    "ep_dp_equals_ep": (
        "08.collective_group", [("members = flat[position % ep::ep]",
                                 "members = flat[position - position % ep:position - position % ep + ep]")],
        {EXPERTS, GROUPS_BIG}),
    "dp_cp_numbered_cp_first": (
        "08.collective_group", [('for d in range(sizes["dp"]) for c in range(sizes["cp"])]',
                                 'for c in range(sizes["cp"]) for d in range(sizes["dp"])]')], {EXPERTS}),
    "kv_heads_split_below_one": (
        "08.layout_memory", [("kv_heads = max(model.n_kv_heads // tp, 1)", "kv_heads = model.n_kv_heads // tp")],
        {MEM_TP, MEM_BIG}),
    "norms_split_by_tp": (
        "08.layout_memory", [("+ 2 * d  # the two norm", "+ 2 * d // tp  # the two norm")], {MEM_TP, MEM_BIG}),
    "zero_over_dp_only": (
        "08.layout_memory", [("replicas = parallel.dp * parallel.cp", "replicas = parallel.dp")], {MEM_ZERO}),
    "shards_rounded_down": (
        "08.layout_memory", [("math.ceil(u / replicas)", "u // replicas")], {MEM_ZERO}),
    "stage_sharded_as_one_buffer": (  # padded once, not per unit: fewer bytes than lab.parallel.zero holds
        "08.layout_memory", [("sum(math.ceil(u / replicas) for u in units)", "math.ceil(sum(units) / replicas)")],
        {MEM_ZERO}),
    "zero_ladder_off_by_one": (
        "08.layout_memory", [("parallel.zero >= zero_stage", "parallel.zero > zero_stage")], {MEM_ZERO, MEM_BIG}),
    "output_layer_on_every_stage": (
        "08.layout_memory", [("    if stage == parallel.pp - 1:\n        root +=", "    if True:\n        root +=")],
        {MEM_PP}),
    "tied_output_layer_counted_twice": (
        "08.layout_memory", [("(0 if model.tie_embeddings and parallel.pp == 1 else vocab)", "vocab")], {MEM_ONE}),
    "tied_output_layer_shared_across_stages": (
        "08.layout_memory", [("model.tie_embeddings and parallel.pp == 1", "model.tie_embeddings")], {MEM_PP}),
    "optimizer_without_master_weights": (
        "08.layout_memory", [('"optimizer": 12 * held(1)', '"optimizer": 8 * held(1)')],
        {MEM_ONE, MEM_TP, MEM_PP, MEM_ZERO, MEM_BIG}),
    "dp_ignores_cp": (
        "08.batch_budget", [("dp = gpus // (tp * pp * cp)", "dp = gpus // (tp * pp)")], {BUDGET}),
    "no_pipeline_filter": (
        "08.batch_budget", [(" and per_replica // mbs >= pp - 1", "")], {BUDGET_PP}),
    "half_sequences_accepted": (
        "08.batch_budget", [("if gbs_tokens % seq or (gbs_tokens // seq) % dp:", "if (gbs_tokens // seq) % dp:")],
        {BUDGET_PP}),
    "max_mbs_left_out": (
        "08.batch_budget", [("range(1, min(max_mbs, per_replica) + 1)", "range(1, min(max_mbs, per_replica))")],
        {BUDGET}),
    "bad_cluster_accepted": (
        "08.batch_budget", [('raise ValueError(f"gpus={gpus} must be a multiple of tp*pp*cp = {tp * pp * cp}")',
                             "pass")], {BUDGET_BAD}),
    "diagnose_reads_must_divide_as_tp": (
        "08.fix_config", [('"tp_heads": "must divide n_heads"', '"tp_heads": "must divide"')], {DIAGNOSE, FIX_SHAPES}),
    "fix_loses_the_ranks_a_degree_gives_up": ("08.fix_config", [(STRIP_DP, "pass")], {FIX_SHAPES}),
    "fix_mla_drops_tp_ranks": (
        "08.fix_config", [('p["dp"], p["tp"], p["sp"] = p["dp"] * p["tp"], 1, False', 'p["tp"], p["sp"] = 1, False')],
        {FIX_REFUSED}),
    "fix_zero_with_pp_to_zero2": ("08.fix_config", [('p["zero"] = 1', 'p["zero"] = 2')], {FIX_REFUSED}),
    "fix_batch_by_changing_the_batch": (
        "08.fix_config", [('    elif rule == "sp_without_tp":',
                           '    elif rule == "batch":\n        fixed["train"]["global_batch"] = p["dp"]\n'
                           '    elif rule == "sp_without_tp":')], {FIX_BATCH}),
    "fix_edits_its_input": (
        "08.fix_config", [("fixed = copy.deepcopy(config)", "fixed = config")], {FIX_SHAPES, FIX_REFUSED, FIX_BATCH}),
    "best_is_the_last_candidate": (
        "08.best_layout", [('"h100", seq, gbs_tokens).candidates[0]', '"h100", seq, gbs_tokens).candidates[-1]')],
        {BEST}),
    "best_is_the_smallest_footprint": (  # the layout that leaves the most memory free, not the fastest
        "08.best_layout", [('"h100", seq, gbs_tokens).candidates[0]',
                            '"h100", seq, gbs_tokens).candidates[0]\n    best = min(search(model, gpus, '
                            'gpus_per_node, "h100", seq, gbs_tokens).candidates, key=lambda c: c.memory.per_gpu['
                            '"total"])')], {BEST}),
    "why_not_gives_the_message": (
        "08.best_layout", [("return result.rejected[family].main_reason()[0]",
                            "return result.rejected[family].main_reason()[1]")], {WHY_REJECTED}),
    "why_not_reads_the_family_alone": (  # its own largest part (compute), not what it loses to the best
        "08.best_layout", [("getattr(ours[0].time, part) - getattr(best.time, part)", "getattr(ours[0].time, part)")],
        {WHY_SLOWER}),
    "why_not_the_part_it_gains_on": (
        "08.best_layout", [("return max(lost, key=lost.get)", "return min(lost, key=lost.get)")], {WHY_SLOWER}),
    "stages_even_with_the_rest_last": (  # Megatron's even split, the remainder on the last stage
        "08.llama3_layout", [("stages = [n_layers] if virtual == 1 else [k - 1] + [k] * (virtual - 2) + [k - 1]",
                              "stages = [n_layers // virtual] * (virtual - 1) + [n_layers - n_layers // virtual * "
                              "(virtual - 1)]")], {L3_STAGES, L3_BUBBLE}),
    "dp_forgets_the_pipeline": ("08.llama3_layout", [("dp = gpus // (tp * pp)", "dp = gpus // tp")],
                                {L3_STAGES, L3_BUBBLE}),
    "bubble_without_interleaving": (
        "08.llama3_layout", [('"bubble": (pp - 1) / (chunks * m)', '"bubble": (pp - 1) / m')], {L3_STAGES, L3_BUBBLE}),
    "micro_batches_of_one_sequence": (
        "08.llama3_layout", [("m = global_batch // (dp * mbs)", "m = global_batch // dp")], {L3_BUBBLE}),
    "stages_of_no_layer_accepted": (
        "08.llama3_layout", [("if virtual > 1 and (rest or k < 2):", "if virtual > 1 and rest:")], {L3_REFUSES}),
}
CHAPTER = Chapter("08_5d_parallelism.ipynb", EXERCISES, MUTANTS, said=("returned", "raised"))
globals().update(chapter_tests(CHAPTER))


@pytest.mark.parametrize("seed", range(3))
def test_the_grid_reference_is_lab_dist_for_labs_order_and_the_view_for_others(seed):
    """For lab's order the checks' grid (`grid_coords`, `grid_group`) is `lab.distributed.layout` and `axis_groups`;
    for any
    other order it is `arange(world).view(*sizes in order)`, the rule the exercise states."""
    import math

    import torch

    from lab.distributed import axis_groups, layout

    rng = random.Random(seed)
    sizes = ch08.random_sizes(rng)
    world = math.prod(sizes.values())
    grid = layout(world, **sizes)
    for order in (ch08.AXES, tuple(rng.sample(ch08.AXES, 4)), ("tp", "cp", "pp", "dp")):
        view = torch.arange(world).view(*[sizes[a] for a in order])
        for rank in range(world):
            assert (view == rank).nonzero()[0].tolist() == ch08.grid_coords(rank, sizes, order)
            for axis in ch08.AXES:
                line = view.movedim(order.index(axis), -1).reshape(-1, sizes[axis])
                assert ch08.grid_group(rank, axis, sizes, order) == next(g for g in line.tolist() if rank in g)
    assert torch.equal(grid, torch.arange(world).view(*[sizes[a] for a in ch08.AXES]))
    for axis in ch08.AXES:  # for lab's order grid_group reads axis_groups: the same lines, in coordinate order
        assert [ch08.grid_group(g[0], axis, sizes, ch08.AXES) for g in axis_groups(world, axis, **sizes)] == \
            axis_groups(world, axis, **sizes)


@pytest.mark.parametrize("rule", sorted(ch08.ALLOWED))
def test_every_broken_config_breaks_its_rule_only(rule):
    """Each broken config is refused by lab with the line of its rule (and no other)."""
    words = {"tp_heads": "must divide n_heads", "pp_layers": "must divide n_layers", "ep_experts":
             "must divide n_experts", "batch": "must divide global_batch", "sp_without_tp": "sp=True needs tp",
             "zero_without_dp": "needs dp > 1", "zero_with_pp": "zero>=2 with pp", "zero_with_ep": "zero with ep",
             "tp_with_mla": "tp with mla", "pp_with_tied_embeddings": "pp with tied embeddings"}
    rng = random.Random(rule)
    for _ in range(5):
        error = ch08.lab_error(ch08.broken_config(rng, rule))
        assert error and words[rule] in error, error
