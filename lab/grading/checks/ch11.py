"""Chapter 11, inference. The KV-cache update, paged blocks with reference counts, one step of continuous batching,
the speculative acceptance rule, the latency bound of a decode step, and latency percentiles against an SLO.

Every answer is compared with the chapter's own implementation, run here on the same inputs:

* the KV cache with `lab.inference.kv_cache` (`KVCache.store`, `attend_with_offset`): keys, values and attention
  outputs of a prefill, chunks and single-token decodes;
* the block pool with `lab.inference.block_manager.BlockManager`, driven through the same allocations, growths and
  frees (a shared prefix is a prefix-cache hit there: the sharer's prompt starts with the other's full blocks), and
  its `slot_mapping`;
* one scheduling step with `lab.inference.scheduler.Scheduler` over sequences placed in its running and waiting
  queues (ample blocks, no prefix caching: the step's choice is the budget's alone);
* the rejection sampler with `lab.inference.speculative.rejection_sample` on the cases whose outcome is certain
  (one-hot rows: greedy decoding), and by distribution on the rest: over thousands of seeded rounds the first
  token must follow the target's distribution, the number accepted the closed form Σ min(p, q) per position, the
  bonus token the target's last row (a z-score per token, `expect_distribution`);
* the decode step's bound and the critical batch with `lab.calc.inference` on a random dense model and a random
  chip, so that no published number can be typed in;
* TTFT / TPOT percentiles and SLO attainment with `lab.inference.latency` on random server logs (Poisson arrivals,
  queues before admission, stalls, one-token answers).

torch and `lab.inference`'s engine modules (which import torch) are imported inside the functions: `lab.check` of
other chapters loads this module too. `lab.inference.latency` imports no torch.
"""

from __future__ import annotations

import math
import random

from lab.calc.hardware import Accelerator
from lab.calc.inference import critical_batch, decode_step, kv_bytes_per_token
from lab.calc.params import param_breakdown
from lab.config import ModelConfig
from lab.grading.checks import (
    TORCH,
    CheckFailed,
    Mistake,
    driver,
    exercise,
    expect_allclose,
    expect_close,
    expect_equal,
    explain,
    preview,
)
from lab.grading.sandbox import CallError
from lab.inference.latency import RequestTimes, percentile, slo_attainment

# --- 11.kv_cache_update ----------------------------------------------------------------------------------------

KV_CACHE = exercise("11.kv_cache_update", entry=("run_kv_cache",), **TORCH)


def _tensor(g, shape: tuple[int, ...]):
    import torch

    return torch.randn(*shape, generator=g)


def _expect_kv_cache(student, rng: random.Random, chunks: list[int], heads: int, kv_heads: int) -> None:
    """Run `chunks` (new tokens per forward) through the student's cache and lab's KVCache: the keys and values
    each update returns, and the attention of the chunk's queries over them."""
    import torch

    from lab.inference.kv_cache import KVCache, attend_with_offset

    batch, head_dim = rng.randrange(1, 3), rng.choice((4, 8))
    max_len = sum(chunks) + rng.randrange(1, 4)
    g = torch.Generator().manual_seed(rng.randrange(10**6))
    steps = [tuple(_tensor(g, (batch, h, t, head_dim)) for h in (heads, kv_heads, kv_heads)) for t in chunks]
    what = f"run_kv_cache(<chunks of {chunks} tokens, batch {batch}, {heads} query heads, {kv_heads} KV heads, " \
           f"head_dim {head_dim}>, max_len={max_len})"
    got = driver(what, "a dict of keys, values and out per chunk", student.run_kv_cache,
                 [[x.tolist() for x in step] for step in steps], max_len)
    cache = KVCache(batch, max_len)
    for i, (q, k, v) in enumerate(steps):
        keys, values = cache.store(0, k, v)
        out = attend_with_offset(q, keys, values, cache.length)
        at = f"{what}: chunk {i} ({chunks[i]} token{'s' if chunks[i] > 1 else ''} at length {cache.length})"
        for name, expected in (("keys", keys), ("values", values), ("out", out)):
            answers = got.get(name)
            answer = answers[i] if isinstance(answers, list) and len(answers) == len(steps) else None
            if not (isinstance(answer, dict) and answer.get("shape") == list(expected.shape)):
                shape = answer.get("shape") if isinstance(answer, dict) else answer
                raise CheckFailed(f"{at}: {name} returned shape {str(shape)[:80]}, expected {list(expected.shape)}"
                                  + (" (positions [0, length + T): the cached tokens and the new ones)"
                                     if name != "out" else ""))
            expect_allclose(answer.get("values"), expected.flatten().tolist(), f"{at}: {name}", tol=1e-5)
        cache.length += chunks[i]


