"""The serving engine's pure logic (issue 20): Sequence, BlockManager and Scheduler, with no model.

A fake model runner stands in for ModelRunner. It keeps a simulated paged cache (one slot holds the whole prefix
whose last token's K/V would be there: past the first layer, a token's K/V depend on every token before it), writes
each scheduled chunk through `slot_mapping`, reads every sequence's whole context back by gathering the blocks of
its block table, checks it, and returns the deterministic token
(31 * last token + position) % VOCAB of the context it read. So a wrong slot, a block overwritten while still
shared, or a wrong prefix hit (the same block after another prefix included) shows up as a corrupted context or a
different token, and a full simulated run can be compared with the reference continuation computed straight from
the prompt.

Each named edge-case test was checked against a planted bug: off-by-one slot mapping, freeing a block still
shared by another sequence, a full prefix hit that skips the last prompt token, evicting the most recently
freed block instead of the least, a block hash that ignores its parent block.
"""

from __future__ import annotations

import random

import pytest

from lab.inference.block_manager import BlockManager
from lab.inference.sampling import SamplingParams
from lab.inference.scheduler import Scheduler
from lab.inference.sequence import Sequence, SequenceStatus

VOCAB = 97


def next_token(context: list[int]) -> int:
    """The fake model: a deterministic function of the context (its last token and the new token's position)."""
    return (context[-1] * 31 + len(context)) % VOCAB


def reference(prompt: list[int], params: SamplingParams) -> list[int]:
    """The tokens a request must get, computed without any engine."""
    tokens = list(prompt)
    out: list[int] = []
    while len(out) < params.max_tokens:
        out.append(next_token(tokens))
        tokens.append(out[-1])
        if out[-1] in params.stop_token_ids:
            break
    return out


class FakeRunner:
    """ModelRunner's stand-in: a simulated paged cache written and read through the block manager."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.cache: list[tuple[int, ...] | None] = [None] * (bm.num_blocks * bm.block_size)

    def run(self, scheduled: list[tuple[Sequence, int]]) -> dict[int, int]:
        for seq, n in scheduled:  # a batched forward writes every chunk's K/V, then attends
            start = seq.num_computed_tokens
            for p, slot in zip(range(start, start + n), self.bm.slot_mapping(seq, start, start + n), strict=True):
                self.cache[slot] = tuple(seq.token_ids[: p + 1])  # what position p's K/V depend on
        sampled = {}
        for seq, n in scheduled:
            end = seq.num_computed_tokens + n
            bs = self.bm.block_size  # read as paged attention does: gather whole blocks along the block table
            context = [entry for b in seq.block_table for entry in self.cache[b * bs : (b + 1) * bs]][:end]
            assert context == [tuple(seq.token_ids[: p + 1]) for p in range(end)], f"seq {seq.seq_id} corrupted"
            if end == seq.num_tokens:
                sampled[seq.seq_id] = next_token([prefix[-1] for prefix in context])
        return sampled


def make_seq(seq_id: int, prompt: list[int], max_tokens: int = 4, stop: tuple[int, ...] = ()) -> Sequence:
    return Sequence(seq_id, prompt, len(prompt), SamplingParams(max_tokens=max_tokens, stop_token_ids=stop))


def step(sched: Scheduler, runner: FakeRunner) -> tuple[list[tuple[Sequence, int]], list[Sequence]]:
    scheduled = sched.schedule()
    return scheduled, sched.update(scheduled, runner.run(scheduled))


def prefill(bm: BlockManager, seq: Sequence) -> None:
    """Admit a sequence and pretend its whole prompt was computed (for BlockManager-only tests)."""
    assert bm.allocate(seq)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)


def blocks_in_pool(bm: BlockManager) -> set[int]:
    return set(bm.free_ids) | set(bm.evictable)


# -- BlockManager ---------------------------------------------------------------------------------------------


def test_slot_mapping_is_block_times_block_size_plus_offset():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(0, [1, 2, 3])
    seq.block_table = [5, 2]
    assert bm.slot_mapping(seq, 0, 8) == [20, 21, 22, 23, 8, 9, 10, 11]
    assert bm.slot_mapping(seq, 3, 5) == [23, 8]  # across the block boundary
    with pytest.raises(ValueError, match=r"positions \[6, 9\)"):
        bm.slot_mapping(seq, 6, 9)


def test_full_prefix_hit_with_prompt_a_multiple_of_block_size_still_computes_the_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched, runner = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=32), FakeRunner(bm)
    prompt = list(range(10, 18))  # 8 tokens: two full blocks
    a, b = make_seq(0, prompt), make_seq(1, prompt)
    sched.add(a)
    step(sched, runner)
    assert len(bm.cached) == 2  # both prompt blocks of `a` are published

    sched.add(b)
    scheduled, _ = step(sched, runner)
    # Every block of b's prompt is cached, yet its last block is recomputed: the last token's logits are needed.
    assert (b, 4) in scheduled
    assert b.num_cached_prompt_tokens == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    assert b.generated == [next_token(prompt)]
    assert (bm.prefix_hits, bm.prefix_queries) == (4, 16)


def test_a_block_after_another_prefix_is_not_a_hit():
    """A = P1 + X + t and B = P2 + Y + t2 are cached; C = P2 + X + t finds P2 (B's first block) but not X: A's X
    block holds the K/V of X after P1, not after P2. A hash of the block's own tokens (no parent) would hand it over."""
    bm = BlockManager(num_blocks=16, block_size=4)
    p1, p2, x, y = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]
    for seq_id, prompt in ((0, p1 + x + [17]), (1, p2 + y + [18])):
        prefill(bm, make_seq(seq_id, prompt))
    c = make_seq(2, p2 + x + [17])
    assert bm.num_cached_tokens(c) == 4  # one block, not two
    assert bm.allocate(c) and c.num_computed_tokens == 4


