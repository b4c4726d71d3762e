"""lab.precision.loss_scale: dynamic loss scaling, checked step for step against torch's own GradScaler.

The two run side by side on twin fp32 models with lab.train's AdamW; inf and nan gradients are injected at
chosen steps and growth_interval is small, so one short run goes through growth, back-off, skipped steps and a
growth count restarted by an overflow. Scale, growth count, skipped steps and parameters must agree bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lab.distributed import run
from lab.parallel.optim import adamw
from lab.precision.loss_scale import DynamicLossScaler

STEPS = 12
INJECT = {3: float("inf"), 4: float("nan"), 9: float("inf")}  # step -> value written into one gradient
GROWTH_INTERVAL = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)) for _ in range(STEPS)]


def _trajectory(scaler: DynamicLossScaler | torch.amp.GradScaler) -> list[dict]:
    """Train STEPS steps with `scaler`; per step: the scale used, whether the step was taken, the growth count
    after update, and the parameters after the step."""
    model = _model()
    optimizer = adamw(model.parameters(), lr=1e-2, weight_decay=0.1)
    log = []
    for step, (x, y) in enumerate(_batches()):
        scale = scaler.get_scale()
        loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        if step in INJECT:
            model[0].weight.grad[1, 2] = INJECT[step]
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = optimizer.state[model[0].weight].get("step", torch.tensor(0.0)).item()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        log.append({"scale": scale, "stepped": optimizer.state[model[0].weight]["step"].item() > before,
                    "tracker": scaler.state_dict()["_growth_tracker"],
                    "params": [p.detach().clone() for p in model.parameters()]})
    return log


FACTORS = {"powers of 2": (2.0**10, 2.0, 0.5),  # the defaults' shape: exact arithmetic
           "odd factors": (3.0, 1.7, 0.3)}  # the product rounded to fp32 the way GradScaler rounds it


@pytest.fixture(scope="module", params=list(FACTORS))
def both(request) -> tuple[list[dict], list[dict], tuple[float, float, float]]:
    init, growth, backoff = FACTORS[request.param]
    kwargs = dict(init_scale=init, growth_factor=growth, backoff_factor=backoff, growth_interval=GROWTH_INTERVAL)
    return (_trajectory(DynamicLossScaler(**kwargs)), _trajectory(torch.amp.GradScaler(device="cpu", **kwargs)),
            FACTORS[request.param])


def test_scale_trajectory_equals_grad_scaler(both):
    ours, torchs, (init, growth, backoff) = both
    assert [e["scale"] for e in ours] == [e["scale"] for e in torchs]
    assert [e["tracker"] for e in ours] == [e["tracker"] for e in torchs]
    # the rule spelled out: grow after the 3 clean steps 0-2 and 5-7 (the count restarted by the overflows of
    # steps 3 and 4), back off after 3, 4 and 9 (steps 8 and 10-11 are counted, too few to grow)
    g, b = growth, backoff
    expected = [1, 1, 1, g, g * b, g * b * b, g * b * b, g * b * b, g * g * b * b, g * g * b * b,
                g * g * b * b * b, g * g * b * b * b]
    assert [e["scale"] for e in ours] == pytest.approx([init * f for f in expected], rel=1e-6)


def test_the_same_steps_are_skipped(both):
    ours, torchs, _ = both
    skipped = [step for step, e in enumerate(ours) if not e["stepped"]]
    assert skipped == sorted(INJECT)
    assert [e["stepped"] for e in torchs] == [e["stepped"] for e in ours]


def test_parameters_equal_bit_for_bit_after_every_step(both):
    ours, torchs, _ = both
    for step, (a, b) in enumerate(zip(ours, torchs, strict=True)):
        for x, y in zip(a["params"], b["params"], strict=True):
            assert torch.equal(x, y), f"step {step}: parameters differ from GradScaler's"
            assert torch.isfinite(x).all(), f"step {step}: an inf/nan reached the weights"


def test_state_dict_is_interchangeable_with_grad_scaler():
    ours = DynamicLossScaler(init_scale=3.0, growth_factor=1.7, backoff_factor=0.3, growth_interval=5)
    param = nn.Parameter(torch.zeros(2))
    for value in (1.0, float("inf"), 1.0):  # back off once, then one clean step counted
        param.grad = torch.full((2,), value)
        ours.unscale_([param])
        ours.update()
    theirs = torch.amp.GradScaler(device="cpu")
    theirs.load_state_dict(ours.state_dict())
    assert theirs.state_dict() == ours.state_dict() == {"scale": pytest.approx(0.9), "growth_factor": 1.7,
                                                        "backoff_factor": 0.3, "growth_interval": 5,
                                                        "_growth_tracker": 1}
    again = DynamicLossScaler()
    again.load_state_dict(theirs.state_dict())
    assert again.state_dict() == ours.state_dict()


def test_scale_never_grows_to_inf():
    """At 2^127 a growth ×2 would be inf in fp32: the scale stays, as GradScaler's does (and the count restarts)."""
    param = nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    for scaler in (DynamicLossScaler(init_scale=2.0**127, growth_interval=1),
                   torch.amp.GradScaler(device="cpu", init_scale=2.0**127, growth_interval=1)):
        scaler.scale(param.sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        assert scaler.get_scale() == 2.0**127 and scaler.state_dict()["_growth_tracker"] == 0
        optimizer.zero_grad()


def test_fp16_gradients_underflow_to_zero_without_scaling_and_survive_with_it():
    """A near-converged fp16 linear: residuals of ~1e-5 averaged over 4096 outputs give dL/dout ≈ 1e-8, below
    half of fp16's smallest subnormal (2^-24 ≈ 6e-8), so backward rounds every one to zero. Scaled by 2^16 they
    land in fp16's normal range; unscaled again in fp32 they match the exact gradient of the same forward."""
    torch.manual_seed(0)
    layer = nn.Linear(16, 16).half()
    x = torch.randn(256, 16).half()
    with torch.no_grad():
        y = layer(x).float() + 2e-5 * (2 * torch.rand(256, 16) - 1)

    def weight_grad(scaler: DynamicLossScaler) -> tuple[torch.Tensor, torch.Tensor]:
        layer.zero_grad()
        out = layer(x).float()  # the loss in fp32, as autocast computes it
        scaler.scale(nn.functional.mse_loss(out, y)).backward()
        master = nn.Parameter(layer.weight.detach().float())
        master.grad = layer.weight.grad.float()
        scaler.unscale_([master])
        residual = out.detach().double() - y.double()
        return master.grad.double(), 2 / residual.numel() * residual.T @ x.double()

    unscaled, exact = weight_grad(DynamicLossScaler(enabled=False))
    assert exact.abs().max() > 1e-7 and torch.count_nonzero(unscaled) == 0
    scaled, exact = weight_grad(DynamicLossScaler(init_scale=2.0**16))
    assert ((scaled - exact).norm() / exact.norm()).item() < 1e-3


def test_disabled_scaler_passes_through():
    scaler = DynamicLossScaler(enabled=False)
    param = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=1.0)
    loss = (param * 3).sum()
    assert scaler.scale(loss) is loss and scaler.get_scale() == 1.0
    loss.backward()
    scaler.unscale_(optimizer)
    assert scaler.step(optimizer) is True
    scaler.update()
    assert torch.equal(param.detach(), torch.full((2,), -2.0)) and scaler.state_dict() == {}


