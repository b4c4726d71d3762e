"""lab.precision.fp8_monitor: an activation outlier under delayed scaling saturates the FP8 cast, spikes the loss
and wipes out the step's gradient; the checks fire at that step and at no other, and current scaling on the same
data neither spikes nor fires."""

from __future__ import annotations

import pytest

from lab.precision.fp8_monitor import CastCheck, StepReport, outlier_run

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
