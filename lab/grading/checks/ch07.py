"""Chapter 07, expert parallelism. Routing, the balancing losses and capacity, checked against `lab.model.MoE`; the
dispatch plan against the layout of `lab.parallel.ep`; a whole MoE layer on real ranks against the layer in one
process.

The routing, loss and capacity exercises get plain lists — router logits, chosen experts — and their references
run through `lab.model.MoE` itself: a layer whose router is the identity (d_model = n_experts), so that its logits
are the check's. Logits are drawn on a grid with random jitter, so that no two of a token's experts tie and the
top-k is the same however a correct answer computes it.

The dispatch exercise's functions get random routings with experts that no token chose, one expert that most
chose, and assignments dropped, at ep up to 64; they are compared with the permutation, counts and split sizes
that `MoE.forward` and `lab.parallel.ep.ExpertParallelCompute` compute.

The expert-parallel exercise's driver (`run_ep_moe`) draws the router and every expert from a seed on every rank,
and the rank's own tokens, keeps its experts and runs the student's layer inside `count_collectives`. The check
draws the same tensors, runs `lab.model.MoE` on each rank's tokens in float64 and compares every rank's output; it
counts what went to `all_to_all_single` with `lab.calc.moe.layer_all_to_all_bytes`. Inputs whose routing is
nearly tied (two experts' logits within 1e-4 at the top-k boundary) are drawn again.

The backward exercise's driver (`run_ep_backward`) runs that layer, made differentiable by the student's
`AllToAll`, on ep × dp ranks (EP groups of consecutive ranks, expert groups ep apart), backpropagates each rank's
loss and calls the student's gradient sync. The check runs `lab.model.MoE` on every rank's tokens in one process
(float64) and compares each rank's token gradients (its own loss) and its router's and experts' gradients (the
mean of all ranks' losses) right after the sync.

The worked problems (07.problems) are plain Python functions of random numbers, compared with `lab.calc.moe` (and
`lab.calc.comms` for one all-to-all's time) to 1%; the EP degree where communication dominates exactly.

torch and `lab.model` are imported inside the functions: `lab.check` of other chapters loads this module too.
"""

from __future__ import annotations

import random

from lab.grading.checks import (
    RANKS,
    TORCH,
    CheckFailed,
    Mistake,
    driver,
    exercise,
    expect_allclose,
    expect_close,
    expect_equal,
    expect_number,
    explain,
    generator,
    per_rank,
)
from lab.grading.sandbox import CallError

SEED_STRIDE = 7919  # rank r's tokens come from seed + SEED_STRIDE * (r + 1): the driver uses the same rule


def moe_layer(d_model: int, n_experts: int, top_k: int, gating: str = "softmax", d_ff: int = 2,
              capacity_factor: float = 0.0):
    """`lab.model.MoE` of that shape (its attention fields are placeholders: only the MoE is built), float64.
    Without further ado its router is the identity (d_model must then be n_experts): its logits are its input."""
    import torch

    from lab.config import ModelConfig
    from lab.model import MoE

    cfg = ModelConfig(d_model=d_model, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=2, n_experts=n_experts,
                      top_k=top_k, d_ff_expert=d_ff, moe_gating=gating, capacity_factor=capacity_factor)
    moe = MoE(cfg).double()
    if d_model == n_experts:
        with torch.no_grad():
            moe.router.weight.copy_(torch.eye(n_experts))
    return moe


def random_logits(rng: random.Random, n_tokens: int, n_experts: int, width: float = 4.0,
                  offset: float = 0.0) -> list[list[float]]:
    """Router logits without ties, in offset ± width: each token's are distinct points of a grid of 10·n_experts
    points, jittered by less than a third of a step (so that even float32 sigmoids of them differ)."""
    step = width / (5 * n_experts)
    return [[round(offset + step * (v - 5 * n_experts + rng.uniform(-0.3, 0.3)), 6)
             for v in rng.sample(range(10 * n_experts), n_experts)] for _ in range(n_tokens)]


def reference_route(logits: list[list[float]], top_k: int, gating: str):
    """`MoE.route` of these logits: (weights, experts, aux_loss, z_loss)."""
    import torch

    moe = moe_layer(len(logits[0]), len(logits[0]), top_k, gating)
    with torch.no_grad():
        weights, experts = moe.route(torch.tensor(logits, dtype=torch.float64))
    return weights, experts, moe.aux_loss.item(), moe.z_loss.item()


def random_routing(rng: random.Random, n_tokens: int, n_experts: int, top_k: int, hot: tuple[int, ...] = (),
                   cold: tuple[int, ...] = ()) -> list[list[int]]:
    """Each token's top_k distinct experts, best first: drawn from `hot` with probability 0.7 each, never from
    `cold`."""
    allowed = [e for e in range(n_experts) if e not in cold]
    routing = []
    for _ in range(n_tokens):
        chosen: list[int] = []
        while len(chosen) < top_k:
            pool = [e for e in (hot if hot and rng.random() < 0.7 else allowed) if e not in chosen]
            chosen.append(rng.choice(pool or [e for e in allowed if e not in chosen]))
        routing.append(chosen)
    return routing


# --- 07.top_k_routing ------------------------------------------------------------------------------------------

ROUTING = exercise("07.top_k_routing", entry=("route", "run_route"), **TORCH)  # MoE's default gates ("auto")


def _logits(rng: random.Random, n_experts: int, gating: str, offset: float = 0.0, max_tokens: int = 13) -> list:
    """Random logits for `gating`, within ±2 to ±8 (softmax) or ±2 to ±4 (sigmoid: float32 sigmoids of larger
    logits come too close to 1 to be told apart)."""
    width = rng.uniform(2, 8) if gating == "softmax" else rng.uniform(2, 4)
    return random_logits(rng, rng.randrange(3, max_tokens), n_experts, width, offset)


