"""Chapter 03, data parallelism and ZeRO. The student's classes train a tiny model on real gloo ranks.

Each multi-rank exercise cell ends with a given driver (`train_bucketed`, `train_zero1`, `train_zero2`,
`train_zero3`, `train_zero3_prefetch`) that
builds a small `lab.model` from the config a check sends, trains it for a few steps with the student's class on
this rank's rows of each global batch, and reports plain numbers: per-step losses, three-number fingerprints of
every gradient and parameter, collective calls and bytes, bytes held. The checks here run the same steps in
one process on the whole batch (`lab.model`, `lab.parallel.dp`) and compare, after every step and on every
rank; bucket sizes, shard sizes and bytes come from `lab.parallel.dp.BucketedDP` and
`lab.calc.memory.static_bytes`. A second DP driver (`grads_with_unused_layer`) runs one backward through two
Linear layers of which the forward uses one: a bucket that backward never completes must still be averaged.
ZeRO-2's driver also reports each rank's gradient shards right after backward (compared with the slices of the
whole batch's flat gradient, `reference(shards=dp)`) and the gradient bytes it holds then; the prefetch driver
returns a trace of each step — which block's shard is all-gathered, async or not, when each async handle is
waited on, when each block's forward starts — and hands the gathered values over only at the wait, so that a
prefetch never waited on computes with NaN weights instead of racing.
A gradient, norm or SGD update that is exactly dp (or 1/dp) times the reference is named as the mistake
behind it. Configs are random and awkward: odd widths, so that no block's parameter count
divides by 2 or 3 and every shard ends in padding. The DP and ZeRO-3 drivers take plain SGD steps, so that a
gradient off by a factor of dp shows in the parameters (AdamW would normalise it away); ZeRO-1, whose point is
the optimizer's states, uses AdamW and also reports the global gradient norm.

The worked problems (`03.problems`) are plain Python of random numbers in the sandbox (no lab.calc there),
compared with `lab.calc.memory`, `lab.calc.comms` and `lab.calc.zero` within 1%.

torch is imported inside the functions: `lab.check` of other chapters loads this module too.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence

from lab.calc.comms import collective_time, dp_critical_batch, zero3_overlap_ratio
from lab.calc.memory import bytes_per_param, static_bytes
from lab.calc.network import Link
from lab.calc.zero import zero3_param_bytes
from lab.config import ModelConfig
from lab.grading.checks import (
    CheckFailed,
    Mistake,
    describe,
    exercise,
    expect_allclose,
    expect_close,
    expect_equal,
    expect_number,
    per_rank,
    recognise,
    shown,
)

RANKS = {"modules": ("lab.config", "lab.model", "lab.loss", "lab.distributed"), "packages": ("tomli_w", "torch"),
         "memory_mb": 4096}
SEQ_LEN = 8


def random_config(rng: random.Random) -> ModelConfig:
    """Two blocks of a tiny decoder whose blocks' parameter counts divide by neither 2 nor 3."""
    while True:
        n_heads = rng.choice([2, 4])
        cfg = ModelConfig(name="random", vocab_size=rng.randrange(31, 97), d_model=rng.randrange(17, 41, 2),
                          n_layers=2, n_heads=n_heads, n_kv_heads=rng.choice([d for d in (1, 2) if n_heads % d == 0]),
                          head_dim=rng.choice([4, 6, 8]), d_ff=rng.randrange(21, 61, 2), max_seq_len=64)
        if block_numel(cfg) % 2 and block_numel(cfg) % 3 and total_numel(cfg) % 2 and total_numel(cfg) % 3:
            return cfg


def block_numel(cfg: ModelConfig) -> int:
    d = cfg.d_model
    return 2 * d + 2 * d * cfg.head_dim * (cfg.n_heads + cfg.n_kv_heads) + 3 * d * cfg.d_ff


def total_numel(cfg: ModelConfig) -> int:
    return cfg.n_layers * block_numel(cfg) + 2 * cfg.vocab_size * cfg.d_model + cfg.d_model


def model_numels(cfg: ModelConfig) -> tuple[int, int]:
    """(parameters of the model, of one block), counted by `lab.model` on the meta device."""
    from lab.model import build_model, num_params

    model = build_model(cfg)
    return num_params(model), num_params(model.layers["0"])


# --- the single-process reference: the same helpers as the notebook's drivers --------------------------------

def tokens_for(cfg: ModelConfig, seed: int, step: int, global_batch: int):
    import torch

    generator = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randint(cfg.vocab_size, (global_batch, SEQ_LEN + 1), generator=generator)


