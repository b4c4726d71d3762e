"""Chapter 10's checks: the solutions pass with any secret, the released stubs score nothing, and every
plausible-but-wrong answer (mutant) fails the checks named for it.

A mutant is the solution cell with one classic mistake — the scale inverted (amax/max), no saturation before the
cast, no guard for an all-zero tensor, a loss scale that backs off when it should grow or a growth tracker that is
not reset, delayed scaling from the current amax or from a history that never forgets, tile amaxes over the wrong
axis or over whole rows, a ragged last tile dropped, ZeRO-3's gathers counted once per micro-batch or
without their FP8 scales, an MXFP4 scale rounded up or not a power of two, E2M1 ties away from zero, no
saturation at ±6 — and only the checks that must catch it are run, to keep this
file fast. The checks' own references are torch.amp.GradScaler, lab.precision.fp8 and
lab.precision.microscaling; the GradScaler driver is
checked here against the rule GradScaler documents.
"""

from __future__ import annotations

import pytest
from grading_support import Chapter, chapter_tests

from lab.grading.checks import ch10

EXERCISES = ("10.quantize_tensorwise", "10.loss_scale_update", "10.delayed_scaling", "10.tilewise_scales",
             "10.zero3_gather_bytes", "10.mxfp4_block")

Q_CURRENT = "a per-tensor scale max/amax: the fp8 values nearest x·scale, and back (e4m3 and e5m2)"
Q_SATURATES = "a given scale that overflows some values: they saturate at ±max, never inf or NaN"
Q_ZEROS = "an all-zero tensor: scale 1, zeros back (no inf, no NaN)"
LS_GROWTH = "clean steps: the scale grows by growth_factor every growth_interval steps, the tracker restarts"
LS_BACKOFF = "an inf/nan step: back-off, the tracker restarts, the step is skipped"
LS_RANDOM = "random growth and back-off factors and intervals, a long random trajectory"
D_HISTORY = "the scale of step t comes from the amaxes of the `length` steps before it (the first: its own amax)"
D_SPIKE = "a step whose amax is far above its history's: its largest values saturate at ±max"
T_WHOLE = "rows of whole 1×128 tiles: one scale per tile, the fp8 values and back"
T_RAGGED = "a ragged last tile (cols not a multiple of 128), one row, and an all-zero tile (scale 1)"

Z_ONE = "one micro-batch in fp32 and bf16, dp dividing the unit: two gathers of the shard, one reduce-scatter"
Z_FP8 = "fp8: one byte a parameter gathered, and one fp32 amax per tensor all-reduced before each gather"
Z_ACCUM = "several micro-batches, and a unit dp does not divide: two gathers per micro-batch, shards rounded up"
GATHERED = "gathers * (dp - 1) * shard * BYTES_PER_PARAMETER[gather]"
SCALES = "gathers * 2 * (dp - 1) / dp * 4 * n_tensors if"
MX_RANDOM = ("random blocks over twelve decades, one all negative: the scale 2^(floor(log2 amax) - 2) and E2M1 "
             "elements")
MX_TIES = "values halfway between two E2M1 neighbours: ties go to the even one (2.5 -> 2, 3.5 -> 4, 5 -> 4)"
MX_SATURATES = "a block whose amax / scale lands past 6 saturates at ±6; an all-zero block gives zeros, no NaN"
MX_SCALE = "return 2.0 ** (math.floor(math.log2(amax)) - E2M1_EMAX)"
ROUND = "return torch.round(v / step) * step"

GROW = "return scale * growth_factor, 0, False"
BACK_OFF = "return scale * backoff_factor, 0, True"
PUSH = "    history.push(amax)\n"
AMAX_OF_X = "    amax = x.abs().max()\n"
AMAX = "tiles.abs().amax(dim=-1, keepdim=True)"

