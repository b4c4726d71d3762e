"""lab.precision.fp8_monitor: an activation outlier under delayed scaling saturates the FP8 cast, spikes the loss
and wipes out the step's gradient; the checks fire at that step and at no other, and current scaling on the same
data neither spikes nor fires. And an inf reaching an FP8 linear in lab.train stops the step before its update,
in one line naming the tensor and the step (lab.precision.fp8.NonFiniteFlags, read once per step)."""

from __future__ import annotations

import math

import pytest
import torch

import lab.trainer as trainer
from lab.config import PRECISIONS, load_config
from lab.precision.fp8 import NonFiniteAmax
from lab.precision.fp8_linear import RECIPES
from lab.precision.fp8_monitor import CastCheck, StepReport, outlier_run
from lab.precision.scheme import precision_scheme

OUTLIER_STEP = 16


@pytest.fixture(scope="module")
def runs() -> dict[str, list[StepReport]]:
    return {"fp32": outlier_run(None, outlier_step=OUTLIER_STEP),
            "delayed": outlier_run("delayed", outlier_step=OUTLIER_STEP),
            "delayed, no outlier": outlier_run("delayed", outlier_step=None),
            "current": outlier_run("tensorwise", outlier_step=OUTLIER_STEP)}


def alarmed_steps(reports: list[StepReport]) -> list[int]:
    return [r.step for r in reports if r.alarms()]


def test_delayed_scaling_meets_the_outlier_and_the_checks_fire_at_that_step(runs):
    delayed, fp32 = runs["delayed"], runs["fp32"]
    assert alarmed_steps(delayed) == [OUTLIER_STEP]
    [alarm] = delayed[OUTLIER_STEP].alarms()
    assert alarm.startswith(f"step {OUTLIER_STEP}: output.x amax 3e+04 is ") and "values saturated" in alarm
    assert delayed[OUTLIER_STEP].loss > 4 * fp32[OUTLIER_STEP].loss  # the spike
    assert delayed[OUTLIER_STEP].grad_norm < fp32[OUTLIER_STEP].grad_norm / 100  # the step's gradient is lost
    before = slice(1, OUTLIER_STEP)  # step 0 bootstraps from its own amax
    assert all(abs(d.loss / f.loss - 1) < 0.05 for d, f in zip(delayed[before], fp32[before], strict=True))


def test_the_checks_stay_quiet_on_a_clean_run_and_under_current_scaling(runs):
    assert alarmed_steps(runs["delayed, no outlier"]) == []
    current, fp32 = runs["current"], runs["fp32"]
    assert alarmed_steps(current) == []
    assert all(c.jump == 1.0 for r in current for c in r.casts)  # the scale is made from the tensor itself
    assert current[OUTLIER_STEP].loss == pytest.approx(fp32[OUTLIER_STEP].loss, rel=0.05)


def test_a_cast_check_flags_a_jump_with_saturation_and_non_finite_steps():
    assert CastCheck("x", 10.0, 1.0, 3).overflowed and CastCheck("x", 10.0, 1.0, 3).jump == 10.0
    assert not CastCheck("x", 1.05, 1.0, 1).overflowed  # a new record of a noisy amax: drift, not a jump
    assert not CastCheck("x", 10.0, 10.0, 0).overflowed and CastCheck("x", 0.0, 0.0, 0).jump == 0.0
    report = StepReport(3, float("nan"), float("inf"))
    assert report.alarms() == ["step 3: loss is nan", "step 3: grad norm is inf"]
    with pytest.raises(ValueError, match=r"outlier_step=30: expected None or an int in \[0, 24\)"):
        outlier_run(None, outlier_step=30)


