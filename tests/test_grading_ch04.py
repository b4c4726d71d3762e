"""Chapter 04's checks: the solutions pass with any secret, the released stubs score nothing, and every
plausible-but-wrong answer (mutant) fails the checks named for it.

Four exercises run the student's layers on real gloo ranks (tp 2, 3 and 4) inside the sandbox and compare
outputs and gradients with one process. A mutant is the solution cell with one classic mistake — f's backward
without its all-reduce, a softmax over the local vocabulary shard only, a reduce-scatter along the batch instead
of the sequence, a norm run after the all-gather, a copied KV head's gradient summed over the whole TP group
instead of its replicas — and only the checks that must catch it are run, to keep this file fast.
"""

from __future__ import annotations

import pytest
from grading_support import Chapter, chapter_tests

from lab.grading.checks import ch04

EXERCISES = ("04.matmul_collective", "04.column_row_linear", "04.vocab_parallel_ce", "04.sequence_parallel",
             "04.tp_gqa_attention", "04.problems")

CASE_THREE = ('''    if aj is not None and aj == bj:  # case 3: both contracting dims split over the same axis
        if reduce_scatter and bk is None:
            return {"case": 3, "collectives": [f"reduce-scatter C over {aj} along K"]}
        return {"case": 3, "collectives": [f"all-reduce C over {aj}"]}
''')
CASE_FOUR = ('''    if ai is not None and ai == bk:  # C[I_X, K_X] is impossible: gather A's rows
        case = 4 if case == 1 else case
        collectives.append(f"all-gather A over {ai} along I")
''')
LOCAL_SOFTMAX = ("        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)\n",
                 "        dist.all_reduce(sum_exp, group=group)\n")
GATHERED_LOGITS = ("        shards = [torch.empty_like(exp) for _ in range(dist.get_world_size(group))]\n"
                   "        dist.all_gather(shards, exp.contiguous(), group=group)\n"
                   "        sum_exp = torch.cat(shards, -1).sum(-1)\n")

GQA_OUTPUT = "forward: every rank's y equals one process's attention (tp 4, 2 KV heads)"
GQA_GRADS = "backward: x.grad, and each rank's slices of the Wq and Wo gradients (tp 4, 2 KV heads)"
GQA_KV = "backward: every rank's K and V gradients, summed over the replicas, are its KV head's (tp 2 and 4)"

