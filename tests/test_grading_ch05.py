"""Chapter 05's checks: the solutions pass with any secret, the released stubs score nothing, and every
plausible-but-wrong answer (mutant) fails the checks named for it.

The ring exercises run the student's forward and backward on real gloo ranks (2, 3 and 4) inside the sandbox,
after the answers they build on, and compare every rank's output (gradients) with attention over the whole
sequence (autograd through it). A mutant is the solution cell with one classic mistake — a merge that does not
rescale the running output, a NaN for rows no key reached, a causal rule that computes later chunks or forgets
the diagonal mask, a ring that turns the wrong way, a backward that leaves dK/dV one hop short of home,
renormalises each block instead of using the forward's lse or passes to the wrong neighbour, zig-zag chunks in
the wrong order or paired wrongly — and only the checks that must catch it are run, to keep this file fast.
"""

from __future__ import annotations

import random

import pytest
from grading_support import Chapter, chapter_tests

from lab.grading.checks import ch05

EXERCISES = ("05.lse_merge", "05.zigzag_assignment", "05.ring_forward", "05.ring_backward", "05.causal_work",
             "05.problems")

MERGE_VALUES = "two blocks of keys, merged: the out and lse of attention over all of them"
MERGE_LARGE = "scores in the hundreds: no overflow"
MERGE_MASKED = "fully masked rows (lse = −inf in one block, or in both): no NaN"
MERGE_MANY = "three to five blocks folded one at a time, in a random order"
ZZ_CHUNKS = "rank r holds chunks r and 2·cp−1−r, in that order (cp up to 16)"
ZZ_POSITIONS = "each rank's token positions (what RoPE rotates by), random cp and seq_len"
ZZ_OWNER = "where a global position lives: [rank, local index]"
ZZ_REJECT = "a seq_len that 2·cp does not divide: a ValueError"
RING_FULL = "no mask: every rank's output equals attention over the whole sequence (2 and 3 ranks)"
RING_CAUSAL = "causal, contiguous chunks: later chunks skipped, the diagonal masked (2, 3 and 4 ranks)"
RING_LAYOUTS = "causal, zig-zag and shuffled layouts: the block rule compares global chunk indices"
RING_P2P = "only isend/irecv: cp−1 sends of the rank's K and V per rank"
RING_ANY = "4 ranks, shuffled layouts of 1 to 3 chunks per rank, causal and not"
RB_FULL = "no mask: every rank's dq, dk, dv equal autograd's over the whole sequence (2 and 3 ranks)"
RB_CAUSAL = "causal, zig-zag chunks: dq, dk, dv equal autograd's (2 and 3 ranks)"
RB_BYTES = "only isend/irecv: each rank sends its K/V block's size 2·cp−1 times (cp−1 K/V, cp dK/dV)"
RB_ANY = "3 ranks, a shuffled layout of 1 to 3 chunks per rank, causal"
WORK_CONTIGUOUS = "contiguous chunks: query-key pairs per rank, random cp and seq_len"
WORK_ZIGZAG = "zig-zag: query-key pairs per rank, random cp and seq_len"
WORK_IMBALANCE = "max/mean of the per-rank work, both layouts"
WORK_LONG = "up to 64 ranks and a million tokens, both layouts"

RB_DKV_SEND = ("        requests += [dist.isend(dkv, (rank + 1) % world), "
               "dist.irecv(dkv_incoming, (rank - 1) % world)]\n")
RB_DKV_STAYS = ("        if step < world - 1:  # (the mistake: no hop after the last step)\n"
                "            requests += [dist.isend(dkv, (rank + 1) % world), "
                "dist.irecv(dkv_incoming, (rank - 1) % world)]\n"
                "        else:\n"
                "            dkv_incoming = dkv\n")
