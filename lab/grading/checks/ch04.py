"""Chapter 04, tensor and sequence parallelism. The student's layers run on real gloo ranks; one process checks.

Each multi-rank exercise cell ends with a given driver (`run_mlp`, `run_cross_entropy`, `run_sp_block`): on
every rank it draws the full inputs and weights from a seed, keeps this rank's shards, runs the student's code
inside `count_collectives` and reports plain lists — the output, the gradients of the input and of the weight
shards, the collectives' calls and bytes. The checks here draw the same tensors in the same order, compute the
whole layer in one process in float64, and compare every rank's values with the slice of the single-process
result that the rank must hold (the rules of `lab.parallel.tp` and `lab.parallel.tp_comms`). Shapes are random:
odd batch sizes and widths, and the world size divides only what tensor parallelism splits (the output features,
the vocabulary, the sequence).

The sharded-matmul exercise is compared with `lab.calc.sharding.matmul_plan` (torch-free) on random shardings,
and the worked problems (`04.problems`) with the tensor-parallel arithmetic of `lab.calc.sharding` and
`lab.calc.roofline` on random numbers, to 1%.

torch is imported inside the functions: `lab.check` of other chapters loads this module too.
"""

from __future__ import annotations

import random

from lab.calc import sharding
from lab.calc.roofline import tp_mlp_matmuls
from lab.calc.sharding import matmul_plan
from lab.grading.checks import (
    RANKS,
    CheckFailed,
    Mistake,
    exercise,
    expect_allclose,
    expect_close,
    generator,
    per_rank,
)

GATHERS = ("all_gather", "all_gather_single")  # count_collectives counts torch < 2.13's names under the new ones
SCATTERS = ("reduce_scatter", "reduce_scatter_single")


# --- comparing what the ranks report -------------------------------------------------------------------------

def _calls(counts) -> dict[str, list[int]]:
    """{op: [calls, bytes]} as the drivers report it, without the ops that were not called."""
    counts = counts if isinstance(counts, dict) else {}
    return {op: v for op, v in counts.items() if isinstance(v, list) and len(v) == 2 and v[0]}


def _chunk(t, world: int, dim: int, rank: int) -> list[float]:
    return t.chunk(world, dim)[rank].flatten().tolist()


# --- 04.column_row_linear ------------------------------------------------------------------------------------

COLUMN_ROW = exercise("04.column_row_linear", entry=("run_mlp",), **RANKS)


def mlp_inputs(shape: list[int], d_model: int, d_ff: int, seed: int) -> dict:
    """x, w1, w2 and the probe, drawn in the order the driver `run_mlp` draws them."""
    import torch

    g = generator(seed)
    x = torch.randn(*shape, d_model, generator=g)
    w1 = torch.randn(d_ff, d_model, generator=g) / d_model**0.5
    w2 = torch.randn(d_model, d_ff, generator=g) / d_ff**0.5
    probe = torch.randn(*shape, d_model, generator=g)
    return {"x": x, "w1": w1, "w2": w2, "probe": probe}


def mlp_reference(shape: list[int], d_model: int, d_ff: int, seed: int) -> dict:
    """One process, float64: y = relu(x W1ᵀ) W2ᵀ, loss = Σ y·probe, and the gradients."""
    import torch

    t = {k: v.double().requires_grad_(k != "probe") for k, v in mlp_inputs(shape, d_model, d_ff, seed).items()}
    y = torch.relu(t["x"] @ t["w1"].T) @ t["w2"].T
    (y * t["probe"]).sum().backward()
    return {"y": y.detach(), "x_grad": t["x"].grad, "w1_grad": t["w1"].grad, "w2_grad": t["w2"].grad}


def _mlp(student, rng: random.Random, world: int) -> tuple[list, dict]:
    shape = [rng.randrange(1, 4), rng.randrange(1, 8)]
    d_model, d_ff, seed = rng.randrange(3, 24), world * rng.randrange(1, 9), rng.randrange(10**6)
    call = f"run_mlp(shape={shape}, d_model={d_model}, d_ff={d_ff}, seed={seed}) on {world} ranks"
    results = per_rank(student.ranks("run_mlp", world, shape, d_model, d_ff, seed), world, call)
    return results, {"call": call, "ref": mlp_reference(shape, d_model, d_ff, seed), "world": world,
                     "bytes": 4 * shape[0] * shape[1] * d_model}


@COLUMN_ROW.check(points=1, hint="the row-parallel layer's local product is a partial sum of y over the ranks' "
                                 "slices of F: g all-reduces it in forward (and f is the identity in forward)")
