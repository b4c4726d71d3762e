"""ZeRO-1/2/3 on real gloo ranks: equal to one process and to FSDP2, 1/dp of the bytes, exact collectives."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from test_dp import (
    CONFIG,
    TRAIN,
    assert_grads_close,
    assert_matches_reference,
    engine_after_finish,
    make_engine,
    micro_batches,
    reference_grads,
    train,
    train_variants,
)
from test_dp import _first_batch as first_batch

from lab.calc.memory import static_bytes
from lab.distributed import count_collectives, run
from lab.model import build_model, materialize, num_params
from lab.parallel.optim import adamw, clip_grad_norm
from lab.parallel.zero import Zero, make_data_parallel

# Units: the root (embedding, final norm, output) and each block; their parameter counts are all odd.
_BLOCK = num_params(build_model(CONFIG).layers["0"])
UNIT_NUMELS = [num_params(build_model(CONFIG)) - CONFIG.n_layers * _BLOCK] + [_BLOCK] * CONFIG.n_layers


def _shard(numel: int, world: int) -> int:
    return math.ceil(numel / world)


@functools.cache
def zero_runs(world: int) -> dict[tuple[str, int], dict]:
    return run(train_variants, world, ("zero1", "zero2", "zero3", "fsdp2"))[0]


@pytest.mark.parametrize("grad_accum", [1, 3])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_equals_one_process(stage, world, grad_accum):
    assert_matches_reference(zero_runs(world)[f"zero{stage}", grad_accum])


@pytest.mark.parametrize("grad_accum", [1, 3])
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_gives_the_same_as_lab_zero3(world, grad_accum):
    """torch's FSDP2 (fully_shard per block, set_requires_gradient_sync for accumulation): the same results."""
    assert_matches_reference(zero_runs(world)["fsdp2", grad_accum])


def test_zero3_with_activation_recomputation():
    """Recomputing a block in backward runs its forward hooks again: they must neither gather nor free."""
    assert_matches_reference(run(train, 2, "zero3", 1, recompute="full")[0])


@functools.cache
def tied_moe_runs() -> dict[tuple[str, int], dict]:
    return run(train_variants, 2, ("bucketed", "zero2", "zero3"), (3,), "tied-moe")[0]


@pytest.mark.parametrize("kind", ["bucketed", "zero2", "zero3"])
def test_tied_embeddings_and_experts(kind):
    """A weight shared by two modules lives in one unit and gets one gradient hook; every expert of a MoE
    block gets a gradient (zeros when no token chose it), so no unit or bucket waits forever."""
    assert_matches_reference(tied_moe_runs()[kind, 3], model_name="tied-moe")


def _phase_counts(stage: int, grad_accum: int) -> list[dict]:
    """Collective calls and bytes in each phase of one step: every micro-batch, finish, clip, step (the
    optimizer's, then the engine's `after_step`)."""
    engine = make_engine(f"zero{stage}", materialize(build_model(CONFIG), seed=0))
    optimizer = adamw(engine.parameters(), TRAIN.lr, TRAIN.weight_decay)
    phases = []
    for i, (x, y) in enumerate(micro_batches(first_batch(), grad_accum)):
        with count_collectives() as counts, engine.backward_context(last_micro_batch=i == grad_accum - 1):
            (F.cross_entropy(engine.model(x).flatten(0, 1), y.flatten()) / grad_accum).backward()
        phases.append(counts)
    for phase in (engine.finish, lambda: clip_grad_norm(engine.parameters(), TRAIN.grad_clip),
                  lambda: (optimizer.step(), engine.after_step())):
        with count_collectives() as counts:
            phase()
        phases.append(counts)
    return [{op: (counts.calls[op], counts.bytes[op]) for op in counts.calls} for counts in phases]


def _all_stages(grad_accum: int) -> dict[int, list[dict]]:
    return {stage: _phase_counts(stage, grad_accum) for stage in (1, 2, 3)}


def test_exact_collectives_per_step():
    """Per unit and step: ZeRO-1/2 one reduce-scatter (in the last backward) and one all-gather (after the
    optimizer step); ZeRO-3 two all-gathers per micro-batch (before forward, before backward) and one
    reduce-scatter. Bytes: the padded unit into reduce-scatter, one shard out of each rank per all-gather.
    Clipping adds one all-reduce of an 8-byte scalar (the sum of squares, in float64)."""
    world, grad_accum, units = 4, 3, len(UNIT_NUMELS)
    padded = 4 * sum(_shard(n, world) * world for n in UNIT_NUMELS)
    shards = 4 * sum(_shard(n, world) for n in UNIT_NUMELS)
    rs, ag = "reduce_scatter_single", "all_gather_single"
    norm = {"all_reduce": (1, 8)}
    for stage, phases in run(_all_stages, world, grad_accum)[0].items():
        *accumulating, last, finish, clip, step = phases
        if stage < 3:
            assert accumulating == [{}] * (grad_accum - 1), stage  # no_sync: nothing leaves the rank
            assert (last, finish, clip, step) == ({rs: (units, padded)}, {}, norm, {ag: (units, shards)}), stage
        else:
            gathers = {ag: (2 * units, 2 * shards)}
            assert accumulating == [gathers] * (grad_accum - 1)
            assert (last, finish, clip, step) == ({**gathers, rs: (units, padded)}, {}, norm, {})


