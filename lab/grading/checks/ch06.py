"""Chapter 06, pipeline parallelism. Schedules and their bubble, checked against the simulator; the split backward
and an AFAB step, checked against autograd in one process.

The schedule exercises (`06.one_f_one_b_order`, `06.bubble`, `06.peak_activations`) are pure Python: the checks
compare the student's answers, at random pipeline depths p, micro-batch counts m and chunk counts v, with
`lab.calc.schedules` (the per-rank op lists the real pipeline runs) and with what `lab.calc.bubble.simulate`
measures when it plays those schedules — never with the closed forms alone.

The split-backward exercise's drivers draw every tensor from a seed: `run_weight_grad` the input and output
gradient of one nn.Linear or RMSNorm, `run_split_backward` a small stage (Linear, tanh, RMSNorm, Linear) and
its micro-batches, run F/B/W in the order of one rank of a ZB-H1 schedule. The driver reports, besides the
gradients, what B must not do: compute a weight gradient (hooks on the parameters count it) or change a
`.grad`. The checks draw the same tensors, run autograd over the whole stage in float64 and compare.

The AFAB exercise's driver (`run_afab`) draws every stage's weights and the batch from a seed on every rank,
keeps its own stage, runs the student's step inside `count_collectives` and reports the loss, the gradients and
the messages. The check runs the whole model on the whole batch in one process, float64. The 1F1B exercise
(`06.one_f_one_b_ranks`) builds on it: its driver (`run_one_f_one_b`) draws the same model with AFAB's
`make_model` and also counts, with a hook on each stage output, the micro-batches in flight. Both run their ranks
with a deadline: a pipeline that deadlocks is stopped within seconds, and the check says which rank waited in
which send or receive (the flight recorder's lines, which the sandbox keeps).

The worked problems (`06.problems`) are plain Python of random numbers, compared with `lab.calc` — the
simulator's measurements where it has them.

torch and `lab.calc` are imported inside the functions: `lab.check` of other chapters loads this module too.
"""

from __future__ import annotations

import math
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
    point_to_point_sent,
    where_ranks_waited,
)
from lab.grading.sandbox import CallError

# --- 06.one_f_one_b_order --------------------------------------------------------------------------------

ORDER = exercise("06.one_f_one_b_order", entry=("one_f_one_b_order",))


def _expect_order(student, p: int, m: int, r: int) -> None:
    from lab.calc.schedules import one_f_one_b

    expected = [str(op) for op in one_f_one_b(p, m).ops[r]]
    got = student.one_f_one_b_order(p, m, r)
    if got != expected:
        raise CheckFailed(f"one_f_one_b_order(p={p}, m={m}, r={r}) returned {got!r:.300}, expected {expected!r:.300}")


@ORDER.check(points=1, hint="the last stage (r = p − 1) warms up with no forward: F0 B0 F1 B1 ...; the first "
                            "(r = 0) with p − 1 forwards, so that its p-th forward meets the first backward")
def order_first_and_last_stage(student, rng):
    """the first and the last stage, m ≥ p"""
    for _ in range(2):
        p = rng.randrange(2, 9)
        m = rng.randrange(p, 3 * p + 1)
        for r in (0, p - 1):
            _expect_order(student, p, m, r)


@ORDER.check(points=2, hint="1F1B has three phases: how many forwards a stage runs before its first backward depends "
                            "on its distance from the last stage")
def order_every_stage(student, rng):
    """every stage: p − r − 1 warm-up forwards, then one forward and one backward in turn, then the cool-down"""
    for p in (rng.randrange(3, 6), rng.randrange(6, 11)):
        m = rng.randrange(p, 4 * p + 1)
        for r in range(p):
            _expect_order(student, p, m, r)


@ORDER.check(points=1, hint="with m < p a stage cannot warm up with more forwards than there are micro-batches")
def order_few_micro_batches(student, rng):
    """fewer micro-batches than stages (m < p)"""
    for _ in range(2):
        p = rng.randrange(3, 11)
        m = rng.randrange(1, p)
        for r in range(p):
            _expect_order(student, p, m, r)


@ORDER.check(points=1, hidden=True, hint="the order must hold at any depth: no special case for small p")
def order_deep_pipelines(student, rng):
    """16 to 32 stages and up to 128 micro-batches"""
    p = rng.randrange(16, 33)
    m = rng.choice([rng.randrange(1, p), rng.randrange(p, 129)])
    for r in sorted(rng.sample(range(p), 6)):
        _expect_order(student, p, m, r)


# --- 06.bubble -------------------------------------------------------------------------------------------

BUBBLE = exercise("06.bubble", entry=("bubble_ratio", "step_time"))