MUTANTS = {  # name: (exercise, [(old, new) in the solution cell], checks that must fail)
    "scale_inverted": (  # the mutant
        "10.quantize_tensorwise", [("top / amax, torch.ones_like", "amax / top, torch.ones_like")], {Q_CURRENT}),
    "no_saturation": (  # the mutant: e5m2 overflows to inf (torch's CPU cast to e4m3fn clamps by itself)
        "10.quantize_tensorwise", [("(x.float() * scale).clamp(-top, top).to(dtype)", "(x.float() * scale).to(dtype)")],
        {Q_SATURATES}),
    "no_guard_for_amax_zero": (
        "10.quantize_tensorwise", [("torch.where(amax > 0, top / amax, torch.ones_like(amax))", "top / amax")],
        {Q_ZEROS}),
    "dequantize_multiplies": (
        "10.quantize_tensorwise", [("return x_fp8.float() / scale", "return x_fp8.float() * scale")],
        {Q_CURRENT, Q_SATURATES}),
    "backoff_applied_when_growing": (
        "10.loss_scale_update", [(GROW, "return scale * backoff_factor, 0, False")],
        {LS_GROWTH, LS_BACKOFF, LS_RANDOM}),
    "tracker_not_reset_after_growth": (
        "10.loss_scale_update", [(GROW, "return scale * growth_factor, growth_tracker, False")],
        {LS_GROWTH, LS_BACKOFF, LS_RANDOM}),
    "tracker_not_reset_on_inf": (
        "10.loss_scale_update", [(BACK_OFF, "return scale * backoff_factor, growth_tracker, True")],
        {LS_BACKOFF, LS_RANDOM}),
    "inf_step_not_skipped": (
        "10.loss_scale_update", [(BACK_OFF, "return scale * backoff_factor, 0, False")], {LS_BACKOFF, LS_RANDOM}),
    "delayed_from_the_current_amax": (  # the mutant: the amax pushed before the scale is taken
        "10.delayed_scaling", [(PUSH, ""), (AMAX_OF_X, AMAX_OF_X + PUSH)],
        {D_HISTORY, D_SPIKE}),
    "history_never_forgets": (
        "10.delayed_scaling", [("[float(amax)])[-self.length:]", "[float(amax)])")], {D_HISTORY}),
    "tile_amax_per_column": (  # the mutant: the amax over the rows, not along each row's tile
        "10.tilewise_scales", [(AMAX, "tiles.abs().amax(dim=0, keepdim=True)")], {T_WHOLE, T_RAGGED}),
    "one_scale_per_row": (
        "10.tilewise_scales", [(AMAX, "tiles.abs().amax(dim=(1, 2), keepdim=True)")], {T_WHOLE, T_RAGGED}),
    "ragged_tile_dropped": (
        "10.tilewise_scales", [("n_tiles = -(-cols // tile)", "n_tiles = cols // tile")], {T_RAGGED}),
    "dequantize_scales_repeated_as_a_row": (
        "10.tilewise_scales", [("scales.repeat_interleave(tile, dim=1)", "scales.repeat(1, tile)")],
        {T_WHOLE, T_RAGGED}),
    "one_gather_per_micro_batch": (  # forgets that ZeRO-3 frees the parameters between forward and backward
        "10.zero3_gather_bytes", [("gathers = 2 * grad_accum", "gathers = grad_accum")], {Z_ONE, Z_FP8, Z_ACCUM}),
    "gather_counted_as_the_shard": (
        "10.zero3_gather_bytes", [(GATHERED, "gathers * shard * BYTES_PER_PARAMETER[gather]")],
        {Z_ONE, Z_FP8, Z_ACCUM}),
    "fp8_as_two_bytes": (
        "10.zero3_gather_bytes", [('"fp8": 1}', '"fp8": 2}')], {Z_FP8, Z_ACCUM}),
    "fp8_scales_forgotten": (
        "10.zero3_gather_bytes", [(SCALES, "0 if")], {Z_FP8, Z_ACCUM}),
    "scales_once_a_step": (
        "10.zero3_gather_bytes", [(SCALES, "2 * (dp - 1) / dp * 4 * n_tensors if")], {Z_FP8, Z_ACCUM}),
    "grad_accum_ignored": (
        "10.zero3_gather_bytes", [("gathers = 2 * grad_accum", "gathers = 2")], {Z_ACCUM}),
    "no_padding": (
        "10.zero3_gather_bytes", [("shard = -(-n_params // dp)", "shard = n_params // dp")], {Z_ACCUM}),
    "gradients_in_the_gather_format": (
        "10.zero3_gather_bytes", [("(dp - 1) * shard * 4,", "(dp - 1) * shard * BYTES_PER_PARAMETER[gather],")],
        {Z_ONE, Z_FP8, Z_ACCUM}),
    "mx_scale_from_ceil": (  # the mutant: the exponent rounded up, every scale doubled
        "10.mxfp4_block", [(MX_SCALE, MX_SCALE.replace("floor", "ceil"))], {MX_RANDOM, MX_SATURATES}),
    "mx_scale_not_a_power_of_two": (  # amax / 6, an fp32 scale as FP8's recipes use: E8M0 cannot hold it
        "10.mxfp4_block", [(MX_SCALE, "return amax / E2M1_MAX")], {MX_RANDOM, MX_SATURATES}),
    "mx_amax_signed": (
        "10.mxfp4_block", [("amax = x.abs().max().item()", "amax = x.max().item()")], {MX_RANDOM}),
    "mx_no_guard_for_a_zero_block": (
        "10.mxfp4_block", [("    if amax == 0:\n        return 2.0**-127\n", "")], {MX_SATURATES}),
    "e2m1_ties_away_from_zero": (
        "10.mxfp4_block", [(ROUND, "return torch.trunc(v / step + 0.5 * torch.sign(v)) * step")], {MX_TIES}),
    "e2m1_no_saturation": (
        "10.mxfp4_block", [("    v = v.clamp(-E2M1_MAX, E2M1_MAX)\n", "")], {MX_SATURATES}),
}