def _resident(stage: int) -> dict[str, dict[str, int]]:
    """Bytes per category after finish (gradients reduced), after the step (optimizer states exist) and, for
    ZeRO-3, inside the last block's forward (the only block gathered then; nothing left to prefetch)."""
    model = materialize(build_model(CONFIG), seed=0)
    engine = make_engine(f"zero{stage}" if stage else "naive", model)
    optimizer = adamw(engine.parameters(), TRAIN.lr, TRAIN.weight_decay)
    seen = {}

    def in_last_block(*_) -> None:
        seen.setdefault("in_last_block", engine.resident_bytes(optimizer))

    model.layers[str(CONFIG.n_layers - 1)].attn.register_forward_hook(in_last_block)
    (x, y), = micro_batches(first_batch(), 1)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    engine.finish()
    seen["after_finish"] = engine.resident_bytes(optimizer)
    clip_grad_norm(engine.parameters(), TRAIN.grad_clip)
    optimizer.step()
    engine.after_step()
    seen["after_step"] = engine.resident_bytes(optimizer)
    return seen


def _resident_all_stages() -> dict[int, dict]:
    return {stage: _resident(stage) for stage in (0, 1, 2, 3)}


@functools.cache
def resident_runs(world: int) -> list[dict[int, dict]]:
    return run(_resident_all_stages, world)


@pytest.mark.parametrize("world", [2, 4])
def test_resident_bytes_shrink_by_dp(world):
    """Measured on live tensors, per rank: ZeRO-1 holds 1/dp of the optimizer states, ZeRO-2 also 1/dp of
    the gradients, ZeRO-3 also 1/dp of the parameters (plus the gathered units while a block computes)."""
    shards = 4 * sum(_shard(n, world) for n in UNIT_NUMELS)  # bytes of one rank's shard of every unit
    padded = 4 * sum(_shard(n, world) * world for n in UNIT_NUMELS)
    gathered = 4 * (_shard(UNIT_NUMELS[0], world) + _shard(UNIT_NUMELS[-1], world)) * world  # root + last block
    for rank_result in resident_runs(world):
        dp = rank_result[0]
        psi = dp["after_step"]["params"]
        assert psi == 4 * sum(UNIT_NUMELS) == dp["after_finish"]["grads"]

        def about_1_over_dp(value: int, full: int) -> bool:  # padding and AdamW's per-piece step counters
            return abs(value * world / full - 1) < 0.02

        for stage in (1, 2, 3):
            after_finish, after_step = rank_result[stage]["after_finish"], rank_result[stage]["after_step"]
            assert about_1_over_dp(after_step["optimizer"], dp["after_step"]["optimizer"]), stage
            assert after_finish["grads"] == (padded + shards if stage == 1 else shards), stage
            assert after_step["params"] == (shards if stage == 3 else padded), stage
        assert rank_result[3]["in_last_block"]["params"] == shards + gathered


def test_zero_needs_a_process_group_and_a_stage():
    model = materialize(build_model(CONFIG))
    with pytest.raises(ValueError, match="zero=2 needs a process group"):
        make_data_parallel(model, None, zero=2)
    with pytest.raises(ValueError, match="stage=4 must be 1, 2 or 3"):
        Zero(model, None, 4)


@pytest.mark.parametrize("world", [2, 4])
def test_resident_bytes_equal_the_calculator(world):
    """The live bytes of every stage equal `lab.calc.memory.static_bytes` (fp32: 4 + 4 + 8 bytes per
    parameter, sharded per ZeRO's ladder) up to what the calculator does not model: each unit's padding to a
    multiple of dp, AdamW's 4-byte step counter per parameter piece, and ZeRO-1's reduce-scatter output (one
    gradient shard, 1/dp) kept beside its full gradient buffer."""
    n = sum(UNIT_NUMELS)
    padding = 4 * len(UNIT_NUMELS) * world  # at most dp - 1 padded elements per unit, per fp32 tensor
    steps = 4 * len(list(build_model(CONFIG).parameters()))  # at most one piece per parameter on a rank
    shards = 4 * sum(_shard(u, world) for u in UNIT_NUMELS)
    for rank_result in resident_runs(world):
        for stage in (0, 1, 2, 3):
            predicted = static_bytes(n, "fp32", zero=stage, dp=world)
            measured = {"params": rank_result[stage]["after_step"]["params"],
                        "grads": rank_result[stage]["after_finish"]["grads"] - (shards if stage == 1 else 0),
                        "optimizer": rank_result[stage]["after_step"]["optimizer"]}
            for key, allowance in (("params", padding), ("grads", padding), ("optimizer", 2 * padding + steps)):
                assert abs(measured[key] - predicted[key]) <= allowance, (stage, key, measured, predicted)


def _shard_grads(stage: int, grad_accum: int) -> list[tuple[list[str], int, int, object]]:
    """Right after `finish()`: each unit's parameter names (in buffer order), shard start and size, and the
    averaged gradient shard this rank holds (numpy)."""
    engine = engine_after_finish(f"zero{stage}", grad_accum)
    names = {param: name for name, param in engine.names.items()}  # ZeRO-3's module holds the pieces
    return [([names[p] for p in unit.offsets], unit.start, unit.shard_numel, unit.shard_grad.clone().numpy())
            for unit in engine.units]


@pytest.mark.parametrize("world,grad_accum", [(2, 1), (4, 3)])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradient_shards_equal_one_process_right_after_finish(stage, world, grad_accum):
    """Each rank's shard of each unit's averaged gradient, before clipping and AdamW (which hide a uniform
    scale such as a missing 1/dp), equals the same slice of the single-process gradient."""
    want = reference_grads()
    for rank, units in enumerate(run(_shard_grads, world, stage, grad_accum)):
        for names, start, size, shard in units:
            flat = torch.cat([want[name].flatten() for name in names])
            expected = F.pad(flat, (0, size * world - flat.numel()))[start:start + size]
            where = f"rank {rank}, unit from {names[0]}"
            assert_grads_close({where: torch.from_numpy(shard)}, {where: expected})