MUTANTS = {  # name: (exercise, [(old, new) in the solution cell], checks that must fail)
    "plan_case_three_gathers_instead": (
        "04.matmul_collective", [(CASE_THREE, "")],
        {"case 3: J split over the same axis in both operands (all-reduce, or reduce-scatter along K)",
         "any shardings over a three-axis mesh"}),
    "plan_reduce_scatter_ignored": (
        "04.matmul_collective", [("if reduce_scatter and bk is None:", "if False:")],
        {"case 3: J split over the same axis in both operands (all-reduce, or reduce-scatter along K)"}),
    "plan_only_one_operand_gathered": (
        "04.matmul_collective", [("    if bj is not None:\n", "    elif bj is not None:\n")],
        {"cases 1 and 2: is the contracting dimension split in one operand, in none?"}),
    "plan_case_four_forgotten": (
        "04.matmul_collective", [(CASE_FOUR, "")],
        {"case 4: I and K split over the same axis", "any shardings over a three-axis mesh"}),
    "f_backward_without_all_reduce": (  # the mutant: the column layer's input gradient stays partial
        "04.column_row_linear", [("        grad = grad.clone()\n        dist.all_reduce(grad, group=ctx.group)\n", "")],
        {"backward: every rank's x.grad equals the single-process one (3 and 4 ranks)"}),
    "g_forgotten_in_forward": (
        "04.column_row_linear", [("        dist.all_reduce(x, group=group)\n", "")],
        {"forward: every rank's y equals the single-process MLP (2 ranks)"}),
    "g_backward_all_reduces_too": (
        "04.column_row_linear", [("        return grad, None  # the gradient of y is the same on every rank already\n",
                                  "        grad = grad.clone()\n        dist.all_reduce(grad)\n"
                                  "        return grad, None\n")],
        {"backward: each rank's weight gradients are its slices of the single-process ones"}),
    "g_as_all_gather_and_sum": (
        "04.column_row_linear", [("        dist.all_reduce(x, group=group)\n        return x\n",
                                  "        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]\n"
                                  "        dist.all_gather(parts, x, group=group)\n"
                                  "        return torch.stack(parts).sum(0)\n")],
        {"one all-reduce of b·s·d values forward (g) and one backward (f)"}),
    "ce_softmax_over_local_shard_only": (  # the mutant: max and sum of exponentials never all-reduced
        "04.vocab_parallel_ce", [(line, "") for line in LOCAL_SOFTMAX],
        {"the loss equals the full softmax's cross-entropy (2 and 3 ranks)"}),
    "ce_target_logit_not_masked": (
        "04.vocab_parallel_ce", [("shifted.gather(-1, index[..., None])[..., 0] * mine",
                                  "shifted.gather(-1, index[..., None])[..., 0]")],
        {"the loss equals the full softmax's cross-entropy (2 and 3 ranks)"}),
    "ce_one_hot_subtracted_on_every_rank": (
        "04.vocab_parallel_ce", [("-mine[..., None].to(grad.dtype)", "-torch.ones_like(index[..., None], "
                                                                      "dtype=grad.dtype)")],
        {"each rank's logits gradient is its vocabulary slice of the full one (3 and 4 ranks)"}),
    "ce_max_not_subtracted": (
        "04.vocab_parallel_ce", [("shifted = logits - global_max[..., None]", "shifted = logits")],
        {"logits in the hundreds: no overflow (the global max is subtracted first)"}),
    "ce_logits_gathered": (
        "04.vocab_parallel_ce", [("        sum_exp = exp.sum(dim=-1)\n        dist.all_reduce(sum_exp, group=group)\n",
                                  GATHERED_LOGITS)],
        {"only all-reduces of a few numbers per token: the logits are never gathered"}),
    "sp_reduce_scatter_on_the_wrong_dimension": (  # the mutant: blocks of the batch, not of the sequence
        "04.sequence_parallel", [("reduce_scatter_single(out, full, group=group)",
                                  "reduce_scatter_single(out, x.contiguous(), group=group)")],
        {"forward: each rank holds its sequence block of x + MLP(norm(x)) (2 ranks)"}),
    "sp_gather_backward_keeps_its_slice": (  # the gradient's partial sums are never summed over ranks
        "04.sequence_parallel", [("        return reduce_scatter_sequence(grad, ctx.group), None\n",
                                  "        return grad.chunk(dist.get_world_size(ctx.group), 1)"
                                  "[dist.get_rank(ctx.group)], None\n")],
        {"backward: input, weight and norm gradients equal one process (3 and 4 ranks)"}),
    "sp_norm_after_the_all_gather": (
        "04.sequence_parallel", [("h = GatherSequence.apply(rms_norm(x, norm_weight), group)",
                                  "h = rms_norm(GatherSequence.apply(x, group), norm_weight)")],
        {"the norm runs on the rank's own tokens, before the all-gather"}),
    "sp_exit_with_all_reduce_and_slice": (
        "04.sequence_parallel", [("        return reduce_scatter_sequence(x, group)\n",
                                  "        x = x.clone()\n        dist.all_reduce(x, group=group)\n"
                                  "        return x.chunk(dist.get_world_size(group), 1)[dist.get_rank(group)]\n")],
        {"one all-gather and one reduce-scatter forward, the same backward, no all-reduce"}),
    "gqa_kv_grads_not_summed": (  # each copy of a KV head keeps the partial gradient of its rank's queries
        "04.tp_gqa_attention", [("        dist.all_reduce(weight.grad, group=mine)\n", "        weight.grad\n")],
        {GQA_KV}),
    "gqa_kv_grads_summed_over_all_ranks": (  # right with one KV head, wrong with two: the heads' gradients mix
        "04.tp_gqa_attention", [("weight.grad, group=mine)", "weight.grad, group=group)")],
        {GQA_KV}),
    "gqa_kv_head_interleaved": (  # the index off: rank r takes head r % n_kv, not the head its query heads read
        "04.tp_gqa_attention", [("    return rank // copies\n", "    return rank % n_kv_heads\n")],
        {GQA_OUTPUT, GQA_KV, GQA_GRADS}),
    "gqa_output_not_all_reduced": (  # g forgotten: each rank returns its heads' partial sum
        "04.tp_gqa_attention", [("    return ReduceFromTP.apply(partial, group)\n", "    return partial\n")],
        {GQA_OUTPUT}),
}


