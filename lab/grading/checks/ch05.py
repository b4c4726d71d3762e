"""Chapter 05, context parallelism. Merging partial attention, the zig-zag layout, ring attention on real ranks
(forward and backward), the work per rank.

The merge exercise's driver (`run_merge`) takes plain lists: the checks draw attention scores and values here,
split the keys into two blocks, compute each block's (out, lse) in float64 — rows whose block holds no key
they may see get lse = −inf and out = 0 — and compare the student's merge (run in float32) with attention over
all the keys at once. Scores in the hundreds catch an exp that overflows, rows masked in one block or both
catch a NaN.

The ring exercise's driver (`run_ring_attention`) draws q, k, v from a seed on every rank, keeps the rank's
chunks of the sequence (the layout a check sends: contiguous, zig-zag from `lab.calc.cp.chunk_ids`, or a
shuffled one, so that the causal rule must compare *global* chunk indices), runs the student's forward inside
`count_collectives`, and reports the output and the messages. The check draws the same tensors, computes full
attention in one process in float64 with `lab.parallel.ring_attention.block_forward` (the whole sequence is one
block: diagonal when causal) and compares every rank's output with its chunks of the result.

The backward exercise's driver (`run_ring_backward`) draws q, k, v and the upstream gradient dout from a seed,
computes the forward's out and lse in one process with the student's `block_attention`, keeps the rank's chunks
and runs the student's backward inside `count_collectives`; the check compares every rank's dq, dk, dv with
autograd through torch's attention over the whole sequence (float64), and counts the bytes the ring sends.

The zig-zag and work exercises are compared with `lab.calc.cp` (`chunk_ids`, `attention_work`) and
`lab.parallel.cp.sequence_positions` at random cp and sequence lengths.

torch and `lab.parallel` are imported inside the functions: `lab.check` of other chapters loads this module too.
"""

from __future__ import annotations

import random

from lab.calc.cp import (
    DIAGONAL,
    FULL,
    allgather_kv_bytes,
    attention_matches_mlp,
    attention_share,
    attention_work,
    chunk_ids,
    hide_tokens,
    kv_block_bytes,
    ring_bytes,
    ulysses_bytes,
    ulysses_max_cp,
)
from lab.calc.memory import korthikanti_layer_bytes
from lab.grading.checks import (
    RANKS,
    TORCH,
    CheckFailed,
    Mistake,
    exercise,
    expect_allclose,
    expect_close,
    expect_dict,
    expect_equal,
    expect_number,
    expect_raises,
    generator,
    per_rank,
    point_to_point_sent,
)

# --- 05.lse_merge ----------------------------------------------------------------------------------------

MERGE = exercise("05.lse_merge", entry=("run_merge",), **TORCH)