def mlp_output(student, rng):
    """forward: every rank's y equals the single-process MLP (2 ranks)"""
    results, run = _mlp(student, rng, 2)
    for rank, got in enumerate(results):
        expect_allclose(got.get("y"), run["ref"]["y"].flatten().tolist(), f"{run['call']}: rank {rank}'s y")


def _g_backward_all_reduced(tp: int) -> list[Mistake]:
    return [Mistake(tp, "tp", "g's backward is the identity: the gradient of y is the same on every rank already, "
                              "and all-reducing it multiplies every gradient below it by tp")]


@COLUMN_ROW.check(points=2, hint="each rank's column layer sends x's gradient back through its own slice of W1 "
                                 "only: a partial sum; f's backward all-reduces it, so every rank gets the whole")
def mlp_input_grad(student, rng):
    """backward: every rank's x.grad equals the single-process one (3 and 4 ranks)"""
    for world in (3, 4):
        results, run = _mlp(student, rng, world)
        for rank, got in enumerate(results):
            expect_allclose(got.get("x_grad"), run["ref"]["x_grad"].flatten().tolist(),
                            f"{run['call']}: rank {rank}'s x.grad", mistakes=_g_backward_all_reduced(world))


@COLUMN_ROW.check(points=1, hint="g's backward is the identity: the gradient of y is already the same on every "
                                 "rank, and all-reducing it would multiply the weight gradients by tp")
def mlp_weight_grads(student, rng):
    """backward: each rank's weight gradients are its slices of the single-process ones"""
    world = rng.choice([2, 3])
    results, run = _mlp(student, rng, world)
    for rank, got in enumerate(results):
        expect_allclose(got.get("w1_grad"), _chunk(run["ref"]["w1_grad"], world, 0, rank),
                        f"{run['call']}: rank {rank}'s gradient of its W1 rows (column-parallel)",
                        mistakes=_g_backward_all_reduced(world))
        expect_allclose(got.get("w2_grad"), _chunk(run["ref"]["w2_grad"], world, 1, rank),
                        f"{run['call']}: rank {rank}'s gradient of its W2 columns (row-parallel)",
                        mistakes=_g_backward_all_reduced(world))


@COLUMN_ROW.check(points=1, hint="one dist.all_reduce in g's forward and one in f's backward, each of the whole "
                                 "activation: no all_gather, no extra copies over the wire")
def mlp_collectives(student, rng):
    """one all-reduce of b·s·d values forward (g) and one backward (f)"""
    results, run = _mlp(student, rng, rng.choice([2, 3]))
    expected = {"all_reduce": [1, run["bytes"]]}
    for rank, got in enumerate(results):
        for phase in ("forward", "backward"):
            counts = _calls(got.get(phase))
            if counts != expected:
                raise CheckFailed(f"{run['call']}: rank {rank}'s collectives in {phase} returned {counts!r}, "
                                  f"expected {expected!r} ([calls, bytes])")


# --- 04.vocab_parallel_ce ------------------------------------------------------------------------------------

CROSS_ENTROPY = exercise("04.vocab_parallel_ce", entry=("run_cross_entropy",), **RANKS)


def ce_reference(shape: list[int], vocab: int, seed: int, scale: float) -> dict:
    """Logits and targets drawn as the driver `run_cross_entropy` draws them; the full softmax's loss and grad."""
    import torch
    import torch.nn.functional as F

    g = generator(seed)
    logits = (torch.randn(*shape, vocab, generator=g) * scale).double().requires_grad_()
    targets = torch.randint(vocab, shape, generator=g)
    loss = F.cross_entropy(logits.flatten(0, -2), targets.flatten())
    loss.backward()
    return {"loss": loss.item(), "grad": logits.grad}