def _costs(rng: random.Random) -> tuple[float, float, float]:
    """t_f, t_b and t_w in ZB-H1's regime (t_w ≤ t_f, 2·t_w ≤ t_b), rounded so that messages stay short."""
    tf = round(rng.uniform(0.5, 3.0), 3)
    tb = round(rng.uniform(1.0, 6.0), 3)
    tw = round(rng.uniform(0.1, min(tf, tb / 2)), 3)
    return tf, tb, tw


def _config(rng: random.Random, schedule: str, max_p: int = 16) -> tuple[int, int, int]:
    p = rng.randrange(2, max_p + 1)
    if schedule == "interleaved":
        return p, p * rng.randrange(1, 6), rng.randrange(2, 5)
    if schedule == "zb-h1":
        return p, rng.randrange(p, 4 * p + 1), 1
    return p, rng.randrange(1, 65), 1


def _simulate(schedule: str, p: int, m: int, v: int, tf: float = 1.0, tb: float = 2.0, tw: float = 1.0):
    from lab.calc.bubble import simulate
    from lab.calc.schedules import make_schedule

    return simulate(make_schedule(schedule, p, m, v), tf, tb, min(tw, tb))


def _expect_bubble(student, schedule: str, p: int, m: int, v: int) -> None:
    chunks = [Mistake(v, "v", "with v chunks per rank every op is v times shorter, and so are the p − 1 fill and drain "
                              "slots: the useful time is not")] if v > 1 else []
    expect_number(student.bubble_ratio(schedule, p, m, v), _simulate(schedule, p, m, v).bubble_ratio,
                  f"bubble_ratio({schedule!r}, p={p}, m={m}, v={v})", mistakes=chunks)


def _expect_step(student, schedule: str, p: int, m: int, v: int, costs: tuple[float, float, float]) -> None:
    tf, tb, tw = costs
    expect_number(student.step_time(schedule, p, m, v, tf, tb, tw), _simulate(schedule, p, m, v, tf, tb, tw).makespan,
                  f"step_time({schedule!r}, p={p}, m={m}, v={v}, t_f={tf}, t_b={tb}, t_w={tw})")


@BUBBLE.check(points=0.5, hint="the bubble ratio compares a rank's idle time with its useful time: count the slots "
                               "of each")
def bubble_afab_one_f_one_b(student, rng):
    """AFAB and 1F1B: the bubble ratio (p−1)/m"""
    for schedule in ("afab", "1f1b"):
        _expect_bubble(student, schedule, *_config(rng, schedule))


@BUBBLE.check(points=0.5, hint="with v chunks per rank each op is shorter: what happens to the fill and drain, and "
                               "what to the useful time?")
def bubble_interleaved(student, rng):
    """interleaved 1F1B: v chunks per rank shrink the bubble by v"""
    for _ in range(2):
        _expect_bubble(student, "interleaved", *_config(rng, "interleaved"))


@BUBBLE.check(points=0.25, hint="follow the last micro-batch: when does it enter the pipeline, and how long is its "
                                "way through and back?")
def step_afab_one_f_one_b(student, rng):
    """step time of AFAB and 1F1B, random t_f and t_b"""
    for schedule in ("afab", "1f1b"):
        _expect_step(student, schedule, *_config(rng, schedule), _costs(rng))


@BUBBLE.check(points=0.25, hint="the step is the useful time plus the bubble, and interleaving shrinks only one of "
                                "them")
def step_interleaved(student, rng):
    """step time of interleaved 1F1B"""
    for _ in range(2):
        _expect_step(student, "interleaved", *_config(rng, "interleaved"), _costs(rng))


@BUBBLE.check(points=0.25, hint="ZB-H1 keeps 1F1B's bubble slots but fills part of each with deferred "
                                "weight-gradient work")
def step_zero_bubble(student, rng):
    """ZB-H1: deferred weight gradients fill part of the bubble"""
    for _ in range(2):
        _expect_step(student, "zb-h1", *_config(rng, "zb-h1"), _costs(rng))


@BUBBLE.check(points=0.25, hidden=True, hint="no special case for small pipelines: the formulas hold at any p, m, v")
def bubble_deep_pipelines(student, rng):
    """up to 32 stages and 128 micro-batches, every schedule"""
    for schedule in ("afab", "1f1b", "interleaved", "zb-h1"):
        p = rng.randrange(16, 33)
        m = p * rng.randrange(1, 5) if schedule in ("interleaved", "zb-h1") else rng.randrange(1, 129)
        v = rng.randrange(2, 5) if schedule == "interleaved" else 1
        if schedule != "zb-h1":
            _expect_bubble(student, schedule, p, m, v)
        _expect_step(student, schedule, p, m, v, _costs(rng))


# --- 06.peak_activations ---------------------------------------------------------------------------------

PEAK = exercise("06.peak_activations", entry=("peak_activations",))


def _expect_peaks(student, schedule: str, p: int, m: int, v: int = 1) -> None:
    expected = _simulate(schedule, p, m, v).peak_activations
    expect_allclose(student.peak_activations(schedule, p, m, v), expected,
                    f"peak_activations({schedule!r}, p={p}, m={m}, v={v})", tol=1e-9)