def attention_blocks(scores, values, visible, bounds: list[int]) -> list[tuple]:
    """(out, lse) of attention over each block of keys bounds[i]:bounds[i+1] (float64); a row that sees no key
    of a block gets lse = −inf and out = 0 there. `bounds` = [0, len(keys)] gives attention over all keys."""
    import torch

    blocks = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        s = scores[..., start:end].masked_fill(~visible[..., start:end], float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        empty = torch.isneginf(lse)
        weights = torch.exp(s - torch.where(empty, 0.0, lse).unsqueeze(-1))  # 0 on every key of an empty row
        blocks.append((weights @ values[..., start:end, :], lse))
    return blocks


def merge_case(rng: random.Random, n_blocks: int = 2, offset: float = 0.0, masked: bool = False) -> dict:
    """Random scores (H, T, N) and values (H, N, D) cut into `n_blocks` blocks of keys; each block's (out, lse)
    and the result over all keys. `offset`: each block's scores shifted by about that much (scores in the
    hundreds); `masked`: some rows see no key of the first block, some none of the last, some none at all."""
    import torch

    heads, rows, dim = rng.randrange(1, 4), rng.randrange(3, 9), rng.randrange(1, 7)
    sizes = [rng.randrange(1, 7) for _ in range(n_blocks)]
    bounds = [sum(sizes[:i]) for i in range(n_blocks + 1)]
    g = generator(rng.randrange(10**6))
    scores = torch.randn(heads, rows, bounds[-1], generator=g, dtype=torch.float64) * rng.uniform(1.0, 3.0)
    if offset:
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            scores[..., start:end] += offset + rng.uniform(-4.0, 4.0)
    values = torch.randn(heads, bounds[-1], dim, generator=g, dtype=torch.float64)
    visible = torch.rand(heads, rows, bounds[-1], generator=g, dtype=torch.float64) < 0.8
    visible[..., 0] = True  # every row sees a key of every block, unless masked below
    visible[..., bounds[-2]] = True
    if masked:
        first, last, both = rng.sample(range(rows), 3)
        visible[:, first, bounds[0]:bounds[1]] = False
        visible[:, last, bounds[-2]:] = False
        visible[:, both, :] = False
    return {"blocks": attention_blocks(scores, values, visible, bounds),
            "full": attention_blocks(scores, values, visible, [0, bounds[-1]])[0],
            "shape": [heads, rows, dim], "sizes": sizes}


def _merge(student, a: tuple, b: tuple, what: str) -> tuple[list, list]:
    got = expect_dict(student.run_merge(a[0].tolist(), a[1].tolist(), b[0].tolist(), b[1].tolist()), what)
    return got.get("out"), got.get("lse")


def _expect_merge(student, case: dict, what: str) -> None:
    (out_a, lse_a), (out_b, lse_b) = case["blocks"]
    out, lse = _merge(student, (out_a, lse_a), (out_b, lse_b), what)
    full_out, full_lse = case["full"]
    expect_allclose(lse, full_lse.flatten().tolist(), f"{what}: the merged lse")
    expect_allclose(out, full_out.flatten().tolist(), f"{what}: the merged out")


def _describe(case: dict) -> str:
    heads, rows, dim = case["shape"]
    return f"run_merge(...) of two blocks of {case['sizes'][0]} and {case['sizes'][1]} keys, " \
           f"out ({heads}, {rows}, {dim}), lse ({heads}, {rows})"


@MERGE.check(points=2, hint="each block's output is normalised by its own lse: both must be re-weighted to the "
                            "merged normaliser, the running one too")
def merge_values(student, rng):
    """two blocks of keys, merged: the out and lse of attention over all of them"""
    for _ in range(3):
        case = merge_case(rng)
        _expect_merge(student, case, _describe(case))


@MERGE.check(points=1, hint="e^lse overflows float32 above lse ≈ 88: combine the two lse without exponentiating them "
                            "directly")
def merge_large_scores(student, rng):
    """scores in the hundreds: no overflow"""
    case = merge_case(rng, offset=rng.uniform(150.0, 400.0))
    _expect_merge(student, case, _describe(case) + ", scores in the hundreds")


@MERGE.check(points=1, hint="a row that saw no key has lse = −inf in both blocks: what does your weight become "
                            "there?")
def merge_masked_rows(student, rng):
    """fully masked rows (lse = −inf in one block, or in both): no NaN"""
    case = merge_case(rng, masked=True)
    _expect_merge(student, case, _describe(case) + ", rows masked in a block or in both")


@MERGE.check(points=1, hidden=True, hint="the merge must give the same result whichever block comes first: "
                                         "a block's weight depends only on its own lse and the merged one")
def merge_many_blocks(student, rng):
    """three to five blocks folded one at a time, in a random order"""
    import torch

    case = merge_case(rng, n_blocks=rng.randrange(3, 6), offset=rng.choice([0.0, 100.0]), masked=True)
    blocks = list(case["blocks"])
    rng.shuffle(blocks)
    what = f"run_merge(...) folding {len(blocks)} blocks of keys one at a time"
    out, lse = blocks[0]
    for block in blocks[1:]:
        got_out, got_lse = _merge(student, (out, lse), block, what)
        if not (isinstance(got_out, list) and isinstance(got_lse, list)
                and len(got_out) == out.numel() and len(got_lse) == lse.numel()):
            raise CheckFailed(f"{what} returned out {got_out!r:.120}, lse {got_lse!r:.120}, expected lists of "
                              f"{out.numel()} and {lse.numel()} values")
        out = torch.tensor(got_out, dtype=torch.float64).view(out.shape)
        lse = torch.tensor(got_lse, dtype=torch.float64).view(lse.shape)
    full_out, full_lse = case["full"]
    expect_allclose(lse.flatten().tolist(), full_lse.flatten().tolist(), f"{what}: the final lse")
    expect_allclose(out.flatten().tolist(), full_out.flatten().tolist(), f"{what}: the final out")


# --- 05.zigzag_assignment --------------------------------------------------------------------------------

ZIGZAG = exercise("05.zigzag_assignment", entry=("zigzag_chunks", "zigzag_positions", "zigzag_owner"))


def _seq_len(rng: random.Random, cp: int) -> int:
    return 2 * cp * rng.randrange(1, 12)


@ZIGZAG.check(points=0.5, hint="zig-zag pairs a chunk from the front with its mirror from the back, so that every "
                               "rank gets equal causal work")
def zigzag_chunk_ids(student, rng):
    """rank r holds chunks r and 2·cp−1−r, in that order (cp up to 16)"""
    for cp in (2, rng.randrange(3, 9), rng.randrange(9, 17)):
        for rank in range(cp):
            expect_equal(student.zigzag_chunks(rank, cp), chunk_ids(rank, cp, "zigzag"),
                         f"zigzag_chunks(rank={rank}, cp={cp})")


@ZIGZAG.check(points=0.5, hint="RoPE rotates by a token's global position in the sequence, not its index on the rank")
def zigzag_rope_positions(student, rng):
    """each rank's token positions (what RoPE rotates by), random cp and seq_len"""
    from lab.parallel.cp import sequence_positions

    for cp in (2, rng.randrange(3, 9)):
        seq_len = _seq_len(rng, cp)
        for rank in range(cp):
            expect_equal(student.zigzag_positions(rank, cp, seq_len),
                         sequence_positions(seq_len, rank, cp, "zigzag").tolist(),
                         f"zigzag_positions(rank={rank}, cp={cp}, seq_len={seq_len})")


@ZIGZAG.check(points=0.5, hint="a rank's two chunks sit one after the other locally: find the rank whose positions "
                               "include the token")
def zigzag_owner_of_position(student, rng):
    """where a global position lives: [rank, local index]"""
    from lab.parallel.cp import sequence_positions

    cp = rng.randrange(2, 9)
    seq_len = _seq_len(rng, cp)
    owner = {p: [rank, i] for rank in range(cp)
             for i, p in enumerate(sequence_positions(seq_len, rank, cp, "zigzag").tolist())}
    chunk = seq_len // (2 * cp)
    positions = {0, seq_len - 1, cp * chunk - 1, cp * chunk, *rng.sample(range(seq_len), min(seq_len, 12))}
    for position in sorted(positions):
        expect_equal(student.zigzag_owner(position, cp, seq_len), owner[position],
                     f"zigzag_owner(position={position}, cp={cp}, seq_len={seq_len})")


@ZIGZAG.check(points=0.5, hint="zig-zag cuts the sequence into 2·cp chunks of one length: a length that cannot be cut "
                               "so is refused with a ValueError whose message names seq_len and 2·cp; unequal chunks "
                               "would give the ranks unequal work and shapes")
def zigzag_rejects_bad_lengths(student, rng):
    """a seq_len that 2·cp does not divide: a ValueError"""
    for _ in range(2):
        cp = rng.randrange(2, 9)
        seq_len = 2 * cp * rng.randrange(1, 10) + rng.randrange(1, 2 * cp)
        expect_raises("ValueError", f"zigzag_positions(rank=0, cp={cp}, seq_len={seq_len})", student.zigzag_positions,
                      0, cp, seq_len, why=f"2·cp = {2 * cp} does not divide {seq_len}")


# --- 05.ring_forward -------------------------------------------------------------------------------------

RING = exercise("05.ring_forward", entry=("run_ring_attention",), requires=("05.lse_merge",), **RANKS)


def ring_reference(shape: list[int], causal: bool, seed: int):
    """q, k, v drawn as the driver `run_ring_attention` draws them; attention over the whole sequence in float64
    (`lab.parallel.ring_attention.block_forward`: with a causal mask the whole sequence is one diagonal block)."""
    import torch

    from lab.parallel.ring_attention import block_forward

    g = generator(seed)
    q, k, v = (torch.randn(shape, generator=g).double() for _ in range(3))
    out, _ = block_forward(q, k, v, DIAGONAL if causal else FULL, shape[-1] ** -0.5)
    return out


def rank_part(t, chunks: list[list[int]], rank: int):
    """Rank `rank`'s part of t (B, H, T, D) along the sequence: its chunks, in its order."""
    import torch

    n = sum(len(c) for c in chunks)
    return torch.cat([t.chunk(n, dim=2)[c] for c in chunks[rank]], dim=2)


def random_layout(rng: random.Random, cp: int, kind: str) -> list[list[int]]:
    """Every rank's global chunk indices: "contiguous", "zigzag" (`lab.calc.cp`), or "shuffled" (a random
    permutation of `per_rank`·cp chunks, dealt out `per_rank` to a rank)."""
    if kind in ("contiguous", "zigzag"):
        return [chunk_ids(r, cp, kind) for r in range(cp)]
    per_rank = rng.randrange(1, 4)
    order = list(range(per_rank * cp))
    rng.shuffle(order)
    return [sorted(order[r * per_rank:(r + 1) * per_rank], key=lambda _: rng.random()) for r in range(cp)]


def _ring(student, rng: random.Random, world: int, kind: str, causal: bool) -> tuple[list, dict]:
    chunks = random_layout(rng, world, kind)
    n = sum(len(c) for c in chunks)
    # chunks of 2 tokens or more: a diagonal block of one token would need no mask
    shape = [rng.randrange(1, 3), rng.randrange(1, 4), n * rng.randrange(2, 5), rng.randrange(2, 9)]
    seed = rng.randrange(10**6)
    call = f"run_ring_attention(shape={shape}, chunks={chunks}, causal={causal}, seed={seed}) on {world} ranks"
    results = per_rank(student.ranks("run_ring_attention", world, shape, chunks, causal, seed), world, call)
    return results, {"call": call, "shape": shape, "chunks": chunks, "seed": seed, "world": world, "causal": causal}


def _expect_ring(student, rng: random.Random, world: int, kind: str, causal: bool) -> None:
    results, run = _ring(student, rng, world, kind, causal)
    reference = ring_reference(run["shape"], causal, run["seed"])
    for rank, got in enumerate(results):
        expected = rank_part(reference, run["chunks"], rank).flatten().tolist()
        expect_allclose(got.get("out"), expected, f"{run['call']}: rank {rank}'s output (chunks {run['chunks'][rank]})")


@RING.check(points=1, hint="every rank's K/V must visit every rank once: which block does a rank hold at each step, "
                           "and where does it go next?")
def ring_not_causal(student, rng):
    """no mask: every rank's output equals attention over the whole sequence (2 and 3 ranks)"""
    for world in (2, 3):
        _expect_ring(student, rng, world, "contiguous", causal=False)


@RING.check(points=2, hint="under the causal mask a key block is seen fully, partly or not at all, depending on "
                           "where it lies relative to the query block")
def ring_causal_contiguous(student, rng):
    """causal, contiguous chunks: later chunks skipped, the diagonal masked (2, 3 and 4 ranks)"""
    for world in (2, 3, 4):
        _expect_ring(student, rng, world, "contiguous", causal=True)


@RING.check(points=1, hint="whether a query block sees a key block depends on where the two chunks lie in the whole "
                           "sequence, whatever ranks hold them and wherever they sit locally")
def ring_causal_zigzag(student, rng):
    """causal, zig-zag and shuffled layouts: the block rule compares global chunk indices"""
    _expect_ring(student, rng, rng.choice([2, 4]), "zigzag", causal=True)
    _expect_ring(student, rng, 3, "shuffled", causal=True)


@RING.check(points=1, hint="the K/V travel by point-to-point messages only, K and V of a step together in one message, "
                           "started before the local block's attention so that they overlap it; count the steps that "
                           "still have a block to pass on")
def ring_point_to_point(student, rng):
    """only isend/irecv: cp−1 sends of the rank's K and V per rank"""
    world = rng.choice([3, 4])
    results, run = _ring(student, rng, world, rng.choice(["contiguous", "zigzag"]), causal=True)
    batch, heads, seq, dim = run["shape"]
    kv_bytes = 2 * batch * heads * (seq // world) * dim * 4
    for rank, got in enumerate(results):
        expect_equal(point_to_point_sent(got, rank, run["call"]), [world - 1, (world - 1) * kv_bytes],
                     f"{run['call']}: rank {rank}'s [messages sent, bytes sent] (its K and V are {kv_bytes} bytes)")


@RING.check(points=1, hidden=True, hint="the causal rule and the ring must not assume a layout: any chunks, any "
                                        "number of them per rank")
def ring_any_layout(student, rng):
    """4 ranks, shuffled layouts of 1 to 3 chunks per rank, causal and not"""
    for causal in (True, False):
        _expect_ring(student, rng, 4, "shuffled", causal)


# --- 05.causal_work --------------------------------------------------------------------------------------

WORK = exercise("05.causal_work", entry=("causal_work", "imbalance"))


def _work_cases(rng: random.Random, layout: str, n: int, max_cp: int = 16, max_chunk: int = 200):
    for _ in range(n):
        cp = rng.randrange(2, max_cp + 1)
        yield cp, 2 * cp * rng.randrange(1, max_chunk)  # 2·cp divides it: both layouts apply


def _expect_work(student, cp: int, seq_len: int, layout: str) -> None:
    expect_equal(student.causal_work(seq_len, cp, layout), attention_work(seq_len, cp, layout),
                 f"causal_work(seq_len={seq_len}, cp={cp}, layout={layout!r})")


@WORK.check(points=1, hint="count the (query, key) pairs a rank's queries see under the causal mask: the chunks "
                           "before them, and their own")
def work_contiguous(student, rng):
    """contiguous chunks: query-key pairs per rank, random cp and seq_len"""
    for cp, seq_len in _work_cases(rng, "contiguous", 3):
        _expect_work(student, cp, seq_len, "contiguous")


@WORK.check(points=1, hint="under zig-zag a rank's work is the sum of its two chunks' causal work")
def work_zigzag(student, rng):
    """zig-zag: query-key pairs per rank, random cp and seq_len"""
    for cp, seq_len in _work_cases(rng, "zigzag", 3):
        _expect_work(student, cp, seq_len, "zigzag")


@WORK.check(points=1, hint="the step waits for the busiest rank: max over ranks divided by the mean (1.0 is "
                           "balanced)")
def work_imbalance(student, rng):
    """max/mean of the per-rank work, both layouts"""
    for layout in ("contiguous", "zigzag"):
        for cp, seq_len in _work_cases(rng, layout, 2):
            work = attention_work(seq_len, cp, layout)
            expect_number(student.imbalance(seq_len, cp, layout), max(work) / (sum(work) / cp),
                          f"imbalance(seq_len={seq_len}, cp={cp}, layout={layout!r})")


@WORK.check(points=1, hidden=True, hint="with a million tokens the counts outgrow what a float holds exactly: count "
                                        "the pairs in integers, the diagonal's own pairs included")
def work_long_sequences(student, rng):
    """up to 64 ranks and a million tokens, both layouts"""
    for layout in ("contiguous", "zigzag"):
        for cp, seq_len in _work_cases(rng, layout, 2, max_cp=64, max_chunk=8000):
            _expect_work(student, cp, seq_len, layout)


# --- 05.ring_backward ------------------------------------------------------------------------------------

BACKWARD = exercise("05.ring_backward", entry=("run_ring_backward",), requires=("05.lse_merge", "05.ring_forward"),
                    **RANKS)


def backward_reference(shape: list[int], causal: bool, seed: int) -> tuple:
    """dq, dk, dv of attention over the whole sequence in one process (float64, autograd through torch's
    attention) for the q, k, v and upstream gradient dout the driver `run_ring_backward` draws."""
    import torch
    import torch.nn.functional as F

    g = generator(seed)
    q, k, v, dout = (torch.randn(shape, generator=g).double().requires_grad_() for _ in range(4))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return torch.autograd.grad(out, (q, k, v), dout)


def _ring_backward(student, rng: random.Random, world: int, kind: str, causal: bool) -> tuple[list, dict]:
    chunks = random_layout(rng, world, kind)
    n = sum(len(c) for c in chunks)
    shape = [rng.randrange(1, 3), rng.randrange(1, 4), n * rng.randrange(2, 5), rng.randrange(2, 9)]
    seed = rng.randrange(10**6)
    call = f"run_ring_backward(shape={shape}, chunks={chunks}, causal={causal}, seed={seed}) on {world} ranks"
    results = per_rank(student.ranks("run_ring_backward", world, shape, chunks, causal, seed), world, call)
    return results, {"call": call, "shape": shape, "chunks": chunks, "world": world, "seed": seed}


def _expect_ring_backward(student, rng: random.Random, world: int, kind: str, causal: bool) -> None:
    results, run = _ring_backward(student, rng, world, kind, causal)
    grads = backward_reference(run["shape"], causal, run["seed"])
    for rank, got in enumerate(results):
        for name, grad in zip(("dq", "dk", "dv"), grads, strict=True):
            expected = rank_part(grad, run["chunks"], rank).flatten().tolist()
            expect_allclose(got.get(name), expected, f"{run['call']}: rank {rank}'s {name} (chunks "
                                                     f"{run['chunks'][rank]})")


@BACKWARD.check(points=2, hint="dq belongs to your queries; dk and dv belong to the K/V block you hold, which must "
                               "end on its owner")
def ring_backward_not_causal(student, rng):
    """no mask: every rank's dq, dk, dv equal autograd's over the whole sequence (2 and 3 ranks)"""
    for world in (3, 2):  # 3 first: at 2 ranks the next rank is also the previous one
        _expect_ring_backward(student, rng, world, "contiguous", causal=False)


@BACKWARD.check(points=3, hint="the backward's probabilities must be normalised like the forward's final output, not "
                               "block by block; and the causal rule holds in the backward too")
def ring_backward_causal(student, rng):
    """causal, zig-zag chunks: dq, dk, dv equal autograd's (2 and 3 ranks)"""
    for world in (2, 3):
        _expect_ring_backward(student, rng, world, "zigzag", causal=True)


@BACKWARD.check(points=1, hint="the gradients of K and V must reach the rank that owns the block, by isend/irecv only: "
                               "count what a rank sends for K/V and for their gradients over the whole ring")
def ring_backward_messages(student, rng):
    """only isend/irecv: each rank sends its K/V block's size 2·cp−1 times (cp−1 K/V, cp dK/dV)"""
    world = 3
    results, run = _ring_backward(student, rng, world, "contiguous", causal=True)
    batch, heads, seq, dim = run["shape"]
    kv_bytes = 2 * batch * heads * (seq // world) * dim * 4
    for rank, got in enumerate(results):
        _, sent = point_to_point_sent(got, rank, run["call"])
        expect_equal(sent, (2 * world - 1) * kv_bytes, f"{run['call']}: rank {rank}'s bytes sent (its K and V are "
                                                        f"{kv_bytes} bytes)")


@BACKWARD.check(points=2, hidden=True, hint="the block rule and the ring must not assume a layout: any chunks, any "
                                            "number of them per rank")
def ring_backward_any_layout(student, rng):
    """3 ranks, a shuffled layout of 1 to 3 chunks per rank, causal"""
    _expect_ring_backward(student, rng, 3, "shuffled", causal=True)


# --- 05.problems -----------------------------------------------------------------------------------------------
# Back-of-envelope problems: plain Python in the sandbox (no lab.calc there), compared with lab.calc.cp (and
# lab.calc.memory for the activations) to 1%.

PROBLEMS = exercise("05.problems", entry=(
    "ring_hide_tokens", "contiguous_spread", "zigzag_speedup", "kv_step_mb", "activation_gib_per_rank",
    "ring_over_ulysses", "ulysses_max_context", "attention_share_at", "attention_mlp_crossover", "allgather_kv_mb"))
TOLERANCE = 0.01
NO_KV_TWO = Mistake(0.5, "K without V", "a K/V block is two tensors, K and V")
CAUSAL_HALF = Mistake(0.5, "the full s × s matrix", "under a causal mask only the lower triangle of the scores is "
                                                    "computed")


def _heads(rng: random.Random) -> tuple[int, int]:
    heads = rng.choice([8, 16, 32, 40, 64, 96, 128])
    return heads, rng.choice([g for g in (1, 2, 4, 8, 16) if heads % g == 0 and g < heads])


@PROBLEMS.check(points=1, hint="compare a step's causal compute time with its K/V transfer time and solve for the "
                               "chunk size (units: FLOP/s and bytes/s)")
def p1_ring_hide_tokens(student, rng):
    """P1 — c*: the tokens per rank above which a ring step hides its K/V transfer"""
    for _ in range(2):
        heads, kv_heads = _heads(rng)
        dtype_bytes, tflops, gbytes = rng.choice([1, 2, 4]), rng.uniform(100, 2000), rng.uniform(20, 900)
        expect_close(student.ring_hide_tokens(heads, kv_heads, dtype_bytes, tflops, gbytes),
                     hide_tokens(heads, kv_heads, dtype_bytes, tflops * 1e12, gbytes * 1e9),
                     f"ring_hide_tokens({heads}, {kv_heads}, {dtype_bytes}, {tflops:.6g}, {gbytes:.6g})", TOLERANCE)


@PROBLEMS.check(points=1, hint="with contiguous chunks the causal work grows with the rank: compare the busiest rank "
                               "with the least busy")
def p2_contiguous_spread(student, rng):
    """P2 — without zig-zag: the busiest rank's work over the least busy one's"""
    for cp, chunk in ((rng.randrange(2, 5), rng.randrange(1, 8)), (rng.randrange(5, 33), rng.randrange(8, 40))):
        seq_len = cp * chunk  # short chunks too: the diagonal's L(L+1)/2 against a careless L²/2
        work = attention_work(seq_len, cp, "contiguous")
        expect_close(student.contiguous_spread(seq_len, cp), max(work) / min(work),
                     f"contiguous_spread({seq_len}, {cp})", TOLERANCE)


@PROBLEMS.check(points=1, hint="a step lasts as long as its busiest rank, under each layout")
def p3_zigzag_speedup(student, rng):
    """P3 — zig-zag's speed-up of causal ring attention over contiguous chunks"""
    for cp, half in ((rng.randrange(2, 5), rng.randrange(1, 8)), (rng.randrange(5, 33), rng.randrange(8, 40))):
        seq_len = 2 * cp * half
        ratio = max(attention_work(seq_len, cp, "contiguous")) / max(attention_work(seq_len, cp, "zigzag"))
        expect_close(student.zigzag_speedup(seq_len, cp), ratio, f"zigzag_speedup({seq_len}, {cp})", TOLERANCE)


@PROBLEMS.check(points=1, hint="K and V of the chunk's tokens, for the KV heads only (GQA), in the given dtype; in MB "
                               "(1e6 bytes)")
def p4_kv_step_mb(student, rng):
    """P4 — the K/V bytes one ring step passes on, with GQA (MB)"""
    for _ in range(2):
        tokens, (_, kv_heads) = rng.randrange(512, 65537), _heads(rng)
        head_dim, dtype_bytes = rng.choice([64, 96, 128, 256]), rng.choice([1, 2, 4])
        expect_close(student.kv_step_mb(tokens, kv_heads, head_dim, dtype_bytes),
                     kv_block_bytes(1, tokens, kv_heads, head_dim, dtype_bytes) / 1e6,
                     f"kv_step_mb({tokens}, {kv_heads}, {head_dim}, {dtype_bytes})", TOLERANCE, [NO_KV_TWO])


@PROBLEMS.check(points=1, hint="the chapter's activation count with SP and a flash kernel, on the tokens one CP rank "
                               "holds; in GiB (2^30)")
def p5_activation_gib(student, rng):
    """P5 — activation memory per rank at long context with CP and TP (GiB)"""
    for tp in (rng.choice([1, 2]), rng.choice([4, 8])):
        cp = rng.choice([2, 4, 8, 16])
        seq, d_model = cp * 1024 * rng.randrange(8, 129), 1024 * rng.randrange(2, 17)
        n_layers = rng.randrange(16, 127)
        expected = korthikanti_layer_bytes(seq // cp, 1, d_model, 1, tp=tp, sp=True, flash=True) * n_layers / 2**30
        expect_close(student.activation_gib_per_rank(seq, cp, tp, d_model, n_layers), expected,
                     f"activation_gib_per_rank({seq}, {cp}, {tp}, {d_model}, {n_layers})", TOLERANCE)


@PROBLEMS.check(points=1, hint="count what each scheme moves per rank: the ring passes K/V blocks, Ulysses re-shards "
                               "q, k, v and the output")
def p6_ring_over_ulysses(student, rng):
    """P6 — ring attention's bytes per rank and layer over Ulysses' all-to-alls"""
    for _ in range(2):
        cp, (heads, kv_heads) = rng.choice([2, 4, 8, 16, 32]), _heads(rng)
        ratio = ring_bytes(cp * 1024, cp, kv_heads, 128) / ulysses_bytes(cp * 1024, cp, heads, kv_heads, 128)
        expect_close(student.ring_over_ulysses(cp, heads, kv_heads), ratio,
                     f"ring_over_ulysses({cp}, {heads}, {kv_heads})", TOLERANCE)


@PROBLEMS.check(points=1, hint="Ulysses gives each CP rank whole heads: cp ≤ the n_heads/tp heads a TP rank holds; "
                               "the context is cp times the tokens per GPU")
def p7_ulysses_max_context(student, rng):
    """P7 — the longest context Ulysses reaches at a given number of tokens per GPU"""
    for tp in (rng.choice([1, 2]), rng.choice([4, 8])):
        heads, tokens = rng.choice([16, 32, 64, 128]), 1024 * rng.randrange(1, 33)
        expect_close(student.ulysses_max_context(heads, tp, tokens), ulysses_max_cp(heads, tp) * tokens,
                     f"ulysses_max_context({heads}, {tp}, {tokens})", TOLERANCE)


def _layer(rng: random.Random) -> tuple[int, int, int, int, int]:
    """d_model, heads, KV heads, head_dim, d_ff — heads·head_dim not always d_model."""
    heads, kv_heads = _heads(rng)
    head_dim = rng.choice([64, 128, 256])
    d_model = heads * head_dim if rng.random() < 0.5 else 1024 * rng.randrange(2, 17)
    return d_model, heads, kv_heads, head_dim, 256 * rng.randrange(8, 160)


@PROBLEMS.check(points=1, hint="compare attention's score and value products with the FLOPs of the layer's weights "
                               "(projections and MLP)")
def p8_attention_share(student, rng):
    """P8 — the share of a layer's forward FLOPs in causal attention at a context length"""
    for seq in (1024 * rng.randrange(1, 9), 1024 * rng.randrange(32, 257)):
        dims = _layer(rng)
        expect_close(student.attention_share_at(seq, *dims), attention_share(seq, *dims),
                     f"attention_share_at({seq}, {', '.join(map(str, dims))})", TOLERANCE)


@PROBLEMS.check(points=1, hint="per token, attention's core grows with s and the MLP does not: find where they are "
                               "equal")
def p9_attention_mlp_crossover(student, rng):
    """P9 — the context at which causal attention costs as many FLOPs as the MLP"""
    for _ in range(2):
        d_model, heads, _, head_dim, d_ff = _layer(rng)
        expect_close(student.attention_mlp_crossover(d_model, heads, head_dim, d_ff),
                     attention_matches_mlp(d_model, heads, head_dim, d_ff),
                     f"attention_mlp_crossover({d_model}, {heads}, {head_dim}, {d_ff})", TOLERANCE, [CAUSAL_HALF])


@PROBLEMS.check(points=1, hint="after the all-gather every rank holds K and V of the whole sequence for the layer, KV "
                               "heads only; in MB (1e6)")
def p10_allgather_kv_mb(student, rng):
    """P10 — the all-gather variant (Llama 3): the K/V each rank holds for one layer (MB)"""
    for _ in range(2):
        seq, (_, kv_heads) = 1024 * rng.randrange(8, 1025), _heads(rng)
        head_dim, dtype_bytes = rng.choice([64, 128, 256]), rng.choice([1, 2])
        expect_close(student.allgather_kv_mb(seq, kv_heads, head_dim, dtype_bytes),
                     allgather_kv_bytes(seq, kv_heads, head_dim, dtype_bytes) / 1e6,
                     f"allgather_kv_mb({seq}, {kv_heads}, {head_dim}, {dtype_bytes})", TOLERANCE, [NO_KV_TWO])