def lm_loss(model, rows):
    import torch.nn.functional as F

    return F.cross_entropy(model(rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten())


def fingerprint(t) -> list[float]:
    import torch

    t = t.detach().double().flatten()
    ramp = torch.linspace(-1.0, 1.0, t.numel(), dtype=torch.float64)
    return [t.sum().item(), t.square().sum().item(), (t * ramp).sum().item()]


def zero_units(model) -> list[list]:
    """The parameters of each ZeRO unit, as the drivers make them: each block, then the rest (the root)."""
    root = [p for name, p in model.named_parameters() if not name.startswith("layers.")]
    return [list(block.parameters()) for block in model.layers.values()] + [root]


def shard_fingerprints(params: list, dp: int) -> list[list[float]]:
    """Each of dp ranks' shard of the gradients of `params` laid flat and padded to dp·ceil(numel/dp)."""
    import torch

    flat = torch.cat([p.grad.detach().flatten() for p in params])
    shard = -(-flat.numel() // dp)
    flat = torch.cat([flat, flat.new_zeros(shard * dp - flat.numel())])
    return [fingerprint(part) for part in flat.split(shard)]


def reference(cfg: ModelConfig, seed: int, steps: int, global_batch: int, lr: float, weight_decay: float = 0.0,
              optimizer: str = "sgd", shards: int = 0) -> dict:
    """One process, the whole global batch in one backward pass: per-step loss, gradient and parameter
    fingerprints, and the global gradient norm; with `shards` = dp, also each rank's shard of each ZeRO unit's
    flat gradient (`grad_shards[step][unit][rank]`). AdamW has lab.train's betas and eps and decays every
    parameter, norms included, as the exercise's optimizer over one flat shard must (`lab.parallel.optim.adamw`
    would spare the norms)."""
    import torch

    from lab.model import build_model, materialize
    from lab.parallel.optim import BETAS, EPS

    model = materialize(build_model(cfg), seed=seed)
    params = list(model.parameters())
    adam = (torch.optim.AdamW(params, lr=lr, betas=BETAS, eps=EPS, weight_decay=weight_decay)
            if optimizer == "adamw" else None)
    out = {"names": [n for n, _ in model.named_parameters()], "numels": [p.numel() for p in params],
           "losses": [], "grads": [], "params": [], "grad_norms": [], "params0": [fingerprint(p) for p in params],
           "grad_shards": []}
    for step in range(steps):
        loss = lm_loss(model, tokens_for(cfg, seed, step, global_batch))
        loss.backward()
        out["losses"].append(loss.item())
        out["grads"].append([fingerprint(p.grad) for p in params])
        if shards:
            out["grad_shards"].append([shard_fingerprints(unit, shards) for unit in zero_units(model)])
        out["grad_norms"].append(math.sqrt(sum(p.grad.double().square().sum().item() for p in params)))
        with torch.no_grad():
            if adam is not None:
                adam.step()
            else:
                for p in params:
                    p -= lr * p.grad
        model.zero_grad(set_to_none=True)
        out["params"].append([fingerprint(p) for p in params])
    return out


def reference_bucket_sizes(cfg: ModelConfig, bucket_mb: float) -> list[int]:
    """Bytes of each bucket, in all-reduce order, by `lab.parallel.dp.BucketedDP` (torch DDP's rule)."""
    from lab.model import build_model, materialize
    from lab.parallel.dp import BucketedDP

    return BucketedDP(materialize(build_model(cfg)), None, bucket_mb).bucket_sizes


def _close(got, want: float, scale: float, rel: float) -> bool:
    return isinstance(got, (int, float)) and not isinstance(got, bool) and abs(got - want) <= rel * scale + 1e-12


def _linear(fp: list, prev: list | None) -> list[float]:
    """The parts of a fingerprint that scale with the tensor: (sum, √sum of squares, ramp-weighted sum) of a
    gradient; (sum, ramp-weighted sum) of a parameter's SGD update from `prev`."""
    if prev is None:
        return [fp[0], math.sqrt(max(fp[1], 0.0)), fp[2]]
    return [fp[0] - prev[0], fp[2] - prev[2]]


def _expect_fingerprints(got, want: list, numel: int, what: str, rel: float, mistakes: Sequence[Mistake] = (),
                         prev: list | None = None) -> None:
    """Sums and ramp-weighted sums within rel·‖t‖·√numel (their largest possible size), squares within rel·‖t‖².
    A gradient (or, from `prev`, an SGD update) off by one of `mistakes`' factors says which."""
    norm_sq = max(want[1], 0.0)
    scales = [math.sqrt(norm_sq * numel), norm_sq, math.sqrt(norm_sq * numel)]
    if not (isinstance(got, list) and len(got) == 3 and all(map(_close, got, want, scales, [rel] * 3))):
        usable = isinstance(got, list) and len(got) == 3 and all(isinstance(g, (int, float)) for g in got)
        # an update is a small difference of float32 values: its ratio is known to about 1e-2
        note, hint = recognise(_linear(got, prev), _linear(want, prev), mistakes, 1e-5 if prev is None else 2e-2) \
            if usable else ("", None)
        if note and prev is not None:
            note = note.replace("the expected values", "the expected update")
        raise CheckFailed(f"{what} returned {shown(got)}, expected {shown(want)} (fingerprint: sum, sum of "
                          f"squares, ramp-weighted sum){note}", hint)


def expect_parity(results: list, ref: dict, keys: tuple[str, ...], what: str, rel: float,
                  mistakes: Sequence[Mistake] = (), sgd: bool = False) -> None:
    """Every rank's per-step losses and fingerprints (`keys`: "grads", "params") match the reference; a
    gradient, gradient norm or (with `sgd`, whose update is -lr times the gradient) parameter update off by
    one of `mistakes`' factors says which."""
    for rank, got in enumerate(results):
        if not isinstance(got, dict):
            raise CheckFailed(f"{what}: rank {rank} returned {type(got).__name__}, expected the driver's dict")
        for step, want in enumerate(ref["losses"]):
            losses = got.get("losses") or []
            loss = losses[step] if len(losses) > step else None
            if not _close(loss, want, abs(want), rel):
                raise CheckFailed(f"{what}: rank {rank}, the loss of step {step + 1} returned {shown(loss)}, "
                                  f"expected {shown(want)}")
            norms = got.get("grad_norms")
            if norms is not None:
                norm = norms[step] if isinstance(norms, list) and len(norms) > step else None
                if not _close(norm, ref["grad_norms"][step], ref["grad_norms"][step], rel):
                    note, hint = recognise([norm], [ref["grad_norms"][step]], mistakes)
                    raise CheckFailed(f"{what}: rank {rank}, global gradient norm of step {step + 1} returned "
                                      f"{shown(norm)}, expected {shown(ref['grad_norms'][step])}{note}", hint)
            for key in keys:
                rows = got.get(key) or []
                row = rows[step] if len(rows) > step and isinstance(rows[step], list) else []
                before = ref["params"][step - 1] if step else ref["params0"]
                for index, (name, numel) in enumerate(zip(ref["names"], ref["numels"], strict=True)):
                    label = "gradient" if key == "grads" else "value"
                    prev = before[index] if key == "params" else None
                    _expect_fingerprints(row[index] if index < len(row) else None, ref[key][step][index], numel,
                                         f"{what}: rank {rank}, after step {step + 1} the {label} of {name}", rel,
                                         mistakes if key == "grads" or sgd else (), prev)


def _summed(dp: int, where: str) -> list[Mistake]:
    """The two classic ways to get dp ranks' mean wrong, for `recognise`."""
    return [Mistake(dp, "dp", f"the ranks' gradients were summed, not averaged: divide {where} by dp"),
            Mistake(1 / dp, "1/dp", f"the average was divided by dp once too often: divide {where} by dp once")]


def _batch(rng: random.Random, dp: int, grad_accum: int = 1) -> int:
    return dp * grad_accum * rng.randrange(1, 3)


# --- 03.bucketed_dp -----------------------------------------------------------------------------------------

BUCKETED = exercise("03.bucketed_dp", entry=("train_bucketed", "grads_with_unused_layer"), **RANKS)
SGD_LR = 0.5


def _bucketed(student, rng: random.Random, dp: int, grad_accum: int, steps: int = 3) -> tuple[list, dict]:
    cfg, seed = random_config(rng), rng.randrange(10**6)
    batch, bucket_mb = _batch(rng, dp, grad_accum), rng.uniform(0.004, 0.02)
    call = f"train_bucketed({describe(cfg)}, seed={seed}, steps={steps}, global_batch={batch}, " \
           f"grad_accum={grad_accum}, bucket_mb={bucket_mb:.4f}) on {dp} ranks"
    results = student.ranks("train_bucketed", dp, cfg, seed, steps, batch, grad_accum, bucket_mb, SGD_LR)
    return results, {"cfg": cfg, "seed": seed, "batch": batch, "bucket_mb": bucket_mb, "call": call,
                     "steps": steps}


def _bucketed_parity(student, rng: random.Random, dp: int, grad_accum: int) -> None:
    results, run = _bucketed(student, rng, dp, grad_accum)
    ref = reference(run["cfg"], run["seed"], run["steps"], run["batch"], SGD_LR)
    expect_parity(results, ref, ("grads", "params"), run["call"], rel=1e-5,
                  mistakes=_summed(dp, "each bucket's buffer"), sgd=True)


@BUCKETED.check(points=2, hint="each rank's gradient is a mean over its own rows; what the ranks must agree on is "
                               "the mean over all of them")
def parity_two_ranks(student, rng):
    """dp=2: the same losses, gradients and parameters as one process after every step"""
    _bucketed_parity(student, rng, 2, 1)


@BUCKETED.check(points=2, hint="inside no_sync() the gradients only add up in the buckets; the last micro-batch's "
                               "backward sends their sum once")
def parity_three_ranks_accumulation(student, rng):
    """dp=3 with gradient accumulation: the same as one process after every step"""
    _bucketed_parity(student, rng, 3, rng.choice([2, 3]))


def _all_reduces(results: list, run: dict) -> list:
    first = results[0] if results and isinstance(results[0], dict) else {}
    steps = first.get("all_reduces")
    if not isinstance(steps, list) or len(steps) != run["steps"]:
        raise CheckFailed(f"{run['call']}: rank 0 returned all_reduces={steps!r}, expected one entry per step")
    return steps


@BUCKETED.check(points=1, hint="the buckets must follow the order in which backward produces gradients, and a "
                               "bucket's size rule is in the statement")
def buckets(student, rng):
    """buckets as torch DDP sizes them, one all-reduce per bucket per step"""
    results, run = _bucketed(student, rng, rng.choice([2, 3]), 1, steps=2)
    sizes = reference_bucket_sizes(run["cfg"], run["bucket_mb"])
    expect_equal(results[0].get("bucket_sizes") if isinstance(results[0], dict) else None, sizes,
                 f"{run['call']}: bucket_sizes")
    for step, entry in enumerate(_all_reduces(results, run), start=1):
        calls = sum(c for c, _ in entry["per_backward"]) + entry["finish"][0]
        sent = sum(b for _, b in entry["per_backward"]) + entry["finish"][1]
        expect_equal([calls, sent], [len(sizes), sum(sizes)], f"{run['call']}: step {step}, [all_reduce calls, bytes]")


@BUCKETED.check(points=1, hint="inside no_sync() the gradients only add up: a micro-batch's backward there must "
                               "neither send a bucket nor count it as complete, so that the last micro-batch's "
                               "backward is the one that completes every bucket")
def no_sync(student, rng):
    """no all-reduce inside no_sync(): one per bucket, during the last micro-batch's backward"""
    grad_accum = rng.choice([2, 3])
    results, run = _bucketed(student, rng, 2, grad_accum, steps=2)
    n_buckets = len(reference_bucket_sizes(run["cfg"], run["bucket_mb"]))
    for step, entry in enumerate(_all_reduces(results, run), start=1):
        calls = [c for c, _ in entry["per_backward"]] + [entry["finish"][0]]
        expect_equal(sum(calls[:-2]), 0, f"{run['call']}: step {step}, all_reduce calls in the {grad_accum - 1} "
                                         f"micro-batches under no_sync()")
        expect_equal(calls[-2:], [n_buckets, 0], f"{run['call']}: step {step}, all_reduce calls [during the last "
                                                 f"micro-batch's backward, in finish()]")


@BUCKETED.check(points=1, hint="an all-reduce that waits for finish() overlaps nothing: each bucket must be on its "
                               "way, without blocking backward, as soon as its last gradient is in, leaving finish() "
                               "only the waiting")
def overlap(student, rng):
    """every all-reduce starts during backward (overlapped), none in finish()"""
    results, run = _bucketed(student, rng, rng.choice([2, 3]), 1, steps=2)
    n_buckets = len(reference_bucket_sizes(run["cfg"], run["bucket_mb"]))
    for step, entry in enumerate(_all_reduces(results, run), start=1):
        expect_equal([entry["per_backward"][-1][0], entry["finish"][0]], [n_buckets, 0],
                     f"{run['call']}: step {step}, all_reduce calls [during backward, in finish()]")


def unused_layer_reference(seed: int, dp: int) -> tuple[list[str], list[list[float]], list[int]]:
    """The model of the notebook's `grads_with_unused_layer` (its `unused_layer_model`), each rank's rows through
    the used layer only: (parameter names, their gradients averaged over the dp ranks, their sizes)."""
    import torch
    from torch import nn

    with torch.random.fork_rng():  # the notebook draws the weights from the global generator
        torch.manual_seed(seed)
        model = nn.ModuleDict({"used": nn.Linear(6, 5), "unused": nn.Linear(6, 5)})
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    for rank in range(dp):
        rows = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed * 100 + rank))
        model.zero_grad()
        model["used"](rows).square().mean().backward()
        for t, p in zip(total, params, strict=True):
            t += 0 if p.grad is None else p.grad.detach()
    names = [n for n, _ in model.named_parameters()]
    return names, [(t / dp).flatten().tolist() for t in total], [p.numel() for p in params]