P1 = "P1 — the largest TP degree that stays compute-bound, Y < F·W/C"
P2 = "P2 — T_comm / T_math of a TP MLP's forward"
P3 = "P3 — bytes each GPU sends per layer under TP, forward and backward"
P4 = "P4 — the activation bytes per layer sequence parallelism saves"
P5 = "P5 — the arithmetic intensity of one GPU's column-parallel matmul"
P6 = "P6 — the TP bound over a node's network card instead of NVLink"
P7 = "P7 — how many times fewer bytes vocab-parallel cross-entropy moves than gathering the logits"
P8 = "P8 — bytes to combine A[I, J_X] · B[J_X, K]'s partial sums: all-reduce or reduce-scatter"
P9 = "P9 — bytes of one layer's Wk and Wv on each TP rank with GQA"
MUTANTS |= {  # the problems: each mistake in every cell where a learner would make it
    "problems_all_reduce_without_the_2": ("04.problems", [
        ("comm = 2 * (tp - 1) / tp * 2 / bandwidth", "comm = (tp - 1) / tp * 2 / bandwidth"),
        ("return 4 * 2 * (tp - 1) / tp * activation", "return 4 * (tp - 1) / tp * activation"),
        ("factor = 1 if reduce_scatter else 2", "factor = 1")], {P2, P3, P8}),
    "problems_one_matmul_in_the_tp_bound": ("04.problems", [("math_per_token = 4 * d_ff", "math_per_token = 2 * d_ff")],
                                            {P1}),
    "problems_sp_keeps_the_norms_whole": ("04.problems", [("return sbh * (10 + 24 / tp) - 34 * sbh / tp",
                                                           "return sbh * (10 + 24 / tp) - (10 + 24 / tp) * sbh / tp")],
                                          {P4}),
    "problems_matmul_not_split": ("04.problems", [("local = d_ff // tp", "local = d_ff")], {P5}),
    "problems_nic_bits_taken_as_bytes": ("04.problems", [("nic_gbit_s * 1e9 / 8", "nic_gbit_s * 1e9")], {P6}),
    "problems_ce_floats_as_bf16": ("04.problems", [("vocab_parallel = 3 * 2 * 4", "vocab_parallel = 3 * 2 * 2")],
                                   {P7}),
    "problems_kv_heads_split_below_one": ("04.problems", [("max(n_kv_heads // tp, 1)", "n_kv_heads / tp")], {P9}),
}


CHAPTER = Chapter("04_tensor_sequence_parallel.ipynb", EXERCISES, MUTANTS)
globals().update(chapter_tests(CHAPTER))