RB_KV_SEND = "dist.isend(kv, (rank + 1) % world), dist.irecv(incoming, (rank - 1) % world)"
RING_SEND = "            requests = [dist.isend(kv, (rank + 1) % world), dist.irecv(incoming, (rank - 1) % world)]\n"
RING_ALL_GATHER = ("            gathered = [torch.empty_like(kv) for _ in range(world)]\n"
                   "            dist.all_gather(gathered, kv)\n"
                   "            incoming, requests = gathered[(rank - 1) % world], []\n")

MUTANTS = {  # name: (exercise, [(old, new) in the solution cell], checks that must fail)
    "merge_forgets_to_rescale_the_running_output": (  # the mutant
        "05.lse_merge", [("out_a * torch.exp(lse_a - finite).unsqueeze(-1)", "out_a")], {MERGE_VALUES, MERGE_MANY}),
    "merge_lse_is_the_larger_one": (
        "05.lse_merge", [("lse = torch.logaddexp(lse_a, lse_b)", "lse = torch.maximum(lse_a, lse_b)")],
        {MERGE_VALUES}),
    "merge_exponentiates_the_lse": (
        "05.lse_merge", [("lse = torch.logaddexp(lse_a, lse_b)",
                          "lse = torch.log(torch.exp(lse_a) + torch.exp(lse_b))")],
        {MERGE_LARGE}),
    "merge_nan_for_rows_masked_in_both": (
        "05.lse_merge", [("torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)", "lse")],
        {MERGE_MASKED, MERGE_MANY}),
    "zigzag_mirror_chunk_first": (  # the mutant: shard order swapped
        "05.zigzag_assignment", [("return [rank, 2 * cp - 1 - rank]", "return [2 * cp - 1 - rank, rank]")],
        {ZZ_CHUNKS, ZZ_POSITIONS}),
    "zigzag_pairs_r_with_cp_plus_r": (
        "05.zigzag_assignment", [("return [rank, 2 * cp - 1 - rank]", "return [rank, cp + rank]")],
        {ZZ_CHUNKS, ZZ_POSITIONS}),
    "zigzag_rope_at_local_positions": (
        "05.zigzag_assignment", [("return [c * chunk + i for c in zigzag_chunks(rank, cp) for i in range(chunk)]",
                                  "return list(range(2 * chunk))")],
        {ZZ_POSITIONS}),
    "zigzag_owner_second_chunk_from_zero": (
        "05.zigzag_assignment", [("return [2 * cp - 1 - c, chunk + offset]", "return [2 * cp - 1 - c, offset]")],
        {ZZ_OWNER}),
    "zigzag_accepts_any_length": (
        "05.zigzag_assignment", [("    if seq_len % (2 * cp):\n        raise", "    if False:\n        raise")],
        {ZZ_REJECT}),
    "ring_computes_later_chunks": (  # the mutant: wrong causal block rule
        "05.ring_forward", [('return "diagonal" if k_chunk == q_chunk else "skip"',
                             'return "diagonal" if k_chunk == q_chunk else "full"')],
        {RING_CAUSAL, RING_LAYOUTS, RING_ANY}),
    "ring_no_diagonal_mask": (
        "05.ring_forward", [("if not causal or k_chunk < q_chunk:", "if not causal or k_chunk <= q_chunk:")],
        {RING_CAUSAL, RING_LAYOUTS, RING_ANY}),
    "ring_rule_compares_ranks": (  # right for the contiguous split only
        "05.ring_forward", [("kind = block_kind(q_chunk, k_chunk, causal)", "kind = block_kind(rank, src, causal)")],
        {RING_LAYOUTS, RING_ANY}),
    "ring_source_rank_the_wrong_way": (
        "05.ring_forward", [("src = (rank - step) % world", "src = (rank + step) % world")], {RING_CAUSAL}),
    "ring_forgets_to_pass_kv": (
        "05.ring_forward", [("            kv = incoming\n", "")], {RING_FULL, RING_CAUSAL}),
    "ring_sends_after_the_last_step_too": (
        "05.ring_forward", [("        if step < world - 1:  # post", "        if True:  # post"),
                            ("        if step < world - 1:\n            for request",
                             "        if True:\n            for request")],
        {RING_P2P}),
    "ring_by_all_gather": ("05.ring_forward", [(RING_SEND, RING_ALL_GATHER)], {RING_P2P}),
    "ring_backward_dkv_left_on_the_wrong_rank": (  # the last hop forgotten: rank r keeps rank r+1's dK/dV
        "05.ring_backward", [(RB_DKV_SEND, RB_DKV_STAYS)], {RB_FULL, RB_BYTES}),
    "ring_backward_no_diagonal_mask": (
        "05.ring_backward", [('if kind == "diagonal":', 'if False:')], {RB_CAUSAL, RB_ANY}),
    "ring_backward_wrong_neighbour": (  # K/V passed to r − 1 while the source is still counted as r − step
        "05.ring_backward", [(RB_KV_SEND, RB_KV_SEND.replace("rank + 1", "rank ± 1").replace("rank - 1", "rank + 1")
                                                .replace("rank ± 1", "rank - 1"))],
        {RB_FULL}),
    "ring_backward_block_softmax_instead_of_lse": (  # each block renormalised on its own
        "05.ring_backward", [("probs = torch.exp(scores - lse.unsqueeze(-1))",
                              "probs = torch.softmax(scores, dim=-1)")],
        {RB_CAUSAL}),
    "work_diagonal_block_counted_whole": (
        "05.causal_work", [("chunk * (chunk + 1) // 2", "chunk * chunk")], {WORK_CONTIGUOUS, WORK_ZIGZAG, WORK_LONG}),
    "work_skipped_blocks_counted": (
        "05.causal_work", [("sum(c * chunk * chunk", "sum((n_chunks - 1) * chunk * chunk")],
        {WORK_CONTIGUOUS, WORK_LONG}),
    "work_zigzag_pairs_r_with_cp_plus_r": (
        "05.causal_work", [("[rank, 2 * cp - 1 - rank]", "[rank, cp + rank]")], {WORK_ZIGZAG, WORK_LONG}),
    "work_imbalance_max_over_min": (
        "05.causal_work", [("max(work) / (sum(work) / cp)", "max(work) / min(work)")], {WORK_IMBALANCE}),
}