@KV_CACHE.check(points=2, hint="the chunk's keys and values go right after the ones already cached, and attention "
                               "must see everything cached so far; a decode step's single query sees every key")
def kv_prefill_then_decode(student, rng):
    """a prefill, then single-token decodes: k, v written at [length, length + T), positions [0, length + T) back"""
    heads = rng.choice((2, 4))
    _expect_kv_cache(student, rng, [rng.randrange(3, 7)] + [1] * rng.randrange(3, 5), heads, heads)


@KV_CACHE.check(points=1, hint="the chunk's queries come after the cached keys: the causal rule compares absolute "
                               "positions, not indices within the chunk (is_causal=True assumes as many queries as "
                               "keys)")
def kv_chunked_prefill(student, rng):
    """chunks of several queries at an offset (GQA): query i sees the keys up to its own absolute position"""
    kv_heads = rng.choice((1, 2))
    _expect_kv_cache(student, rng, [rng.randrange(2, 5) for _ in range(3)] + [1], kv_heads * rng.choice((2, 3)),
                     kv_heads)


# --- 11.block_allocation ---------------------------------------------------------------------------------------

BLOCKS = exercise("11.block_allocation", entry=("run_blocks", "run_slots"))


class _Oracle:
    """lab's BlockManager driven through the ops of `run_blocks`. A sequence that shares another's first n full
    blocks gets that sequence's first n·block_size token ids, then ids of its own: with prefix caching, lab finds
    those blocks by their hash and shares them. Each allocation's tokens are computed and committed at once."""

    def __init__(self, num_blocks: int, block_size: int, sharing: bool) -> None:
        from lab.inference.block_manager import BlockManager

        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=sharing)
        self.seqs: dict = {}
        self.next_token = 0

    def _fresh(self, n: int) -> list[int]:
        self.next_token += n
        return list(range(self.next_token - n, self.next_token))

    def apply(self, op: list) -> bool:
        from lab.inference.sampling import SamplingParams
        from lab.inference.sequence import Sequence

        bs = self.bm.block_size
        if op[0] == "alloc":
            _, name, num_tokens, source, n_shared = op
            prefix = self.seqs[source].token_ids[: n_shared * bs] if source else []
            seq = Sequence(len(self.seqs), prefix + self._fresh(num_tokens - len(prefix)), num_tokens,
                           SamplingParams())
            if not self.bm.allocate(seq):
                return False
            self.seqs[name] = seq
        elif op[0] == "grow":
            _, name, num_tokens = op
            seq = self.seqs[name]
            if not self.bm.ensure_slots(seq, num_tokens - seq.num_tokens):
                return False
            seq.token_ids += self._fresh(num_tokens - seq.num_tokens)
        else:
            self.bm.free(self.seqs.pop(op[1]))
            return True
        seq.num_computed_tokens = seq.num_tokens
        self.bm.commit(seq)
        return True

    def state(self, ok: bool) -> dict:
        return {"ok": ok, "tables": {name: list(seq.block_table) for name, seq in self.seqs.items()},
                "ref_count": [b.ref_count for b in self.bm.blocks], "num_free": self.bm.num_free_blocks}


def _spell(op: list) -> str:
    if op[0] == "alloc":
        share = f", sharing the first {op[4]} blocks of {op[3]}" if op[3] else ""
        return f"allocate {op[1]} ({op[2]} tokens{share})"
    return f"grow {op[1]} to {op[2]} tokens" if op[0] == "grow" else f"free {op[1]}"