@PEAK.check(points=1, hint="AFAB runs every forward before the first backward: each stage holds all m")
def peak_afab(student, rng):
    """AFAB: every stage holds all m micro-batches"""
    for _ in range(2):
        p = rng.randrange(2, 17)
        _expect_peaks(student, "afab", p, rng.randrange(1, 65))


@PEAK.check(points=1, hint="a stage's peak is reached just before its first backward: count the forwards it has run "
                           "by then")
def peak_one_f_one_b(student, rng):
    """1F1B with m ≥ p: stage r holds p − r"""
    for _ in range(2):
        p = rng.randrange(2, 17)
        _expect_peaks(student, "1f1b", p, rng.randrange(p, 4 * p + 1))


@PEAK.check(points=1, hint="a stage never holds more micro-batches than there are")
def peak_few_micro_batches(student, rng):
    """1F1B with m < p: never more than m"""
    for _ in range(2):
        p = rng.randrange(3, 17)
        _expect_peaks(student, "1f1b", p, rng.randrange(1, p))


@PEAK.check(points=1, hint="interleaved 1F1B warms up longer than plain 1F1B, but each chunk holds only a part of "
                           "the stage")
def peak_interleaved(student, rng):
    """interleaved 1F1B, in stages' worth of activations: more than 1F1B's p − r"""
    for _ in range(2):
        p, m, v = _config(rng, "interleaved", max_p=12)
        _expect_peaks(student, "interleaved", p, m, v)


@PEAK.check(points=1, hidden=True, hint="no special case for small pipelines")
def peak_deep_pipelines(student, rng):
    """up to 32 stages, every schedule"""
    p = rng.randrange(16, 33)
    _expect_peaks(student, "afab", p, rng.randrange(1, 129))
    _expect_peaks(student, "1f1b", p, rng.randrange(1, 129))
    _expect_peaks(student, "interleaved", p, p * rng.randrange(1, 4), rng.randrange(2, 5))


# --- 06.split_backward -----------------------------------------------------------------------------------

SPLIT = exercise("06.split_backward", entry=("run_weight_grad", "run_split_backward"), **TORCH)


def weight_grad_reference(kind: str, lead: list[int], d_in: int, d_out: int, eps: float, seed: int) -> dict:
    """x (lead..., d_in) and the output gradient (lead..., d_out) as `run_weight_grad` draws them; autograd's
    weight (and bias) gradients of an nn.Linear(d_in, d_out), or of an RMSNorm(d_in) with this eps, in float64."""
    import torch
    import torch.nn.functional as F

    g = generator(seed)
    x = torch.randn(*lead, d_in, generator=g).double()
    grad_y = torch.randn(*lead, d_out, generator=g).double()
    if kind == "linear":
        weight = torch.randn(d_out, d_in, dtype=torch.float64, requires_grad=True)  # any value: W does not use it
        bias = torch.randn(d_out, dtype=torch.float64, requires_grad=True)
        F.linear(x, weight, bias).backward(grad_y)
        return {"weight": weight.grad, "bias": bias.grad}
    weight = torch.randn(d_in, dtype=torch.float64, requires_grad=True)
    (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight).backward(grad_y)
    return {"weight": weight.grad}


def _expect_weight_grad(student, rng: random.Random, kind: str, lead: list[int]) -> None:
    d_in = rng.randrange(2, 9)
    d_out = rng.randrange(2, 9) if kind == "linear" else d_in
    while kind == "linear" and d_out == d_in:
        d_out = rng.randrange(2, 9)
    eps = rng.choice([1e-6, round(rng.uniform(0.05, 0.5), 3)])
    seed = rng.randrange(10**6)
    call = f"run_weight_grad({kind!r}, lead={lead}, d_in={d_in}, d_out={d_out}, eps={eps}, seed={seed})"
    got = driver(call, f"the weight gradients of the {kind} layer", student.run_weight_grad, kind, lead, d_in, d_out,
                 eps, seed)
    expected = weight_grad_reference(kind, lead, d_in, d_out, eps, seed)
    rows = math.prod(lead)
    mean = [Mistake(1 / rows, "1/rows", f"a weight serves every one of the {rows} rows (positions): its gradient is "
                                        f"the sum of theirs, not their mean")] if rows > 1 else []
    for name, grad in expected.items():
        expect_equal(got.get(f"{name}_shape"), list(grad.shape), f"{call}: the shape of the {name} gradient")
        expect_allclose(got.get(name), grad.flatten().tolist(), f"{call}: the {name} gradient", mistakes=mean)


@SPLIT.check(points=1, hint="derive the weight and bias gradients of a linear layer: each has the shape of its "
                            "parameter")