P1, P2, P3, P4, P5 = ("P1 — c*: the tokens per rank above which a ring step hides its K/V transfer",
                      "P2 — without zig-zag: the busiest rank's work over the least busy one's",
                      "P3 — zig-zag's speed-up of causal ring attention over contiguous chunks",
                      "P4 — the K/V bytes one ring step passes on, with GQA (MB)",
                      "P5 — activation memory per rank at long context with CP and TP (GiB)")
P6, P7, P8, P9, P10 = ("P6 — ring attention's bytes per rank and layer over Ulysses' all-to-alls",
                       "P7 — the longest context Ulysses reaches at a given number of tokens per GPU",
                       "P8 — the share of a layer's forward FLOPs in causal attention at a context length",
                       "P9 — the context at which causal attention costs as many FLOPs as the MLP",
                       "P10 — the all-gather variant (Llama 3): the K/V each rank holds for one layer (MB)")
MUTANTS |= {  # the problems: each mistake in every cell where a learner would make it
    "problems_gb_taken_for_gib": ("05.problems", [
        ("link_gbytes * 1e9", "link_gbytes * 2**30"),
        ("tokens_per_rank * kv_heads * head_dim * dtype_bytes / 1e6",
         "tokens_per_rank * kv_heads * head_dim * dtype_bytes / 2**20")], {P1, P4}),
    "problems_k_without_v": ("05.problems", [("return 2 * tokens_per_rank", "return tokens_per_rank"),
                                             ("return 2 * seq * kv_heads", "return seq * kv_heads")], {P4, P10}),
    "problems_attention_not_halved_by_the_mask": ("05.problems", [
        ("core = 2 * seq * n_heads", "core = 4 * seq * n_heads"),
        ("return 3 * d_model * d_ff", "return 1.5 * d_model * d_ff")], {P8, P9}),
    "problems_diagonal_block_as_half_a_square": ("05.problems", [
        ("diagonal = chunk * (chunk + 1) // 2", "diagonal = chunk * chunk / 2"),
        ("half * (half + 1)", "half * half")], {P2, P3}),
    "problems_ulysses_forgets_the_output": ("05.problems", [("(2 * heads + 2 * kv_heads)", "(heads + 2 * kv_heads)")],
                                            {P6}),
    "problems_activations_without_sequence_parallelism": ("05.problems", [
        ("34 * tokens * d_model / tp", "tokens * d_model * (10 + 24 / tp)")], {P5}),
    "problems_ulysses_cp_ignores_tp": ("05.problems", [("n_heads // tp * tokens_per_gpu", "n_heads * tokens_per_gpu")],
                                       {P7}),
}


