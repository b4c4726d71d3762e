"""Chapter 08, 5D parallelism. The mesh exercises are checked against `lab.distributed.layout` and
`lab.distributed.axis_groups`
(and, for axis orders other than lab's, against the grid `arange(world).view(*sizes in order)` they generalise); the
memory of a layout against `lab.calc.memory.estimate_memory`; the batch budget and the failing configs against the
rules of `lab.config` (`Config.validate` and `check_supported`).

Sizes are random and not only powers of two (3, 5, 6 ranks along an axis); models have K/V heads fewer than the
TP degree and parameter counts that no dp·cp divides; every broken config breaks exactly one rule, which the check
confirms with `lab.config` before asking the student about it.

torch (through `lab.distributed`) is imported inside the functions: `lab.check` of other chapters loads this module too.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random

from lab.calc.memory import estimate_memory
from lab.config import Config, ModelConfig, ParallelConfig, TrainConfig, check_supported
from lab.grading.checks import CheckFailed, driver, exercise, expect_equal, expect_number, expect_raises

AXES = ("dp", "pp", "cp", "tp")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


# --- 08.mesh_coords ----------------------------------------------------------------------------------------------

MESH = exercise("08.mesh_coords", entry=("coords_of", "rank_of", "group_of", "run_coords", "run_rank_of",
                                         "run_groups"))


def grid_coords(rank: int, sizes: dict[str, int], order: tuple[str, ...]) -> list[int]:
    """The coordinates (in `order`) of `rank` on arange(world).view(*[sizes[a] for a in order])."""
    out = []
    for axis in reversed(order):
        rank, c = divmod(rank, sizes[axis])
        out.append(c)
    return out[::-1]


def grid_group(rank: int, axis: str, sizes: dict[str, int], order: tuple[str, ...]) -> list[int]:
    """The line of that grid through `rank` along `axis`, by coordinate: lab.distributed.axis_groups for lab's order."""
    if tuple(order) == AXES:
        from lab.distributed import axis_groups

        return next(g for g in axis_groups(math.prod(sizes.values()), axis, **sizes) if rank in g)
    here = grid_coords(rank, sizes, order)
    stride = math.prod(sizes[a] for a in order[order.index(axis) + 1:])
    start = rank - here[order.index(axis)] * stride
    return [start + i * stride for i in range(sizes[axis])]


def random_sizes(rng: random.Random, world_max: int = 64) -> dict[str, int]:
    """Degrees for the four axes, at least two of them > 1, some not powers of two."""
    while True:
        sizes = {a: rng.choice([1, 2, 2, 3, 4, 5, 6]) for a in AXES}
        if sum(v > 1 for v in sizes.values()) >= 2 and math.prod(sizes.values()) <= world_max:
            return sizes


def _ranks(rng: random.Random, sizes: dict[str, int], n: int = 6) -> list[int]:
    world = math.prod(sizes.values())
    return sorted(rng.sample(range(world), min(n, world)))


def _expect_coords(student, sizes: dict, order: tuple, ranks: list[int]) -> None:
    call = f"run_coords({sizes}, {order}, {ranks})"
    got = driver(call, "the coordinates of each rank", student.run_coords, sizes, order, ranks)
    expect_equal(got.get("coords"), [grid_coords(r, sizes, order) for r in ranks],
                 f"{call}: each rank's coordinates, in the order {order}")


@MESH.check(points=1, hint="the last axis of `order` varies fastest, like the digits of a number")
def coords_lab_order(student, rng):
    """lab's order (dp, pp, cp, tp): each rank's coordinates, as lab.distributed.layout lays them out"""
    from lab.distributed import layout

    for _ in range(3):
        sizes = random_sizes(rng)
        ranks = _ranks(rng, sizes)
        grid = layout(math.prod(sizes.values()), **sizes)
        assert all((grid == r).nonzero()[0].tolist() == grid_coords(r, sizes, AXES) for r in ranks)
        _expect_coords(student, sizes, AXES, ranks)


@MESH.check(points=1, hint="nothing may assume lab's order: the axes may come in any order")
def coords_any_order(student, rng):
    """other axis orders (Megatron's pp outermost, random ones): coordinates, and the rank back from them"""
    for order in (("pp", "dp", "cp", "tp"), tuple(rng.sample(AXES, 4)), tuple(rng.sample(AXES, 4))):
        sizes = random_sizes(rng)
        ranks = _ranks(rng, sizes)
        _expect_coords(student, sizes, order, ranks)
        coords = [grid_coords(r, sizes, order) for r in ranks]
        call = f"run_rank_of({sizes}, {order}, {coords})"
        got = driver(call, "the rank at each coordinate", student.run_rank_of, sizes, order, coords)
        expect_equal(got.get("ranks"), ranks, f"{call}: the rank at each coordinate")