CHAPTER = Chapter("10_mixed_precision_fp8.ipynb", EXERCISES, MUTANTS, said=("returned", "raised"))
globals().update(chapter_tests(CHAPTER))


def test_the_grad_scaler_driver_follows_the_documented_rule():
    """The loss-scale checks' reference, torch.amp.GradScaler driven with planted infs, gives the trajectory its
    documentation describes: growth after growth_interval clean steps, back-off and a skipped step on an inf, the
    count restarted by both."""
    found_infs = [False, False, True, False, True, False, False, False]
    scales, trackers, skipped = ch10.grad_scaler_trajectory(found_infs, 1024.0, 2.0, 0.5, 2)
    assert scales == [1024.0, 2048.0, 1024.0, 1024.0, 512.0, 512.0, 1024.0, 1024.0]
    assert trackers == [1, 0, 0, 1, 0, 1, 0, 1]
    assert skipped == found_infs


def test_expect_fp8_is_the_nearest_value_rule():
    """expect_fp8 passes torch's cast and the other neighbour of a tie, fails a value one step off, NaN and inf."""
    import torch

    x, scale = torch.tensor([0.3, -2.0, 1.0625, 1000.0]), torch.tensor(1.0)
    cast = x.to(torch.float8_e4m3fn).float().tolist()  # 1.0625 is a tie between 1.0 and 1.125; 1000 saturates
    assert cast[3] == 448.0
    ch10.expect_fp8(cast, x, scale, "e4m3", "q")
    ch10.expect_fp8([cast[0], cast[1], 1.125, 448.0], x, scale, "e4m3", "q")
    for wrong in ([0.34375, -2.0, 1.0, 448.0], [cast[0], float("nan"), 1.0, 448.0], [*cast[:3], float("inf")]):
        with pytest.raises(ch10.CheckFailed, match="q returned .* expected"):
            ch10.expect_fp8(wrong, x, scale, "e4m3", "q")
    with pytest.raises(ch10.CheckFailed, match="returned 3 values, expected 4 fp8 values"):
        ch10.expect_fp8(cast[:3], x, scale, "e4m3", "q")


def test_the_tilewise_reference_ragged_and_zero():
    """tilewise_reference: one scale per 128 values of a row, the narrower last tile its own, 1 for a zero tile."""
    import torch

    x = torch.zeros(2, 300)
    x[0, :128], x[0, 128:256], x[0, 256:] = 2.0, 0.5, 7.0
    x[1, 256:] = -4.0  # row 1: two zero tiles, then the ragged one
    scales, per_element = ch10.tilewise_reference(x)
    assert scales.tolist() == [[224.0, 896.0, 64.0], [1.0, 1.0, 112.0]]
    assert per_element.shape == (2, 300) and per_element[0, 299] == 64.0 and per_element[1, 0] == 1.0