def _bucket_count(numels: list[int], bucket_mb: float) -> int:
    """Buckets of `numels` (in parameter order) filled in reverse up to at least bucket_mb MiB of fp32 each."""
    cap, count, held = int(bucket_mb * 2**20) // 4, 0, 0
    for numel in reversed(numels):
        held += numel
        if held >= cap:
            count, held = count + 1, 0
    return count + (held > 0)


@BUCKETED.check(points=1, hint="a parameter that got no gradient leaves its bucket incomplete, so backward never sends "
                               "it: the replicas drift apart unless that bucket is still averaged before the step")
def unused_layer(student, rng):
    """a layer the forward skips: finish() still averages its bucket, once"""
    dp, seed, bucket_mb = rng.choice([2, 3]), rng.randrange(10**6), round(rng.uniform(2e-4, 2e-3), 5)
    call = f"grads_with_unused_layer(seed={seed}, bucket_mb={bucket_mb}) on {dp} ranks"
    results = per_rank(student.ranks("grads_with_unused_layer", dp, seed, bucket_mb), dp, call)
    names, expected, numels = unused_layer_reference(seed, dp)
    for rank, got in enumerate(results):
        grads = got.get("grads")
        if not isinstance(grads, list) or len(grads) != len(expected):
            raise CheckFailed(f"{call}: rank {rank}'s gradients returned {grads!r:.120}, expected {len(expected)}")
        for name, g, e in zip(names, grads, expected, strict=True):
            expect_allclose(g, e, f"{call}: rank {rank}'s gradient of {name} after finish() (averaged over the "
                                  f"ranks; zero for the unused layer)", tol=1e-5, mistakes=_summed(dp, "the bucket"))
    expect_equal(results[0].get("all_reduces"), _bucket_count(numels, bucket_mb),
                 f"{call}: all_reduce calls (one per bucket)")


