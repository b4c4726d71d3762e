"""Chapter 11's checks: the solutions pass with any secret, the released stubs score nothing, and every
plausible-but-wrong answer (mutant) fails the checks named for it.

A mutant is the solution cell with one classic mistake — the cache written one position late, a causal mask aligned
to the top left (is_causal with fewer queries than keys), a shared block freed while another sequence still uses
it, an off-by-one slot, prompts admitted before the running decodes or beyond the budget, a long prompt overtaken,
an unnormalised residual, a bonus token drawn from the draft, the acceptance ratio upside down, the KV cache or its
factor 2 forgotten, TTFT from admission or TPOT counting the first token — and only the checks that must catch it
are run, to keep this file fast. The checks' references are lab.inference and lab.calc.inference; the two the
checks build themselves (the scheduler's queues and the distribution test) are checked here against hand-worked
cases.
"""

from __future__ import annotations

import pytest
from grading_support import Chapter, chapter_tests

from lab.grading.checks import ch11

EXERCISES = ("11.kv_cache_update", "11.block_allocation", "11.batching_step", "11.speculative_accept",
             "11.decode_latency", "11.latency_slo")

KV_DECODE = "a prefill, then single-token decodes: k, v written at [length, length + T), positions [0, length + T) back"
KV_CHUNKS = "chunks of several queries at an offset (GQA): query i sees the keys up to its own absolute position"
B_SHARED = "sequences sharing a prefix: shared blocks counted per user, freed only when their last user is done"
B_FULL = "a small pool: an allocation that does not fit fails whole, freed blocks are reused in the order freed"
B_SLOTS = "slot mapping: position p of a sequence in slot block_table[p // bs] · bs + p % bs of the pool"
S_CHUNKED = "chunked prefill: running sequences first, then waiting prompts FCFS, cut to the token budget"
S_WHOLE = "no chunked prefill: a prompt runs whole or waits, and nobody overtakes the head of the queue"
S_SEQS = "max_num_seqs caps the sequences in flight, whatever the budget leaves"
R_GREEDY = "one-hot rows (greedy): accept while the draft agrees with the target, then the target's token, or the bonus"
R_RESIDUAL = "the residual after a rejection: max(0, p − q), renormalised to sum to 1"
R_DIST = "over many seeded rounds: the first token follows p, the count accepted Σ min(p, q), the bonus p's last row"
L_KV = "KV bytes per token: a key and a value per KV head and layer (GQA), in bf16 and in int8"
L_STEP = "the memory-bound decode step: weights plus every sequence's KV cache over HBM bandwidth (random model, chip)"
L_CRIT = "the critical batch: the chip's ridge × weight bytes / 2, for bf16 and int8 weights"
SLO_TTFT = "TTFT p90 from arrival to first token, the queue before admission included"
SLO_TPOT = "TPOT p90: the mean gap between tokens after the first, (last - first) / (n - 1)"
SLO_PCT = "percentiles interpolated between the closest ranks (numpy's default), on a few values and on many"
SLO_BOTH = "SLO attainment: the share of requests within both bounds; one-token answers have no TPOT"

RUNNING_LOOP = """    for seq_id, left in running:  # decodes and prefills in progress first, in admission order
        n = chunk(left)
        if n == 0:
            break
        scheduled.append([seq_id, n])
        budget -= n
"""