@pytest.mark.parametrize("kwargs", [dict(init_scale=0.0), dict(init_scale=1e39), dict(growth_factor=1.0),
                                    dict(backoff_factor=1.0), dict(growth_interval=0), dict(growth_interval=2.5)])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        DynamicLossScaler(**kwargs)


def test_misuse_is_refused():
    scaler = DynamicLossScaler()
    param = nn.Parameter(torch.ones(2, dtype=torch.float16))
    param.grad = torch.ones(2, dtype=torch.float16)
    with pytest.raises(ValueError, match="float16 gradients"):
        scaler.unscale_([param])  # divided in fp16 they would underflow again
    with pytest.raises(RuntimeError, match="unscale_"):
        scaler.update()  # no inf check this step
    param = nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    scaler.unscale_([param])
    with pytest.raises(RuntimeError, match="already"):
        scaler.unscale_([param])


def _sharded_step(inf_on_rank: int) -> tuple[bool, float, bool]:
    """Each rank holds a different shard (as under ZeRO); one rank's shard overflows."""
    param = nn.Parameter(torch.ones(4))
    param.grad = torch.full((4,), float("inf") if dist.get_rank() == inf_on_rank else 1.0)
    local_inf = not torch.isfinite(param.grad).all().item()
    scaler = DynamicLossScaler(init_scale=8.0)
    stepped = scaler.step(torch.optim.SGD([param], lr=0.1))
    scaler.update()
    return stepped, scaler.get_scale(), local_inf


def test_every_rank_skips_when_one_rank_overflows():
    results = run(_sharded_step, 2, 1)
    assert [local_inf for _, _, local_inf in results] == [False, True]  # rank 0 saw clean gradients ...
    assert results[0][:2] == results[1][:2] == (False, 4.0)  # ... and skipped with rank 1, backing off alike