def _expect_blocks(student, num_blocks: int, block_size: int, ops: list[list], sharing: bool) -> None:
    oracle = _Oracle(num_blocks, block_size, sharing)
    expected = [oracle.state(oracle.apply(op)) for op in ops]
    what = f"run_blocks(num_blocks={num_blocks}, block_size={block_size}, <{len(ops)} operations>)"
    got = driver(what, "a dict with the state after each operation", student.run_blocks, num_blocks, block_size, ops)
    states = got.get("states")
    if not (isinstance(states, list) and len(states) == len(ops)):
        raise CheckFailed(f"{what}: states returned {str(states)[:80]}, expected one state per operation")
    done = []
    for op, state, due in zip(ops, states, expected, strict=True):
        done.append(_spell(op))
        at = f"{what}, after: {'; '.join(done[-4:])}"
        if not isinstance(state, dict):
            raise CheckFailed(f"{at}: the state returned {state!r:.80}, expected a dict")
        if state.get("ok") != due["ok"]:
            raise CheckFailed(f"{at}: the last operation returned {'success' if state.get('ok') else 'failure'}, "
                              f"expected {'success' if due['ok'] else 'failure (too few free blocks)'}")
        if state.get("tables") != due["tables"]:
            raise CheckFailed(f"{at}: the block tables returned {state.get('tables')}, expected {due['tables']}")
        expect_equal(state.get("ref_count"), due["ref_count"], f"{at}: the reference counts")
        expect_equal(state.get("num_free"), due["num_free"], f"{at}: the number of free blocks")