def weight_grad_linear(student, rng):
    """Linear's W: the weight gradient (out, in) and the bias gradient, 2-D input"""
    for _ in range(2):
        _expect_weight_grad(student, rng, "linear", [rng.randrange(1, 9)])


@SPLIT.check(points=1, hint="the gain multiplies the normalised input, not x itself")
def weight_grad_rmsnorm(student, rng):
    """RMSNorm's W: the gradient of its scale"""
    for _ in range(2):
        _expect_weight_grad(student, rng, "rmsnorm", [rng.randrange(1, 9)])


@SPLIT.check(points=1, hint="a weight is shared by every position: its gradient sums over every leading dimension of "
                            "the input, not only the first")
def weight_grad_leading_dims(student, rng):
    """(batch, seq, features) inputs: summed over every leading dimension, Linear and RMSNorm"""
    for kind in ("linear", "rmsnorm"):
        _expect_weight_grad(student, rng, kind, [rng.randrange(2, 4), rng.randrange(2, 5)])


STAGE_PARAMS = ("0.weight", "0.bias", "2.weight", "3.weight")  # Linear(d, h), Tanh, RMSNorm(h), Linear(h, d, no bias)


def split_reference(d_model: int, d_hidden: int, lead: list[int], microbatches: int, eps: float, seed: int) -> dict:
    """The stage and micro-batches as `run_split_backward` draws them (every parameter, in order, then every
    input, then every output gradient); autograd over all micro-batches in float64: each input's gradient, and
    the parameter gradients summed over the micro-batches."""
    import torch

    g = generator(seed)
    shapes = [(d_hidden, d_model), (d_hidden,), (d_hidden,), (d_model, d_hidden)]
    params = [(torch.randn(*s, generator=g) / s[-1] ** 0.5).double().requires_grad_() for s in shapes]
    xs = [torch.randn(*lead, d_model, generator=g).double().requires_grad_() for _ in range(microbatches)]
    grad_ys = [torch.randn(*lead, d_model, generator=g).double() for _ in range(microbatches)]
    w1, b1, scale, w2 = params
    for x, grad_y in zip(xs, grad_ys, strict=True):
        h = torch.tanh(x @ w1.T + b1)
        y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * scale) @ w2.T
        y.backward(grad_y)
    return {"input_grads": [x.grad for x in xs], "weight_grads": dict(zip(STAGE_PARAMS, params, strict=True))}


def _zb_ops(rng: random.Random, m: int) -> tuple[list[str], str]:
    """One rank's F/B/W order in a ZB-H1 schedule with m micro-batches: some W's right after their B, some later."""
    from lab.calc.schedules import zb_h1

    p = rng.randrange(2, 2 * m + 1)
    r = rng.randrange(1, p)  # rank 0 runs each W right after its B
    return [str(op) for op in zb_h1(p, m).ops[r]], f"rank {r} of ZB-H1 at p={p}"


def _split(student, rng: random.Random, microbatches: int, ops: list[str], what: str) -> tuple[dict, dict, str]:
    d_model, d_hidden = rng.randrange(2, 7), rng.randrange(3, 9)
    lead = [rng.randrange(1, 4), rng.randrange(1, 4)]
    eps, seed = round(rng.uniform(1e-3, 0.2), 3), rng.randrange(10**6)
    call = (f"run_split_backward(d_model={d_model}, d_hidden={d_hidden}, lead={lead}, eps={eps}, seed={seed}, "
            f"ops={' '.join(ops)}) ({what})")
    got = driver(call, "each micro-batch's input gradient and the parameters' gradients (a .grad must have its "
                       "parameter's shape)", student.run_split_backward, d_model, d_hidden, lead, eps, seed, ops)
    return got, split_reference(d_model, d_hidden, lead, microbatches, eps, seed), call


@SPLIT.check(points=2, hint="B must compute the input gradients only: a call that also fills the parameters' .grad "
                            "does W's work too early")
def split_b_only_input_grads(student, rng):
    """B: the stage's input gradient, and no weight gradient computed or stored"""
    m = rng.randrange(2, 5)
    ops = [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)] + [f"W{i}" for i in range(m)]
    got, expected, call = _split(student, rng, m, ops, "every B before any W")
    grads = got.get("input_grads")
    if not isinstance(grads, list) or len(grads) != m:
        raise CheckFailed(f"{call}: the input gradients returned {grads!r:.120}, expected one list per micro-batch")
    for i, (g, e) in enumerate(zip(grads, expected["input_grads"], strict=True)):
        expect_allclose(g, e.flatten().tolist(), f"{call}: micro-batch {i}'s input gradient")
    computed, changed = got.get("weight_grads_in_b"), got.get("grads_changed_by_b")
    if computed != 0 or changed != []:
        raise CheckFailed(f"{call}: during B, weight gradients computed and parameters whose .grad changed returned "
                          f"{computed!r} and {changed!r}, expected 0 and [] (B leaves the weights to W)")