@MESH.check(points=1, hint="a group along an axis shares every other coordinate with the rank")
def groups_along_an_axis(student, rng):
    """the group along each axis, by coordinate: lab.distributed.axis_groups for lab's order, the grid's lines for others"""  # noqa: E501 - the check's name
    for order in (AXES, tuple(rng.sample(AXES, 4))):
        sizes = random_sizes(rng)
        for axis in AXES:
            if sizes[axis] == 1 and rng.random() < 0.7:
                continue
            ranks = _ranks(rng, sizes, 3)
            call = f"run_groups({sizes}, {order}, {axis!r}, {ranks})"
            got = driver(call, "each rank's group", student.run_groups, sizes, order, axis, ranks)
            expect_equal(got.get("groups"), [grid_group(r, axis, sizes, order) for r in ranks],
                         f"{call}: the ranks of each one's {axis} group, by their {axis} coordinate")


@MESH.check(points=1, hidden=True, hint="nothing may depend on the world being small: 16,384 ranks")
def llama3_405b_mesh(student, rng):
    """Llama 3 405B's 16,384 ranks (tp8, cp1 or 16, pp16, dp128 or 8)"""
    for sizes in ({"dp": 128, "pp": 16, "cp": 1, "tp": 8}, {"dp": 8, "pp": 16, "cp": 16, "tp": 8}):
        ranks = _ranks(rng, sizes, 5)
        _expect_coords(student, sizes, AXES, ranks)
        call = f"run_groups({sizes}, {AXES}, 'dp', {ranks})"
        got = driver(call, "each rank's group", student.run_groups, sizes, AXES, "dp", ranks)
        expect_equal(got.get("groups"), [grid_group(r, "dp", sizes, AXES) for r in ranks], f"{call}: the dp groups")


# --- 08.collective_group -----------------------------------------------------------------------------------------

GROUP = exercise("08.collective_group", entry=("collective_group", "run_collective_group"),
                 requires=("08.mesh_coords",))

KINDS = {  # kind: (op, lab.distributed.axis_groups axis)
    "sp_activations": ("all_gather", "tp"), "row_linear_output": ("all_reduce", "tp"), "ring_kv": ("send", "cp"),
    "stage_activations": ("send", "pp"), "dense_grads": ("all_reduce", "dp_cp"),
    "zero3_params": ("all_gather", "dp_cp"), "moe_tokens": ("all_to_all", "ep"),
    "expert_grads": ("all_reduce", "ep_dp"),
}


def _expect_groups(student, rng: random.Random, sizes: dict, ep: int, kinds: tuple[str, ...], n: int = 4) -> None:
    from lab.distributed import axis_groups

    world = math.prod(sizes.values())
    ranks = _ranks(rng, sizes, n)
    for kind in kinds:
        op, axis = KINDS[kind]
        call = f"run_collective_group({ranks}, {kind!r}, {sizes}, ep={ep})"
        got = driver(call, "each rank's op and group", student.run_collective_group, ranks, kind, sizes, ep)
        groups = axis_groups(world, axis, **sizes, ep=ep)
        expected = [{"op": op, "ranks": sorted(next(g for g in groups if r in g))} for r in ranks]
        found = got.get("groups")
        if not isinstance(found, list) or len(found) != len(ranks) or not all(isinstance(g, dict) for g in found):
            raise CheckFailed(f"{call} returned {found!r:.200}, expected {expected}")
        for r, g, want in zip(ranks, found, expected, strict=True):
            if g.get("op") != want["op"] or g.get("ranks") != want["ranks"]:
                raise CheckFailed(f"{call}: rank {r} returned {g}, expected {want} "
                                  f"(lab.distributed.axis_groups {axis!r})")


def _ep_sizes(rng: random.Random) -> tuple[dict[str, int], int]:
    """A layout with cp > 1 and an ep that is neither 1 nor dp·cp, so that every EP rule shows."""
    while True:
        sizes = {"dp": rng.choice([2, 3, 4, 6]), "pp": rng.choice([1, 2]), "cp": rng.choice([2, 3]),
                 "tp": rng.choice([1, 2])}
        eps = [e for e in _divisors(sizes["dp"] * sizes["cp"]) if 1 < e < sizes["dp"] * sizes["cp"]]
        if eps:
            return sizes, rng.choice(eps)


@GROUP.check(points=1, hint="each kind of traffic crosses the line of ranks that shares its work (tp, cp or pp through "
                            "the rank), with the collective its parallelism needs: gathering sequence shards, "
                            "finishing partial sums, or passing to a neighbour")
def tp_cp_pp_groups(student, rng):
    """tensor, context and pipeline parallelism: the op, and the tp, cp or pp line through the rank"""
    for _ in range(2):
        _expect_groups(student, rng, random_sizes(rng), 1,
                       ("sp_activations", "row_linear_output", "ring_kv", "stage_activations"))


@GROUP.check(points=1, hint="CP ranks hold the same weights but saw other tokens: dense gradients are all-reduced, "
                            "and ZeRO-3's shards all-gathered, over every rank with the same pp and tp coordinates — "
                            "dp x cp, not dp alone")