def _shared_ops(rng: random.Random, block_size: int) -> list[list]:
    """A, then B sharing A's prefix, C sharing B's; A grows, A and B are freed while C still shares their blocks, D
    and E take fresh blocks, and C goes last."""
    bs = block_size
    a = rng.randrange(2, 4) * bs + rng.randrange(1, bs)
    b_shared = rng.randrange(1, a // bs + 1)
    b = b_shared * bs + rng.randrange(1, 3 * bs)
    c_shared = rng.randrange(1, b // bs + 1)
    c = c_shared * bs + rng.randrange(1, 2 * bs)
    grown = (a // bs + 1) * bs + rng.randrange(1, bs)  # across a block boundary
    return [["alloc", "A", a, None, 0], ["alloc", "B", b, "A", b_shared], ["alloc", "C", c, "B", c_shared],
            ["grow", "A", grown], ["free", "A"], ["alloc", "D", rng.randrange(bs, 3 * bs), None, 0],
            ["free", "B"], ["alloc", "E", rng.randrange(1, 2 * bs), None, 0], ["free", "C"], ["free", "D"]]


@BLOCKS.check(points=2, hint="a shared block is read by several sequences: it may only return to the free list when "
                             "no sequence uses it any more")
def blocks_shared_prefix(student, rng):
    """sequences sharing a prefix: shared blocks counted per user, freed only when their last user is done"""
    block_size = rng.choice((2, 4, 8))
    ops = _shared_ops(rng, block_size)
    need = sum(-(-op[2] // block_size) for op in ops if op[0] != "free")
    _expect_blocks(student, need + rng.randrange(0, 3), block_size, ops, sharing=True)


@BLOCKS.check(points=1, hint="the pool's order is part of the answer: which end of free_ids fresh blocks come from and "
                             "freed ones go to, and in which order a table lets go of its blocks; an allocation (or "
                             "growth) that does not fit changes nothing — no half-allocated table")
def blocks_full_pool(student, rng):
    """a small pool: an allocation that does not fit fails whole, freed blocks are reused in the order freed"""
    bs = rng.choice((2, 4))
    n = rng.randrange(5, 8)
    a, b = rng.randrange(2, n - 2) * bs, 2 * bs - 1
    ops = [["alloc", "A", a, None, 0], ["alloc", "B", b, None, 0],
           ["alloc", "C", (n - a // bs - 2) * bs + 1, None, 0],  # one block more than is free
           ["grow", "B", 2 * bs + 1], ["free", "A"], ["alloc", "C", (n - 3) * bs, None, 0],
           ["grow", "B", 4 * bs], ["free", "B"], ["alloc", "D", rng.randrange(1, 3 * bs), None, 0], ["free", "C"]]
    _expect_blocks(student, n, bs, ops, sharing=False)


@BLOCKS.check(points=2, hint="a position's slot is found through the block table: which entry, and where inside that "
                             "block?")
def blocks_slot_mapping(student, rng):
    """slot mapping: position p of a sequence in slot block_table[p // bs] · bs + p % bs of the pool"""
    from lab.inference.block_manager import BlockManager
    from lab.inference.sampling import SamplingParams
    from lab.inference.sequence import Sequence

    for _ in range(3):
        bs, num_blocks = rng.choice((2, 4, 8, 16)), rng.randrange(8, 40)
        table = rng.sample(range(num_blocks), rng.randrange(2, 6))
        start = rng.randrange(0, bs * (len(table) - 1))
        end = rng.randrange(start + 1, bs * len(table) + 1)
        seq = Sequence(0, [0] * (bs * len(table)), 1, SamplingParams())
        seq.block_table = table
        expected = BlockManager(num_blocks, bs).slot_mapping(seq, start, end)
        what = f"run_slots({table}, block_size={bs}, start={start}, end={end})"
        got = driver(what, "a dict with the slots", student.run_slots, table, bs, start, end)
        expect_equal(got.get("slots"), expected, what)


# --- 11.batching_step ------------------------------------------------------------------------------------------

BATCHING = exercise("11.batching_step", entry=("run_schedule",))


def schedule_reference(running: list[list[int]], waiting: list[list[int]], max_num_batched_tokens: int,
                       max_num_seqs: int, chunked_prefill: bool) -> list[list[int]]:
    """lab's Scheduler.schedule() for running sequences [seq_id, tokens left to compute] (in admission order) and
    waiting ones [seq_id, prompt length] (FCFS), with blocks for everyone: [[seq_id, tokens], ...]."""
    from lab.inference.block_manager import BlockManager
    from lab.inference.sampling import SamplingParams
    from lab.inference.scheduler import Scheduler
    from lab.inference.sequence import Sequence, SequenceStatus

    longest = max(n for _, n in running + waiting) + 8
    bm = BlockManager(num_blocks=(len(running) + len(waiting)) * longest, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(bm, max_num_seqs, max_num_batched_tokens, chunked_prefill)
    for seq_id, left in running:  # a prompt of `left + 8` tokens, all but `left` computed
        seq = Sequence(seq_id, list(range(left + 8)), left + 8, SamplingParams(max_tokens=4))
        bm.allocate(seq)
        seq.num_computed_tokens, seq.status = 8, SequenceStatus.RUNNING
        scheduler.running.append(seq)
    for seq_id, prompt in waiting:
        scheduler.add(Sequence(seq_id, list(range(prompt)), prompt, SamplingParams(max_tokens=4)))
    return [[seq.seq_id, n] for seq, n in scheduler.schedule()]


def _expect_schedule(student, running: list[list[int]], waiting: list[list[int]], budget: int, max_num_seqs: int,
                     chunked: bool) -> None:
    expected = schedule_reference(running, waiting, budget, max_num_seqs, chunked)
    what = f"run_schedule(running={running}, waiting={waiting}, max_num_batched_tokens={budget}, " \
           f"max_num_seqs={max_num_seqs}, chunked_prefill={chunked})"
    got = driver(what, "a dict with this step's [seq_id, tokens]", student.run_schedule, running, waiting, budget,
                 max_num_seqs, chunked)
    expect_equal(got.get("scheduled"), expected, what)


def _ids(rng: random.Random, n: int) -> list[int]:
    return rng.sample(range(100), n)


@BATCHING.check(points=2, hint="running sequences come before waiting prompts (a decode must never wait behind a "
                               "prompt), and the token budget is shared in that order")
def batching_chunked(student, rng):
    """chunked prefill: running sequences first, then waiting prompts FCFS, cut to the token budget"""
    for _ in range(4):
        n_run, n_wait = rng.randrange(2, 6), rng.randrange(2, 5)
        ids = _ids(rng, n_run + n_wait)
        running = [[i, 1 if rng.random() < 0.7 else rng.randrange(5, 40)] for i in ids[:n_run]]
        waiting = [[i, rng.randrange(5, 60)] for i in ids[n_run:]]
        total = sum(n for _, n in running + waiting)
        budget = rng.randrange(max(n_run + n_wait, sum(n for _, n in running) - 3), total)
        _expect_schedule(student, running, waiting, budget, n_run + n_wait, True)


@BATCHING.check(points=1, hint="without chunked prefill a prompt runs whole or not at all; when the head of the "
                               "queue does not fit, stop: letting a shorter prompt behind it go first would starve "
                               "long prompts")
def batching_whole_prompts(student, rng):
    """no chunked prefill: a prompt runs whole or waits, and nobody overtakes the head of the queue"""
    for _ in range(3):
        n_run, n_wait = rng.randrange(1, 5), 4
        ids = _ids(rng, n_run + n_wait)
        budget = rng.randrange(24, 64)
        head = rng.randrange(budget - n_run + 1, budget + 1)  # does not fit beside the decodes
        waiting = [[ids[n_run], rng.randrange(2, 8)], [ids[n_run + 1], head]] + \
                  [[i, rng.randrange(2, 8)] for i in ids[n_run + 2:]]
        _expect_schedule(student, [[i, 1] for i in ids[:n_run]], waiting, budget, n_run + n_wait, False)


@BATCHING.check(points=1, hint="max_num_seqs counts every sequence in flight — the running ones and those admitted "
                               "this step: admit waiting prompts only while that count is below it")
def batching_max_num_seqs(student, rng):
    """max_num_seqs caps the sequences in flight, whatever the budget leaves"""
    for _ in range(3):
        n_run, n_wait = rng.randrange(1, 5), rng.randrange(3, 6)
        ids = _ids(rng, n_run + n_wait)
        running = [[i, 1 if rng.random() < 0.6 else rng.randrange(2, 9)] for i in ids[:n_run]]
        waiting = [[i, rng.randrange(2, 9)] for i in ids[n_run:]]
        _expect_schedule(student, running, waiting, 256, n_run + rng.randrange(1, n_wait), rng.random() < 0.5)


# --- 11.speculative_accept -------------------------------------------------------------------------------------

SPECULATIVE = exercise("11.speculative_accept", entry=("run_rejection", "run_residual", "run_speculative"), **TORCH)
Z_MAX = 5.5  # a right answer is this many standard deviations off on one count about once in 10^7


def _distribution(rng: random.Random, vocab: int, floor: float = 0.03) -> list[float]:
    weights = [rng.gammavariate(0.7, 1.0) for _ in range(vocab)]
    total = sum(weights)
    return [floor + (1 - floor * vocab) * w / total for w in weights]


def _alpha(p: list[float], q: list[float]) -> float:
    return sum(map(min, p, q))


def expect_distribution(counts, probs: list[float], what: str) -> None:
    """Counts of each token over n draws that could come from `probs`: every count within Z_MAX standard deviations
    of n·p (binomial), and none of a token whose probability is 0."""
    n = sum(counts) if isinstance(counts, list) and all(isinstance(c, int) for c in counts) else -1
    if len(counts if isinstance(counts, list) else ()) != len(probs) or n < 1:
        raise CheckFailed(f"{what} returned {str(counts)[:80]}, expected {len(probs)} counts of tokens")
    for token, (count, p) in enumerate(zip(counts, probs, strict=True)):
        sd = math.sqrt(n * p * (1 - p))
        if (sd == 0 and count != round(n * p)) or (sd > 0 and abs(count - n * p) > Z_MAX * sd):
            raise CheckFailed(f"{what} returned the counts {counts} over {n} draws, expected about "
                              f"{[round(n * x) for x in probs]}: token {token} drawn {count} times where "
                              f"{n * p:.0f} ± {sd:.0f} were due")


@SPECULATIVE.check(points=1, hint="with one-hot rows the acceptance rule becomes deterministic: check what it "
                                  "accepts, what follows a rejection, and where the bonus token comes from")
def speculative_greedy(student, rng):
    """one-hot rows (greedy): accept while the draft agrees with the target, then the target's token, or the bonus"""
    import torch

    from lab.inference.speculative import rejection_sample

    vocab, k = rng.randrange(5, 12), 3
    for agree in (rng.randrange(0, k), k):  # how many proposals agree with the target's argmax; k: all of them
        target = [rng.randrange(vocab) for _ in range(k + 1)]
        draft = [t if i < agree else rng.randrange(vocab) for i, t in enumerate(target[:k])]
        if agree < k:
            draft[agree] = (target[agree] + rng.randrange(1, vocab)) % vocab  # the first disagreement
        else:
            target[k] = (draft[k - 1] + rng.randrange(1, vocab)) % vocab  # the bonus is not the draft's last row
        q = torch.nn.functional.one_hot(torch.tensor(draft), vocab).float()
        p = torch.nn.functional.one_hot(torch.tensor(target), vocab).float()
        tokens, accepted = rejection_sample(draft, q, p, torch.Generator().manual_seed(0))
        what = f"run_rejection(draft_tokens={draft}, <one-hot draft rows>, <one-hot target rows at {target}>)"
        got = driver(what, "a dict of tokens and accepted", student.run_rejection, draft, q.tolist(), p.tolist(),
                     rng.randrange(10**6))
        if got.get("tokens") != tokens or got.get("accepted") != accepted:
            raise CheckFailed(f"{what} returned tokens {got.get('tokens')}, accepted {got.get('accepted')}, "
                              f"expected tokens {tokens}, accepted {accepted}")


@SPECULATIVE.check(points=1, hint="after a rejection the token must come from where the target wants more than the "
                                  "draft offered, as a proper distribution")
def speculative_residual(student, rng):
    """the residual after a rejection: max(0, p − q), renormalised to sum to 1"""
    for _ in range(3):
        vocab = rng.randrange(4, 10)
        p, q = _distribution(rng, vocab), _distribution(rng, vocab)
        excess = [max(0.0, a - b) for a, b in zip(p, q, strict=True)]
        what = f"run_residual(p={preview(p, 3)}, q={preview(q, 3)})"
        got = driver(what, "a dict with the residual", student.run_residual, p, q)
        expect_allclose(got.get("residual"), [e / sum(excess) for e in excess], what, tol=1e-5,
                        mistakes=[Mistake(sum(excess), "the sum of max(0, p - q)",
                                          "the residual is a distribution only once it is normalised")])


def _spec_case(rng: random.Random, vocab: int, k: int) -> tuple[list, list]:
    """Draft rows q (k) and target rows p (k + 1) whose acceptance rates are middling (every branch of the rule is
    taken often) and whose bonus row differs from the draft's last row (a bonus drawn from the draft shows)."""
    while True:
        q = [_distribution(rng, vocab) for _ in range(k)]
        p = [_distribution(rng, vocab) for _ in range(k + 1)]
        alphas = [_alpha(a, b) for a, b in zip(p, q, strict=False)]
        gap = max(abs(a - b) for a, b in zip(p[k], q[k - 1], strict=True))
        if all(0.45 <= a <= 0.8 for a in alphas) and gap >= 0.25:
            return q, p


@SPECULATIVE.check(points=3, hint="the output must follow the target's distribution: check the acceptance "
                                  "probability, what is drawn after the first rejection, and which distribution the "
                                  "bonus token comes from")
def speculative_distribution(student, rng):
    """over many seeded rounds: the first token follows p, the count accepted Σ min(p, q), the bonus p's last row"""
    vocab, k, rounds = rng.randrange(4, 7), 2, 6000
    q, p = _spec_case(rng, vocab, k)
    what = f"run_speculative(<draft rows q {k} x {vocab}>, <target rows p {k + 1} x {vocab}>, rounds={rounds})"
    got = driver(what, "a dict of first, accepted and bonus counts", student.run_speculative, q, p, rounds,
                 rng.randrange(10**6))
    expect_distribution(got.get("first"), p[0], f"{what}: the first token")
    a0, a1 = _alpha(p[0], q[0]), _alpha(p[1], q[1])
    expect_distribution(got.get("accepted"), [1 - a0, a0 * (1 - a1), a0 * a1],
                        f"{what}: rounds that accepted 0, 1, 2 proposals (closed form: α = Σ min(p, q) per position)")
    expect_distribution(got.get("bonus"), p[k], f"{what}: the bonus token of the rounds that accepted all {k}")


# --- 11.decode_latency -----------------------------------------------------------------------------------------

LATENCY = exercise("11.decode_latency", entry=("kv_bytes_per_token", "decode_step_time", "critical_batch"))
_K_AND_V = Mistake(0.5, "only K or only V", "count what one token leaves in the cache in every layer: keys and "
                                            "values, for the KV heads")


def random_model(rng: random.Random) -> ModelConfig:
    """A dense GQA model of random shape (a few hundred million to tens of billions of parameters)."""
    n_heads = rng.choice([8, 16, 24, 32, 40, 48, 64])
    n_kv_heads = rng.choice([d for d in range(1, n_heads) if n_heads % d == 0])
    head_dim = rng.choice([64, 80, 96, 128])
    d_model = n_heads * head_dim
    return ModelConfig(name="random", vocab_size=rng.randrange(30_000, 160_000), d_model=d_model,
                       n_layers=rng.randrange(12, 81), n_heads=n_heads, n_kv_heads=n_kv_heads,
                       d_ff=rng.randrange(2 * d_model, 4 * d_model, 64), max_seq_len=131072)


def random_chip(rng: random.Random) -> Accelerator:
    """A made-up accelerator: bf16 peak 100 TFLOP/s to 2.5 PFLOP/s, HBM 0.8 to 8 TB/s."""
    return Accelerator("random chip", rng.uniform(1e14, 2.5e15), None, None, 96 * 2**30, rng.uniform(8e11, 8e12),
                       "drawn by the check")


def model_dict(cfg: ModelConfig) -> dict:
    return {"n_params": param_breakdown(cfg)["total"], "n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
            "n_kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "d_model": cfg.d_model}


def chip_dict(chip: Accelerator) -> dict:
    return {"peak_flops": chip.bf16_flops, "hbm_bandwidth": chip.hbm_bandwidth}


def _call(what: str, fn, *args):
    """A number from the student's function; a raise fails the check."""
    try:
        return fn(*args)
    except CallError as error:
        raise explain(error, what, "a number") from None


@LATENCY.check(points=1, hint="under GQA the cache holds the KV heads, not the query heads")
def latency_kv_per_token(student, rng):
    """KV bytes per token: a key and a value per KV head and layer (GQA), in bf16 and in int8"""
    for kv_bytes in (2, 1):
        cfg = random_model(rng)
        what = f"kv_bytes_per_token({model_dict(cfg)}, kv_bytes={kv_bytes})"
        expect_close(_call(what, student.kv_bytes_per_token, model_dict(cfg), kv_bytes),
                     kv_bytes_per_token(cfg, kv_bytes), what, mistakes=[_K_AND_V])


@LATENCY.check(points=2, hint="a decode step is memory-bound: count every byte it must read from HBM, weights and "
                              "caches")
def latency_decode_step(student, rng):
    """the memory-bound decode step: weights plus every sequence's KV cache over HBM bandwidth (random model, chip)"""
    for weight_bytes, kv_bytes in ((2, 2), (1, 1), (2, 1)):
        cfg, chip = random_model(rng), random_chip(rng)
        batch, context = rng.randrange(1, 257), rng.randrange(512, 32768)
        expected = decode_step(cfg, chip, batch, context, weight_bytes=weight_bytes, kv_bytes=kv_bytes)
        what = f"decode_step_time({model_dict(cfg)}, {chip_dict(chip)}, batch={batch}, context={context}, " \
               f"weight_bytes={weight_bytes}, kv_bytes={kv_bytes})"
        got = _call(what, student.decode_step_time, model_dict(cfg), chip_dict(chip), batch, context, weight_bytes,
                    kv_bytes)
        share = expected.weights_s / expected.latency_bound_s
        expect_close(got, expected.latency_bound_s, what, rel=1e-6,
                     mistakes=[Mistake(share, "the weights alone", "the KV cache is read too, every step: every "
                                                                   "sequence's whole context, for every layer's KV "
                                                                   "heads"),
                               Mistake(share + (1 - share) / 2, "half the KV cache", _K_AND_V.hint)])


@LATENCY.check(points=1, hint="the batch at which the FLOPs per byte read reach the chip's ridge point (peak over "
                              "bandwidth)")
def latency_critical_batch(student, rng):
    """the critical batch: the chip's ridge × weight bytes / 2, for bf16 and int8 weights"""
    for weight_bytes in (2, 1):
        chip = random_chip(rng)
        what = f"critical_batch({chip_dict(chip)}, weight_bytes={weight_bytes})"
        expect_close(_call(what, student.critical_batch, chip_dict(chip), weight_bytes),
                     critical_batch(chip, weight_bytes), what,
                     mistakes=[Mistake(2.0, "no division by 2", "each weight does 2 FLOPs (a multiply and an add) "
                                                               "per sequence")] if weight_bytes == 2 else
                     [Mistake(2.0, "weight bytes left out", "fewer bytes per weight means more FLOPs per byte "
                                                            "read: B_crit scales with weight_bytes")])


# --- 11.latency_slo --------------------------------------------------------------------------------------------

SLO = exercise("11.latency_slo", entry=("percentile", "latency_report"))


def timeline(rng: random.Random, count: int, one_token_share: float = 0.0) -> list[dict]:
    """A server's log of `count` requests: Poisson arrivals, a queue before admission (none for some), a prefill,
    then decode gaps with now and then a stall (a decode that waited behind another request's prefill); a share of
    one-token answers."""
    now, log = 0.0, []
    for _ in range(count):
        now += rng.expovariate(20.0)
        admitted = now + (rng.uniform(0.01, 0.4) if rng.random() < 0.7 else 0.0)
        tokens = [admitted + rng.uniform(0.02, 0.3)]
        for _ in range(0 if rng.random() < one_token_share else rng.randrange(1, 12)):
            tokens.append(tokens[-1] + rng.uniform(0.01, 0.03) + (rng.uniform(0.1, 0.3) if rng.random() < 0.1 else 0))
        log.append({"arrival": round(now, 6), "admitted": round(admitted, 6), "tokens": [round(t, 6) for t in tokens]})
    return log


def reference_report(log: list[dict], ttft_slo: float, tpot_slo: float) -> dict:
    """lab.inference.latency on the log: TTFT and TPOT p90 (one-token requests have no TPOT), SLO attainment."""
    requests = [RequestTimes(r["arrival"], r["admitted"], list(r["tokens"])) for r in log]
    tpots = [r.tpot for r in requests if r.tpot is not None]
    return {"ttft_p90": percentile([r.ttft for r in requests], 90), "tpot_p90": percentile(tpots, 90),
            "attainment": slo_attainment(requests, ttft_slo, tpot_slo)}


def _slos(rng: random.Random, log: list[dict]) -> tuple[float, float]:
    """An SLO that some requests meet and some miss: bounds between the 40th and 80th percentiles of the log."""
    ref = [RequestTimes(r["arrival"], r["admitted"], list(r["tokens"])) for r in log]
    tpots = [r.tpot for r in ref if r.tpot is not None]
    return (round(percentile([r.ttft for r in ref], rng.uniform(40, 80)), 4),
            round(percentile(tpots, rng.uniform(40, 80)), 4))


def _expect_report(student, log: list[dict], keys: tuple[str, ...], what: str, rng: random.Random) -> None:
    ttft_slo, tpot_slo = _slos(rng, log)
    call = f"latency_report(<{len(log)} requests: {what}>, ttft_slo={ttft_slo}, tpot_slo={tpot_slo})"
    expected = reference_report(log, ttft_slo, tpot_slo)
    got = driver(call, f"a dict with {', '.join(keys)}", student.latency_report, log, ttft_slo, tpot_slo)
    for key in keys:
        expect_close(got.get(key) if isinstance(got, dict) else None, expected[key], f"{call}[{key!r}]", rel=1e-6)


@SLO.check(points=1, hint="a user waits from the moment the request arrives, queue included: TTFT = first token - "
                          "arrival, not first token - admission")
def slo_ttft_from_arrival(student, rng):
    """TTFT p90 from arrival to first token, the queue before admission included"""
    for count in (rng.randrange(10, 30), rng.randrange(40, 80)):
        _expect_report(student, timeline(rng, count), ("ttft_p90",), "queued, then served", rng)


@SLO.check(points=1, hint="TPOT is the pace after the first token: (last - first) / (n - 1), the mean of the n - 1 "
                          "gaps; the first token belongs to TTFT")
def slo_tpot_after_first(student, rng):
    """TPOT p90: the mean gap between tokens after the first, (last - first) / (n - 1)"""
    for count in (rng.randrange(10, 30), rng.randrange(40, 80)):
        _expect_report(student, timeline(rng, count), ("tpot_p90",), "two tokens or more each", rng)


@SLO.check(points=1, hint="interpolate between the two closest ranks: rank = q / 100 · (n - 1) of the sorted values, "
                          "as numpy.percentile does by default")
def slo_percentile(student, rng):
    """percentiles interpolated between the closest ranks (numpy's default), on a few values and on many"""
    for count in (rng.randrange(3, 8), rng.randrange(3, 8), rng.randrange(20, 60)):
        values = [round(rng.uniform(0, 1), 6) for _ in range(count)]
        for q in (50, 90, rng.choice((25, 75, 99))):
            call = f"percentile({preview(values)}, {q})"
            expect_close(_call(call, student.percentile, values, q), percentile(values, q), call, rel=1e-9)


@SLO.check(points=1, hint="a request attains the SLO when its own TTFT and its own TPOT are both within bounds; a "
                          "one-token answer has no TPOT: it is left out of the TPOT percentile and cannot miss that "
                          "bound")
def slo_attainment_both(student, rng):
    """SLO attainment: the share of requests within both bounds; one-token answers have no TPOT"""
    for count in (rng.randrange(10, 30), rng.randrange(40, 80)):
        _expect_report(student, timeline(rng, count, one_token_share=0.3), ("tpot_p90", "attainment"),
                       "some of one token", rng)