def _cross_entropy(student, rng: random.Random, world: int, scale: float) -> tuple[list, dict]:
    shape, seed = [rng.randrange(1, 4), rng.randrange(1, 9)], rng.randrange(10**6)
    vocab = world * rng.randrange(2, 12)
    call = f"run_cross_entropy(shape={shape}, vocab={vocab}, seed={seed}, scale={scale!r}) on {world} ranks"
    results = per_rank(student.ranks("run_cross_entropy", world, shape, vocab, seed, scale), world, call)
    return results, {"call": call, "ref": ce_reference(shape, vocab, seed, scale), "world": world,
                     "tokens": shape[0] * shape[1], "local_bytes": 4 * shape[0] * shape[1] * vocab // world}


def _expect_loss(results: list, run: dict) -> None:
    for rank, got in enumerate(results):
        summed = Mistake(run["world"], "tp", "once the max, the sum of exponentials and the target's logit are "
                                             "all-reduced, every rank holds the whole loss: do not all-reduce it")
        expect_allclose([got.get("loss")], [run["ref"]["loss"]], f"{run['call']}: rank {rank}'s loss", tol=1e-5,
                        mistakes=[summed])


@CROSS_ENTROPY.check(points=2, hint="the log-sum-exp runs over the whole vocabulary, and the target's logit lives on "
                                    "one rank only: what must every rank learn from the others?")
def ce_loss(student, rng):
    """the loss equals the full softmax's cross-entropy (2 and 3 ranks)"""
    for world in (2, 3):
        results, run = _cross_entropy(student, rng, world, rng.uniform(1.0, 4.0))
        _expect_loss(results, run)


@CROSS_ENTROPY.check(points=1, hint="cross-entropy's gradient has a softmax part every rank holds a slice of, and a "
                                    "one-hot part only one rank owns")
def ce_grad(student, rng):
    """each rank's logits gradient is its vocabulary slice of the full one (3 and 4 ranks)"""
    for world in (3, 4):
        results, run = _cross_entropy(student, rng, world, rng.uniform(1.0, 4.0))
        for rank, got in enumerate(results):
            mean = [Mistake(run["tokens"], "n_tokens", "the loss is the mean over the tokens: divide the gradient "
                                                       "by their number too")] if run["tokens"] > 1 else []
            expect_allclose(got.get("grad"), _chunk(run["ref"]["grad"], world, -1, rank),
                            f"{run['call']}: rank {rank}'s gradient of its logits shard", tol=1e-5, mistakes=mean)


@CROSS_ENTROPY.check(points=1, hint="exp(z) overflows float32 above z ≈ 88: the shift that keeps it finite must be "
                                    "the same on every rank")
def ce_large_logits(student, rng):
    """logits in the hundreds: no overflow (the global max is subtracted first)"""
    results, run = _cross_entropy(student, rng, rng.choice([2, 4]), rng.uniform(150.0, 300.0))
    _expect_loss(results, run)


@CROSS_ENTROPY.check(points=1, hint="never gather the logits: per token, only the max, the sum of exponentials "
                                    "and the target's logit cross the wire (three all-reduces of n_tokens values)")
def ce_communication(student, rng):
    """only all-reduces of a few numbers per token: the logits are never gathered"""
    results, run = _cross_entropy(student, rng, rng.choice([2, 3]), 2.0)
    budget = 3 * 4 * run["tokens"]
    for rank, got in enumerate(results):
        counts = _calls(got.get("collectives"))
        others = {op: v for op, v in counts.items() if op != "all_reduce"}
        sent = counts.get("all_reduce", [0, 0])[1]
        if others or sent > budget:
            raise CheckFailed(f"{run['call']}: rank {rank}'s collectives returned {counts!r} ([calls, bytes]), "
                              f"expected all_reduce only, at most {budget} bytes (3 float32 per token; its logits "
                              f"shard alone is {run['local_bytes']} bytes)")


# --- 04.matmul_collective ------------------------------------------------------------------------------------

MATMUL = exercise("04.matmul_collective", entry=("plan_matmul",))


def _spec(rng: random.Random, axes: list[str]) -> list:
    """One operand's sharding: each dimension whole (None) or split over a mesh axis, no axis twice."""
    first = rng.choice([None, *axes])
    second = rng.choice([None, *[a for a in axes if a != first]])
    return [first, second]


def _normal(text) -> str:
    return " ".join(str(text).split()).lower()


def _expect_plan(student, a: list, b: list, reduce_scatter: bool) -> None:
    plan = matmul_plan(tuple(a), tuple(b), reduce_scatter=reduce_scatter)
    expected = {"case": plan.case, "collectives": list(plan.collectives)}
    call = f"plan_matmul(a={a!r}, b={b!r}, reduce_scatter={reduce_scatter})"
    got = student.plan_matmul(a, b, reduce_scatter)
    ok = isinstance(got, dict) and got.get("case") == plan.case and isinstance(got.get("collectives"), list) \
        and [_normal(c) for c in got["collectives"]] == [_normal(c) for c in plan.collectives]
    if not ok:
        raise CheckFailed(f"{call} returned {got!r}, expected {expected!r}")


def _random_plans(student, rng: random.Random, cases: set[int], n: int, axes: list[str],
                  must: tuple[tuple[list, list], ...] = ()) -> None:
    for a, b in must:
        _expect_plan(student, a, b, rng.random() < 0.5)
    found = 0
    while found < n:
        a, b = _spec(rng, axes), _spec(rng, axes)
        if a[1] is not None and a[1] == b[1] and (a[0] == a[1] or b[1] == b[0]):
            continue  # not a valid pair of shardings
        if matmul_plan(tuple(a), tuple(b)).case in cases:
            _expect_plan(student, a, b, rng.random() < 0.5)
            found += 1


@MATMUL.check(points=1, hint="only the contracting dimension J decides: whole in both operands, no communication; "
                             "split in one (or in both over different axes), all-gather each split operand along J")
def cases_one_and_two(student, rng):
    """cases 1 and 2: is the contracting dimension split in one operand, in none?"""
    x, y = rng.sample(["X", "Y", "Z"], 2)
    _random_plans(student, rng, {1, 2}, 6, [x, y], must=(([None, x], [y, None]), ([x, None], [None, y])))


@MATMUL.check(points=1, hint="J split over the same axis in both: each device's product is a partial sum of C; which "
                             "collective finishes it?")
def case_three(student, rng):
    """case 3: J split over the same axis in both operands (all-reduce, or reduce-scatter along K)"""
    x, y = rng.sample(["X", "Y", "Z"], 2)
    for reduce_scatter in (False, True, True):
        _expect_plan(student, [rng.choice([None, y]), x], [x, None], reduce_scatter)
    _expect_plan(student, [None, x], [x, y], True)  # K already split: nothing left to scatter along


@MATMUL.check(points=1, hint="I and K split over the same axis would put one mesh axis on two dimensions of C: one "
                             "operand must be gathered")
def case_four(student, rng):
    """case 4: I and K split over the same axis"""
    x, y = rng.sample(["X", "Y", "Z"], 2)
    _expect_plan(student, [x, None], [None, x], rng.random() < 0.5)
    _expect_plan(student, [x, y], [None, x], rng.random() < 0.5)  # J gathered first, then I
    _random_plans(student, rng, {4}, 2, [x, y])


@MATMUL.check(points=1, hidden=True, hint="check the contracting dimension first (case 3), then gather along J, "
                                          "then look at I and K")
def any_case_three_axes(student, rng):
    """any shardings over a three-axis mesh"""
    for case in rng.sample([1, 2, 3, 4], 4):
        _random_plans(student, rng, {case}, 3, ["X", "Y", "Z"])


# --- 04.sequence_parallel ------------------------------------------------------------------------------------

SEQUENCE = exercise("04.sequence_parallel", entry=("run_sp_block",), **RANKS)
EPS = 1e-6


def sp_reference(shape: list[int], d_model: int, d_ff: int, seed: int, world: int) -> dict:
    """The block out = x + relu(rms_norm(x) W1ᵀ) W2ᵀ in one process (float64), with its inputs drawn as the
    driver `run_sp_block` draws them, the gradients, and the norm weight's gradient from each rank's tokens."""
    import torch

    g = generator(seed)
    x = torch.randn(*shape, d_model, generator=g).double().requires_grad_()
    norm = (1 + 0.1 * torch.randn(d_model, generator=g)).double().requires_grad_()
    w1 = (torch.randn(d_ff, d_model, generator=g) / d_model**0.5).double().requires_grad_()
    w2 = (torch.randn(d_model, d_ff, generator=g) / d_ff**0.5).double().requires_grad_()
    probe = torch.randn(*shape, d_model, generator=g).double()
    x_hat = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS)
    normed = x_hat * norm
    out = x + torch.relu(normed @ w1.T) @ w2.T
    (grad_normed,) = torch.autograd.grad((out * probe).sum(), normed, retain_graph=True)
    (out * probe).sum().backward()
    per_token = (grad_normed * x_hat).detach()  # each token's share of the norm weight's gradient
    local_norm = [block.sum((0, 1)).tolist() for block in per_token.chunk(world, 1)]
    return {"out": out.detach(), "x_grad": x.grad, "w1_grad": w1.grad, "w2_grad": w2.grad, "norm_grad": norm.grad,
            "local_norm_grad": local_norm}