# --- 03.zero1 -----------------------------------------------------------------------------------------------

ZERO1 = exercise("03.zero1", entry=("train_zero1",), **RANKS)
ADAM_LR, WEIGHT_DECAY = 1e-2, 0.1


def _zero1(student, rng: random.Random, dp: int, steps: int = 3) -> tuple[list, dict]:
    cfg, seed = random_config(rng), rng.randrange(10**6)
    batch = _batch(rng, dp)
    call = f"train_zero1({describe(cfg)}, seed={seed}, steps={steps}, global_batch={batch}) on {dp} ranks"
    results = student.ranks("train_zero1", dp, cfg, seed, steps, batch, ADAM_LR, WEIGHT_DECAY)
    return results, {"cfg": cfg, "seed": seed, "batch": batch, "call": call, "steps": steps, "dp": dp}


def _zero1_parity(student, rng: random.Random, dp: int) -> None:
    results, run = _zero1(student, rng, dp)
    ref = reference(run["cfg"], run["seed"], run["steps"], run["batch"], ADAM_LR, WEIGHT_DECAY, "adamw")
    expect_parity(results, ref, ("params",), run["call"], rel=3e-5, mistakes=_summed(dp, "the flat gradient"))


@ZERO1.check(points=1, hint="ZeRO-1's step is three moves: the gradient reduced onto shards (averaged, not summed), "
                            "the optimizer on a shard, the parameters made whole again")
def zero1_parity_two_ranks(student, rng):
    """dp=2: the same losses, gradient norms and parameters as one process after every step"""
    _zero1_parity(student, rng, 2)


@ZERO1.check(points=2, hint="when dp does not divide the parameter count, the shards must still be equal and sit "
                            "where the collectives put them")
def zero1_parity_uneven(student, rng):
    """dp=3, a parameter count dp does not divide: the same as one process after every step"""
    _zero1_parity(student, rng, 3)


@ZERO1.check(points=1, hint="give make_optimizer only this rank's shard (one Parameter viewing it), not the model's "
                            "parameters or the whole flat buffer")
def optimizer_states_sharded(student, rng):
    """each rank keeps AdamW's two moments for its 1/dp shard only"""
    dp = rng.choice([2, 3])
    results, run = _zero1(student, rng, dp, steps=1)
    expected = static_bytes(model_numels(run["cfg"])[0], "fp32", zero=1, dp=dp)["optimizer"]
    expect_equal([r.get("optimizer_bytes") if isinstance(r, dict) else None for r in results], [expected] * dp,
                 f"{run['call']}: AdamW's exp_avg + exp_avg_sq bytes on each rank")


@ZERO1.check(points=1, hint="the gradient goes out as one reduce_scatter_single (each rank receives only its "
                            "shard's sum), the parameters come back as one all_gather_single; no all_reduce")
def zero1_communication(student, rng):
    """one reduce-scatter of the gradients and one all-gather of the parameters per step"""
    dp = rng.choice([2, 3])
    results, run = _zero1(student, rng, dp, steps=1)
    shard = math.ceil(model_numels(run["cfg"])[0] / dp)
    got = results[0].get("collectives") if isinstance(results[0], dict) else None
    expected = {"all_reduce": [0, 0], "reduce_scatter_single": [1, 4 * dp * shard],
                "all_gather_single": [1, 4 * shard]}
    got = got if isinstance(got, dict) else {}
    for op, want in expected.items():
        expect_equal(got.get(op, [0, 0]), want, f"{run['call']}: [{op} calls, bytes] in zero.step()")


# --- 03.zero2 -----------------------------------------------------------------------------------------------

ZERO2 = exercise("03.zero2", entry=("train_zero2",), requires=("03.zero1",), **RANKS)


def unit_numels(cfg: ModelConfig) -> list[int]:
    """Parameters of each ZeRO unit of the drivers: each block, then the root (embedding, final norm, output)."""
    total, block = model_numels(cfg)
    return [block] * cfg.n_layers + [total - cfg.n_layers * block]


def _zero2(student, rng: random.Random, dp: int, steps: int = 2) -> tuple[list, dict]:
    cfg, seed = random_config(rng), rng.randrange(10**6)
    batch = _batch(rng, dp)
    call = f"train_zero2({describe(cfg)}, seed={seed}, steps={steps}, global_batch={batch}) on {dp} ranks"
    results = per_rank(student.ranks("train_zero2", dp, cfg, seed, steps, batch, ADAM_LR, WEIGHT_DECAY), dp, call)
    return results, {"cfg": cfg, "seed": seed, "batch": batch, "call": call, "steps": steps, "dp": dp}


def _zero2_parity(student, rng: random.Random, dp: int) -> None:
    results, run = _zero2(student, rng, dp)
    ref = reference(run["cfg"], run["seed"], run["steps"], run["batch"], ADAM_LR, WEIGHT_DECAY, "adamw")
    expect_parity(results, ref, ("params",), run["call"], rel=3e-5)