def test_the_engine_recomputes_a_block_reached_through_another_prefix():
    """The same three prompts through the scheduler and the prefix-recording runner: C's context and tokens are
    its own, though its second block's tokens were cached after another first block."""
    bm = BlockManager(num_blocks=32, block_size=4)
    sched, runner = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64), FakeRunner(bm)
    p1, p2, x, y = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]
    seqs = [make_seq(0, p1 + x + [17]), make_seq(1, p2 + y + [18])]
    for seq in seqs:
        sched.add(seq)
    while sched.has_unfinished():  # A and B finish: their blocks stay cached
        step(sched, runner)
    c = make_seq(2, p2 + x + [17])
    sched.add(c)
    while sched.has_unfinished():
        step(sched, runner)
    assert c.num_cached_prompt_tokens == 4 and c.generated == reference(p2 + x + [17], c.params)


def test_last_partial_block_is_neither_cached_nor_shared():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched, runner = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=32), FakeRunner(bm)
    prompt = [7, 8, 9, 10, 11, 12]  # one full block and a partial one of 2 tokens
    a = make_seq(0, prompt, max_tokens=6)
    sched.add(a)
    step(sched, runner)
    assert len(bm.cached) == 1 and bm.blocks[a.block_table[1]].hash is None

    b = make_seq(1, prompt, max_tokens=6)
    sched.add(b)
    while sched.has_unfinished():  # both decode into their own second block; the runner checks every context
        step(sched, runner)
    assert a.block_table == [] and b.num_cached_prompt_tokens == 4
    assert a.generated == b.generated == reference(prompt, a.params)


def test_freeing_one_sharer_leaves_the_block_to_the_other():
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = make_seq(0, [1, 2, 3, 4, 5]), make_seq(1, [1, 2, 3, 4, 5])
    prefill(bm, a)
    prefill(bm, b)
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared and [bm.blocks[i].ref_count for i in shared] == [2, 2]

    bm.free(a)
    assert [bm.blocks[i].ref_count for i in shared] == [1, 1]
    assert not set(shared) & blocks_in_pool(bm)
    others = [make_seq(10 + i, [50 + i]) for i in range(bm.num_free_blocks)]
    for seq in others:  # drain the pool: nobody may be handed b's blocks
        assert bm.allocate(seq)
    assert not set(shared) & {blk for seq in others for blk in seq.block_table}
    assert not bm.allocate(make_seq(99, [98]))

    bm.free(b)
    assert set(shared) <= set(bm.evictable)