def _expect_route(student, rng: random.Random, n_experts: int, top_k: int, gating: str, offset: float = 0.0) -> None:
    logits = _logits(rng, n_experts, gating, offset)
    weights, experts, _, _ = reference_route(logits, top_k, gating)
    where = ", in the hundreds" if offset else ""
    call = f"run_route(<{len(logits)} tokens' logits over {n_experts} experts{where}>, top_k={top_k}, {gating!r})"
    got = driver(call, "the weights and the experts", student.run_route, logits, top_k, gating)
    expect_equal(got.get("experts"), experts.tolist(), f"{call}: the experts of each token, best first")
    expect_allclose(got.get("weights"), weights.flatten().tolist(), f"{call}: the weights, token by token", tol=1e-5)


@ROUTING.check(points=0.5, hint="the scores are a distribution over the experts; with top_k > 1 the chosen gates "
                                "must add up to one")
def route_softmax(student, rng):
    """softmax gating, top-2 to top-4: the experts, best first, and weights that sum to one"""
    for top_k in (2, rng.randrange(3, 5)):
        _expect_route(student, rng, rng.randrange(max(4, top_k + 1), 17), top_k, "softmax")


@ROUTING.check(points=0.5, hint="top-1 (Switch) keeps the raw score as its gate: renormalised, a single gate is "
                                "s/s = 1 and the router gets no gradient from the loss — renormalise only when "
                                "top_k > 1")
def route_top1(student, rng):
    """top-1 (Switch), both gatings: the gate is the raw score, not 1"""
    for gating in ("softmax", "sigmoid"):
        _expect_route(student, rng, rng.randrange(4, 17), 1, gating)


@ROUTING.check(points=0.25, hint="sigmoid scores each expert on its own, so the chosen scores do not add up to one "
                                 "by themselves")
def route_sigmoid(student, rng):
    """sigmoid gating (DeepSeek-V3): the chosen experts' σ(logit), renormalised"""
    for top_k in (2, rng.randrange(3, 7)):
        _expect_route(student, rng, rng.randrange(top_k + 2, 17), top_k, "sigmoid")


@ROUTING.check(points=0.5, hint="exp(logit) overflows float32 above 88: use torch's softmax (it subtracts each row's "
                                "max first), never exp(x) / exp(x).sum()")
def route_large_logits(student, rng):
    """router logits in the hundreds: no overflow"""
    _expect_route(student, rng, rng.randrange(4, 17), rng.randrange(2, 4), "softmax", offset=rng.uniform(150, 400))


@ROUTING.check(points=0.25, hidden=True,
               hint="nothing may depend on the number of experts: topk over the last dimension")
def route_many_experts(student, rng):
    """64 to 256 experts, top-8, both gatings"""
    for gating in ("softmax", "sigmoid"):
        _expect_route(student, rng, rng.choice([64, 128, 256]), 8, gating)


# --- 07.balancing_loss -----------------------------------------------------------------------------------------

BALANCING = exercise("07.balancing_loss", entry=("load_balancing_loss", "router_z_loss", "run_balancing_loss",
                                                 "run_z_loss"), **TORCH)


def _expect_aux(student, rng: random.Random, gating: str, uniform: bool = False) -> None:
    """The loss of random logits (all 0 when `uniform`) and their top-2 to top-4 experts, against `MoE.route`'s."""
    n_experts, top_k = rng.randrange(4, 17), rng.randrange(2, 5)
    logits = ([[0.0] * n_experts for _ in range(rng.randrange(3, 20))] if uniform
              else _logits(rng, n_experts, gating, max_tokens=30))
    _, experts, aux, _ = reference_route(logits, top_k, gating)
    where = ", all 0" if uniform else ""
    call = (f"run_balancing_loss(<{len(logits)} tokens' logits over {n_experts} experts{where}>, <their top-{top_k} "
            f"experts>, {gating!r})")
    got = driver(call, "the loss", student.run_balancing_loss, logits, experts.tolist(), gating)
    expect_number(got.get("aux"), aux, f"{call}: the loss", tol=1e-5)


@BALANCING.check(points=1, hint="a router with equal probabilities gives a loss of 1 whatever the routing only if the "
                                "experts' shares of the assignments add up to one: a share of which total?")
def aux_uniform_router(student, rng):
    """a router with equal probabilities: the loss is 1, however the tokens are assigned"""
    for _ in range(2):
        _expect_aux(student, rng, "softmax", uniform=True)


@BALANCING.check(points=1, hint="the loss pairs each expert's share of the assignments with its mean router "
                                "probability, scaled so that a balanced router gives 1")
def aux_softmax(student, rng):
    """softmax gating, random routings: n_experts·Σ f_e·P_e"""
    for _ in range(2):
        _expect_aux(student, rng, "softmax")


@BALANCING.check(points=1, hint="sigmoid scores do not sum to one over the experts: divide each token's scores by "
                                "their sum before averaging them into P_e")
def aux_sigmoid(student, rng):
    """sigmoid gating: P_e from each token's scores normalised to sum to one"""
    _expect_aux(student, rng, "sigmoid")


@BALANCING.check(points=1, hint="the z-loss penalises large router logits through their log-sum-exp; computed "
                                "naively it overflows above 88")
def z_loss_large_logits(student, rng):
    """the router z-loss, logits around 0 and in the hundreds: mean of logsumexp², no overflow"""
    for offset in (0.0, rng.uniform(150, 400)):
        logits = _logits(rng, rng.randrange(4, 17), "softmax", offset, max_tokens=30)
        _, _, _, z = reference_route(logits, 1, "softmax")
        call = f"run_z_loss(<{len(logits)} tokens' logits over {len(logits[0])} experts, around {offset:.0f}>)"
        expect_number(driver(call, "the z-loss", student.run_z_loss, logits).get("z"), z, call, tol=1e-5)


# --- 07.capacity -----------------------------------------------------------------------------------------------

