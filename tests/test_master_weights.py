"""lab.precision.master: fp32 master weights and fp32 gradient sums for a model computing in bf16.

Three runs of one tiny regression from the same (bf16-representable) start: (a) fp32, (b) bf16 parameters with
fp32 masters, (c) bf16 parameters updated in bf16. At lr 1e-4 most AdamW updates are below half a bf16 ulp of
the weight they change, so (c) loses them and (b) keeps them: (b) must track (a) far more closely than (c).
Models are tiny (bf16 matmuls are slow on CPU).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lab.config import PRESETS as MODELS
from lab.config import ModelConfig, ParallelConfig
from lab.model import build_model, materialize
from lab.parallel.optim import adamw
from lab.parallel.parallelize import build_mesh, parallelize
from lab.parallel.placement import Placement, place, placement_of
from lab.precision.loss_scale import DynamicLossScaler
from lab.precision.master import PRESETS, MasterWeights, MixedPrecisionPolicy
from lab.precision.scheme import precision_scheme

BF16 = MixedPrecisionPolicy.preset("bf16")
STEPS, LR = 20, 1e-4


def _model(dtype: torch.dtype) -> nn.Module:
    """The same start in every dtype: weights drawn in fp32 and rounded to bf16, exact in all three."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16())
    return model.to(dtype)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(64, 32, generator=gen), torch.randn(64, 8, generator=gen)


def _train(mode: str) -> tuple[list[torch.Tensor], list[float]]:
    """`fp32`, `masters` (bf16 model, fp32 masters) or `bf16` (bf16 model, bf16 update); returns the final
    weights (in fp32) and the losses."""
    model = _model(torch.float32 if mode == "fp32" else torch.bfloat16)
    masters = MasterWeights(model.parameters(), BF16) if mode == "masters" else None
    optimizer = adamw(masters.master_params if masters else model.parameters(), lr=LR, weight_decay=0.0)
    x, y = _data()
    dtype = next(model.parameters()).dtype
    losses = []
    for _ in range(STEPS):
        loss = nn.functional.mse_loss(model(x.to(dtype)).float(), y)
        loss.backward()
        if masters:
            masters.grads_to_master()
        optimizer.step()
        if masters:
            masters.master_to_model()
        optimizer.zero_grad()
        model.zero_grad()
        losses.append(loss.item())
    return [p.detach().float() for p in (masters.master_params if masters else model.parameters())], losses


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[list[torch.Tensor], list[float]]]:
    return {mode: _train(mode) for mode in ("fp32", "masters", "bf16")}


def _distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return torch.cat([(x - y).flatten() for x, y in zip(a, b, strict=True)]).norm().item()


def test_master_weights_track_fp32_and_bf16_updates_do_not(runs):
    start = [p.detach().float() for p in _model(torch.float32).parameters()]
    moved = _distance(runs["fp32"][0], start)
    with_masters, without = _distance(runs["masters"][0], runs["fp32"][0]), _distance(runs["bf16"][0], runs["fp32"][0])
    assert with_masters < 0.1 * moved, "fp32 masters should follow the fp32 run closely"
    assert without > 0.5 * moved, "bf16 updates should lose most of the fp32 run's progress"
    assert with_masters < 0.1 * without
    fp32_drop = runs["fp32"][1][0] - runs["fp32"][1][-1]
    assert runs["masters"][1][0] - runs["masters"][1][-1] == pytest.approx(fp32_drop, rel=0.1)


def test_an_update_below_half_a_bf16_ulp_vanishes_without_masters_and_adds_up_with_them():
    """w = 1.0, gradient -1, SGD lr 1e-3: 100 updates of 1e-3, each below half of bf16's spacing at 1 (2^-8)."""
    def descend(masters: bool) -> float:
        weight = nn.Parameter(torch.ones((), dtype=torch.bfloat16))
        master = MasterWeights([weight], BF16) if masters else None
        optimizer = torch.optim.SGD(master.master_params if master else [weight], lr=1e-3)
        for _ in range(100):
            (-weight.float()).backward()
            if master:
                master.grads_to_master()
            optimizer.step()
            if master:
                master.master_to_model()
            optimizer.zero_grad()
            weight.grad = None
        return weight.item()

    assert descend(masters=False) == 1.0  # every update rounded away
    assert descend(masters=True) == torch.tensor(1.1).bfloat16().item()  # 1.1 in fp32, rounded for the model