def _lab_tp(shape, d_model, d_ff, vocab, seed, scale):
    """The MLP of `run_mlp` with `lab.parallel.tp`'s layers, the loss with its vocab-parallel cross-entropy, and
    the block of `run_sp_block` with `lab.parallel.tp_comms`' sequence operators, on this rank."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from lab.parallel.tp import ColumnParallelLinear, RowParallelLinear, reduce_output, vocab_parallel_cross_entropy
    from lab.parallel.tp_comms import copy_to_tp, gather_sequence, scatter_sequence

    rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    t = ch04.mlp_inputs(shape, d_model, d_ff, seed)
    first, second = nn.Linear(d_model, d_ff, bias=False), nn.Linear(d_ff, d_model, bias=False)
    first.weight.data, second.weight.data = t["w1"], t["w2"]
    column, row = ColumnParallelLinear(first, group), RowParallelLinear(second, group)
    reduce_output(row, group, sequence_parallel=False)  # the row layer's all-reduce lives in a hook
    x = t["x"].requires_grad_()
    y = row(torch.relu(column(copy_to_tp(x, group))))
    (y * t["probe"]).sum().backward()
    out = {"y": y.detach(), "x_grad": x.grad, "w1_grad": column.weight.grad}

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, vocab, generator=g) * scale
    targets = torch.randint(vocab, shape, generator=g)
    local = logits.chunk(world, -1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, group)
    loss.backward()
    out.update(loss=loss.item(), ce_grad=local.grad)

    sp_shape = [shape[0], world * shape[1]]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*sp_shape, d_model, generator=g)
    norm = 1 + 0.1 * torch.randn(d_model, generator=g)
    w1 = (torch.randn(d_ff, d_model, generator=g) / d_model**0.5).chunk(world, 0)[rank]
    w2 = (torch.randn(d_model, d_ff, generator=g) / d_ff**0.5).chunk(world, 1)[rank]
    x = x.chunk(world, 1)[rank]
    normed = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + ch04.EPS) * norm
    h = torch.relu(gather_sequence(normed, group) @ w1.T)
    out["sp_out"] = x + scatter_sequence(h @ w2.T, group)
    return out


def test_the_references_agree_with_lab_parallel():
    """The checks' single-process references are what `lab.parallel.tp`'s layers compute on real ranks."""
    import torch

    from lab.distributed import run

    shape, d_model, d_ff, vocab, seed, world = [2, 3], 5, 6, 9, 11, 3
    mlp, ce = ch04.mlp_reference(shape, d_model, d_ff, seed), ch04.ce_reference(shape, vocab, seed, 2.0)
    sp = ch04.sp_reference([shape[0], world * shape[1]], d_model, d_ff, seed, world)
    for rank, got in enumerate(run(_lab_tp, world, shape, d_model, d_ff, vocab, seed, 2.0)):
        close = {"rtol": 1e-5, "atol": 1e-6}
        torch.testing.assert_close(got["y"].double(), mlp["y"], **close)
        torch.testing.assert_close(got["x_grad"].double(), mlp["x_grad"], **close)
        torch.testing.assert_close(got["w1_grad"].double(), mlp["w1_grad"].chunk(world, 0)[rank], **close)
        assert got["loss"] == pytest.approx(ce["loss"], rel=1e-5)
        torch.testing.assert_close(got["ce_grad"].double(), ce["grad"].chunk(world, -1)[rank], **close)
        torch.testing.assert_close(got["sp_out"].double(), sp["out"].chunk(world, 1)[rank], **close)


def test_the_plans_cover_every_case():
    import random

    from lab.calc.sharding import matmul_plan

    rng = random.Random(0)
    cases = {matmul_plan(tuple(a), tuple(b)).case for a, b in
             ((ch04._spec(rng, ["X", "Y"]), ch04._spec(rng, ["X", "Y"])) for _ in range(200))
             if not (a[1] is not None and a[1] == b[1] and (a[0] == a[1] or b[1] == b[0]))}
    assert cases == {1, 2, 3, 4}


def test_gradients_tp_times_too_large_are_named():
    """g's backward all-reduced: every weight gradient is exactly tp times too large, and the message says so."""
    exercise_id, replace, must_fail = MUTANTS["g_backward_all_reduces_too"]
    check, = CHAPTER.grade(exercise_id, replace, only=must_fail).checks
    assert "times the expected values (tp = " in check.message and "g's backward is the identity" in check.hint, check