def dp_cp_groups(student, rng):
    """dense gradients and ZeRO-3 weights: the dp × cp ranks, not dp alone"""
    for _ in range(2):
        sizes = {**random_sizes(rng), "cp": rng.choice([2, 3])}
        _expect_groups(student, rng, sizes, 1, ("dense_grads", "zero3_params"))


@GROUP.check(points=1, hint="EP groups and ep_dp groups cut the dp × cp ranks in two different ways: the statement "
                            "says how they are numbered")
def expert_groups(student, rng):
    """experts: tokens over the ep group (consecutive dp × cp ranks), gradients over ep_dp"""
    for _ in range(2):
        sizes, ep = _ep_sizes(rng)
        _expect_groups(student, rng, sizes, ep, ("moe_tokens", "expert_grads"))


@GROUP.check(points=1, hidden=True, hint="nothing may depend on the world being small")
def deepseek_and_llama_groups(student, rng):
    """DeepSeek-V3's 2,048 ranks (pp16, ep64 over dp128) and Llama 3's 16,384 (cp16)"""
    _expect_groups(student, rng, {"dp": 128, "pp": 16, "cp": 1, "tp": 1}, 64, ("moe_tokens", "expert_grads"), n=3)
    _expect_groups(student, rng, {"dp": 8, "pp": 16, "cp": 16, "tp": 8}, 1, ("dense_grads", "ring_kv"), n=3)


# --- 08.layout_memory --------------------------------------------------------------------------------------------

MEMORY = exercise("08.layout_memory", entry=("layout_memory", "run_layout_memory"))


def random_model(rng: random.Random, tp: int, pp: int, tied: bool) -> ModelConfig:
    """A dense GQA model that `tp` and `pp` fit: n_kv_heads below tp now and then (K/V heads replicated)."""
    while True:
        n_heads = tp * rng.choice([1, 2, 3, 4])
        kv = rng.choice(_divisors(n_heads))
        if kv % tp == 0 or tp % kv == 0:
            break
    head_dim = rng.randrange(8, 129, 2)
    return ModelConfig(name="random", vocab_size=tp * rng.randrange(500, 20_000), d_model=n_heads * head_dim + 2
                       * rng.randrange(0, 8), n_layers=pp * rng.randrange(1, 6), n_heads=n_heads, n_kv_heads=kv,
                       head_dim=head_dim, d_ff=tp * rng.randrange(64, 3000), tie_embeddings=tied)


def memory_reference(model: ModelConfig, parallel: ParallelConfig, stage: int) -> dict[str, int]:
    seq = 2 * parallel.cp * parallel.tp
    per_gpu = estimate_memory(model, seq, 1, parallel, stage=stage).per_gpu
    return {k: per_gpu[k] for k in ("params", "grads", "optimizer")}


def _expect_memory(student, model: ModelConfig, parallel: ParallelConfig, stage: int) -> None:
    expected = memory_reference(model, parallel, stage)
    fields = {k: getattr(parallel, k) for k in ("dp", "tp", "pp", "cp", "zero") if getattr(parallel, k)}
    call = (f"run_layout_memory(<{model.n_layers} layers, d_model {model.d_model}, {model.n_heads} heads, "
            f"{model.n_kv_heads} K/V heads of {model.head_dim}, d_ff {model.d_ff}, vocab {model.vocab_size}, "
            f"tied {model.tie_embeddings}>, ParallelConfig({fields}), stage={stage})")
    got = driver(call, "the bytes", student.run_layout_memory, model, dataclasses.asdict(parallel), stage)
    for key, value in expected.items():
        expect_equal(got.get(key), value, f"{call}: {key} bytes")


def _layout(**degrees: int) -> ParallelConfig:
    return ParallelConfig(grad_accum=degrees.get("pp", 1), **degrees)


@MEMORY.check(points=1, hint="count mixed precision's bytes per parameter for each kind of state; a tied output "
                             "layer is not a second matrix")
def memory_one_gpu(student, rng):
    """no parallelism: 2 + 2 + 12 bytes per parameter, tied and untied embeddings"""
    for tied in (False, True):
        _expect_memory(student, random_model(rng, 1, 1, tied), ParallelConfig(), 0)


@MEMORY.check(points=1, hint="TP splits most matrices by tp, but not the norms, and a rank never holds a fraction of "
                             "a KV head")
def memory_tensor_parallel(student, rng):
    """tensor parallelism: matrices split, norms replicated, K/V heads replicated beyond n_kv_heads ranks"""
    for tp in (rng.choice([2, 4]), rng.choice([8, 16])):
        model = random_model(rng, tp, 1, rng.random() < 0.5)
        while tp <= model.n_kv_heads and tp >= 8:  # the second case has fewer K/V heads than ranks
            model = random_model(rng, tp, 1, False)
        _expect_memory(student, model, _layout(tp=tp), 0)