@SPLIT.check(points=2, hint="the micro-batches' weight gradients add up, in whatever order their W's run")
def split_w_accumulates(student, rng):
    """W after B, in a ZB-H1 rank's order: the accumulated weight gradients equal autograd's"""
    m = rng.randrange(3, 7)
    ops, what = _zb_ops(rng, m)
    got, expected, call = _split(student, rng, m, ops, what)
    weights = got.get("weight_grads") if isinstance(got.get("weight_grads"), dict) else {}
    for name, param in expected["weight_grads"].items():
        expect_allclose(weights.get(name), param.grad.flatten().tolist(),
                        f"{call}: {name}.grad after every W (summed over {m} micro-batches)")


# --- 06.afab_step ----------------------------------------------------------------------------------------

AFAB = exercise("06.afab_step", entry=("run_afab",), **RANKS)


def afab_reference(world: int, d: int, layers: int, batch: int, seed: int) -> dict:
    """Every stage's weights, then the batch, as `run_afab` draws them; the whole model on the whole batch in
    float64: the loss (mean squared error) and each stage's parameter gradients, in `stage.parameters()` order."""
    import torch

    g = generator(seed)
    stages = [[(torch.randn(d, d, generator=g) / d**0.5).double().requires_grad_(),
               (torch.randn(d, generator=g) / d**0.5).double().requires_grad_()] for _ in range(world * layers)]
    x = torch.randn(batch, d, generator=g).double()
    target = torch.randn(batch, d, generator=g).double()
    for weight, bias in stages:
        x = torch.tanh(x @ weight.T + bias)
    loss = (x - target).pow(2).mean()
    loss.backward()
    return {"loss": loss.item(),
            "grads": [[t.grad.flatten().tolist() for layer in stages[s * layers:(s + 1) * layers] for t in layer]
                      for s in range(world)]}


RANK_DEADLINE_S = 6  # a right step takes well under a second: ranks still waiting after this are stopped
HANG_HINT = ("a rank waited forever: the message says which rank waited in which send or receive. Every send needs "
             "the receive its neighbour posts at that point; two neighbours that both send first (a blocking "
             "dist.send) wait for each other — post the pair together (dist.batch_isend_irecv) and then wait")


def _rank_failure(error: CallError, call: str) -> CheckFailed:
    """A pipeline's ranks that raised as a failed check. One that hung (gloo's timeout, or the deadline) says which
    rank waited in which operation, from the flight recorder's "collectives:" lines the sandbox keeps."""
    first, _, diagnosis = error.message.partition("\n")
    if error.not_attempted or not (diagnosis or "timed out" in first.lower()):
        return explain(error, call, "every rank to finish")
    waits = where_ranks_waited(error) or "not recorded"
    return CheckFailed(f"{call} hung — {waits} — and raised {first[:200]}, expected every rank to finish", HANG_HINT)


def _pipeline(student, rng: random.Random, name: str, world: int, m: int) -> tuple[list[dict], dict, str]:
    """`name` (run_afab or run_one_f_one_b) on `world` ranks with m micro-batches of a model drawn from rng."""
    d, layers, per_micro_batch = rng.randrange(2, 7), rng.randrange(1, 3), rng.randrange(1, 4)
    batch, seed = m * per_micro_batch, rng.randrange(10**6)
    call = f"{name}(d={d}, layers={layers}, batch={batch}, microbatches={m}, seed={seed}) on {world} ranks"
    try:
        results = student.ranks(name, world, d, layers, batch, m, seed, deadline_s=RANK_DEADLINE_S)
    except CallError as error:
        raise _rank_failure(error, call) from None
    run = {"d": d, "layers": layers, "batch": batch, "m": m, "world": world, "seed": seed}
    return per_rank(results, world, call), run, call


def _expect_one_process(student, rng: random.Random, name: str, world: int, m: int) -> None:
    """The pipeline's loss and every rank's gradients equal `afab_reference`'s: the whole model, one process."""
    results, run, call = _pipeline(student, rng, name, world, m)
    expected = afab_reference(world, run["d"], run["layers"], run["batch"], run["seed"])
    share = [Mistake(m, "m", "the batch's loss is the mean of the m micro-batches' losses: divide each by m before "
                             "its backward"),
             Mistake(1 / m, "1/m", "each micro-batch's loss was divided by m twice (or its gradient again after)")]
    for rank, got in enumerate(results):
        if rank == world - 1:
            expect_number(got.get("loss"), expected["loss"], f"{call}: the last stage's loss", tol=1e-5,
                          mistakes=share)
        elif got.get("loss") is not None:
            raise CheckFailed(f"{call}: rank {rank}'s loss returned {got.get('loss')!r}, expected None (only the "
                              "last stage computes it)")
        grads = got.get("grads")
        if not isinstance(grads, list) or len(grads) != len(expected["grads"][rank]):
            raise CheckFailed(f"{call}: rank {rank}'s gradients returned {grads!r:.120}, expected "
                              f"{len(expected['grads'][rank])} parameters'")
        for index, (g, e) in enumerate(zip(grads, expected["grads"][rank], strict=True)):
            expect_allclose(g, e, f"{call}: rank {rank}'s parameter {index} gradient", mistakes=share)