CAPACITY = exercise("07.capacity", entry=("capacity_mask", "run_capacity"), **TORCH)


def _expect_capacity(student, routing: list[list[int]], capacity_factor: float, n_experts: int, what: str) -> None:
    import torch

    moe = moe_layer(n_experts, n_experts, len(routing[0]), capacity_factor=capacity_factor)
    keep = moe.capacity_mask(torch.tensor(routing)).tolist()
    shown = routing if len(routing) <= 8 else f"<{len(routing)} tokens' top-{len(routing[0])} experts{what}>"
    call = f"run_capacity({shown}, {n_experts}, {capacity_factor})"
    got = driver(call, "which assignments are kept", student.run_capacity, routing, n_experts, capacity_factor)
    expect_equal(got.get("keep"), [int(k) for row in keep for k in row], f"{call}: kept (1) or dropped (0), token by "
                                                                          "token")


def _capacity_case(rng: random.Random, n_experts: int, top_k: int, skewed: bool, whole: bool) -> tuple[list, float]:
    """A routing and a capacity factor whose capacity c·n·k/E is whole (c = 1 or 2 and E divides n), or is at
    least 1/E away from a whole number (so that any order of the arithmetic rounds it up alike); some assignments
    are dropped (c·k < E: an expert may get more than its capacity)."""
    factors = [c for c in ([1.0, 2.0] if whole else [0.25, 0.5, 0.75, 1.25, 1.5]) if c * top_k < n_experts]
    while True:
        n_tokens = n_experts * rng.randrange(1, 5) if whole else rng.randrange(4, 40)
        factor = rng.choice(factors)
        exact = factor * n_tokens * top_k / n_experts
        if whole or exact != int(exact):
            hot = tuple(rng.sample(range(n_experts), 2)) if skewed else ()
            routing = random_routing(rng, n_tokens, n_experts, top_k, hot)
            counts = [sum(row.count(e) for row in routing) for e in range(n_experts)]
            if max(counts) > exact:  # something is dropped
                return routing, factor


@CAPACITY.check(points=1, hint="an expert's capacity is its fair share of the assignments times c, rounded up; first "
                               "come, first served")
def capacity_first_come(student, rng):
    """capacity factor 1 and 2: c·n·k/E per expert, first come first served"""
    for top_k in (rng.randrange(2, 5), 1):
        n_experts = rng.randrange(max(top_k + 1, 3), 13)
        _expect_capacity(student, *_capacity_case(rng, n_experts, top_k, skewed=False, whole=True), n_experts, "")


@CAPACITY.check(points=1, hint="first come, first served means token order first: token 0's choices, then token "
                               "1's, ... — not every token's first choice before any second choice (GShard's order, "
                               "which lab.model.MoE does not follow)")
def capacity_skewed(student, rng):
    """skewed routings: most tokens want the same two experts, the latest assignments are dropped"""
    for whole in (True, False):
        n_experts, top_k = rng.randrange(4, 13), rng.randrange(2, 4)
        _expect_capacity(student, *_capacity_case(rng, n_experts, top_k, skewed=True, whole=whole), n_experts,
                         ", most to two experts")


@CAPACITY.check(points=1, hint="a capacity that is not whole: an expert takes a whole number of assignments, never "
                               "fewer than the fair share times c")
def capacity_rounds_up(student, rng):
    """capacity factors below 1 and capacities that are not whole: rounded up"""
    for _ in range(3):
        n_experts, top_k = rng.randrange(3, 13), rng.randrange(1, 3)
        _expect_capacity(student, *_capacity_case(rng, n_experts, top_k, skewed=rng.random() < 0.5, whole=False),
                         n_experts, "")


# --- 07.dispatch_plan ------------------------------------------------------------------------------------------

DISPATCH = exercise("07.dispatch_plan", entry=("dispatch_plan", "receive_plan", "run_dispatch_plan",
                                               "run_receive_plan"), **TORCH)


