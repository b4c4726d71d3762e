"""Every parallelism composes on one mesh (issue 15): each layout trains as the single-process run does.

Per step, fp32: the loss equals the reference's (rtol 1e-5) and so does the gradient norm (rtol 1e-4). The norm
is taken right after the gradients are reduced, before the optimizer, and it is the check that sees a gradient off
by a constant factor (averaged over dp instead of dp x cp, counted once per TP rank...): the losses do not, since
clipping at 1.0 (the tiny model's first norms are 1.27 to 1.62) and AdamW both undo a constant scale.

Cheap on a 2-core CI: the tiny models, 3 steps, and each reference trained once per session.
"""

from __future__ import annotations

import functools

import pytest
from test_train import _assert_same_losses

from lab.config import load_config
from lab.train import StepLog, run

TINY, MOE = "configs/tiny.toml", "configs/tiny-moe.toml"
STEPS = "train.steps=3"  # step 1 checks the forward and the gradients; steps 2-3 the update they made
# Without the router's balancing losses (defined over the tokens one rank routes in one micro-batch) and without a
# capacity limit, an MoE treats tokens one by one, so any layout of it must equal one process.
NO_AUX = ("model.aux_loss_coef=0.0", "model.z_loss_coef=0.0")


@functools.cache
def _reference(path: str, overrides: tuple[str, ...] = (), nproc: int = 1) -> tuple[StepLog, ...]:
    """The run a layout is compared with, trained once per session and shared by the tests that need it."""
    return tuple(run(load_config(path, [STEPS, *overrides]), nproc, verbose=False))


def _train(path: str, overrides: list[str]) -> list[StepLog]:
    """The layout `overrides` names, on as many ranks as it has (dp*tp*cp*pp)."""
    config = load_config(path, [STEPS, *overrides])
    return run(config, config.parallel.world_size, verbose=False)


def _assert_same_training(reference: tuple[StepLog, ...], logs: list[StepLog]) -> None:
    _assert_same_losses([log.loss for log in reference], [log.loss for log in logs])
    _assert_same_losses([log.grad_norm for log in reference], [log.grad_norm for log in logs], rel=1e-4)


@pytest.mark.parametrize("overrides", [
    pytest.param(["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.pp_schedule='1f1b'",
                  "parallel.grad_accum=4"], id="dp2-tp2-pp2-1f1b"),
    pytest.param(["parallel.dp=2", "parallel.cp=2", "parallel.tp=2", "parallel.sp=true", "parallel.grad_accum=2"],
                 id="dp2-cp2-tp2-sp"),
    pytest.param(["parallel.dp=4", "parallel.tp=2", "parallel.zero=3", "parallel.recompute='full'"],
                 id="zero3-dp4-tp2-recompute"),
    pytest.param(["parallel.pp=2", "parallel.tp=2", "parallel.cp=2", "parallel.pp_schedule='interleaved'",
                  "parallel.pp_virtual_stages=2", "parallel.grad_accum=4"], id="pp2-tp2-cp2-interleaved"),
    pytest.param(["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.zero=1",
                  "parallel.pp_schedule='zb-h1'", "parallel.grad_accum=4"], id="zero1-dp2-tp2-pp2-zbh1"),
])
def test_8_rank_layouts_match_single_process(overrides):
    _assert_same_training(_reference(TINY), _train(TINY, overrides))


@pytest.mark.parametrize("overrides", [
    pytest.param(["parallel.pp=2", "parallel.tp=2", "parallel.grad_accum=2"], id="pp2-tp2"),
    pytest.param(["parallel.pp=2", "parallel.cp=2", "parallel.grad_accum=2"], id="pp2-cp2"),
    pytest.param(["parallel.pp=2", "parallel.dp=2", "parallel.zero=1", "parallel.grad_accum=2"], id="pp2-dp2-zero1"),
    pytest.param(["parallel.dp=2", "parallel.tp=2", "parallel.zero=2"], id="zero2-dp2-tp2"),
])
def test_4_rank_pairs_match_single_process(overrides):
    _assert_same_training(_reference(TINY), _train(TINY, overrides))