def _sp(student, rng: random.Random, world: int) -> tuple[list, dict]:
    shape = [world * rng.randrange(1, 3), world * rng.randrange(1, 4)]  # batch too: a scatter along it must not fit
    d_model, d_ff, seed = rng.randrange(3, 20), world * rng.randrange(1, 7), rng.randrange(10**6)
    call = f"run_sp_block(shape={shape}, d_model={d_model}, d_ff={d_ff}, seed={seed}) on {world} ranks"
    results = per_rank(student.ranks("run_sp_block", world, shape, d_model, d_ff, seed), world, call)
    return results, {"call": call, "ref": sp_reference(shape, d_model, d_ff, seed, world), "world": world,
                     "shard_bytes": 4 * shape[0] * shape[1] * d_model // world}


@SEQUENCE.check(points=2, hint="the reduce-scatter splits along the tensor's first dimension, but the sequence is "
                               "not first: rank r must get its own tokens")
def sp_output(student, rng):
    """forward: each rank holds its sequence block of x + MLP(norm(x)) (2 ranks)"""
    results, run = _sp(student, rng, 2)
    for rank, got in enumerate(results):
        expect_allclose(got.get("out"), _chunk(run["ref"]["out"], 2, 1, rank),
                        f"{run['call']}: rank {rank}'s output (its block of the sequence)")


@SEQUENCE.check(points=2, hint="the conjugate of an all-gather is a reduce-scatter: each rank's column layer "
                               "sends back a partial gradient for every token, which must be summed over ranks "
                               "and split along the sequence again")
def sp_grads(student, rng):
    """backward: input, weight and norm gradients equal one process (3 and 4 ranks)"""
    for world in (3, 4):
        results, run = _sp(student, rng, world)
        ref = run["ref"]
        for rank, got in enumerate(results):
            where = f"{run['call']}: rank {rank}'s"
            expect_allclose(got.get("x_grad"), _chunk(ref["x_grad"], world, 1, rank), f"{where} gradient of its x")
            expect_allclose(got.get("w1_grad"), _chunk(ref["w1_grad"], world, 0, rank), f"{where} W1 rows' gradient")
            expect_allclose(got.get("w2_grad"), _chunk(ref["w2_grad"], world, 1, rank),
                            f"{where} W2 columns' gradient")
            expect_allclose(got.get("norm_grad"), ref["norm_grad"].tolist(), f"{where} norm weight's gradient")


@SEQUENCE.check(points=1, hint="the norm works token by token, so it can stay on the sequence shard: where then do "
                               "the gather and the scatter go?")
def sp_norm_on_shard(student, rng):
    """the norm runs on the rank's own tokens, before the all-gather"""
    world = rng.choice([2, 3])
    results, run = _sp(student, rng, world)
    for rank, got in enumerate(results):
        expect_allclose(got.get("local_norm_grad"), run["ref"]["local_norm_grad"][rank],
                        f"{run['call']}: rank {rank}'s norm weight gradient before the all-reduce (its tokens only)")


@SEQUENCE.check(points=1, hint="sequence parallelism splits g's all-reduce into the two collectives it is made of, so "
                               "that the activation between them stays split along the sequence: no all-reduce, and "
                               "look up the two in lab.distributed")
def sp_collectives(student, rng):
    """one all-gather and one reduce-scatter forward, the same backward, no all-reduce"""
    results, run = _sp(student, rng, rng.choice([2, 3]))
    world, shard = run["world"], run["shard_bytes"]
    for rank, got in enumerate(results):
        for phase in ("forward", "backward"):
            counts = _calls(got.get(phase))
            gathered = sum(counts.get(op, [0, 0])[0] for op in GATHERS)
            scattered = sum(counts.get(op, [0, 0])[0] for op in SCATTERS)
            gather_bytes = sum(counts.get(op, [0, 0])[1] for op in GATHERS)
            scatter_bytes = sum(counts.get(op, [0, 0])[1] for op in SCATTERS)
            others = {op: v for op, v in counts.items() if op not in GATHERS + SCATTERS}
            got_summary = [gathered, gather_bytes, scattered, scatter_bytes]
            expected = [1, shard, 1, world * shard]
            if others or got_summary != expected:
                raise CheckFailed(f"{run['call']}: rank {rank}'s collectives in {phase} returned {counts!r}, "
                                  f"expected [all-gather calls, bytes, reduce-scatter calls, bytes] = {expected} "
                                  f"and nothing else")


# --- 04.tp_gqa_attention -------------------------------------------------------------------------------------

GQA = exercise("04.tp_gqa_attention", entry=("run_gqa_attention",), **RANKS)


def gqa_reference(shape: list[int], n_heads: int, n_kv_heads: int, head_dim: int, d_model: int, seed: int) -> dict:
    """Causal grouped-query attention y = softmax(q kᵀ/√d + mask) v · Woᵀ in one process (float64), its inputs
    drawn as the driver `run_gqa_attention` draws them; query head h uses KV head h // (n_heads / n_kv_heads)."""
    import torch

    g = generator(seed)
    x = torch.randn(*shape, d_model, generator=g)
    wq = torch.randn(n_heads * head_dim, d_model, generator=g) / d_model**0.5
    wk = torch.randn(n_kv_heads * head_dim, d_model, generator=g) / d_model**0.5
    wv = torch.randn(n_kv_heads * head_dim, d_model, generator=g) / d_model**0.5
    wo = torch.randn(d_model, n_heads * head_dim, generator=g) / (n_heads * head_dim) ** 0.5
    probe = torch.randn(*shape, d_model, generator=g).double()
    t = {k: v.double().requires_grad_() for k, v in {"x": x, "wq": wq, "wk": wk, "wv": wv, "wo": wo}.items()}
    (batch, seq), group = shape, n_heads // n_kv_heads

    def heads(w: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, heads, T, head_dim)
        return (t["x"] @ w.T).view(batch, seq, -1, head_dim).transpose(1, 2)

    q = heads(t["wq"])
    k, v = (heads(t[name]).repeat_interleave(group, 1) for name in ("wk", "wv"))
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    weights = (q @ k.transpose(-1, -2) / head_dim**0.5).masked_fill(~causal, float("-inf")).softmax(-1)
    y = (weights @ v).transpose(1, 2).reshape(batch, seq, -1) @ t["wo"].T
    (y * probe).sum().backward()
    return {"y": y.detach(), **{f"{name}_grad": tensor.grad for name, tensor in t.items()}}


def _gqa(student, rng: random.Random, tp: int, n_kv_heads: int) -> tuple[list, dict]:
    shape = [rng.randrange(1, 3), rng.randrange(1, 6)]
    n_heads, head_dim, d_model = tp * rng.randrange(1, 3), rng.randrange(2, 5), rng.randrange(3, 10)
    seed = rng.randrange(10**6)
    call = (f"run_gqa_attention(shape={shape}, n_heads={n_heads}, n_kv_heads={n_kv_heads}, head_dim={head_dim}, "
            f"d_model={d_model}, seed={seed}) on {tp} ranks")
    results = per_rank(student.ranks("run_gqa_attention", tp, shape, n_heads, n_kv_heads, head_dim, d_model, seed),
                       tp, call)
    return results, {"call": call, "tp": tp, "n_kv": n_kv_heads,
                     "ref": gqa_reference(shape, n_heads, n_kv_heads, head_dim, d_model, seed)}


def _kv_head(rank: int, tp: int, n_kv_heads: int) -> int:
    """The KV head rank `rank` must hold: its query heads are the rank-th tp-th of them (`lab.parallel.tp`)."""
    return rank // (tp // n_kv_heads)


@GQA.check(points=2, hint="each rank's query heads must meet the KV head they read under grouped-query attention; "
                          "the row layer's partial sums are finished as in exercise 2")
def gqa_output(student, rng):
    """forward: every rank's y equals one process's attention (tp 4, 2 KV heads)"""
    results, run = _gqa(student, rng, 4, 2)
    for rank, got in enumerate(results):
        expect_allclose(got.get("y"), run["ref"]["y"].flatten().tolist(), f"{run['call']}: rank {rank}'s y")


@GQA.check(points=3, hint="each copy of a KV head saw only its own rank's query heads: its gradient is partial, and "
                          "only the ranks that hold the same head share it")
def gqa_kv_grads(student, rng):
    """backward: every rank's K and V gradients, summed over the replicas, are its KV head's (tp 2 and 4)"""
    for tp, n_kv in rng.sample([(4, 2), rng.choice([(2, 1), (4, 1)])], 2):  # with one KV head, any sum is right
        results, run = _gqa(student, rng, tp, n_kv)
        for rank, got in enumerate(results):
            head = _kv_head(rank, tp, n_kv)
            for name in ("wk", "wv"):
                expect_allclose(got.get(f"{name}_grad"), _chunk(run["ref"][f"{name}_grad"], n_kv, 0, head),
                                f"{run['call']}: rank {rank}'s gradient of its {name} (KV head {head}) after the sync")


@GQA.check(points=2, hint="the query heads and Wo's columns are split as in exercise 2 (column, then row), and "
                          "each rank's queries must meet the KV head they read: x's gradient is a partial sum on "
                          "each rank until f's backward all-reduces it")
def gqa_other_grads(student, rng):
    """backward: x.grad, and each rank's slices of the Wq and Wo gradients (tp 4, 2 KV heads)"""
    results, run = _gqa(student, rng, 4, 2)
    ref = run["ref"]
    for rank, got in enumerate(results):
        where = f"{run['call']}: rank {rank}'s"
        expect_allclose(got.get("x_grad"), ref["x_grad"].flatten().tolist(), f"{where} x.grad")
        expect_allclose(got.get("wq_grad"), _chunk(ref["wq_grad"], 4, 0, rank), f"{where} gradient of its Wq rows")
        expect_allclose(got.get("wo_grad"), _chunk(ref["wo_grad"], 4, 1, rank), f"{where} gradient of its Wo columns")


# --- 04.problems ---------------------------------------------------------------------------------------------
# Back-of-envelope problems: plain Python in the sandbox (no lab.calc there), compared with lab.calc to 1%.

PROBLEMS = exercise("04.problems", entry=(
    "tp_max_degree", "tp_comm_to_compute", "tp_layer_bytes", "sp_activation_saving", "tp_matmul_intensity",
    "tp_max_across_nodes", "vocab_ce_saving", "partial_sum_bytes", "kv_weight_bytes"))
TOLERANCE = 0.01
MISSING_TWO = Mistake(0.5, "a factor 2", "a ring all-reduce sends 2(W−1)/W of the payload: a reduce-scatter and an "
                                        "all-gather")
BITS = Mistake(8, "bits taken for bytes", "a NIC's 400 Gb/s is 400e9 bits a second: divide by 8 for bytes")


def _chip(rng: random.Random) -> tuple[float, float]:
    """A dense peak (FLOP/s) and a link bandwidth (bytes/s) in the range of real GPUs and TPUs."""
    return rng.uniform(2e14, 2.5e15), rng.uniform(5e10, 9e11)


@PROBLEMS.check(points=1, hint="compare what the MLP computes per token on a chip with what it moves per token")
def p1_tp_bound(student, rng):
    """P1 — the largest TP degree that stays compute-bound, Y < F·W/C"""
    for _ in range(2):
        d_ff, (peak, bandwidth) = rng.randrange(2048, 65536), _chip(rng)
        expect_close(student.tp_max_degree(d_ff, peak, bandwidth), sharding.tp_max_degree(d_ff, peak, bandwidth),
                     f"tp_max_degree({d_ff}, {peak:.6g}, {bandwidth:.6g})", TOLERANCE,
                     [Mistake(0.5, "the FLOPs of one matmul", "the MLP has two matmuls, each split over the Y chips: "
                                                              "count the FLOPs of both")])


@PROBLEMS.check(points=1, hint="compare the two matmuls' time per GPU with the all-reduce's: the tokens and the "
                               "model width cancel")
def p2_comm_to_compute(student, rng):
    """P2 — T_comm / T_math of a TP MLP's forward"""
    for tp in (rng.choice([2, 4]), rng.choice([8, 16, 32])):
        d_ff, (peak, bandwidth) = rng.randrange(2048, 65536), _chip(rng)
        expect_close(student.tp_comm_to_compute(d_ff, tp, peak, bandwidth),
                     sharding.tp_comm_to_compute(d_ff, tp, peak, bandwidth),
                     f"tp_comm_to_compute({d_ff}, {tp}, {peak:.6g}, {bandwidth:.6g})", TOLERANCE, [MISSING_TWO])


@PROBLEMS.check(points=1, hint="count the all-reduces of a layer, forward and backward, and what a ring all-reduce "
                               "sends per GPU")
def p3_layer_bytes(student, rng):
    """P3 — bytes each GPU sends per layer under TP, forward and backward"""
    for tp in (2, rng.choice([4, 8, 16])):
        b, s, h, width = rng.randrange(1, 17), rng.choice([1024, 2048, 4096, 8192]), rng.randrange(512, 16385), \
            rng.choice([2, 4])
        expect_close(student.tp_layer_bytes(b, s, h, tp, width), sharding.tp_layer_comm_bytes(b, s, h, tp, width),
                     f"tp_layer_bytes({b}, {s}, {h}, {tp}, {width})", TOLERANCE,
                     [MISSING_TWO, Mistake(0.5, "two all-reduces", "forward has two (g), backward two more (f)")])


@PROBLEMS.check(points=1, hint="Korthikanti et al. count a layer's activations with TP alone and with SP: the "
                               "difference is what TP leaves unsplit")
def p4_sp_saving(student, rng):
    """P4 — the activation bytes per layer sequence parallelism saves"""
    for tp in (2, rng.choice([4, 8])):
        s, b, h = rng.choice([2048, 4096, 8192]), rng.randrange(1, 9), rng.randrange(1024, 16385)
        expect_close(student.sp_activation_saving(s, b, h, tp), sharding.sp_activation_saving(s, b, h, tp),
                     f"sp_activation_saving({s}, {b}, {h}, {tp})", TOLERANCE)


@PROBLEMS.check(points=1, hint="arithmetic intensity of the column matmul on one GPU: its FLOPs over the bytes of "
                               "its operands and result")
def p5_matmul_intensity(student, rng):
    """P5 — the arithmetic intensity of one GPU's column-parallel matmul"""
    for tp in (1, rng.choice([8, 16, 64])):
        tokens, d_model, d_ff = rng.randrange(64, 8193), rng.randrange(1024, 16385), tp * rng.randrange(256, 1025)
        column, _ = tp_mlp_matmuls(tokens, d_model, d_ff, tp)
        expect_close(student.tp_matmul_intensity(tokens, d_model, d_ff, tp), column.intensity,
                     f"tp_matmul_intensity({tokens}, {d_model}, {d_ff}, {tp})", TOLERANCE)


@PROBLEMS.check(points=1, hint="the same bound as problem 1 with the NIC's bandwidth: Gb/s are 1e9 bits a second, "
                               "8 bits a byte")
def p6_across_nodes(student, rng):
    """P6 — the TP bound over a node's network card instead of NVLink"""
    for _ in range(2):
        d_ff, (peak, _), gbits = rng.randrange(2048, 65536), _chip(rng), rng.choice([100, 200, 400, 800])
        expect_close(student.tp_max_across_nodes(d_ff, peak, gbits),
                     sharding.tp_max_degree(d_ff, peak, gbits * 1e9 / 8),
                     f"tp_max_across_nodes({d_ff}, {peak:.6g}, {gbits})", TOLERANCE, [BITS])


@PROBLEMS.check(points=1, hint="compare the bytes of gathering the logits with the few numbers per token the "
                               "vocab-parallel loss exchanges")
def p7_vocab_ce(student, rng):
    """P7 — how many times fewer bytes vocab-parallel cross-entropy moves than gathering the logits"""
    for _ in range(2):
        vocab, width = rng.randrange(32000, 262145), rng.choice([2, 4])
        expect_close(student.vocab_ce_saving(vocab, width), sharding.vocab_ce_saving(vocab, width),
                     f"vocab_ce_saving({vocab}, {width})", TOLERANCE,
                     [Mistake(2, "float32 counted as 2 bytes", "the three per-token numbers are float32")])


@PROBLEMS.check(points=1, hint="case 3: each device holds a partial sum of the whole I×K result: how much of it does "
                               "each of the two collectives send per device (chapter 02's ring)?")
def p8_partial_sums(student, rng):
    """P8 — bytes to combine A[I, J_X] · B[J_X, K]'s partial sums: all-reduce or reduce-scatter"""
    for reduce_scatter in (False, True):
        i, k, x, width = rng.randrange(256, 16385), rng.randrange(256, 16385), rng.randrange(2, 17), rng.choice([2, 4])
        expect_close(student.partial_sum_bytes(i, k, x, width, reduce_scatter),
                     sharding.partial_sum_bytes(i, k, x, width, reduce_scatter),
                     f"partial_sum_bytes({i}, {k}, {x}, {width}, reduce_scatter={reduce_scatter})", TOLERANCE,
                     [MISSING_TWO])


@PROBLEMS.check(points=1, hint="a rank never holds a fraction of a KV head")
def p9_kv_weights(student, rng):
    """P9 — bytes of one layer's Wk and Wv on each TP rank with GQA"""
    n_kv = rng.choice([2, 4, 8])
    for tp in (rng.choice([t for t in (1, 2, 4, 8) if t <= n_kv]), n_kv * rng.choice([2, 4])):
        d_model, head_dim, width = rng.randrange(1024, 16385), rng.choice([64, 128, 256]), rng.choice([2, 4])
        expect_close(student.kv_weight_bytes(d_model, n_kv, head_dim, tp, width),
                     sharding.kv_weight_bytes(d_model, n_kv, head_dim, tp, width),
                     f"kv_weight_bytes({d_model}, {n_kv}, {head_dim}, {tp}, {width})", TOLERANCE)