def test_eviction_takes_the_least_recently_freed_cached_block():
    bm = BlockManager(num_blocks=4, block_size=2)
    seqs = [make_seq(i, [2 * i + 1, 2 * i + 2]) for i in range(4)]  # one full block each
    for seq in seqs:
        prefill(bm, seq)
    owner = {seq.seq_id: seq.block_table[0] for seq in seqs}
    for seq in seqs:  # freed in order 0, 1, 2, 3: all four stay cached, 0 the oldest
        bm.free(seq)
    assert list(bm.evictable) == [owner[0], owner[1], owner[2], owner[3]] and not bm.free_ids

    # A new request that hits block 0 takes it out of the evictable set, and its new block evicts the oldest
    # of the others: block 1.
    hit = make_seq(10, [1, 2, 99])
    assert bm.allocate(hit)
    assert hit.block_table[0] == owner[0] and bm.blocks[owner[0]].ref_count == 1
    assert hit.block_table[1] == owner[1]
    assert list(bm.evictable) == [owner[2], owner[3]]
    assert (bm.prefix_hits, bm.prefix_queries) == (2, 4 * 2 + 3)

    fresh = make_seq(11, [60, 61])
    assert bm.allocate(fresh) and fresh.block_table == [owner[2]]
    assert bm.num_cached_tokens(make_seq(12, [5, 6, 0])) == 0  # block 2's contents are gone
    assert bm.num_cached_tokens(make_seq(13, [7, 8, 0])) == 2  # block 3's are still there
    assert bm.allocate(make_seq(14, [62]))
    assert not bm.allocate(make_seq(15, [63]))  # the block in use by `hit` is never evicted


def test_a_sequence_releases_its_tail_first():
    bm = BlockManager(num_blocks=3, block_size=2)
    seq = make_seq(0, [1, 2, 3, 4, 5, 6])
    prefill(bm, seq)
    table = seq.block_table
    bm.free(seq)
    assert list(bm.evictable) == [table[2], table[1], table[0]]  # the shared-prefix head is evicted last


def test_duplicate_cached_blocks_from_two_simultaneous_prefills():
    bm = BlockManager(num_blocks=8, block_size=4)
    sched, runner = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=32), FakeRunner(bm)
    prompt = [3, 1, 4, 1, 5, 9]
    a, b = make_seq(0, prompt, max_tokens=2), make_seq(1, prompt, max_tokens=3)
    sched.add(a)
    sched.add(b)
    scheduled, _ = step(sched, runner)  # both computed the same first block in the same step
    assert scheduled == [(a, 6), (b, 6)]
    da, db = a.block_table[0], b.block_table[0]
    assert da != db and bm.blocks[da].hash == bm.blocks[db].hash
    assert bm.cached == {bm.blocks[da].hash: da}  # the first one is the cached copy; both stay valid

    step(sched, runner)  # a finishes: its copy is kept, evictable
    assert a.is_finished and da in bm.evictable
    step(sched, runner)  # b finishes: its duplicate is not the cached copy, so it goes back as a fresh block
    assert b.is_finished and db in bm.free_ids and bm.blocks[db].hash is None
    assert a.generated == reference(prompt, a.params) and b.generated == reference(prompt, b.params)

    c = make_seq(2, prompt + [2])
    assert bm.allocate(c) and c.block_table[0] == da
    bm.free(c)
    drain = [make_seq(10 + i, [40 + i]) for i in range(bm.num_blocks)]
    assert all(bm.allocate(seq) for seq in drain)  # evicting everything leaves a consistent, empty cache
    assert bm.cached == {} and bm.num_free_blocks == 0


def test_allocate_and_ensure_slots_change_nothing_when_blocks_are_short():
    bm = BlockManager(num_blocks=3, block_size=2)
    holder = make_seq(0, [1, 2, 3])
    prefill(bm, holder)
    big = make_seq(1, [5, 6, 7, 8, 9])
    assert not bm.allocate(big)
    assert big.block_table == [] and big.num_computed_tokens == 0 and bm.prefix_queries == 3
    assert not bm.ensure_slots(holder, 4)  # 7 tokens need 4 blocks
    assert len(holder.block_table) == 2 and bm.num_free_blocks == 1
    assert bm.ensure_slots(holder, 3) and len(holder.block_table) == 3