@ZERO2.check(points=2, hint="ZeRO-2 reduces a unit's gradient as soon as it is complete, not at the end of backward")
def zero2_parity_two_ranks(student, rng):
    """dp=2: the same losses and parameters as one process after every step"""
    _zero2_parity(student, rng, 2)


@ZERO2.check(points=2, hint="when dp does not divide a unit's size, the shards must still be equal and sit where the "
                            "collectives put them")
def zero2_parity_uneven(student, rng):
    """dp=3, units whose size dp does not divide: the same as one process after every step"""
    _zero2_parity(student, rng, 3)


@ZERO2.check(points=2, hint="the shard must hold the gradient of the whole batch: a mean over the ranks, not their "
                            "sum")
def gradient_shards(student, rng):
    """right after backward, each rank's gradient shards are its slices of the whole batch's mean gradient"""
    dp = rng.choice([2, 3])
    results, run = _zero2(student, rng, dp, steps=2)
    ref = reference(run["cfg"], run["seed"], run["steps"], run["batch"], ADAM_LR, WEIGHT_DECAY, "adamw", shards=dp)
    names = [f"block {i}" for i in range(run["cfg"].n_layers)] + ["the root (embedding, norm, output)"]
    shard_numels = [-(-n // dp) for n in unit_numels(run["cfg"])]
    for rank, got in enumerate(results):
        for step, units in enumerate(ref["grad_shards"]):
            rows = got.get("grad_shards") or []
            row = rows[step] if len(rows) > step and isinstance(rows[step], list) else []
            for u, (name, numel) in enumerate(zip(names, shard_numels, strict=True)):
                _expect_fingerprints(row[u] if u < len(row) else None, units[u][rank], numel,
                                     f"{run['call']}: rank {rank}, step {step + 1}, the gradient shard of {name} "
                                     f"after backward", rel=1e-5, mistakes=_summed(dp, "the unit's flat gradient"))


@ZERO2.check(points=1, hint="the gradient goes out as one reduce_scatter_single per unit (each rank receives only "
                            "its shard's sum), the parameters come back as one all_gather_single; no all_reduce")
def zero2_communication(student, rng):
    """per step and unit, one reduce-scatter of the gradient and one all-gather of the parameters, no all-reduce"""
    dp = rng.choice([2, 3])
    results, run = _zero2(student, rng, dp, steps=1)
    shards = [-(-n // dp) for n in unit_numels(run["cfg"])]
    expected = {"all_reduce": [0, 0], "reduce_scatter_single": [len(shards), 4 * dp * sum(shards)],
                "all_gather_single": [len(shards), 4 * sum(shards)]}
    got = (results[0].get("collectives") or [None])[0]
    got = got if isinstance(got, dict) else {}
    for op, want in expected.items():
        expect_equal(got.get(op, [0, 0]), want, f"{run['call']}: [{op} calls, bytes] in one step (forward, "
                                                f"backward, the units' step())")


@ZERO2.check(points=1, hint="more than one shard of gradient memory is still referenced after backward: find the "
                            "full-size gradients (the unit's and its parameters') that outlive their use")
def gradient_memory(student, rng):
    """after backward each rank holds a 1/dp shard of the gradients, nothing more"""
    dp = rng.choice([2, 3])
    results, run = _zero2(student, rng, dp, steps=2)
    expected = sum(static_bytes(n, "fp32", zero=2, dp=dp)["grads"] for n in unit_numels(run["cfg"]))
    for rank, got in enumerate(results):
        expect_equal(got.get("grad_bytes"), [expected] * run["steps"],
                     f"{run['call']}: rank {rank}, bytes of gradient held after each step's backward")


# --- 03.zero3 -----------------------------------------------------------------------------------------------

ZERO3 = exercise("03.zero3", entry=("train_zero3",), **RANKS)


def _zero3(student, rng: random.Random, dp: int, steps: int = 3) -> tuple[list, dict]:
    cfg, seed = random_config(rng), rng.randrange(10**6)
    batch = _batch(rng, dp)
    call = f"train_zero3({describe(cfg)}, seed={seed}, steps={steps}, global_batch={batch}) on {dp} ranks"
    results = student.ranks("train_zero3", dp, cfg, seed, steps, batch, SGD_LR)
    return results, {"cfg": cfg, "seed": seed, "batch": batch, "call": call, "steps": steps, "dp": dp}


def _zero3_parity(student, rng: random.Random, dp: int) -> None:
    results, run = _zero3(student, rng, dp)
    ref = reference(run["cfg"], run["seed"], run["steps"], run["batch"], SGD_LR)
    expect_parity(results, ref, ("params",), run["call"], rel=1e-5, mistakes=_summed(dp, "the block's flat gradient"),
                  sgd=True)


def _shard_bytes(cfg: ModelConfig, dp: int) -> int:
    """What ZeRO-3 keeps of one block at rest: a 1/dp shard (rounded up) of its fp32 parameters."""
    return static_bytes(model_numels(cfg)[1], "fp32", zero=3, dp=dp)["params"]


@ZERO3.check(points=2, hint="a ZeRO-3 block needs its whole parameters twice per step, and gives back an averaged "
                            "gradient shard once")
def zero3_parity_two_ranks(student, rng):
    """dp=2: the same losses and parameters as one process after every step"""
    _zero3_parity(student, rng, 2)


@ZERO3.check(points=1, hint="the padded buffer and the shards must line up with where the collectives read and write")
def zero3_parity_uneven(student, rng):
    """dp=3, blocks whose size dp does not divide: the same as one process after every step"""
    _zero3_parity(student, rng, 3)


@ZERO3.check(points=1, hint="between steps only the shards may stay in memory: when does the whole buffer stop being "
                            "needed?")
def at_rest(student, rng):
    """between steps each rank holds only its 1/dp shard of each block"""
    dp = rng.choice([2, 3])
    results, run = _zero3(student, rng, dp, steps=2)
    expected = run["cfg"].n_layers * _shard_bytes(run["cfg"], dp)
    for rank, got in enumerate(results):
        expect_equal(got.get("at_rest") if isinstance(got, dict) else None, [expected] * (run["steps"] + 1),
                     f"{run['call']}: rank {rank}, bytes of the blocks' parameters at start and after each step")


@ZERO3.check(points=1, hint="while a block computes, only it may be whole: a block that finished its forward keeps its "
                            "full weights until backward needs them again")
def gathered_while_computing(student, rng):
    """while a block computes its forward, it alone is gathered"""
    dp = rng.choice([2, 3])
    results, run = _zero3(student, rng, dp, steps=2)
    cfg = run["cfg"]
    expected = [[(cfg.n_layers + dp) * _shard_bytes(cfg, dp)] * cfg.n_layers] * run["steps"]
    for rank, got in enumerate(results):
        expect_equal(got.get("in_forward") if isinstance(got, dict) else None, expected,
                     f"{run['call']}: rank {rank}, bytes of the blocks' parameters during each block's forward")


# --- 03.zero3_prefetch --------------------------------------------------------------------------------------

PREFETCH = exercise("03.zero3_prefetch", entry=("train_zero3_prefetch",), requires=("03.zero3",), **RANKS)


def _prefetch(student, rng: random.Random, dp: int, steps: int = 2) -> tuple[list, dict]:
    """Three blocks: the middle one is prefetched by the first and prefetches the last."""
    cfg, seed = dataclasses.replace(random_config(rng), n_layers=3), rng.randrange(10**6)
    batch = _batch(rng, dp)
    call = f"train_zero3_prefetch({describe(cfg)}, seed={seed}, steps={steps}, global_batch={batch}) on {dp} ranks"
    results = per_rank(student.ranks("train_zero3_prefetch", dp, cfg, seed, steps, batch, SGD_LR), dp, call)
    return results, {"cfg": cfg, "seed": seed, "batch": batch, "call": call, "steps": steps, "dp": dp}


def _prefetch_parity(student, rng: random.Random, dp: int) -> None:
    results, run = _prefetch(student, rng, dp)
    ref = reference(run["cfg"], run["seed"], run["steps"], run["batch"], SGD_LR)
    expect_parity(results, ref, ("params",), run["call"], rel=1e-5, sgd=True)


@PREFETCH.check(points=2, hint="an asynchronous all-gather's output holds the weights only once the operation has "
                               "completed: no block may compute before that, and a block nobody prefetched (the first, "
                               "every backward) still needs its weights gathered")
def prefetch_parity_two_ranks(student, rng):
    """dp=2: the same losses and parameters as one process after every step"""
    _prefetch_parity(student, rng, 2)


@PREFETCH.check(points=1, hint="a block computed before its prefetched all-gather had completed: until then its buffer "
                               "holds no weights")
def prefetch_parity_uneven(student, rng):
    """dp=3, blocks whose size dp does not divide: the same as one process after every step"""
    _prefetch_parity(student, rng, 3)


def _events(results: list, run: dict) -> list[tuple[int, int, list]]:
    """(rank, step, the trace up to the last block's forward) for every rank and step."""
    out = []
    for rank, got in enumerate(results):
        traces = got.get("trace")
        if not isinstance(traces, list) or len(traces) != run["steps"]:
            raise CheckFailed(f"{run['call']}: rank {rank} returned trace={traces!r:.120}, expected one per step")
        for step, trace in enumerate(traces):
            last = max((i for i, e in enumerate(trace) if e[0] == "forward"), default=-1)
            out.append((rank, step, [tuple(e) for e in trace[:last + 1]]))
    return out


def _at(events: list, event: tuple, default: int) -> int:
    return events.index(event) if event in events else default


def _shown_trace(events: list) -> str:
    return ", ".join(" ".join(map(str, e)) for e in events)


@PREFETCH.check(points=2, hint="prefetch means the next block's gather is already in flight while this one computes")
def prefetch_issued_early(student, rng):
    """block i+1's all-gather is issued, asynchronously, after block i-1's forward and before block i's"""
    results, run = _prefetch(student, rng, rng.choice([2, 3]), steps=2)
    n = run["cfg"].n_layers
    for rank, step, events in _events(results, run):
        for i in range(n - 1):
            gathers = [k for k, e in enumerate(events) if e[0] == "gather" and e[1] == i + 1]
            first = (events[gathers[0]][2], gathers[0]) if gathers else (None, len(events))
            after = _at(events, ("forward", i - 1), -1) if i else -1
            got = [first[0] is True, after < first[1] < _at(events, ("forward", i), -1)]
            window = f"between block {i - 1}'s and block {i}'s forward" if i else "before block 0's forward"
            expect_equal([int(g) for g in got], [1, 1],
                         f"{run['call']}: rank {rank}, step {step + 1}, block {i + 1}'s first all-gather [async, "
                         f"issued {window}] (1 = yes) in the forward's trace: {_shown_trace(events)}")


@PREFETCH.check(points=1, hint="where the wait sits matters: waiting before the previous block's forward stalls its "
                               "compute, never waiting leaves the block computing without its weights")
def waited_before_use(student, rng):
    """each prefetched all-gather is waited on after the previous block's forward, before its own"""
    results, run = _prefetch(student, rng, rng.choice([2, 3]), steps=2)
    for rank, step, events in _events(results, run):
        for i in range(1, run["cfg"].n_layers):
            waits = [k for k, e in enumerate(events) if e == ("wait", i)]
            ok = any(_at(events, ("forward", i - 1), len(events)) < k < _at(events, ("forward", i), -1) for k in waits)
            expect_equal(int(ok), 1, f"{run['call']}: rank {rank}, step {step + 1}, block {i}'s prefetch waited on "
                                     f"between block {i - 1}'s and block {i}'s forward (1 = yes) in the forward's "
                                     f"trace: {_shown_trace(events)}")


@PREFETCH.check(points=1, hint="a block is still whole between steps: some all-gather was started that nothing frees — "
                               "a prefetch belongs to the forward, and backward's gathers are freed by exercise 4's "
                               "own rule")
def prefetch_at_rest(student, rng):
    """between steps each rank holds only its 1/dp shard of each block"""
    dp = rng.choice([2, 3])
    results, run = _prefetch(student, rng, dp, steps=2)
    expected = run["cfg"].n_layers * _shard_bytes(run["cfg"], dp)
    for rank, got in enumerate(results):
        expect_equal(got.get("at_rest"), [expected] * (run["steps"] + 1),
                     f"{run['call']}: rank {rank}, bytes of the blocks' parameters at start and after each step")


@PREFETCH.check(points=1, hint="while block i computes, block i+1 is already being gathered: two blocks are whole "
                               "(the last block's forward has nothing to prefetch)")
def two_blocks_whole(student, rng):
    """while block i computes its forward, blocks i and i+1 alone are gathered"""
    dp = rng.choice([2, 3])
    results, run = _prefetch(student, rng, dp, steps=2)
    n, shard = run["cfg"].n_layers, _shard_bytes(run["cfg"], dp)
    expected = [[(n + dp * (1 + (i < n - 1))) * shard for i in range(n)]] * run["steps"]
    for rank, got in enumerate(results):
        expect_equal(got.get("in_forward"), expected,
                     f"{run['call']}: rank {rank}, bytes of the blocks' parameters during each block's forward")


# --- 03.memory_ladder ---------------------------------------------------------------------------------------

LADDER = exercise("03.memory_ladder", entry=("zero_state_bytes",))


def _ladder(student, rng: random.Random, stages: tuple[int, ...], precision: str = "mixed",
            uneven: bool = False) -> None:
    for _ in range(3):
        dp = rng.choice([2, 3, 4, 6, 8, 12, 16, 64, 100, 256, 1024])
        n = rng.randrange(10**6, 10**11)
        n = n - n % dp + (rng.randrange(1, dp) if uneven else 0)
        for stage in stages:
            expected = static_bytes(n, precision, zero=stage, dp=dp)
            got = student.zero_state_bytes(n, stage, dp, precision)
            keys = ("params", "grads", "optimizer")
            expect_equal([got.get(k) for k in keys] if isinstance(got, dict) else got, [expected[k] for k in keys],
                         f"zero_state_bytes({n}, stage={stage}, dp={dp}, {precision!r}) as [params, grads, "
                         f"optimizer]")


@LADDER.check(points=1, hint="without ZeRO, dp changes nothing: count mixed precision's bytes per parameter")
def stage_zero(student, rng):
    """no ZeRO (stage 0): every rank holds all the states"""
    _ladder(student, rng, (0,))


@LADDER.check(points=1, hint="ZeRO-1 shards the optimizer's 12 bytes: the fp32 master weights belong to the "
                             "optimizer, with Adam's m and v")
def stage_one(student, rng):
    """ZeRO-1 shards the optimizer states, fp32 master weights included"""
    _ladder(student, rng, (1,))


@LADDER.check(points=1, hint="stage s shards everything up to s: 1 the optimizer states, 2 also the gradients, "
                             "3 also the parameters")
def stages_two_three(student, rng):
    """ZeRO-2 also shards the gradients, ZeRO-3 the parameters too"""
    _ladder(student, rng, (2, 3))


@LADDER.check(points=1, hint="every parameter needs a place and every shard has the same whole size: when dp does not "
                             "divide the count, which way does a shard's size round?")
def uneven(student, rng):
    """parameter counts that dp does not divide round up"""
    _ladder(student, rng, (1, 2, 3), uneven=True)


@LADDER.check(points=1, hidden=True, hint="in fp32: 4-byte weights and gradients and Adam's two 4-byte moments, "
                                          "no master copy")
def fp32(student, rng):
    """fp32 training: 4 + 4 + 8 bytes per parameter"""
    _ladder(student, rng, (0, 1, 2, 3), precision="fp32")


# --- 03.problems --------------------------------------------------------------------------------------------
# Back-of-envelope problems: plain Python in the sandbox (no lab.calc there), compared with lab.calc to 1%.

PROBLEMS = exercise("03.problems", entry=(
    "zero_gb_per_gpu", "zero2_saving_gib", "largest_model_zero3", "zero3_hide_tokens", "zero3_exposed_ms",
    "zero3_prefetch_param_gib", "zero3_accum_bytes", "bucketing_saving_ms", "fsdp_min_global_batch"))
TOLERANCE = 0.01
GB_FOR_GIB = Mistake(1e9 / 2**30, "GB taken for GiB", "a GiB is 2**30 bytes, a GB 1e9: the problem says which")
GIB_FOR_GB = Mistake(2**30 / 1e9, "GiB taken for GB", "a GB is 1e9 bytes, a GiB 2**30: the problem says which")


def _link(bandwidth: float, latency: float = 0.0) -> Link:
    """One network of the problem's numbers (latency left out unless the problem is about it)."""
    return Link("problem", bandwidth, latency, "grader")


@PROBLEMS.check(points=1, hint="list the bytes per parameter of each kind of state and which of them each stage "
                               "shards; a GB is 1e9 bytes")
def p1_zero_gb(student, rng):
    """P1 — model-state GB per GPU under ZeRO-0 to 3, with and without an fp32 gradient buffer"""
    for stage in (0, 1, 2, 3):
        n, gpus, fp32 = rng.randrange(10**8, 10**12), rng.randrange(2, 1025), rng.random() < 0.5
        fp32 = fp32 if stage < 2 else True  # the buffer's sharding is the point at stages 2 and 3
        expected = n * bytes_per_param("mixed", zero=stage, dp=gpus, fp32_grad_accum=fp32) / 1e9
        expect_close(student.zero_gb_per_gpu(n, stage, gpus, fp32), expected,
                     f"zero_gb_per_gpu({n}, stage={stage}, n_gpus={gpus}, fp32_grads={fp32})", TOLERANCE,
                     [GIB_FOR_GB])


@PROBLEMS.check(points=1, hint="what ZeRO-2 adds to ZeRO-1 is the gradients' sharding: the saving is what a rank no "
                               "longer holds; a GiB is 2**30 bytes")
def p2_zero2_saving(student, rng):
    """P2 — the GiB of gradients ZeRO-2 saves per GPU over ZeRO-1"""
    for gpus in (rng.randrange(2, 9), rng.randrange(9, 1025)):
        n = rng.randrange(10**8, 10**12)
        expected = (static_bytes(n, zero=1, dp=gpus)["grads"] - static_bytes(n, zero=2, dp=gpus)["grads"]) / 2**30
        expect_close(student.zero2_saving_gib(n, gpus), expected, f"zero2_saving_gib({n}, n_gpus={gpus})",
                     TOLERANCE, [GB_FOR_GIB])


@PROBLEMS.check(points=1, hint="under ZeRO-3 the model states are sharded over every GPU and must fit next to the "
                               "activations: solve for the parameters (GiB × 2**30 bytes)")
def p3_largest_model_zero3(student, rng):
    """P3 — the largest model N GPUs train with ZeRO-3, activations taking their share of memory"""
    for gpus in (1, 8, rng.randrange(2, 1025)):
        gib = rng.choice([24, 40, 80, 96, 141, 192])
        activations = round(rng.uniform(0.05, 0.6) * gib, 1)
        expected = (gib - activations) * 2**30 / bytes_per_param("mixed", zero=3, dp=gpus)
        expect_close(student.largest_model_zero3(gpus, gib, activations), expected,
                     f"largest_model_zero3(n_gpus={gpus}, gpu_gib={gib}, activation_gib={activations})", TOLERANCE,
                     [GB_FOR_GIB])


@PROBLEMS.check(points=1, hint="compare a layer's all-gather time with its forward's compute time: the layer's size "
                               "cancels")
def p4_zero3_hide_tokens(student, rng):
    """P4 — ZeRO-3's token threshold: tokens per GPU above which a layer's forward hides its all-gather"""
    for gpus in (rng.randrange(2, 9), rng.randrange(9, 1025)):
        tflops, gbs = rng.uniform(100, 2500), rng.uniform(20, 900)
        expected = zero3_overlap_ratio(1, gpus, tflops * 1e12, gbs * 1e9)  # the ratio falls as 1/tokens
        expect_close(student.zero3_hide_tokens(gpus, tflops, gbs), expected,
                     f"zero3_hide_tokens(n_gpus={gpus}, peak_tflops={tflops:.6g}, bandwidth_gbs={gbs:.6g})",
                     TOLERANCE, [Mistake(0.5, "a factor 2", "bf16 weights are 2 bytes a parameter, and the forward "
                                                            "does 2 FLOPs a parameter and token")])


@PROBLEMS.check(points=1, hint="with prefetch the gather overlaps the previous layer's compute: only the part that "
                               "outlasts it is exposed")
def p5_zero3_exposed(student, rng):
    """P5 — the all-gather time a prefetched ZeRO-3 layer leaves exposed, in ms"""
    for comm_bound in (True, False, True):
        gpus, params = rng.randrange(2, 65), rng.randrange(10**7, 2 * 10**9)
        tflops, gbs = rng.uniform(100, 2500), rng.uniform(20, 900)
        threshold = zero3_overlap_ratio(1, gpus, tflops * 1e12, gbs * 1e9)
        tokens = int(threshold * (rng.uniform(0.2, 0.8) if comm_bound else rng.uniform(1.2, 3)))
        gather = collective_time("all_gather", 2 * params, gpus, _link(gbs * 1e9)).time_s
        expected = max(0.0, gather - 2 * params * tokens / (tflops * 1e12)) * 1e3
        what = f"zero3_exposed_ms(block_params={params}, tokens={tokens}, n_gpus={gpus}, peak_tflops={tflops:.6g}, " \
               f"bandwidth_gbs={gbs:.6g})"
        if expected == 0:
            expect_number(student.zero3_exposed_ms(params, tokens, gpus, tflops, gbs), 0.0, what, tol=1e-9)
        else:
            expect_close(student.zero3_exposed_ms(params, tokens, gpus, tflops, gbs), expected, what, TOLERANCE)


@PROBLEMS.check(points=1, hint="the shards, plus the layers that are whole at the same time (how many, with and "
                               "without prefetch?); a GiB is 2**30 bytes")
def p6_prefetch_memory(student, rng):
    """P6 — bf16 parameter GiB on a ZeRO-3 GPU during a forward, with and without prefetch"""
    for prefetch in (True, False):
        n, layers, gpus = rng.randrange(10**9, 10**12), rng.randrange(16, 129), rng.randrange(8, 1025)
        expected = zero3_param_bytes(n, layers, gpus, gathered=2 if prefetch else 1) / 2**30
        expect_close(student.zero3_prefetch_param_gib(n, layers, gpus, prefetch), expected,
                     f"zero3_prefetch_param_gib({n}, n_layers={layers}, n_gpus={gpus}, prefetch={prefetch})",
                     TOLERANCE, [GB_FOR_GIB])


@PROBLEMS.check(points=1, hint="ZeRO-3 frees the weights after every micro-batch: count the collectives of one "
                               "micro-batch, then of a step")
def p7_zero3_accumulation(student, rng):
    """P7 — bytes a GPU sends per optimizer step under ZeRO-3 with gradient accumulation"""
    for accum in (1, rng.randrange(2, 5), rng.randrange(5, 33)):
        n, gpus = rng.randrange(10**8, 10**12), rng.randrange(2, 1025)
        per_micro = (2 * collective_time("all_gather", 2 * n, gpus, _link(1.0)).bytes_sent_per_rank
                     + collective_time("reduce_scatter", 2 * n, gpus, _link(1.0)).bytes_sent_per_rank)
        expect_close(student.zero3_accum_bytes(n, gpus, accum), accum * per_micro,
                     f"zero3_accum_bytes({n}, n_gpus={gpus}, grad_accum={accum})", TOLERANCE)


@PROBLEMS.check(points=1, hint="every ring step pays the latency however small the message: how many steps does one "
                               "all-reduce take?")
def p8_bucketing(student, rng):
    """P8 — the latency per step that bucketing saves over one all-reduce per tensor, in ms"""
    for gpus in (rng.randrange(2, 9), rng.randrange(9, 1025)):
        tensors, alpha_us = rng.randrange(100, 1000), rng.uniform(2, 30)
        buckets = rng.randrange(1, tensors // 10)
        steps = collective_time("all_reduce", 1.0, gpus, _link(1e12, alpha_us * 1e-6)).steps
        expected = (tensors - buckets) * steps * alpha_us * 1e-3
        expect_close(student.bucketing_saving_ms(tensors, buckets, gpus, alpha_us), expected,
                     f"bucketing_saving_ms(n_tensors={tensors}, n_buckets={buckets}, n_gpus={gpus}, "
                     f"alpha_us={alpha_us:.6g})", TOLERANCE)


@PROBLEMS.check(points=1, hint="more links per chip move the same bytes faster: how does that move the compute-bound "
                               "threshold?")
def p9_fsdp_min_batch(student, rng):
    """P9 — the smallest global batch (tokens) that keeps pure FSDP compute-bound, several mesh axes"""
    for axes in (1, 2, 3):
        chips, tflops, gbs = rng.randrange(8, 20000), rng.uniform(100, 2500), rng.uniform(20, 900)
        expected = dp_critical_batch(tflops * 1e12, axes * gbs * 1e9, chips)
        expect_close(student.fsdp_min_global_batch(chips, tflops, gbs, axes), expected,
                     f"fsdp_min_global_batch(chips={chips}, peak_tflops={tflops:.6g}, link_gbs={gbs:.6g}, "
                     f"n_axes={axes})", TOLERANCE)