@MEMORY.check(points=1, hint="the first and the last stage hold more than their layers: which extra weights sit "
                             "where?")
def memory_pipeline_stages(student, rng):
    """pipeline stages: the first holds the embedding, the last the final norm and the output layer"""
    for tied in (False, True):
        pp, tp = rng.choice([2, 3, 4, 8]), rng.choice([1, 2])
        model = random_model(rng, tp, pp, tied)
        for stage in (0, rng.randrange(1, pp - 1) if pp > 2 else 1, pp - 1):
            _expect_memory(student, model, _layout(pp=pp, tp=tp), stage)


@MEMORY.check(points=1, hint="ZeRO shards over every rank that holds the same weights (CP ranks do too), unit by "
                             "unit, each padded on its own")
def memory_zero(student, rng):
    """ZeRO-1/2/3 over the dp × cp ranks, each unit's shard rounded up"""
    for zero in (1, 2, 3):
        dp, cp, tp = rng.choice([3, 5, 6, 7]), rng.choice([1, 2, 3]), rng.choice([1, 2])
        model = random_model(rng, tp, 1, False)
        if cp == 1 and zero == 3:
            cp = 2
        _expect_memory(student, model, _layout(dp=dp, cp=cp, tp=tp, zero=zero), 0)


@MEMORY.check(points=1, hidden=True, hint="nothing may depend on small models: Llama 3 70B and 405B")
def memory_llama3(student, rng):
    """Llama 3 70B (tp8 pp4 dp8 ZeRO-1) and 405B (tp16 over its 8 K/V heads, pp2, dp16, ZeRO-1)"""
    from lab.config import PRESETS

    _expect_memory(student, PRESETS["llama3-70b"], _layout(dp=8, tp=8, pp=4, zero=1), rng.randrange(4))
    _expect_memory(student, PRESETS["llama3-405b"], _layout(dp=16, tp=16, pp=2, zero=1), rng.randrange(2))


# --- 08.batch_budget ---------------------------------------------------------------------------------------------

BUDGET = exercise("08.batch_budget", entry=("batch_layouts", "run_batch_layouts"))