def test_prefix_caching_off_shares_nothing():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a, b = make_seq(0, [1, 2, 3]), make_seq(1, [1, 2, 3])
    prefill(bm, a)
    prefill(bm, b)
    assert not set(a.block_table) & set(b.block_table) and bm.cached == {} and bm.prefix_hits == 0
    bm.free(a)
    assert not bm.evictable and len(bm.free_ids) == 2


# -- Scheduler ------------------------------------------------------------------------------------------------


def test_preempted_sequence_is_reprefilled_with_its_generated_tokens_and_continues():
    bm = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    sched, runner = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=16), FakeRunner(bm)
    a, b = make_seq(0, [1, 2, 3, 4], max_tokens=6), make_seq(1, [5, 6, 7, 8], max_tokens=6)
    c = make_seq(2, [9, 10, 11, 12], max_tokens=1)  # arrives last, waits for a free place (max_num_seqs=2)
    for seq in (a, b, c):
        sched.add(seq)
    assert step(sched, runner)[0] == [(a, 4), (b, 4)]
    # Both now need a second block and one is left: a (admitted first) gets it, b (the newest) is preempted,
    # and goes back in line ahead of c, which arrived after it.
    scheduled, _ = step(sched, runner)
    assert scheduled == [(a, 1)] and list(sched.waiting) == [b, c]
    assert b.status is SequenceStatus.WAITING and b.preemptions == 1 and b.block_table == []
    assert b.num_computed_tokens == 0 and b.generated == [next_token([5, 6, 7, 8])]
    chunks = []
    while sched.has_unfinished():
        scheduled, _ = step(sched, runner)
        chunks.append({seq.seq_id: n for seq, n in scheduled})
    chunks_b = [step[1] for step in chunks if 1 in step]
    assert chunks_b == [5, 1, 1, 1, 1]  # prompt + its one generated token computed again, then decodes
    assert min(i for i, step in enumerate(chunks) if 2 in step) == min(i for i, step in enumerate(chunks) if 1 in step)
    for seq in (a, b, c):
        assert seq.generated == reference(seq.token_ids[:4], seq.params)


def test_without_chunked_prefill_a_recompute_longer_than_the_budget_is_still_split():
    # b is preempted with 9 tokens (4 prompt + 5 generated) and the budget is 8: a new prompt that long is refused
    # by add(), but a recompute has to be split, or b would wait forever.
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    sched, runner = Scheduler(bm, 2, 8, chunked_prefill=False), FakeRunner(bm)
    a, b = make_seq(0, [1, 2, 3, 4], max_tokens=9), make_seq(1, [5, 6, 7, 8], max_tokens=9)
    sched.add(a)
    sched.add(b)
    chunks_b = []
    while sched.has_unfinished():
        scheduled = sched.schedule()
        assert scheduled, "nothing scheduled"
        sched.update(scheduled, runner.run(scheduled))
        chunks_b += [n for seq, n in scheduled if seq is b]
    assert b.preemptions == 1 and chunks_b[5:7] == [8, 1]
    assert b.generated == reference([5, 6, 7, 8], b.params)


def test_preempted_sequence_with_prefix_caching_reuses_its_own_blocks():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched, runner = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=16), FakeRunner(bm)
    a, b = make_seq(0, [1, 2, 3, 4], max_tokens=6), make_seq(1, [5, 6, 7, 8], max_tokens=6)
    for seq in (a, b):
        sched.add(seq)
    chunks_b = []
    while sched.has_unfinished():
        scheduled, _ = step(sched, runner)
        chunks_b += [n for seq, n in scheduled if seq is b]
    # At position 8, a needs a third block: b is preempted with 2 full committed blocks, released tail first, so
    # a's new block evicts b's second block and b's first (its prompt) is still cached when b comes back: only
    # its 5 generated tokens are recomputed.
    assert b.preemptions == 1 and b.num_cached_prompt_tokens == 4
    assert chunks_b == [4, 1, 1, 1, 1, 5]
    assert b.generated == reference([5, 6, 7, 8], b.params)