@AFAB.check(points=2, hint="each stage talks only to its neighbours: activations go forward, their gradients come "
                           "back, and the batch's loss is a mean over micro-batches")
def afab_two_stages(student, rng):
    """2 stages: the loss and every stage's gradients equal one process's"""
    _expect_one_process(student, rng, "run_afab", 2, rng.randrange(2, 5))


@AFAB.check(points=2, hint="a middle stage receives from rank − 1 and sends to rank + 1 going forward, and the "
                           "other way going back; the received activation must require grad so that its gradient "
                           "exists to send back")
def afab_more_stages(student, rng):
    """3 and 4 stages, fewer and more micro-batches than stages"""
    _expect_one_process(student, rng, "run_afab", 3, rng.randrange(2, 6))
    _expect_one_process(student, rng, "run_afab", 4, rng.choice([rng.randrange(2, 4), rng.randrange(5, 7)]))


@AFAB.check(points=1, hint="only dist.send/dist.recv (or isend/irecv) to a neighbour: one activation per micro-batch "
                           "forward across each boundary, one gradient back — no collective, not even for the loss")
def afab_point_to_point(student, rng):
    """point-to-point only: m activations forward and m gradients back across each boundary"""
    _expect_point_to_point(student, rng, "run_afab", rng.choice([3, 4]), rng.randrange(2, 5))


def _expect_point_to_point(student, rng: random.Random, name: str, world: int, m: int) -> None:
    """Only sends and receives between neighbours: m activations forward and m gradients back per boundary."""
    results, run, call = _pipeline(student, rng, name, world, m)
    message = run["batch"] // m * run["d"] * 4  # one micro-batch's activations (or their gradient), float32
    for rank, got in enumerate(results):
        sends = (rank < world - 1) * m + (rank > 0) * m
        expect_equal(point_to_point_sent(got, rank, call), [sends, sends * message],
                     f"{call}: rank {rank}'s [messages sent, bytes sent] (one micro-batch is {message} bytes)")


# --- 06.one_f_one_b_ranks --------------------------------------------------------------------------------

ONE_F_ONE_B = exercise("06.one_f_one_b_ranks", entry=("run_one_f_one_b",), requires=("06.afab_step",), **RANKS)


@ONE_F_ONE_B.check(points=2, hint="1F1B on a stage: a warm-up whose length depends on the stage, a steady state that "
                                  "alternates, a cool-down; the backward in each pair is of the oldest micro-batch "
                                  "held")
def one_f_one_b_two_stages(student, rng):
    """2 stages, more micro-batches than stages: the loss and both stages' gradients equal one process's"""
    _expect_one_process(student, rng, "run_one_f_one_b", 2, rng.randrange(3, 6))


@ONE_F_ONE_B.check(points=2, hint="a middle stage receives its input from rank − 1 and its output's gradient from rank "
                                  "+ 1; with m < p the warm-up is cut short by the number of micro-batches, and the "
                                  "steady state may be empty")
def one_f_one_b_three_stages(student, rng):
    """3 stages, fewer and more micro-batches than stages"""
    _expect_one_process(student, rng, "run_one_f_one_b", 3, 1)  # stage 0's warm-up would be 2 forwards: only 1
    _expect_one_process(student, rng, "run_one_f_one_b", 3, rng.randrange(4, 7))


@ONE_F_ONE_B.check(points=2, hint="count the micro-batches a stage has forwarded but not yet begun to backward: they "
                                  "pile up during the warm-up and the steady state's first forward, until the first "
                                  "backward frees one — one forward too many shows here")
def one_f_one_b_peak(student, rng):
    """the most micro-batches in flight on stage r (forwarded, backward not begun) is p − r"""
    world, m = 3, rng.randrange(4, 7)
    results, _, call = _pipeline(student, rng, "run_one_f_one_b", world, m)
    expect_equal([got.get("peak_in_flight") for got in results], [min(world - r, m) for r in range(world)],
                 f"{call}: the most micro-batches in flight on each rank (forwarded, their backward not begun)")


@ONE_F_ONE_B.check(points=1, hint="only isend/irecv (batched) or send/recv between neighbours: one activation per "
                                  "micro-batch forward across each boundary, one gradient back — no collective, not "
                                  "even for the loss")
def one_f_one_b_point_to_point(student, rng):
    """1F1B's messages: point-to-point only, one activation forward and one gradient back per micro-batch"""
    _expect_point_to_point(student, rng, "run_one_f_one_b", 3, rng.randrange(2, 6))