def dispatch_reference(experts: list[int], n_experts: int, ep: int) -> dict:
    """What `MoE.forward` and `ExpertParallelCompute` compute for these assignments (in token order): the stable
    sort by expert, the counts per expert, the rows for each rank's block of experts."""
    import torch

    flat = torch.tensor(experts)
    counts = torch.bincount(flat, minlength=n_experts)
    return {"order": flat.argsort(stable=True).tolist(), "counts": counts.tolist(),
            "send_splits": counts.view(ep, n_experts // ep).sum(dim=1).tolist()}


def receive_reference(arriving: list[list[int]]) -> dict:
    """`ExpertParallelCompute`'s receive side: rows arrive by source rank, then local expert (arriving[s][j] rows);
    `regroup` lists them by expert, then source rank — the order the local experts run them in."""
    ep, local = len(arriving), len(arriving[0])
    start, starts = 0, {}
    for s in range(ep):
        for j in range(local):
            starts[s, j], start = start, start + arriving[s][j]
    return {"recv_splits": [sum(row) for row in arriving],
            "regroup": [starts[s, j] + i for j in range(local) for s in range(ep) for i in range(arriving[s][j])]}


def _routing_case(rng: random.Random, ep: int, local: int, max_tokens: int = 40) -> tuple[list[int], str]:
    """Kept assignments in token order: one expert that most tokens choose, the last expert and others that none
    chooses, a few assignments dropped."""
    n_experts = ep * local
    cold = {n_experts - 1, *rng.sample(range(n_experts - 1), rng.randrange(0, n_experts // 3 + 1))}
    hot = rng.choice([e for e in range(n_experts) if e not in cold])
    top_k = rng.randrange(1, min(4, n_experts - len(cold)) + 1)
    routing = random_routing(rng, rng.randrange(3, max_tokens), n_experts, top_k, (hot,), tuple(cold))
    experts = [e for row in routing for e in row if rng.random() > 0.1]
    return experts or routing[0], f"{len(experts)} assignments, top-{top_k}, experts {sorted(cold)} chosen by none"


def _expect_dispatch(student, experts: list[int], n_experts: int, ep: int, what: str, keys: tuple[str, ...]) -> None:
    expected = dispatch_reference(experts, n_experts, ep)
    call = f"run_dispatch_plan({experts if len(experts) <= 12 else f'<{what}>'}, n_experts={n_experts}, ep={ep})"
    got = driver(call, "the order, the counts and the send splits", student.run_dispatch_plan, experts, n_experts, ep)
    for key in keys:
        expect_equal(got.get(key), expected[key], f"{call}: {key}")


def _expect_receive(student, arriving: list[list[int]]) -> None:
    expected = receive_reference(arriving)
    call = f"run_receive_plan(arriving={arriving})"
    got = driver(call, "the receive splits and the regroup permutation", student.run_receive_plan, arriving)
    for key in ("recv_splits", "regroup"):
        expect_equal(got.get(key), expected[key], f"{call}: {key}")


def _arriving(rng: random.Random, ep: int, local: int) -> list[list[int]]:
    return [[rng.choice([0, 0, rng.randrange(1, 6)]) for _ in range(local)] for _ in range(ep)]


@DISPATCH.check(points=1, hint="a permutation can say where each assignment goes or which assignment comes i-th: the "
                               "driver expects the latter, stable within an expert")
def dispatch_order(student, rng):
    """the order: assignments sorted by expert, token order kept within each expert"""
    for ep, local in ((2, 2), (rng.randrange(2, 5), rng.randrange(2, 4)), (rng.randrange(3, 9), 1)):
        experts, what = _routing_case(rng, ep, local)
        _expect_dispatch(student, experts, ep * local, ep, what, ("order",))


@DISPATCH.check(points=2, hint="experts nobody chose still count (0); a rank's send split is the rows for all the "
                               "experts that one rank holds")
def dispatch_counts_and_send_splits(student, rng):
    """counts per expert (0 for experts no token chose) and the rows for each EP rank's block of experts"""
    for ep, local in ((2, 2), (rng.randrange(2, 5), rng.randrange(2, 4)), (rng.randrange(3, 9), rng.randrange(2, 5))):
        experts, what = _routing_case(rng, ep, local)
        _expect_dispatch(student, experts, ep * local, ep, what, ("counts", "send_splits"))


@DISPATCH.check(points=2, hint="rows arrive grouped by source rank, then by expert; the experts need them grouped by "
                               "expert")
def receive_splits_and_regroup(student, rng):
    """the receive side: rows from each rank, regrouped by local expert, then by source rank"""
    for ep, local in ((2, 2), (rng.randrange(3, 7), rng.randrange(2, 5)), (rng.randrange(2, 5), 3)):
        arriving = _arriving(rng, ep, local)
        while len({tuple(row) for row in arriving}) == 1 or not any(map(any, arriving)):  # not all alike, not empty
            arriving = _arriving(rng, ep, local)
        _expect_receive(student, arriving)


@DISPATCH.check(points=1, hidden=True, hint="nothing may assume few ranks or experts, or that every expert is chosen")
def dispatch_at_scale(student, rng):
    """64 ranks of 4 experts, most of them chosen by no token"""
    experts, what = _routing_case(rng, 64, 4, max_tokens=400)
    _expect_dispatch(student, experts, 256, 64, what, ("order", "counts", "send_splits"))
    _expect_receive(student, _arriving(rng, 64, 4))


# --- 07.ep_forward ---------------------------------------------------------------------------------------------

EP = exercise("07.ep_forward", entry=("run_ep_moe",), requires=("07.top_k_routing", "07.dispatch_plan"), **RANKS)


def ep_inputs(d_model: int, d_ff: int, n_experts: int, tilt: list[float], tokens_per_rank: list[int], seed: int):
    """The router, every expert's (w1, w3, w2) and every rank's tokens, as `run_ep_moe` draws them (float32)."""
    import torch

    g = generator(seed)
    rows = torch.randn(n_experts, d_model, generator=g)
    router = (rows - rows.mean(dim=1, keepdim=True) + torch.tensor(tilt)[:, None]) / d_model**0.5
    experts = [[torch.randn(shape, generator=g) / shape[1] ** 0.5 for shape in ((d_ff, d_model), (d_ff, d_model),
                                                                                  (d_model, d_ff))]
               for _ in range(n_experts)]
    tokens = [torch.randn(n, d_model, generator=generator(seed + SEED_STRIDE * (rank + 1))) + 1.0
              for rank, n in enumerate(tokens_per_rank)]
    return router, experts, tokens


def _reference_layer(router, experts: list, top_k: int, gating: str):
    """`lab.model.MoE` (float64) holding this router and these experts' (w1, w3, w2)."""
    import torch

    n_experts, d_model = router.shape
    moe = moe_layer(d_model, n_experts, top_k, gating, experts[0][0].shape[0])
    with torch.no_grad():
        moe.router.weight.copy_(router)
        for e, weights in enumerate(experts):
            ffn = moe.experts[str(e)]
            for linear, weight in zip((ffn.w1, ffn.w3, ffn.w2), weights, strict=True):
                linear.weight.copy_(weight)
    return moe


def ep_reference(d_model: int, d_ff: int, n_experts: int, top_k: int, gating: str, tilt: list[float],
                 tokens_per_rank: list[int], seed: int) -> dict:
    """`lab.model.MoE` with the driver's weights, in float64, on each rank's tokens: the outputs, the assignments
    per expert (`load`), and whether any token's top-k is nearly tied (at its boundary, logits within 1e-4, or
    float32 sigmoid scores within 1e-6)."""
    import torch

    router, experts, tokens = ep_inputs(d_model, d_ff, n_experts, tilt, tokens_per_rank, seed)
    moe = _reference_layer(router, experts, top_k, gating)
    with torch.no_grad():
        outs, loads, tied = [], [], False
        for x in tokens:
            outs.append(moe(x.double()))
            loads.append(moe.load.tolist())
            logits = (x.double() @ router.double().T).sort(-1, descending=True).values
            if top_k < n_experts:  # softmax keeps the logits' order; float32 sigmoids near 1 may tie
                scores = logits if gating == "softmax" else logits.float().sigmoid()
                tied |= bool((logits[:, top_k - 1] - logits[:, top_k]).lt(1e-4).any()
                             or (scores[:, top_k - 1] - scores[:, top_k]).lt(1e-6).any())
    return {"out": outs, "load": loads, "tied": tied}


def _ep(student, rng: random.Random, world: int, local: int, top_k: int, gating: str,
        skewed: bool) -> tuple[list[dict], dict, dict]:
    """Run `run_ep_moe` on `world` ranks of `local` experts each; (results, reference, run: the call and its args)."""
    n_experts = world * local
    d_model, d_ff = rng.randrange(4, 13), rng.randrange(4, 13)
    tokens_per_rank = [rng.randrange(2, 13) for _ in range(world)]
    for _ in range(100):
        tilt = [0.0] * n_experts
        if skewed:  # one expert most tokens choose; a third of the others none
            hot, *cold = rng.sample(range(n_experts), 1 + n_experts // 3)
            tilt[hot] = 4.0
            for e in cold:
                tilt[e] = -4.0
        seed = rng.randrange(10**6)
        args = (d_model, d_ff, n_experts, top_k, gating, tilt, tokens_per_rank, seed)
        reference = ep_reference(*args)
        if not reference["tied"]:
            break
    else:
        raise RuntimeError(f"no routing without near-ties in 100 draws of {n_experts} experts, top-{top_k}")
    call = (f"run_ep_moe(d_model={d_model}, d_ff={d_ff}, n_experts={n_experts}, top_k={top_k}, {gating!r}, "
            f"tilt={tilt}, tokens_per_rank={tokens_per_rank}, seed={seed}) on {world} ranks")
    try:
        results = student.ranks("run_ep_moe", world, *args)
    except CallError as error:
        hang = "timed out" in error.message.lower()
        raise explain(error, call, "every rank's output" + (" (a rank that waits forever: the ranks disagree on the "
                                                            "split sizes, or on how many all-to-alls there are)"
                                                            if hang else "")) from None
    return per_rank(results, world, call), reference, {"call": call, "d_model": d_model, "n_experts": n_experts}


def _expect_ep(student, rng: random.Random, world: int, local: int, top_k: int, gating: str, skewed: bool) -> None:
    results, reference, run = _ep(student, rng, world, local, top_k, gating, skewed)
    call = run["call"]
    for rank, got in enumerate(results):
        expect_allclose(got.get("out"), reference["out"][rank].flatten().tolist(),
                        f"{call}: rank {rank}'s output (the MoE layer on its {len(reference['out'][rank])} tokens)")


@EP.check(points=2, hint="a rank cannot receive rows before it knows how many come: the counts travel first; and the "
                         "combine must undo the dispatch's order")
def ep_two_ranks(student, rng):
    """2 ranks of 2 experts: every rank's output equals the whole layer on its tokens"""
    _expect_ep(student, rng, 2, 2, 2, "softmax", skewed=False)


@EP.check(points=2, hint="with uneven routing each rank receives a different number of rows from every other rank, "
                         "grouped by the rank that sent them: the receive splits follow from the counts that arrived, "
                         "the experts need their rows grouped by expert, and the combine needs them back in the order "
                         "they came")
def ep_imbalanced(student, rng):
    """3 and 4 ranks, imbalanced routing: experts that no token chooses, one that most choose, uneven token counts"""
    _expect_ep(student, rng, 3, 2, 2, "softmax", skewed=True)
    _expect_ep(student, rng, 4, rng.randrange(2, 4), rng.randrange(1, 3), "softmax", skewed=True)


@EP.check(points=1, hint="three dist.all_to_all_single per rank and nothing else: the int64 counts (n_experts "
                         "values), the dispatch (your rows) and the combine (your experts' rows)")
def ep_all_to_all_bytes(student, rng):
    """only all_to_all_single: the counts, then the rows both ways, the bytes lab.calc.moe predicts"""
    from lab.calc.moe import layer_all_to_all_bytes

    world, local = rng.choice([2, 3]), 2
    results, reference, run = _ep(student, rng, world, local, 2, "softmax", skewed=True)
    call = run["call"]
    rows_to = [[sum(load[j * local:(j + 1) * local]) for j in range(world)] for load in reference["load"]]
    for rank, got in enumerate(results):
        calls = {op: n for op, n in (got.get("calls") or {}).items() if n}
        if calls != {"all_to_all_single": 3}:
            raise CheckFailed(f"{call}: rank {rank}'s collectives returned {calls}, expected "
                              f"{{'all_to_all_single': 3}} (the counts, the dispatch, the combine)")
        predicted = layer_all_to_all_bytes(rows_to[rank], [rows_to[s][rank] for s in range(world)], rank,
                                           run["d_model"], run["n_experts"], dtype_bytes=4)
        expect_equal((got.get("bytes") or {}).get("all_to_all_single"), predicted["forward"],
                     f"{call}: rank {rank}'s bytes handed to all_to_all_single (float32 rows, int64 counts)")


@EP.check(points=1, hidden=True, hint="nothing may assume softmax, top-2 or two experts per rank")
def ep_sigmoid_top3(student, rng):
    """sigmoid gating, top-3, 4 ranks of 3 experts"""
    _expect_ep(student, rng, 4, 3, 3, "sigmoid", skewed=rng.random() < 0.5)


# --- 07.ep_backward --------------------------------------------------------------------------------------------

EP_BACKWARD = exercise("07.ep_backward", entry=("run_ep_backward",),
                       requires=("07.top_k_routing", "07.dispatch_plan", "07.ep_forward"), **RANKS)


def ep_backward_reference(d_model: int, d_ff: int, n_experts: int, top_k: int, gating: str, tilt: list[float],
                          n_tokens: int, ep: int, dp: int, seed: int) -> dict:
    """What `run_ep_backward` must return on each of ep·dp ranks, from `lab.model.MoE` in float64 in one process:
    rank r's output and the gradient of its tokens under its own loss ℓ_r = Σ out_r·probe_r / n_tokens, and the
    gradients of the global mean loss (1/world)·Σ_r ℓ_r: the router's and those of the experts rank r holds
    (EP rank r % ep of its group). `tied` as in `ep_reference`."""
    import torch

    world, local = ep * dp, n_experts // ep
    router, experts, tokens = ep_inputs(d_model, d_ff, n_experts, tilt, [n_tokens] * world, seed)
    probes = ep_inputs(d_model, d_ff, n_experts, tilt, [n_tokens] * world, seed + 1)[2]
    tied = ep_reference(d_model, d_ff, n_experts, top_k, gating, tilt, [n_tokens] * world, seed)["tied"]
    moe = _reference_layer(router, experts, top_k, gating)
    outs, token_grads = [], []
    for x, probe in zip(tokens, probes, strict=True):
        x = x.double().requires_grad_(True)
        out = moe(x)
        ((out * probe.double()).sum() / n_tokens).backward()
        outs.append(out.detach().flatten().tolist())
        token_grads.append(x.grad.flatten().tolist())

    def mean_grad(param) -> list[float]:  # an expert no token chose has no gradient: zeros
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        return (grad / world).flatten().tolist()

    expert_grads = [mean_grad(ffn.w1.weight) + mean_grad(ffn.w3.weight) + mean_grad(ffn.w2.weight)
                    for ffn in (moe.experts[str(e)] for e in range(n_experts))]
    return {"out": outs, "tokens": token_grads, "router": mean_grad(moe.router.weight), "tied": tied,
            "experts": [expert_grads[r % ep * local:(r % ep + 1) * local] for r in range(world)]}


def _expect_ep_backward(student, rng: random.Random, ep: int, dp: int, local: int, top_k: int, gating: str,
                        skewed: bool) -> None:
    """`run_ep_backward` on ep·dp ranks against `ep_backward_reference`: outputs, token gradients, then the
    router's and every local expert's gradient right after the student's sync."""
    world, n_experts = ep * dp, ep * local
    d_model, d_ff, n_tokens = rng.randrange(4, 11), rng.randrange(4, 11), rng.randrange(3, 11)
    for _ in range(100):
        tilt = [0.0] * n_experts
        if skewed:  # one expert most tokens choose, one that none chooses
            hot, cold = rng.sample(range(n_experts), 2)
            tilt[hot], tilt[cold] = 4.0, -4.0
        seed = rng.randrange(10**6)
        args = (d_model, d_ff, n_experts, top_k, gating, tilt, n_tokens, ep, seed)
        reference = ep_backward_reference(*args[:7], ep, dp, seed)
        if not reference["tied"]:
            break
    else:
        raise RuntimeError(f"no routing without near-ties in 100 draws of {n_experts} experts, top-{top_k}")
    call = (f"run_ep_backward(d_model={d_model}, d_ff={d_ff}, n_experts={n_experts}, top_k={top_k}, {gating!r}, "
            f"tilt={tilt}, n_tokens={n_tokens}, ep={ep}, seed={seed}) on {world} ranks (ep={ep} × dp={dp})")
    try:
        results = student.ranks("run_ep_backward", world, *args, deadline_s=10)
    except CallError as error:
        raise explain(error, call, "every rank's gradients") from None
    summed = [Mistake(world, "the world size", "a sum over the ranks, not a mean: divide by the world size")]
    by_ep_only = [Mistake(dp, "dp", "each expert's gradient is already the sum over its EP group's tokens, and summed "
                                    "over its replicas the sum over every token: divide by the world size (ep·dp), "
                                    "not by ep"), *summed]
    for rank, got in enumerate(per_rank(results, world, call)):
        where = f"{call}: rank {rank}'s"
        expect_allclose(got.get("out"), reference["out"][rank], f"{where} output (exercise 5's layer)")
        expect_allclose(got.get("tokens"), reference["tokens"][rank],
                        f"{where} gradient of its tokens under its own loss (what the backward all-to-alls bring home)")
        expect_allclose(got.get("router"), reference["router"], f"{where} router gradient after sync_gradients (the "
                        "global mean loss's)", mistakes=summed)
        experts = got.get("experts")
        if not isinstance(experts, list) or len(experts) != local:
            raise CheckFailed(f"{where} expert gradients returned {experts!r:.80}, expected a list of {local} "
                              f"experts' gradients")
        for j, (mine, want) in enumerate(zip(experts, reference["experts"][rank], strict=True)):
            expect_allclose(mine, want, f"{where} gradient of expert {rank % ep * local + j} (w1, w3, w2 flattened) "
                            "after sync_gradients (the global mean loss's)", mistakes=by_ep_only)


@EP_BACKWARD.check(points=3, hint="the rows' gradients must go back to the ranks their tokens came from, undoing the "
                                  "dispatch; and after backward the router's and each expert's gradients must be those "
                                  "of the global mean loss — over which ranks does each one live?")
def ep_backward_two_ranks(student, rng):
    """2 ranks (ep=2): every rank's token, router and expert gradients equal the layer's in one process"""
    _expect_ep_backward(student, rng, 2, 1, 2, 2, "softmax", skewed=False)


@EP_BACKWARD.check(points=4, hint="with dp replicas of every expert, each replica's gradient saw only its own EP "
                                  "group's tokens: the replicas must agree on the mean over the whole batch")
def ep_backward_ep_times_dp(student, rng):
    """4 ranks, ep=2 × dp=2, imbalanced routing: every rank's gradients after the sync equal the global mean's"""
    _expect_ep_backward(student, rng, 2, 2, 2, 2, "softmax", skewed=True)


@EP_BACKWARD.check(points=1, hidden=True, hint="nothing may assume softmax, top-2 or two experts per rank")
def ep_backward_sigmoid_top3(student, rng):
    """sigmoid gating, top-3, ep=2 × dp=2 of 3 experts per rank"""
    _expect_ep_backward(student, rng, 2, 2, 3, 3, "sigmoid", skewed=rng.random() < 0.5)



# --- 07.problems -----------------------------------------------------------------------------------------------
# Back-of-envelope problems: plain Python in the sandbox (no lab.calc there), compared with lab.calc.moe to 1%.

PROBLEMS = exercise("07.problems", entry=(
    "all_to_all_bytes_per_layer", "routed_expert_flops", "active_params", "dropped_assignments", "expert_gib_per_gpu",
    "rows_per_expert", "dispatch_seconds", "comm_compute_ratio", "ep_where_comm_dominates"))
TOLERANCE = 0.01
NO_BACKWARD = Mistake(0.5, "a factor 2", "backward runs the two all-to-alls again, the other way: 4 per layer")


def _crossing(ep: int) -> list[Mistake]:
    """Every row counted as leaving the rank: ep/(ep − 1) times too much."""
    return [Mistake(ep / (ep - 1), "ep/(ep − 1)", "the rows for the rank's own experts never leave it: (ep − 1)/ep "
                                                  "of them cross")]


def _layer(rng: random.Random) -> tuple[int, int, int, int]:
    """tokens per GPU, top_k, d_model, d_ff_expert of a plausible MoE layer."""
    return rng.randrange(512, 16385), rng.randrange(1, 9), rng.randrange(1024, 8193), rng.randrange(256, 4097)


@PROBLEMS.check(points=1, hint="count the all-to-alls of a training step and the share of the rows that leaves the "
                               "rank in each")
def p1_all_to_all_bytes(student, rng):
    """P1 — the bytes one rank sends over all-to-alls per MoE layer, forward and backward"""
    from lab.calc.moe import expected_all_to_all_bytes

    for ep in (rng.randrange(2, 9), rng.choice([16, 32, 64, 128, 256])):
        tokens, top_k, d_model, _ = _layer(rng)
        width = rng.choice([1, 2])
        expect_close(student.all_to_all_bytes_per_layer(tokens, top_k, d_model, ep, width),
                     expected_all_to_all_bytes(tokens, top_k, d_model, ep, width),
                     f"all_to_all_bytes_per_layer({tokens}, {top_k}, {d_model}, {ep}, {width})", TOLERANCE,
                     [NO_BACKWARD, *_crossing(ep)])


@PROBLEMS.check(points=1, hint="count an expert's weights, the training FLOPs per weight and row, and the rows the "
                               "experts see")
def p2_routed_flops(student, rng):
    """P2 — the routed experts' training FLOPs per layer: 6 · tokens·top_k · 3·d·f"""
    from lab.calc.moe import routed_expert_flops

    for _ in range(2):
        tokens, top_k, d_model, d_ff = _layer(rng)
        expect_close(student.routed_expert_flops(tokens, top_k, d_model, d_ff),
                     routed_expert_flops(tokens, top_k, d_model, d_ff),
                     f"routed_expert_flops({tokens}, {top_k}, {d_model}, {d_ff})", TOLERANCE,
                     [Mistake(1 / 3, "forward only", "backward costs twice the forward: 6 FLOPs per weight and row, "
                                                     "not 2"),
                      Mistake(2 / 3, "2·d·f weights", "a SwiGLU expert has three matrices: w1, w3 and w2")])


@PROBLEMS.check(points=1, hint="a token's active parameters leave out the routed experts it was not sent to, in "
                               "every MoE layer")
def p3_active_params(student, rng):
    """P3 — active parameters: the total less the routed experts a token skips"""
    from lab.calc.moe import active_params

    for _ in range(2):
        moe_layers, n_experts = rng.randrange(8, 81), rng.choice([8, 16, 64, 128, 256])
        top_k, d_model, d_ff = rng.randrange(1, 9), rng.randrange(1024, 8193), rng.randrange(256, 4097)
        routed = moe_layers * n_experts * 3 * d_model * d_ff
        total = routed + rng.randrange(routed // 50, routed // 5)
        expect_close(student.active_params(total, moe_layers, n_experts, top_k, d_model, d_ff),
                     active_params(total, moe_layers, n_experts, top_k, d_model, d_ff),
                     f"active_params({total}, {moe_layers}, {n_experts}, {top_k}, {d_model}, {d_ff})", TOLERANCE)


@PROBLEMS.check(points=1, hint="compute each expert's load and its capacity; what exceeds the capacity is dropped")
def p4_dropped(student, rng):
    """P4 — capacity factor and a skewed router: the assignments dropped"""
    from lab.calc.moe import dropped_assignments

    for factor in (rng.choice([1.0, 1.25, 1.5]), rng.choice([0.5, 0.75])):
        tokens, top_k, n_experts = rng.randrange(1000, 100001), rng.randrange(2, 5), rng.choice([8, 16, 64])
        hot_share = rng.uniform(3, min(10, 0.9 * n_experts)) / n_experts  # 3 to 10 times its fair share, < 0.9
        expect_close(student.dropped_assignments(tokens, top_k, n_experts, factor, hot_share),
                     dropped_assignments(tokens, top_k, n_experts, factor, hot_share),
                     f"dropped_assignments({tokens}, {top_k}, {n_experts}, {factor}, {hot_share:.6g})", TOLERANCE)


@PROBLEMS.check(points=1, hint="count the experts a GPU holds per MoE layer and their bytes; GiB = 2**30 bytes (1 GB "
                               "= 1e9)")
def p5_expert_memory(student, rng):
    """P5 — the experts' memory per GPU at expert parallelism ep, in GiB"""
    from lab.calc.moe import expert_bytes_per_gpu

    for _ in range(2):
        moe_layers, n_experts = rng.randrange(8, 81), rng.choice([8, 16, 64, 128, 256])
        ep = rng.choice([e for e in (2, 4, 8, 16, 32, 64) if e <= n_experts])
        d_model, d_ff, width = rng.randrange(1024, 8193), rng.randrange(256, 4097), rng.choice([2, 4, 16])
        expect_close(student.expert_gib_per_gpu(moe_layers, n_experts, d_model, d_ff, ep, width),
                     expert_bytes_per_gpu(moe_layers, n_experts, d_model, d_ff, ep, width) / 2**30,
                     f"expert_gib_per_gpu({moe_layers}, {n_experts}, {d_model}, {d_ff}, {ep}, {width})", TOLERANCE,
                     [Mistake(2**30 / 1e9, "GiB / GB", "a GiB is 2**30 bytes, not 1e9")])


@PROBLEMS.check(points=1, hint="the ep ranks of an EP group each route tokens·top_k assignments over n_experts "
                               "experts, and every expert sits on one rank of the group")
def p6_rows_per_expert(student, rng):
    """P6 — the rows one expert computes per layer under uniform routing: ep·tokens·top_k/n_experts"""
    from lab.calc.moe import rows_per_expert

    for _ in range(2):
        n_experts = rng.choice([8, 16, 64, 128, 256])
        ep = rng.choice([e for e in (2, 4, 8, 16, 32, 64) if e <= n_experts])
        tokens, top_k = rng.randrange(512, 16385), rng.randrange(1, 9)
        expect_close(student.rows_per_expert(tokens, top_k, n_experts, ep),
                     rows_per_expert(tokens, top_k, n_experts, ep),
                     f"rows_per_expert({tokens}, {top_k}, {n_experts}, {ep})", TOLERANCE,
                     [Mistake(1 / ep, "1/ep", "each expert gets rows from all ep ranks of its group, not only from its "
                                              "own")])


@PROBLEMS.check(points=1, hint="the bytes a rank sends in one all-to-all, over its bandwidth (GB/s = 1e9 bytes/s)")
def p7_dispatch_time(student, rng):
    """P7 — one dispatch all-to-all's time at a given bandwidth"""
    from lab.calc.comms import collective_time
    from lab.calc.network import Link

    for ep in (rng.randrange(2, 9), rng.choice([16, 64, 256])):
        tokens, top_k, d_model, _ = _layer(rng)
        gbs, width = rng.uniform(25, 900), rng.choice([1, 2])
        link = Link("problem", gbs * 1e9, 0.0, "grader")
        expect_close(student.dispatch_seconds(tokens, top_k, d_model, ep, gbs, width),
                     collective_time("all_to_all", tokens * top_k * d_model * width, ep, link=link).time_s,
                     f"dispatch_seconds({tokens}, {top_k}, {d_model}, {ep}, {gbs:.6g}, {width})", TOLERANCE,
                     _crossing(ep))


@PROBLEMS.check(points=1, hint="compare the step's all-to-all time with its expert compute time: the tokens cancel")
def p8_comm_compute(student, rng):
    """P8 — EP's comm/compute ratio per layer (bf16, latency left out)"""
    from lab.calc.moe import comm_compute_ratio_on

    for ep in (rng.randrange(2, 9), rng.choice([16, 64, 256])):
        tokens, top_k, d_model, d_ff = _layer(rng)
        gbs, tflops = rng.uniform(25, 900), rng.uniform(100, 2000)
        expect_close(student.comm_compute_ratio(tokens, top_k, d_model, d_ff, ep, gbs, tflops),
                     comm_compute_ratio_on(tokens, top_k, d_model, d_ff, ep, gbs * 1e9, tflops * 1e12),
                     f"comm_compute_ratio({tokens}, {top_k}, {d_model}, {d_ff}, {ep}, {gbs:.6g}, {tflops:.6g})",
                     TOLERANCE, [NO_BACKWARD, Mistake(3, "forward FLOPs only", "training FLOPs are 6 per weight and "
                                                                                 "row: forward 2, backward 4")])


@PROBLEMS.check(points=1, hint="the communication share grows with ep: find the first ep where the all-to-alls take "
                               "at least as long as the experts (α in µs: 1e-6 s)")
def p9_ep_where_comm_dominates(student, rng):
    """P9 — the EP degree beyond which the all-to-alls outlast the experts' compute"""
    from lab.calc.moe import comm_compute_ratio_on, ep_where_comm_dominates

    for _ in range(2):
        while True:
            tokens, top_k, d_model, d_ff = _layer(rng)
            gbs, tflops, latency_us = rng.uniform(200, 900), rng.uniform(100, 1000), rng.uniform(2, 30)
            numbers = (tokens, top_k, d_model, d_ff, gbs * 1e9, tflops * 1e12)
            ep = ep_where_comm_dominates(*numbers, latency_us * 1e-6)
            near = [comm_compute_ratio_on(*numbers[:4], e, *numbers[4:], latency_us * 1e-6) for e in (ep - 1, ep)]
            if 2 < ep <= 4096 and all(abs(r - 1) > 1e-6 for r in near):  # not already at 2, no knife-edge
                break
        expect_equal(student.ep_where_comm_dominates(tokens, top_k, d_model, d_ff, gbs, tflops, latency_us), ep,
                     f"ep_where_comm_dominates({tokens}, {top_k}, {d_model}, {d_ff}, {gbs:.6g}, {tflops:.6g}, "
                     f"{latency_us:.6g})")