def test_chunked_prefill_splits_a_long_prompt_and_decodes_are_not_starved():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched, runner = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8), FakeRunner(bm)
    short = [make_seq(i, [i + 1, i + 2], max_tokens=12) for i in range(3)]
    for seq in short:
        sched.add(seq)
    step(sched, runner)  # the three short prompts (6 tokens)
    long = make_seq(3, list(range(40, 80)), max_tokens=2)
    sched.add(long)
    chunks = []
    while not long.num_generated:
        scheduled, _ = step(sched, runner)
        assert [(seq, n) for seq, n in scheduled if seq is not long] == [(seq, 1) for seq in short]
        chunks += [n for seq, n in scheduled if seq is long]
    assert chunks == [5] * 8  # the budget left after three decodes, 40 prompt tokens over 8 steps
    while sched.has_unfinished():
        step(sched, runner)
    assert all(seq.generated == reference(seq.token_ids[: seq.num_prompt_tokens], seq.params) for seq in short)


def test_without_chunked_prefill_a_prompt_runs_whole_and_one_over_the_budget_is_refused():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched, runner = Scheduler(bm, 4, 16, chunked_prefill=False), FakeRunner(bm)
    with pytest.raises(ValueError, match="prompt of 17 tokens .* exceeds max_num_batched_tokens=16"):
        sched.add(make_seq(0, list(range(17))))
    first, second = make_seq(1, list(range(10))), make_seq(2, list(range(20, 30)))
    sched.add(first)
    sched.add(second)
    assert step(sched, runner)[0] == [(first, 10)]  # 6 tokens left in the budget: `second` waits, whole
    assert step(sched, runner)[0] == [(first, 1), (second, 10)]


def test_add_refuses_a_request_that_could_never_fit_in_the_cache():
    sched = Scheduler(BlockManager(num_blocks=2, block_size=4), max_num_seqs=2, max_num_batched_tokens=16)
    sched.add(make_seq(0, [1] * 4, max_tokens=5))  # 8 slots: exactly 2 blocks
    with pytest.raises(ValueError, match="may need 9 token slots"):
        sched.add(make_seq(1, [1] * 4, max_tokens=6))


def test_scheduler_rejects_a_budget_smaller_than_max_num_seqs():
    with pytest.raises(ValueError, match="max_num_batched_tokens=3 must be >= max_num_seqs=4"):
        Scheduler(BlockManager(8, 4), max_num_seqs=4, max_num_batched_tokens=3)


# -- full simulated runs --------------------------------------------------------------------------------------

SHARED = [11, 12, 13, 14, 15, 16, 17, 18]  # two blocks of 4 that several prompts start with


def workload() -> list[tuple[list[int], SamplingParams]]:
    """Ten requests of mixed lengths: shared prefixes, exact duplicates, lengths that are multiples of the block
    size, single-token prompts, and stop tokens chosen to fire midway."""
    rng = random.Random(0)
    prompts = [
        SHARED + [1, 2, 3],
        SHARED,
        SHARED + [1, 2, 3],
        [5],
        SHARED + [4, 5, 6, 7],
        list(range(30, 53)),
        [9, 9],
        SHARED[:4] + [8, 8, 8],
        list(range(60, 76)),
        SHARED + [1, 2],
    ]
    requests = []
    for i, prompt in enumerate(prompts):
        max_tokens = rng.randint(1, 12)
        stop: tuple[int, ...] = ()
        if i % 3 == 0 and max_tokens > 3:
            stop = (reference(prompt, SamplingParams(max_tokens=max_tokens))[2],)
        requests.append((prompt, SamplingParams(max_tokens=max_tokens, stop_token_ids=stop)))
    return requests


Steps = list[dict[int, int]]  # per step: request index -> the chunk it ran