def test_an_inf_reaching_an_fp8_linear_stops_the_trainer_before_the_update_naming_tensor_and_step(monkeypatch):
    # From step 2 on, the last layer's w2 gets an inf in its input (a forward pre-hook, armed after step 1). The
    # step must stop with the FP8 line naming that tensor (not "loss nan", which says nothing of where; nor an
    # earlier layer's gradient, which the inf reached later), and neither the bf16 weights nor the fp32 masters
    # may differ from what step 1 left: the flags are read after the backward, before the update.
    built, armed, after_step_1 = [], [], {}
    parallelize = trainer.parallelize

    def poison(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
        return (args[0].index_fill(-1, torch.tensor([3]), math.inf),) if armed else None

    def parallelize_and_hook(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 — parallelize's own arguments
        par = parallelize(*args, **kwargs)
        par.model.get_submodule("layers.1.ffn.w2").register_forward_pre_hook(poison)
        built.append(par)
        return par

    def on_step(log: trainer.StepLog) -> None:
        par = built[0]
        after_step_1.update({name: t.detach().clone() for name, t in par.model.state_dict().items()})
        after_step_1.update({f"master {i}": p.detach().clone() for i, p in enumerate(par.parameters())})
        armed.append(log.step)

    monkeypatch.setattr(trainer, "parallelize", parallelize_and_hook)
    config = load_config("configs/tiny.toml", ["model.n_layers=2", "train.steps=3", "train.global_batch=2",
                                               "train.precision='fp8-tensorwise'"])
    with pytest.raises(NonFiniteAmax, match=r"^step 2: amax of layers\.1\.ffn\.w2's input is not finite "
                       r"\(and \d+ more\): .*stopped before its update: lower the learning rate") as err:
        trainer.run(config, verbose=False, on_step=on_step)
    assert "\n" not in str(err.value) and armed == [1]
    par = built[0]
    now = {name: t for name, t in par.model.state_dict().items()}
    now.update({f"master {i}": p for i, p in enumerate(par.parameters())})
    changed = [name for name, t in after_step_1.items() if not torch.equal(now[name], t)]
    assert changed == [], f"updated after the non-finite amax: {changed[:3]}"


def test_every_stateless_fp8_recipe_is_a_precision_lab_train_runs():
    # Each recipe of lab.precision but the delayed one (its amax histories are not in checkpoints) is a --precision
    # name, and trains as bf16 does to within FP8's rounding (measured: 1.6e-4 apart, relative, at step 3).
    assert {name for name in PRECISIONS if name.startswith("fp8-")} == {f"fp8-{r}" for r in RECIPES} - {"fp8-delayed"}
    assert precision_scheme("fp8-rowwise").fp8 == RECIPES["rowwise"]
    final = {}
    for precision in ("bf16", "fp8-rowwise"):
        config = load_config("configs/tiny.toml", ["model.n_layers=2", "train.steps=3", "train.global_batch=2",
                                                   f"train.precision='{precision}'"])
        final[precision] = trainer.run(config, verbose=False)[-1].loss
    assert final["fp8-rowwise"] == pytest.approx(final["bf16"], rel=2e-3)


def test_a_non_finite_amax_on_one_rank_stops_every_rank_before_its_update(tmp_path, monkeypatch):
    # Two data-parallel replicas; at step 2 only rank 1's w2 records an inf amax (as a saturating cast would,
    # with the loss and the gradients still finite). Both ranks must stop before their update with the same line,
    # naming the rank: without the agreement rank 0 would make its update, then wait at the next collective.
    def flag_on_rank_1(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        if torch.distributed.get_rank() == 1 and (tmp_path / "updated 1").exists():
            module.kernel.nonfinite.record("layers.1.ffn.w2's input", torch.tensor(math.inf))

    parallelize = trainer.parallelize

    def parallelize_and_hook(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 — parallelize's own arguments
        par = parallelize(*args, **kwargs)
        par.model.get_submodule("layers.1.ffn.w2").register_forward_pre_hook(flag_on_rank_1)
        after_step, updates = par.after_step, []

        def record_the_update() -> None:  # called right after the optimizer's step, before any collective
            updates.append(torch.distributed.get_rank())
            with open(tmp_path / f"updated {len(updates)}", "a") as record:
                record.write(f"rank {updates[-1]}\n")
            after_step()

        par.after_step = record_the_update
        return par

    monkeypatch.setattr(trainer, "parallelize", parallelize_and_hook)
    config = load_config("configs/tiny.toml", ["model.n_layers=2", "train.steps=3", "train.global_batch=2",
                                               "parallel.dp=2", "train.precision='fp8-tensorwise'"])
    with pytest.raises(NonFiniteAmax, match=r"^step 2: amax of layers\.1\.ffn\.w2's input on rank 1 is not finite: "
                       r".*stopped before its update"):
        trainer.run(config, nproc=2, verbose=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["updated 1"]  # no rank updated at step 2