MUTANTS = {  # name: (exercise, [(old, new) in the solution cell], checks that must fail)
    "cache_written_one_late": (  # the off-by-one write position
        "11.kv_cache_update", [("cache_k[:, :, length:end] = k", "cache_k[:, :, length + 1:end + 1] = k"),
                               ("cache_v[:, :, length:end] = v", "cache_v[:, :, length + 1:end + 1] = v")],
        {KV_DECODE, KV_CHUNKS}),
    "one_new_key_returned": (
        "11.kv_cache_update", [("return cache_k[:, :, :end], cache_v[:, :, :end]",
                                "return cache_k[:, :, :length + 1], cache_v[:, :, :length + 1]")],
        {KV_DECODE, KV_CHUNKS}),
    "mask_aligned_top_left": (  # is_causal=True's triangle when queries are fewer than keys
        "11.kv_cache_update", [("torch.arange(offset, S)[:, None]", "torch.arange(T)[:, None]")],
        {KV_DECODE, KV_CHUNKS}),
    "freeing_a_shared_block": (  # the mutant: the reference count ignored
        "11.block_allocation", [("""            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free_ids.append(block)""", """            self.ref_count[block] = 0
            self.free_ids.append(block)""")], {B_SHARED}),
    "shared_blocks_not_counted": (
        "11.block_allocation", [("        for block in shared:\n            self.ref_count[block] += 1\n", "")],
        {B_SHARED}),
    "allocation_without_room_check": (
        "11.block_allocation", [("        if fresh > len(self.free_ids):\n            return None\n", "")], {B_FULL}),
    "slot_mapping_off_by_one": (  # the mutant
        "11.block_allocation", [("+ p % block_size for p", "+ p % block_size + 1 for p")], {B_SLOTS}),
    "slot_mapping_block_of_the_next_position": (
        "11.block_allocation", [("block_table[p // block_size]", "block_table[(p + 1) // block_size]")], {B_SLOTS}),
    "running_decodes_starved": (  # the waiting prompts are served first
        "11.batching_step", [(RUNNING_LOOP, ""), ("    return scheduled", RUNNING_LOOP + "    return scheduled")],
        {S_CHUNKED}),
    "prompt_admitted_beyond_the_budget": (
        "11.batching_step", [("else chunk(left)", "else left")], {S_CHUNKED}),
    "head_of_the_queue_overtaken": (
        "11.batching_step", [("break  # nobody overtakes", "continue  # nobody overtakes")], {S_WHOLE}),
    "max_num_seqs_ignored": (
        "11.batching_step", [("0 if in_flight == max_num_seqs else chunk(left)", "chunk(left)")], {S_SEQS}),
    "residual_not_renormalised": (  # the "missing rescale in rejection sampling"
        "11.speculative_accept", [("return excess / excess.sum()", "return excess")], {R_RESIDUAL, R_DIST}),
    "bonus_drawn_from_the_draft": (
        "11.speculative_accept", [("draw(target_probs[k], generator)", "draw(draft_probs[k - 1], generator)")],
        {R_GREEDY, R_DIST}),
    "acceptance_ratio_inverted": (
        "11.speculative_accept", [("float(p[x] / q[x])", "float(q[x] / p[x])")], {R_GREEDY, R_DIST}),
    "rejection_draws_from_the_target": (  # no correction: the draft's bias stays in the output
        "11.speculative_accept", [("draw(residual_distribution(p, q), generator)", "draw(p, generator)")], {R_DIST}),
    "kv_cache_forgotten": (
        "11.decode_latency", [("return (weights + kv_cache) / chip", "return weights / chip")], {L_STEP}),
    "k_and_v_not_both_counted": (
        "11.decode_latency", [("return 2 * model[\"n_layers\"]", "return model[\"n_layers\"]")], {L_KV, L_STEP}),
    "query_heads_for_kv_heads": (
        "11.decode_latency", [("model[\"n_kv_heads\"]", "model[\"n_heads\"]")], {L_KV, L_STEP}),
    "critical_batch_without_the_half": (
        "11.decode_latency", [("* weight_bytes / 2", "* weight_bytes")], {L_CRIT}),
    "ttft_from_admission": (  # issue 39's planted slip: the queue left out of the user's wait
        "11.latency_slo", [('ttft = [r["tokens"][0] - r["arrival"]', 'ttft = [r["tokens"][0] - r["admitted"]')],
        {SLO_TTFT}),
    "first_token_in_tpot": (  # E2E / n: the prefill's wait counted as a decode gap
        "11.latency_slo", [('(r["tokens"][-1] - r["tokens"][0]) / (len(r["tokens"]) - 1)',
                            '(r["tokens"][-1] - r["arrival"]) / len(r["tokens"])')], {SLO_TPOT}),
    "nearest_rank_percentile": (
        "11.latency_slo", [("return ordered[low] + (rank - low) * (ordered[high] - ordered[low])",
                            "return ordered[round(rank)]")], {SLO_PCT}),
    "ttft_bound_only": (
        "11.latency_slo", [("met = [t <= ttft_slo and (p is None or p <= tpot_slo)", "met = [t <= ttft_slo")],
        {SLO_BOTH}),
    "one_token_tpot_zero": (  # a one-token answer given TPOT 0 drags the percentile down
        "11.latency_slo", [('if len(r["tokens"]) > 1 else None', 'if len(r["tokens"]) > 1 else 0.0')], {SLO_BOTH}),
}