def _lab_gqa(shape, n_heads, n_kv_heads, head_dim, d_model, seed):
    """`run_gqa_attention`'s attention with `lab.parallel.tp`'s layers (wk, wv as `ReplicatedKVLinear`), the
    model's causal core and `sync_tensor_parallel_grads`, on this rank."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from lab.model import causal_attention
    from lab.parallel.tp import ColumnParallelLinear, ReplicatedKVLinear, RowParallelLinear, sync_tensor_parallel_grads
    from lab.parallel.tp_comms import copy_to_tp, reduce_from_tp

    group = dist.group.WORLD
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, d_model, generator=g).requires_grad_()
    full = {}
    for name, rows in (("wq", n_heads), ("wk", n_kv_heads), ("wv", n_kv_heads)):
        full[name] = nn.Linear(d_model, rows * head_dim, bias=False)
        full[name].weight.data = torch.randn(rows * head_dim, d_model, generator=g) / d_model**0.5
    full["wo"] = nn.Linear(n_heads * head_dim, d_model, bias=False)
    full["wo"].weight.data = torch.randn(d_model, n_heads * head_dim, generator=g) / (n_heads * head_dim) ** 0.5
    probe = torch.randn(*shape, d_model, generator=g)
    layers = nn.ModuleDict({"wq": ColumnParallelLinear(full["wq"], group),
                            **{n: ReplicatedKVLinear(full[n], group, n_kv_heads) for n in ("wk", "wv")},
                            "wo": RowParallelLinear(full["wo"], group)})
    B, T = shape
    h = copy_to_tp(x, group)
    q, k, v = (layers[n](h).view(B, T, -1, head_dim).transpose(1, 2) for n in ("wq", "wk", "wv"))
    y = reduce_from_tp(layers["wo"](causal_attention(q, k, v).transpose(1, 2).reshape(B, T, -1)), group)
    (y * probe).sum().backward()
    sync_tensor_parallel_grads(layers, group)
    return {"y": y.detach(), "x_grad": x.grad, **{f"{n}_grad": layers[n].weight.grad for n in layers}}


@pytest.mark.parametrize(("tp", "n_kv"), [(4, 2)])
def test_the_gqa_reference_agrees_with_lab_parallel(tp, n_kv):
    """The check's one-process attention and its KV-head rule are what `lab.parallel.tp` computes on real ranks:
    with 2 KV heads over 4 ranks, `ReplicatedKVLinear` holds head r // 2 and its synced gradient is that head's."""
    import torch

    from lab.distributed import run

    shape, n_heads, head_dim, d_model, seed = [2, 5], 8, 3, 7, 5
    ref = ch04.gqa_reference(shape, n_heads, n_kv, head_dim, d_model, seed)
    close = {"rtol": 1e-5, "atol": 1e-6}
    for rank, got in enumerate(run(_lab_gqa, tp, shape, n_heads, n_kv, head_dim, d_model, seed)):
        head = ch04._kv_head(rank, tp, n_kv)
        torch.testing.assert_close(got["y"].double(), ref["y"], **close)
        torch.testing.assert_close(got["x_grad"].double(), ref["x_grad"], **close)
        torch.testing.assert_close(got["wq_grad"].double(), ref["wq_grad"].chunk(tp, 0)[rank], **close)
        torch.testing.assert_close(got["wo_grad"].double(), ref["wo_grad"].chunk(tp, 1)[rank], **close)
        for name in ("wk", "wv"):
            torch.testing.assert_close(got[f"{name}_grad"].double(), ref[f"{name}_grad"].chunk(n_kv, 0)[head], **close)