CHAPTER = Chapter("05_context_parallel.ipynb", EXERCISES, MUTANTS)
globals().update(chapter_tests(CHAPTER))


def test_the_merge_reference_is_online_softmax():
    """The merge check's expected values: `lab.parallel.ring_attention.merge` of the blocks (where no row is fully
    masked) equals attention over all the keys, and a masked row's result is out 0, lse −inf."""
    import torch

    from lab.parallel.ring_attention import merge

    rng = random.Random(0)
    for offset in (0.0, 300.0):
        case = ch05.merge_case(rng, n_blocks=3, offset=offset)
        out, lse = None, None
        for block in case["blocks"]:
            out, lse = merge(out, lse, *block)
        torch.testing.assert_close(out, case["full"][0])
        torch.testing.assert_close(lse, case["full"][1])
    masked = ch05.merge_case(rng, masked=True)
    full_out, full_lse = masked["full"]
    empty = torch.isneginf(full_lse)
    assert empty.any() and not full_out[empty].any() and not full_out.isnan().any()
    assert all(torch.isneginf(lse).any() for _, lse in masked["blocks"])


def _lab_ring(shape, chunks, causal, seed):
    """`lab.parallel.ring_attention` on this rank's chunks of the drivers' q, k, v (and dout): the output and, from
    its backward, dq, dk, dv."""
    import torch
    import torch.distributed as dist

    from lab.parallel.ring_attention import ring_attention

    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (ch05.rank_part(torch.randn(shape, generator=g), chunks, dist.get_rank()) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = ring_attention(q, k, v, None, chunks, causal=causal)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))


@pytest.mark.parametrize("kind, cp", [("zigzag", 2), ("shuffled", 3)])
def test_the_ring_reference_agrees_with_lab_parallel(kind, cp):
    """The checks' expected outputs and gradients (full attention and autograd through it, cut by the layout) are
    what `lab.parallel`'s ring computes on real ranks, forward and backward, and its rank parts are
    `lab.parallel.cp.shard_sequence`'s for the library's layouts."""
    import torch

    from lab.distributed import run
    from lab.parallel.cp import shard_sequence

    rng = random.Random(cp)
    chunks = ch05.random_layout(rng, cp, kind)
    shape = [2, 3, 4 * sum(map(len, chunks)), 8]
    for causal in (True, False):
        reference = [ch05.ring_reference(shape, causal, 5), *ch05.backward_reference(shape, causal, 5)]
        for rank, got in enumerate(run(_lab_ring, cp, shape, chunks, causal, 5)):
            for mine, expected in zip(got, reference, strict=True):
                torch.testing.assert_close(mine.double(), ch05.rank_part(expected, chunks, rank), rtol=1e-5, atol=1e-5)
    x = torch.arange(2 * 24).view(2, 1, 24, 1)
    for layout in ("contiguous", "zigzag"):
        for rank in range(3):
            parts = ch05.random_layout(rng, 3, layout)
            assert torch.equal(ch05.rank_part(x, parts, rank), shard_sequence(x, rank, 3, layout, dim=2))