# --- 06.problems -----------------------------------------------------------------------------------------------
# Back-of-envelope problems: plain Python in the sandbox (no lab.calc there), compared with lab.calc — the
# simulator's measurements where it has them — to 1%.

PROBLEMS = exercise("06.problems", entry=(
    "idle_fraction", "min_microbatches", "min_microbatches_interleaved", "interleaved_messages", "zb_h1_idle",
    "activation_bytes_saved", "boundary_bytes_per_step", "tp_over_pp_bytes", "step_seconds", "first_stage_bytes"))
TOLERANCE = 0.01
ONE_DIRECTION = Mistake(0.5, "one direction", "each activation's gradient comes back across the boundary too")


def _target(rng: random.Random, p: int, v: int = 1) -> float:
    """A bubble-ratio target whose (p − 1)/(v·target) is not within rounding of an integer (ceil stays exact)."""
    while True:
        target = round(rng.uniform(0.01, 0.3), 4)
        ratio = (p - 1) / (v * target)
        if abs(ratio - round(ratio)) > 1e-6:
            return target


@PROBLEMS.check(points=1, hint="idle over the whole step, not over the useful time: count the slots of a step and the "
                               "ones a rank spends idle")
def p1_idle_fraction(student, rng):
    """P1 — the share of a 1F1B step each GPU idles: (p − 1)/(m + p − 1)"""
    from lab.calc.bubble import explore

    for _ in range(2):
        p, m = rng.randrange(2, 33), rng.randrange(1, 257)
        expect_close(student.idle_fraction(p, m), explore("1f1b", p, m).idle_fraction, f"idle_fraction({p}, {m})",
                     TOLERANCE)


@PROBLEMS.check(points=1, hint="the smallest whole m that meets the target: one fewer must miss it")
def p2_min_microbatches(student, rng):
    """P2 — the fewest micro-batches for a 1F1B bubble ratio at most a target"""
    from lab.calc.bubble import min_microbatches

    for _ in range(2):
        p = rng.randrange(2, 33)
        target = _target(rng, p)
        expect_equal(student.min_microbatches(p, target), min_microbatches(p, target),
                     f"min_microbatches({p}, {target})")


@PROBLEMS.check(points=1, hint="interleaving shrinks the bubble; and Megatron's interleaved order constrains which m "
                               "are allowed")
def p3_min_microbatches_interleaved(student, rng):
    """P3 — the same with v chunks per rank (interleaved 1F1B): fewer micro-batches, in multiples of p"""
    from lab.calc.bubble import min_microbatches

    for _ in range(2):
        p, v = rng.randrange(2, 17), rng.randrange(2, 9)
        target = _target(rng, p, v)
        expect_equal(student.min_microbatches_interleaved(p, v, target), min_microbatches(p, target, v),
                     f"min_microbatches_interleaved({p}, {v}, {target})")


@PROBLEMS.check(points=1, hint="a micro-batch crosses v·p − 1 boundaries between virtual stages going forward, and "
                               "as many coming back — each one a message between two ranks")
def p4_interleaved_messages(student, rng):
    """P4 — interleaving's price: point-to-point messages per step, 2·m·(v·p − 1)"""
    from lab.calc.bubble import explore

    for _ in range(2):
        p, v = rng.randrange(2, 9), rng.randrange(2, 5)
        m = p * rng.randrange(1, 5)
        expect_close(student.interleaved_messages(p, m, v), explore("interleaved", p, m, v).p2p_messages,
                     f"interleaved_messages({p}, {m}, {v})", TOLERANCE, [ONE_DIRECTION])


@PROBLEMS.check(points=1, hint="ZB-H1 keeps 1F1B's bubble slots but fills part of each with deferred weight-gradient "
                               "work")
def p5_zb_h1_idle(student, rng):
    """P5 — ZB-H1's idle time per rank, in the paper's regime (m ≥ p, t_w ≤ t_f, 2·t_w ≤ t_b)"""
    from lab.calc.bubble import explore

    for _ in range(2):
        p = rng.randrange(2, 17)
        tf, tb, tw = _costs(rng)
        simulated = max(explore("zb-h1", p, rng.randrange(p, 3 * p + 1), tf=tf, tb=tb, tw=tw).idle)
        expect_close(student.zb_h1_idle(p, tf, tb, tw), simulated, f"zb_h1_idle({p}, {tf}, {tb}, {tw})", TOLERANCE)


@PROBLEMS.check(points=1, hint="compare how many micro-batches' activations each schedule holds at its peak on the "
                               "stage")