CHAPTER = Chapter("11_inference.ipynb", EXERCISES, MUTANTS, said=("returned", "raised"))
globals().update(chapter_tests(CHAPTER))


def test_schedule_reference_worked_example():
    """The scheduler reference (lab's Scheduler over placed queues): decodes first, then a prompt cut to what the
    budget leaves; without chunking the prompt waits and the one behind it does not overtake it."""
    running, waiting = [[7, 1], [3, 1], [5, 6]], [[9, 12], [2, 3]]
    assert ch11.schedule_reference(running, waiting, 16, 8, True) == [[7, 1], [3, 1], [5, 6], [9, 8]]
    assert ch11.schedule_reference(running, waiting, 16, 8, False) == [[7, 1], [3, 1], [5, 6]]
    assert ch11.schedule_reference(running, waiting, 32, 4, True) == [[7, 1], [3, 1], [5, 6], [9, 12]]


def test_expect_distribution_passes_sampling_noise_and_fails_a_bias():
    """Counts drawn from p pass; the same number of draws from a distribution 0.05 away fails, naming the token."""
    import random

    rng, p = random.Random(0), [0.1, 0.2, 0.3, 0.4]
    counts = [0] * 4
    for _ in range(6000):
        counts[rng.choices(range(4), p)[0]] += 1
    ch11.expect_distribution(counts, p, "first")
    biased = [0] * 4
    for _ in range(6000):
        biased[rng.choices(range(4), [0.15, 0.2, 0.3, 0.35])[0]] += 1
    with pytest.raises(ch11.CheckFailed, match=r"first returned the counts .* expected about .*token 0"):
        ch11.expect_distribution(biased, p, "first")
    with pytest.raises(ch11.CheckFailed, match="expected 4 counts"):
        ch11.expect_distribution(counts[:3], p, "first")


def test_lab_rejection_sampler_passes_the_distribution_check():
    """The distribution check's closed forms (p for the first and the bonus token, Σ min(p, q) per position for the
    count accepted) hold for lab.inference.speculative.rejection_sample, driven the way the notebook's driver does."""
    import random

    import torch

    from lab.inference.speculative import rejection_sample

    class Lab:
        @staticmethod
        def run_speculative(draft_probs, target_probs, rounds, seed):
            g = torch.Generator().manual_seed(seed)
            q, p = torch.tensor(draft_probs), torch.tensor(target_probs)
            k, vocab = q.shape
            counts = {"first": [0] * vocab, "accepted": [0] * (k + 1), "bonus": [0] * vocab}
            for _ in range(rounds):
                tokens, accepted = rejection_sample(torch.multinomial(q, 1, generator=g).flatten().tolist(), q, p, g)
                counts["first"][tokens[0]] += 1
                counts["accepted"][accepted] += 1
                counts["bonus"][tokens[-1]] += accepted == k
            return counts

    ch11.speculative_distribution(Lab(), random.Random(0))