@pytest.mark.parametrize("overrides", [
    pytest.param(["parallel.dp=2", "parallel.tp=2", "parallel.ep=2"], id="ep2-dp2-tp2"),
    # EP groups are consecutive ranks of the flattened (dp, cp) grid: here each spans the two CP ranks of a DP rank
    pytest.param(["parallel.dp=2", "parallel.cp=2", "parallel.ep=2"], id="ep2-dp2-cp2"),
])
def test_4_rank_expert_parallel_pairs_match_single_process(overrides):
    reference, logs = _reference(MOE, NO_AUX), _train(MOE, [*NO_AUX, *overrides])
    _assert_same_training(reference, logs)
    for step, (a, b) in enumerate(zip(reference, logs, strict=True), start=1):
        assert (b.expert_load, b.dropped_tokens) == (a.expert_load, a.dropped_tokens), f"step {step}"


def test_expert_and_pipeline_parallel_carry_the_router_losses_through_the_stages():
    """ep2 x dp2 x pp2 on the MoE model, balancing losses on and a capacity limit that drops tokens.

    The balancing losses are defined over the tokens each rank routes in each micro-batch, so the reference is the
    same micro-batches on the same data-parallel ranks without EP and PP (dp=4, same grad_accum), not one process.
    Expert load, dropped tokens and the balancing loss are summed over the stages' layers, as the reference's are."""
    common = ["parallel.dp=4", "parallel.grad_accum=2", "model.capacity_factor=1.0"]
    reference = _reference(MOE, tuple(common), 4)
    logs = _train(MOE, [*common, "parallel.ep=2", "parallel.pp=2"])
    _assert_same_training(reference, logs)
    for step, (a, b) in enumerate(zip(reference, logs, strict=True), start=1):
        assert (b.expert_load, b.dropped_tokens) == (a.expert_load, a.dropped_tokens), f"step {step}"
        assert b.aux_loss == pytest.approx(a.aux_loss, rel=1e-5), f"step {step}"
        # each layer's load, though the layers live on two stages; the layers add up to the whole
        assert b.expert_load_per_layer == a.expert_load_per_layer and len(b.expert_load_per_layer) == 4, f"step {step}"
        assert [sum(loads) for loads in zip(*b.expert_load_per_layer.values(), strict=True)] == b.expert_load
        assert all(0 < sum(loads) <= 8 * 32 * 2 for loads in b.expert_load_per_layer.values())  # a layer's tokens x k
    assert reference[-1].dropped_tokens > 0  # the capacity limit is exercised
    assert sum(logs[-1].expert_load) + logs[-1].dropped_tokens == 8 * 32 * 2 * 4  # tokens x top_k x layers


def test_run_refuses_a_layout_lab_cannot_run_in_one_line():
    """`lab.train.run` called from Python, as a notebook does, applies the CLI's refusals: it raises in the caller
    (no rank's error wrapped in another) one line naming the values."""
    config = load_config(TINY, [STEPS, "parallel.dp=2", "parallel.pp=2", "parallel.zero=2", "parallel.grad_accum=2"])
    with pytest.raises(ValueError) as refusal:
        run(config, config.parallel.world_size, verbose=False)
    message = str(refusal.value)
    assert len(message.splitlines()) == 1 and "zero=2" in message and "pp=2" in message, message


def test_run_refuses_a_rank_count_that_is_not_the_layouts():
    config = load_config(TINY, [STEPS, "parallel.dp=2"])
    with pytest.raises(ValueError) as refusal:
        run(config, 4, verbose=False)
    message = str(refusal.value)
    assert len(message.splitlines()) == 1 and "nproc=4" in message and "dp*tp*cp*pp" in message, message