def p6_activation_bytes_saved(student, rng):
    """P6 — what 1F1B saves on stage r against AFAB: (m − min(m, p − r)) micro-batches' activations"""
    from lab.calc.bubble import explore

    for _ in range(2):
        p = rng.randrange(2, 17)
        m, r, nbytes = rng.randrange(p, 65), rng.randrange(p), rng.randrange(10**8, 10**10)
        afab, one_f_one_b = explore("afab", p, m), explore("1f1b", p, m)
        expected = (afab.peak_activations[r] - one_f_one_b.peak_activations[r]) * nbytes
        expect_close(student.activation_bytes_saved(p, m, r, nbytes), expected,
                     f"activation_bytes_saved({p}, {m}, {r}, {nbytes})", TOLERANCE)


@PROBLEMS.check(points=1, hint="a stage boundary carries one activation forward and one gradient back per "
                               "micro-batch, whatever the layers")
def p7_boundary_bytes(student, rng):
    """P7 — bytes across one pipeline boundary per step: 2·m·b·s·h·2 (bf16, both ways)"""
    from lab.calc.bubble import boundary_bytes

    for _ in range(2):
        b, s, h = rng.randrange(1, 9), rng.choice([2048, 4096, 8192]), rng.choice([4096, 8192, 16384])
        m = rng.randrange(4, 65)
        expect_close(student.boundary_bytes_per_step(b, s, h, m), 2 * m * boundary_bytes(b, s, h),
                     f"boundary_bytes_per_step({b}, {s}, {h}, {m})", TOLERANCE,
                     [ONE_DIRECTION, Mistake(2, "fp32", "bf16 activations are 2 bytes each, not 4")])


@PROBLEMS.check(points=1, hint="Megatron TP all-reduces the (b, s, h) activations twice per layer forward and twice "
                               "backward, each sending 2(t − 1)/t of them per GPU; a pipeline stage sends one "
                               "forward and one back for all its layers")
def p8_tp_over_pp_bytes(student, rng):
    """P8 — TP's bytes per GPU over PP's for one stage's L layers: 4·L·(t − 1)/t"""
    from lab.calc.bubble import boundary_bytes
    from lab.calc.comms import collective_time
    from lab.calc.network import Link

    link = Link("problem", 1.0, 0.0, "grader")  # bytes only: the link does not matter
    for _ in range(2):
        layers, tp = rng.randrange(1, 33), rng.choice([2, 4, 8])
        message = boundary_bytes(1, 4096, 8192)  # any (b, s, h): the ratio does not depend on it
        tp_bytes = 4 * layers * collective_time("all_reduce", message, tp, link).bytes_sent_per_rank
        expect_close(student.tp_over_pp_bytes(layers, tp), tp_bytes / (2 * message),
                     f"tp_over_pp_bytes({layers}, {tp})", TOLERANCE,
                     [Mistake(tp / (tp - 1), "(t−1)/t left out", "a ring all-reduce sends 2(t − 1)/t of the "
                                                                 "tensor per GPU, not 2")])


@PROBLEMS.check(points=1, hint="find the micro-batches per replica first, then the length of a 1F1B step")
def p9_step_seconds(student, rng):
    """P9 — a 1F1B step in seconds, from the global batch: m = B/(b·dp), then (m + p − 1)(t_f + t_b)"""
    from lab.calc.bubble import explore

    for _ in range(2):
        p, dp, micro = rng.randrange(2, 17), rng.choice([2, 4, 8, 16]), rng.choice([1, 2, 4])
        global_batch = dp * micro * rng.randrange(1, 65)
        tf = round(rng.uniform(0.01, 0.2), 4)
        tb = round(2 * tf * rng.uniform(0.9, 1.2), 4)
        m = global_batch // (dp * micro)
        expected = explore("1f1b", p, m, tf=tf, tb=tb, tw=0.0).makespan
        expect_close(student.step_seconds(global_batch, micro, dp, p, tf, tb), expected,
                     f"step_seconds({global_batch}, {micro}, {dp}, {p}, {tf}, {tb})", TOLERANCE)


@PROBLEMS.check(points=1, hint="the first stage's memory: model states for its share of the parameters, plus the "
                               "activations 1F1B holds there at its peak")
def p10_first_stage_bytes(student, rng):
    """P10 — the first stage's memory with 1F1B: 16·N/p + min(m, p)·(L/p)·A"""
    from lab.calc.bubble import explore
    from lab.calc.memory import bytes_per_param

    for _ in range(2):
        p = rng.choice([2, 4, 8, 16])
        layers = p * rng.randrange(1, 9)
        params, m = rng.randrange(10**9, 10**11), rng.randrange(2, 65)
        per_layer = rng.randrange(10**8, 2 * 10**9)  # one micro-batch's activations through one layer
        held = explore("1f1b", p, m).peak_activations[0]
        expected = bytes_per_param("mixed") * params / p + held * layers / p * per_layer
        expect_close(student.first_stage_bytes(params, layers, p, m, per_layer), expected,
                     f"first_stage_bytes({params}, {layers}, {p}, {m}, {per_layer})", TOLERANCE)