def simulate(
    order: list[int],
    *,
    num_blocks: int,
    block_size: int = 4,
    max_num_seqs: int = 4,
    budget: int = 16,
    chunked: bool = True,
    caching: bool = True,
) -> tuple[dict[int, Sequence], Steps, BlockManager]:
    """Run the workload through Scheduler + FakeRunner, checking the step limits. Returns the sequences by
    request index, and for each step the chunk each scheduled request ran."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    sched, runner = Scheduler(bm, max_num_seqs, budget, chunked_prefill=chunked), FakeRunner(bm)
    requests = workload()
    seqs = {i: Sequence(i, requests[i][0], len(requests[i][0]), requests[i][1]) for i in order}
    for i in order:
        sched.add(seqs[i])
    steps: Steps = []
    for _ in range(1000):
        if not sched.has_unfinished():
            break
        scheduled, _ = step(sched, runner)
        assert scheduled, "a step with unfinished requests scheduled nothing"
        assert sum(n for _, n in scheduled) <= budget and len(scheduled) <= max_num_seqs
        assert len(sched.running) <= max_num_seqs and len({seq.seq_id for seq, _ in scheduled}) == len(scheduled)
        steps.append({seq.seq_id: n for seq, n in scheduled})
    assert not sched.has_unfinished()
    assert bm.num_free_blocks == num_blocks and all(block.ref_count == 0 for block in bm.blocks)
    return seqs, steps, bm


def chunks_of(steps: Steps, i: int) -> list[int]:
    return [step[i] for step in steps if i in step]


def expected_outputs() -> dict[int, list[int]]:
    return {i: reference(prompt, params) for i, (prompt, params) in enumerate(workload())}


ORDERS = [list(range(10)), list(range(9, -1, -1)), random.Random(1).sample(range(10), 10)]
CONFIGS = {
    "ample": dict(num_blocks=128),
    "ample-no-cache": dict(num_blocks=128, caching=False),
    "no-chunking": dict(num_blocks=128, budget=32, chunked=False),
    "tight-budget": dict(num_blocks=128, budget=5, max_num_seqs=3),
    "tiny-cache": dict(num_blocks=9),  # the longest request needs all 9 blocks: preemption is forced
    "tiny-cache-no-cache": dict(num_blocks=9, caching=False),
    "tiny-cache-no-chunking": dict(num_blocks=9, budget=32, chunked=False),
}


@pytest.mark.parametrize("config", CONFIGS)
def test_simulated_run_gives_the_reference_tokens_in_every_configuration_and_order(config):
    expected = expected_outputs()
    for order in ORDERS:
        seqs, _, bm = simulate(order, **CONFIGS[config])
        assert {i: seq.generated for i, seq in seqs.items()} == expected, f"order {order}"
        assert all(seq.is_finished for seq in seqs.values())
        if config.startswith("tiny-cache"):
            assert sum(seq.preemptions for seq in seqs.values()) > 0
        if CONFIGS[config].get("caching", True):
            assert bm.prefix_hits > 0


def test_the_workload_really_exercises_stop_tokens():  # so that the simulated runs test stopping
    expected = expected_outputs()
    stopped = [i for i, (_, params) in enumerate(workload()) if params.stop_token_ids]
    assert stopped and all(
        len(expected[i]) == 3 and expected[i][-1] in workload()[i][1].stop_token_ids for i in stopped
    )


def test_token_budget_and_max_num_seqs_are_respected_and_both_bind():
    # simulate() asserts both limits at every step; here, check that this workload actually presses on them.
    _, steps, _ = simulate(list(range(10)), num_blocks=128, budget=5, max_num_seqs=3)
    assert max(sum(step.values()) for step in steps) == 5 and max(len(step) for step in steps) == 3
    longest = max(range(10), key=lambda i: len(workload()[i][0]))
    prompt_chunks = []
    for n in chunks_of(steps, longest):
        prompt_chunks.append(n)
        if sum(prompt_chunks) == len(workload()[longest][0]):
            break
    assert len(prompt_chunks) >= 23 // 5 and max(prompt_chunks) <= 5  # its 23-token prompt split by the budget


def test_chunks_per_sequence_do_not_depend_on_the_request_order():
    # With room for everyone (budget, blocks, sequences) and no prefix cache, each request runs its prompt in one
    # step and then one token a step, whatever the order it arrived in.
    expected = expected_outputs()
    for order in ORDERS:
        _, steps, _ = simulate(order, num_blocks=128, budget=256, max_num_seqs=10, caching=False)
        for i, (prompt, _) in enumerate(workload()):
            assert chunks_of(steps, i) == [len(prompt)] + [1] * (len(expected[i]) - 1), f"request {i}, order {order}"