def budget_reference(gbs_tokens: int, seq: int, gpus: int, tp: int, pp: int, cp: int, max_mbs: int) -> list[list]:
    """Every (dp, mbs, grad_accum): mbs·grad_accum·dp·seq = gbs_tokens, mbs ≤ max_mbs, grad_accum ≥ pp − 1 (nanotron's
    sweep filter); each confirmed by `lab.config` (the global batch of gbs/seq sequences, dp·grad_accum dividing it)."""
    dp = gpus // (tp * pp * cp)
    out = []
    for mbs in range(1, max_mbs + 1):
        accum, rest = divmod(gbs_tokens, seq * mbs * dp)
        if rest == 0 and accum >= max(pp - 1, 1):
            model = ModelConfig(n_layers=pp * 2, n_heads=4 * tp, n_kv_heads=4 * tp, d_model=32 * tp, d_ff=64 * tp,
                                vocab_size=64 * tp, max_seq_len=seq)
            Config(model=model, parallel=ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp, grad_accum=accum),
                   train=TrainConfig(global_batch=gbs_tokens // seq, seq_len=seq)).validate()
            out.append([dp, mbs, accum])
    return out


def _expect_budget(student, *args: int) -> None:
    names = ("gbs_tokens", "seq", "gpus", "tp", "pp", "cp", "max_mbs")
    call = f"run_batch_layouts({', '.join(f'{n}={v}' for n, v in zip(names, args, strict=True))})"
    got = driver(call, "the layouts", student.run_batch_layouts, *args)
    expect_equal(got.get("layouts"), budget_reference(*args), f"{call}: every [dp, mbs, grad_accum], by mbs")


@BUDGET.check(points=1, hint="the global batch, in sequences, is shared by the data-parallel replicas; each "
                             "replica's share must split into whole micro-batches")
def budget_playbook_example(student, rng):
    """the playbook's example (1 M tokens, seq 4096, 8 GPUs, pp 4) and random clusters with tp and cp"""
    _expect_budget(student, 2**20, 4096, 8, 1, 4, 1, rng.choice([4, 8, 16]))
    for cp in (rng.choice([2, 3]), rng.choice([1, 2, 3]), 1):
        tp = rng.choice([1, 2, 4, 8])
        seq = rng.choice([1024, 2048, 4096, 8192]) * cp
        gpus = tp * cp * rng.choice([2, 3, 6, 12, 16, 48])
        dp = gpus // (tp * cp)
        _expect_budget(student, seq * dp * rng.choice([12, 16, 30, 64, 96]), seq, gpus, tp, 1, cp, rng.randrange(3, 13))


@BUDGET.check(points=1, hint="a pipeline of pp stages needs at least pp − 1 micro-batches (grad_accum); a batch of "
                             "fewer sequences than replicas, or not a whole number of sequences, has no layout")
def budget_pipelines_and_empty(student, rng):
    """pipelines need at least pp − 1 micro-batches; too small a batch, or not whole sequences, gives no layout"""
    pp, seq = rng.choice([4, 6, 8]), 4096
    gpus = pp * rng.choice([2, 4])
    dp = gpus // pp
    _expect_budget(student, seq * dp * rng.choice([2 * pp, 3 * pp, 24]), seq, gpus, 1, pp, 1, 16)
    _expect_budget(student, seq * (dp - 1), seq, gpus, 1, pp, 1, 4)  # fewer sequences than replicas
    _expect_budget(student, seq * dp * 8 + seq // 2, seq, gpus, 1, pp, 1, 4)  # half a sequence over


@BUDGET.check(points=1, hint="raise ValueError when tp·pp·cp does not divide the GPUs: no whole number of replicas")
def budget_bad_cluster(student, rng):
    """GPUs that tp·pp·cp does not divide: a ValueError"""
    tp, pp = rng.choice([2, 4, 8]), rng.choice([3, 5])
    gpus = tp * pp * rng.randrange(2, 9) + rng.randrange(1, tp)
    expect_raises("ValueError", f"batch_layouts(2**22, 4096, gpus={gpus}, tp={tp}, pp={pp}, cp=1, max_mbs=8)",
                  student.batch_layouts, 2**22, 4096, gpus, tp, pp, 1, 8,
                  why=f"{gpus} GPUs are not a whole number of tp·pp = {tp * pp} model replicas")


# --- 08.fix_config -----------------------------------------------------------------------------------------------

FIX = exercise("08.fix_config", entry=("diagnose", "fix", "run_diagnose", "run_fix"))

# The parallel fields each rule lets a fix change, besides dp and grad_accum.
ALLOWED = {
    "tp_heads": {"tp", "sp"}, "pp_layers": {"pp", "pp_schedule", "pp_virtual_stages"}, "ep_experts": {"ep"},
    "batch": set(), "sp_without_tp": {"sp", "tp"}, "zero_without_dp": {"zero"},
    "zero_with_pp": {"zero", "pp", "pp_schedule", "pp_virtual_stages"}, "zero_with_ep": {"zero", "ep"},
    "tp_with_mla": {"tp", "sp"}, "pp_with_tied_embeddings": {"pp", "pp_schedule", "pp_virtual_stages"},
}
MLA = {"preset": "tiny-moe", "attention": "mla", "n_kv_heads": 4, "head_dim": 16, "q_lora_rank": 16,
       "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8}


def broken_config(rng: random.Random, rule: str) -> dict:
    """A config that breaks `rule` and no other, on the tiny models."""
    batch = {"global_batch": 8 * rng.choice([3, 4, 6]), "seq_len": 32}
    if rule == "tp_heads":
        dp = rng.choice([1, 2, 4])
        return {"model": {"preset": "tiny"}, "parallel": {"dp": dp, "tp": rng.choice([6, 12])},
                "train": {"global_batch": 24 * dp, "seq_len": 32}}
    if rule == "pp_layers":
        return {"model": {"preset": "tiny", "n_layers": rng.choice([6, 10])},
                "parallel": {"dp": 2, "pp": 4, "grad_accum": 4}, "train": {"global_batch": 8 * rng.choice([1, 3])}}
    if rule == "ep_experts":
        return {"model": {"preset": "tiny-moe", "n_experts": rng.choice([6, 12])},
                "parallel": {"dp": 8, "ep": 8}, "train": batch}
    if rule == "batch":
        dp = rng.choice([2, 3])
        return {"model": {"preset": "tiny"}, "parallel": {"dp": dp, "grad_accum": 4},
                "train": {"global_batch": dp * rng.choice([2, 6, 10])}}
    if rule == "sp_without_tp":
        return {"model": {"preset": "tiny"}, "parallel": {"dp": rng.choice([2, 4]), "sp": True}, "train": batch}
    if rule == "zero_without_dp":
        return {"model": {"preset": "tiny"}, "parallel": {"tp": 2, "zero": rng.choice([1, 2, 3])}, "train": batch}
    if rule == "zero_with_pp":
        return {"model": {"preset": "tiny"}, "parallel": {"dp": 2, "pp": 2, "zero": rng.choice([2, 3]),
                                                          "grad_accum": 2}, "train": batch}
    if rule == "zero_with_ep":
        return {"model": {"preset": "tiny-moe"}, "parallel": {"dp": 4, "ep": rng.choice([2, 4]), "zero": 1},
                "train": batch}
    if rule == "tp_with_mla":
        return {"model": dict(MLA), "parallel": {"dp": rng.choice([1, 2]), "tp": 2}, "train": batch}
    if rule == "pp_with_tied_embeddings":
        return {"model": {"preset": "tiny", "tie_embeddings": True},
                "parallel": {"dp": rng.choice([1, 2]), "pp": 2, "grad_accum": 2}, "train": batch}
    raise ValueError(f"rule={rule!r} must be one of {', '.join(ALLOWED)}")


def lab_error(config: dict) -> str | None:
    """What lab.train says about `config`: its one-line error, or None if it runs it."""
    try:
        check_supported(Config.from_dict(copy.deepcopy(config)))
    except ValueError as error:
        return str(error)
    return None


def _parallel(section: dict) -> dict:
    return {**{f.name: f.default for f in dataclasses.fields(ParallelConfig)}, **section}


def _world(section: dict) -> int:
    p = _parallel(section)
    return p["dp"] * p["tp"] * p["pp"] * p["cp"]


def expect_fix(student, config: dict, rule: str) -> None:
    call = f"run_fix({config})"
    got = driver(call, "the fixed config", student.run_fix, config)
    if not got.get("input_untouched", False):
        raise CheckFailed(f"{call} returned a config but changed the one it was given, expected a new dict")
    fixed = got.get("fixed")
    if not isinstance(fixed, dict):
        raise CheckFailed(f"{call} returned {fixed!r:.200}, expected a config dict")
    error = lab_error(fixed)
    if error:
        raise CheckFailed(f"{call} returned a config that lab refuses ({error}), expected one that lab.train runs")
    for section in ("model", "train"):
        same = getattr(Config.from_dict({section: fixed.get(section, {})}), section) == \
            getattr(Config.from_dict({section: config[section]}), section)
        if not same:
            raise CheckFailed(f"{call} returned {section} = {fixed.get(section)}, expected the same {section} as given")
    if _world(fixed.get("parallel", {})) != _world(config["parallel"]):
        raise CheckFailed(f"{call} returned {fixed.get('parallel')} on {_world(fixed.get('parallel', {}))} ranks, "
                          f"expected the same {_world(config['parallel'])} ranks (dp takes those a degree gives up)")
    before, after = _parallel(config["parallel"]), _parallel(fixed.get("parallel", {}))
    changed = {k for k in after if after[k] != before.get(k)} - ALLOWED[rule] - {"dp", "grad_accum"}
    if changed:
        raise CheckFailed(f"{call} returned parallel = {fixed.get('parallel')}, changing {sorted(changed)}: expected "
                          f"changes to {sorted(ALLOWED[rule] | {'dp', 'grad_accum'})} only ({rule!r})")


def expect_equal_text(got, expected, what: str) -> None:
    """An answer that is a name (or None), compared exactly."""
    if got != expected:
        raise CheckFailed(f"{what} returned {got!r}, expected {expected!r}")


def _cases(rng: random.Random, rules: tuple[str, ...]):
    for rule in rules:
        config = broken_config(rng, rule)
        assert lab_error(config), (rule, config)  # lab refuses it, for the rule named
        yield rule, config


@FIX.check(points=1, hint="run the config through lab (Config.from_dict, then check_supported) and read the error's "
                          "line: each rule of the table names the words it contains")
def diagnose_every_rule(student, rng):
    """diagnose: the rule each broken config breaks, and None for one lab runs"""
    for rule, config in _cases(rng, tuple(ALLOWED)):
        call = f"run_diagnose({config})"
        got = driver(call, "the rule", student.run_diagnose, config)
        expect_equal_text(got.get("rule"), rule, f"{call}: the rule (lab says: {lab_error(config)})")
    fine = {"model": {"preset": "tiny"}, "parallel": {"dp": 2, "tp": 2}, "train": {"global_batch": 8}}
    expect_equal_text(driver("run_diagnose", "the rule", student.run_diagnose, fine).get("rule"), None,
                      f"run_diagnose({fine}): a config lab runs")


@FIX.check(points=1, hint="the degree must divide the model's shape, and the ranks it gives up must go somewhere: the "
                          "product of the four degrees stays what it was")
def fix_shape_rules(student, rng):
    """fix tp, pp and ep that do not divide the model: same ranks, dp takes what the degree gives up"""
    for rule, config in _cases(rng, ("tp_heads", "pp_layers", "ep_experts")):
        expect_fix(student, config, rule)


@FIX.check(points=1, hint="each refused combination is two features lab.train will not run together: give up one of "
                          "them (the one the rule is about) and keep every rank busy")
def fix_refused_layouts(student, rng):
    """fix the layouts lab.train refuses: ZeRO with PP or EP, TP with MLA, PP with tied embeddings"""
    for rule, config in _cases(rng, ("zero_with_pp", "zero_with_ep", "tp_with_mla", "pp_with_tied_embeddings")):
        expect_fix(student, config, rule)


@FIX.check(points=1, hint="the batch split, sp and ZeRO each depend on another degree: when that degree cannot change, "
                          "change what depends on it, and leave the global batch as it is")
def fix_batch_and_switches(student, rng):
    """fix the batch split, SP without TP and ZeRO without DP, leaving the global batch as it is"""
    for rule, config in _cases(rng, ("batch", "sp_without_tp", "zero_without_dp")):
        expect_fix(student, config, rule)


# --- 08.best_layout ----------------------------------------------------------------------------------------------

BEST = exercise("08.best_layout", entry=("best_layout", "why_not", "run_best_layout", "run_why_not"),
                modules=("lab.config", "lab.calc"))
STEP_PARTS = ("compute", "tp", "cp", "ep", "pp", "dp", "bubble")
LAYOUT_FIELDS = ("dp", "tp", "pp", "cp", "ep", "zero", "pp_schedule", "recompute")


def random_cluster(rng: random.Random) -> tuple:
    """(model, gpus, gpus_per_node, seq, gbs_tokens): a small model on up to 32 H100s, so that a search is quick."""
    model = rng.choice(["llama3-1b", "smollm-135m", "llama3-8b"])
    gpus_per_node = rng.choice([4, 8])
    gpus = gpus_per_node * rng.choice([2, 4] if model == "llama3-8b" else [1, 2, 4])
    seq = 2048 if model == "smollm-135m" else rng.choice([2048, 4096])  # SmolLM's max_seq_len is 2048
    return model, gpus, gpus_per_node, seq, seq * gpus * rng.choice([4, 8, 16])


def _search(args: tuple):
    from lab.calc.search import search

    model, gpus, gpus_per_node, seq, gbs_tokens = args
    return search(model, gpus, gpus_per_node, "h100", seq, gbs_tokens)


def losing_part(result, family: str) -> tuple[str, float]:
    """The step-time part in which `family`'s best layout loses most to the best one, and by how much over the
    runner-up part (seconds)."""
    best = result.candidates[0]
    ours = next(c for c in result.candidates if c.family == family)
    lost = sorted(((getattr(ours.time, p) - getattr(best.time, p), p) for p in STEP_PARTS), reverse=True)
    return lost[0][1], lost[0][0] - lost[1][0]


def _call(args: tuple) -> str:
    return ", ".join(map(repr, args))


@BEST.check(points=1, hint="the search's candidates are ranked: read the fields of the best one")
def best_is_the_first_candidate(student, rng):
    """the best layout: the search's first candidate (degrees, ZeRO, schedule, recompute, mbs, grad_accum)"""
    for _ in range(2):
        args = random_cluster(rng)
        best = _search(args).candidates[0]
        expected = {**{k: getattr(best.parallel, k) for k in LAYOUT_FIELDS}, "mbs": best.mbs,
                    "grad_accum": best.grad_accum}
        call = f"run_best_layout({_call(args)})"
        got = driver(call, "the best layout", student.run_best_layout, *args)
        if {k: got.get(k) for k in expected} != expected:
            raise CheckFailed(f"{call} returned {got}, expected {expected} ({best.layout}, mbs {best.mbs})")


def _expect_reasons(student, args: tuple, families: list[str], expected: list[str], what: str) -> None:
    call = f"run_why_not({_call(args)}, {families})"
    got = driver(call, "a reason per family", student.run_why_not, *args, families)
    if got.get("reasons") != expected:
        raise CheckFailed(f"{call} returned {got.get('reasons')}, expected {expected} ({what})")


@BEST.check(points=1, hint="a family with no candidate left was rejected: the search records why, as a reason and a "
                           "message; the answer is the reason")
def why_not_a_rejected_family(student, rng):
    """why not a family the search rejected: the reason that stops its layouts closest to running"""
    for _ in range(10):
        args = random_cluster(rng)
        rejected = _search(args).rejected_families()
        if rejected:
            family = rng.choice(sorted(rejected))
            _expect_reasons(student, args, [family], [rejected[family].main_reason()[0]],
                            f"no layout of {family} survived: {rejected[family].main_reason()[1]}")
            return
    raise RuntimeError("no cluster with a rejected family in 10 draws")


@BEST.check(points=1, hint="compare the family's best candidate (its first in the ranked list) with the overall best, "
                           "part by part: the answer is the part where the family loses the most time")
def why_not_a_slower_family(student, rng):
    """why not a family that runs but is slower: the part of the step time where it loses most to the best"""
    for _ in range(10):
        args = random_cluster(rng)
        result = _search(args)
        best = result.candidates[0]
        families = list(dict.fromkeys(c.family for c in result.candidates if c.family != best.family))
        clear = [f for f in families if losing_part(result, f)[1] > 1e-3 * best.time.total]  # no near-tie
        pick = [f for f in clear if losing_part(result, f)[0] != "compute"][:1] + \
            [f for f in clear if losing_part(result, f)[0] == "compute"][:1]
        if pick:
            _expect_reasons(student, args, pick, [losing_part(result, f)[0] for f in pick],
                            f"the best is {best.layout}")
            return
    raise RuntimeError("no cluster with a clearly slower family in 10 draws")


# --- 08.llama3_layout --------------------------------------------------------------------------------------------

LLAMA3 = exercise("08.llama3_layout", entry=("by_hand", "run_by_hand"))


def by_hand_reference(n_layers: int, gpus: int, gpus_per_node: int, pp: int, global_batch: int, mbs: int,
                      chunks: int) -> dict:
    """Llama 3's walk (chapter 08, section 5a): TP over the node, dp from the rest, the layers over pp·chunks
    virtual stages by Llama 3's rule (`lab.layout.stage_layers`, "llama3"), the micro-batches each replica runs and
    the bubble's closed form (`lab.calc.bubble.bubble_ratio`). ValueError where a step fails."""
    from lab.calc.bubble import bubble_ratio
    from lab.layout import stage_layers

    tp = gpus_per_node
    if gpus % (tp * pp):
        raise ValueError(f"gpus={gpus} is not a multiple of tp*pp = {tp * pp}")
    dp = gpus // (tp * pp)
    stages = stage_layers(n_layers, pp * chunks, "llama3")
    if global_batch % (dp * mbs):
        raise ValueError(f"global_batch={global_batch} does not split into dp={dp} replicas of micro-batches of {mbs}")
    m = global_batch // (dp * mbs)
    return {"tp": tp, "dp": dp, "stages": stages, "micro_batches": m, "bubble": bubble_ratio(pp, m, chunks)}


def _expect_by_hand(student, *args: int) -> None:
    names = ("n_layers", "gpus", "gpus_per_node", "pp", "global_batch", "mbs", "chunks")
    call = f"run_by_hand({', '.join(f'{n}={v}' for n, v in zip(names, args, strict=True))})"
    expected = by_hand_reference(*args)
    got = driver(call, "tp, dp, the stages, the micro-batches and the bubble", student.run_by_hand, *args)
    for key in ("tp", "dp", "stages", "micro_batches"):
        expect_equal(got.get(key), expected[key], f"{call}[{key!r}]")
    expect_number(got.get("bubble"), expected["bubble"], f"{call}['bubble']", tol=1e-9)


@LLAMA3.check(points=1, hint="the first and the last virtual stage get one layer fewer than the others, which all "
                             "get the same: k - 1, k, ..., k, k - 1 with pp·chunks·k - 2 = n_layers")
def llama3_stages(student, rng):
    """Llama 3 405B on 8,192 and 16,384 GPUs (126 layers, TP8 · PP16), and random models split Llama 3's way"""
    for gpus, chunks in ((16384, 1), (8192, 2), (16384, 4)):
        _expect_by_hand(student, 126, gpus, 8, 16, 2048, 1, chunks)
    for _ in range(3):
        pp, chunks, k = rng.choice([2, 3, 4, 6, 8]), rng.choice([1, 2, 3]), rng.randrange(2, 7)
        dp = rng.choice([1, 2, 3, 8])
        _expect_by_hand(student, pp * chunks * k - 2, 8 * pp * dp, 8, pp, dp * rng.choice([4, 8, 12, 16]), 1, chunks)


@LLAMA3.check(points=1, hint="each replica runs global_batch / (dp · mbs) micro-batches; the interleaved bubble is "
                             "(pp - 1) / (chunks · micro-batches) of the useful time")
def llama3_bubble(student, rng):
    """the micro-batches of a replica and the bubble, with micro-batches of more than one sequence and nodes of 4"""
    for _ in range(4):
        g, pp, chunks, mbs = rng.choice([4, 8]), rng.choice([2, 4, 5]), rng.choice([1, 2, 4]), rng.choice([1, 2, 4])
        dp = rng.choice([2, 3, 6])
        _expect_by_hand(student, pp * chunks * 4 - 2, g * pp * dp, g, pp, dp * mbs * rng.choice([3, 8, 16]), mbs,
                        chunks)


@LLAMA3.check(points=1, hint="raise ValueError when the GPUs are not whole replicas of tp·pp, when the layers do not "
                             "split Llama 3's way, or when the batch does not split into the replicas' micro-batches")
def llama3_refuses(student, rng):
    """what does not split: GPUs, layers (Llama 3's rule, or stages of one layer) and the batch: a ValueError"""
    pp = rng.choice([4, 8])
    cases = [((126, 8 * pp * 4 + 8, 8, pp, 512, 1, 1), "the GPUs are not whole replicas of tp·pp"),
             ((127, 8 * 16 * 8, 8, 16, 512, 1, 1), "127 + 2 layers is no multiple of 16 stages"),
             ((pp - 2, 8 * pp, 8, pp, 64, 1, 1), "k = 1: the first and the last stage would hold no layer"),
             ((126, 8 * 16 * 8, 8, 16, 8 * 16 + 4, 1, 1), "the batch is not a whole number of sequences a replica")]
    for args, why in cases:
        expect_raises("ValueError", f"by_hand{args}", student.by_hand, *args, why=why)