def test_fp32_gradient_sums_over_micro_batches_beat_bf16_sums():
    """16 micro-batches' bf16 gradients summed in the reduce_dtype; the reference sums the same gradients in
    fp64, so only the summation differs."""
    model = _model(torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    batches = [(torch.randn(4, 32, generator=gen).bfloat16(), torch.randn(4, 8, generator=gen)) for _ in range(16)]
    grads = []
    for x, y in batches:
        model.zero_grad()
        nn.functional.mse_loss(model(x).float(), y).backward()
        grads.append([p.grad.double() for p in model.parameters()])
    exact = [sum(g[i] for g in grads) for i in range(len(grads[0]))]

    def error(reduce_dtype: torch.dtype) -> float:
        masters = MasterWeights(model.parameters(), MixedPrecisionPolicy(torch.bfloat16, reduce_dtype))
        model.zero_grad()
        for x, y in batches:
            nn.functional.mse_loss(model(x).float(), y).backward()
            masters.grads_to_master()
        got = [m.grad.double() for m in masters.master_params]
        return _distance(got, exact) / torch.cat([e.flatten() for e in exact]).norm().item()

    fp32, bf16 = error(torch.float32), error(torch.bfloat16)
    assert fp32 < 1e-6 and bf16 > 1e-3
    # and the sum that autograd itself makes in the bf16 .grad, one grads_to_master at the end, is as coarse
    masters = MasterWeights(model.parameters(), BF16)
    model.zero_grad()
    for x, y in batches:
        nn.functional.mse_loss(model(x).float(), y).backward()
    masters.grads_to_master()
    got = [m.grad.double() for m in masters.master_params]
    assert _distance(got, exact) / torch.cat([e.flatten() for e in exact]).norm().item() > 100 * fp32


def test_fp16_step_with_loss_scaling_and_masters():
    """The fp16 recipe end to end, in the order a training step takes: backward on the scaled loss, gradients
    into the fp32 masters, unscale and check there, step (skipped on an overflow), masters back to the model."""
    model = _model(torch.float16)
    masters = MasterWeights(model.parameters(), PRESETS["fp16"])
    optimizer = adamw(masters.master_params, lr=1e-2, weight_decay=0.0)
    scaler = DynamicLossScaler(init_scale=2.0**12, growth_interval=3)
    x, y = _data()
    losses, stepped = [], []
    for step in range(5):
        loss = nn.functional.mse_loss(model(x.half()).float(), y)
        scaler.scale(loss).backward()
        if step == 2:
            next(model.parameters()).grad[0, 0] = float("inf")  # an fp16 overflow in backward
        masters.grads_to_master()
        before = [m.detach().clone() for m in masters.master_params]
        stepped.append(scaler.step(optimizer))
        scaler.update()
        masters.master_to_model()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step == 2:
            assert all(torch.equal(b, m) for b, m in zip(before, masters.master_params, strict=True))
    assert stepped == [True, True, False, True, True]
    assert scaler.get_scale() == 2.0**11  # backed off once; the overflow restarted the count, so no growth
    assert losses[-1] < losses[0]
    assert all(torch.equal(p, m.half()) for p, m in zip(model.parameters(), masters.master_params, strict=True))


def test_none_gradients_and_partial_pieces():
    """Only the tensors given: views of a flat bf16 buffer (ZeRO's pieces), one of them without a gradient."""
    flat = torch.arange(8, dtype=torch.bfloat16)
    pieces = [nn.Parameter(flat[:5]), nn.Parameter(flat[5:])]
    masters = MasterWeights(pieces, BF16)
    pieces[0].grad = torch.ones(5, dtype=torch.bfloat16)
    masters.grads_to_master()
    assert masters.master_params[1].grad is None and torch.equal(pieces[0].grad, torch.zeros(5, dtype=torch.bfloat16))
    torch.optim.SGD(masters.master_params, lr=0.25).step()  # a None gradient: that master is not touched
    masters.master_to_model()
    assert flat.tolist() == [-0.25, 0.75, 1.75, 2.75, 3.75, 5, 6, 7]  # written through the views


def test_masters_carry_the_attributes_the_optimizer_and_norm_read():
    matrix = place(nn.Parameter(torch.zeros(4, 2, dtype=torch.bfloat16)), Placement(tp_dim=0, tp_parts=2))
    piece = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    piece.decays = True  # a flat piece of a matrix, as ZeRO marks it
    norm_weight = nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    masters = MasterWeights([matrix, piece, norm_weight], BF16)
    assert all(m.dtype == torch.float32 and m.is_leaf for m in masters.master_params)
    assert placement_of(masters.master_params[0]) == Placement(tp_dim=0, tp_parts=2)
    groups = adamw(masters.master_params, lr=1.0, weight_decay=0.1).param_groups
    assert [len(g["params"]) for g in groups] == [2, 1]  # matrix and piece decay, the norm weight does not


def test_fp32_policy_keeps_no_copy():
    params = list(_model(torch.float32).parameters())
    masters = MasterWeights(params, PRESETS["fp32"])
    assert all(m is p for m, p in zip(masters.master_params, params, strict=True))


def test_policy_presets_and_validation():
    assert BF16 == MixedPrecisionPolicy(torch.bfloat16, torch.float32, torch.float32)
    assert BF16.needs_master_weights and not BF16.needs_loss_scaling
    assert PRESETS["fp16"].needs_loss_scaling and not PRESETS["fp32"].needs_master_weights
    with pytest.raises(ValueError, match="'fp8' must be one of fp32, bf16, fp16"):
        MixedPrecisionPolicy.preset("fp8")
    with pytest.raises(ValueError, match="param_dtype=torch.int8"):
        MixedPrecisionPolicy(torch.int8)
    with pytest.raises(ValueError, match="reduce_dtype=torch.bfloat16 must be at least as wide"):
        MixedPrecisionPolicy(torch.float32, torch.bfloat16)
    with pytest.raises(ValueError, match="torch.float32 given for param_dtype=torch.bfloat16"):
        MasterWeights(_model(torch.float32).parameters(), BF16)


def _fp32_reference(cfg: ModelConfig, seed: int) -> nn.Module:
    """The single-process fp32 model of the same seed: the values every layout and precision starts from."""
    return materialize(build_model(cfg), seed=seed)


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp8-tilewise"])
def test_masters_start_from_the_fp32_initial_values_bitwise(precision):
    """Issue 33: the masters were the upcast of the already-rounded weights, so at step 0 they differed from the fp32
    run's (an fp16 embedding by 9.7e-4 in norm). FSDP2's masters are the fp32 values themselves; so are lab's."""
    cfg = MODELS["tiny"]
    par = parallelize(cfg, None, ParallelConfig(), torch.device("cpu"), 3, 32, precision=precision_scheme(precision))
    reference = dict(_fp32_reference(cfg, 3).named_parameters())
    for name, param in par.model.named_parameters():
        master = par.masters.master(param)
        assert master.dtype == torch.float32
        assert torch.equal(master, reference[name]), f"{name}: {(master - reference[name]).norm():.1e} off in norm"
        assert torch.equal(param, reference[name].to(param.dtype)), name  # and the weights are those, rounded


def test_zero3_pieces_start_from_their_slice_of_the_fp32_values():
    """ZeRO-3 on 2 ranks (rank 1 of a fake process group: no other rank runs, its broadcast leaves values as they
    are): each master is its piece's slice of the fp32 parameter, `flat_range` of its flattened value."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend

    cfg = MODELS["tiny"]
    parallel = ParallelConfig(dp=2, zero=3)
    dist.init_process_group("fake", rank=1, world_size=2, store=dist.HashStore())
    try:
        par = parallelize(cfg, build_mesh(parallel), parallel, torch.device("cpu"), 5, 32,
                          precision=precision_scheme("fp16"))
        pieces = par.engine.named_parameters()
    finally:
        dist.destroy_process_group()
    reference = dict(_fp32_reference(cfg, 5).named_parameters())
    assert len(pieces) == len(par.masters.master_params) > 0
    for name, piece in pieces:
        start, end = piece.flat_range
        assert torch.equal(par.masters.master(piece), reference[name].flatten()[start:end]), name


def test_initial_values_must_be_those_the_weights_were_rounded_from():
    weight = nn.Parameter(torch.tensor([0.1, 0.2]).half())
    assert MasterWeights([weight], PRESETS["fp16"], [torch.tensor([0.1, 0.2])]).master_params[0].tolist() == \
        pytest.approx([0.1, 0.2], abs=0, rel=1e-7)
    with pytest.raises(ValueError, match=r"^initial\[0\] does not round to its parameter \(shape \(2,\)\)"):
        MasterWeights([weight], PRESETS["fp16"], [torch.tensor([0.1, 0.3])])
    with pytest.raises(ValueError, match=r"^initial\[0\] is torch.float16 \(2,\) for a parameter of shape \(2,\)"):
        MasterWeights([weight], PRESETS["fp16"], [weight.detach()])
    with pytest.raises(ValueError, match="initial has 0 tensors for 1 parameters"):
        MasterWeights([weight], PRESETS["fp16"], [])
