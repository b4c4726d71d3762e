"""Chapter 10, mixed precision and FP8. A per-tensor FP8 scale, the dynamic loss-scale update, delayed scaling
from an amax history, DeepSeek-V3's 1×128 tile-wise scales, the bytes ZeRO-3 sends when it gathers in
fp32, bf16 or FP8.

The FP8 checks draw float32 tensors here, send them as lists, and read back the fp8 values (as floats), the
scales and the dequantised tensor. The expected fp8 values are torch's own casts (`Tensor.to(float8_...)`),
computed here: each value must be the fp8 number nearest to x·scale clamped to the format's ±max, either
neighbour at a tie (`expect_fp8`), so an answer that rounds x·scale in another but equally correct order passes.
Saturation is checked in e5m2, whose cast overflows to ±inf: torch's CPU cast to e4m3fn happens to clamp by
itself, so a missing clamp is invisible there (and a NaN on other implementations).

The references are torch's and the chapter's own: the loss-scale trajectory is `torch.amp.GradScaler`'s, driven
here step by step with infs planted in a gradient (`grad_scaler_trajectory`); the scales of delayed and tile-wise
scaling come from `lab.precision.fp8` (`AmaxHistory`, `scale_from_amax`, `amax` with `Scaling(granularity="tile")`).

torch and `lab.precision` are imported inside the functions: `lab.check` of other chapters loads this module too.
"""

from __future__ import annotations

import random

from lab.grading.checks import (
    TORCH,
    CheckFailed,
    Mistake,
    driver,
    exercise,
    expect_allclose,
    expect_close,
    expect_equal,
    expect_number,
    preview,
    shown,
)

FORMATS = {"e4m3": ("float8_e4m3fn", 448.0), "e5m2": ("float8_e5m2", 57344.0)}  # name: (torch dtype, max)
TILE = 128  # DeepSeek-V3's activation tiles: 1 x 128


def _dtype(fmt: str):
    import torch

    return getattr(torch, FORMATS[fmt][0])


def reference_scale(amax, fmt: str):
    """max/amax of a float32 tensor of amaxes, 1 where amax is 0 (`lab.precision.fp8.scale_from_amax`)."""
    from lab.precision.fp8 import scale_from_amax

    return scale_from_amax(amax, fmt)


def _drawn(rng: random.Random, shape: tuple[int, ...], amax: float):
    """A float32 tensor of `shape` from the check's rng whose largest |value| is `amax`."""
    import torch

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(rng.randrange(10**6)), dtype=torch.float64)
    return (x * (amax / x.abs().max())).float()


def expect_fp8(got, x, scale, fmt: str, what: str, hint: str | None = None) -> None:
    """`got` (a flat list) must hold, for each element of x·scale clamped to ±max, the `fmt` value nearest to it
    (torch's cast), or the other neighbour when x·scale sits on a tie up to float32 rounding."""
    import torch

    top = FORMATS[fmt][1]
    y = (x.double() * scale.double()).clamp(-top, top).flatten()
    nearest = y.to(_dtype(fmt)).double()
    if not (isinstance(got, list) and len(got) == y.numel()
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in got)):
        size = f"{len(got)} values" if isinstance(got, list) else repr(got)[:80]
        raise CheckFailed(f"{what} returned {size}, expected {y.numel()} fp8 values (shape {tuple(x.shape)})", hint)
    values = torch.tensor(got, dtype=torch.float64)
    slack = (nearest - y).abs() + 1e-5 * y.abs()
    wrong = ~((values - y).abs() <= slack)  # NaN and inf are wrong
    if wrong.any():
        i = int(wrong.nonzero()[0])
        raise CheckFailed(f"{what} returned {shown(float(values[i]))} at flat index {i}, expected "
                          f"{shown(float(nearest[i]))}: the {fmt} value nearest x·scale = {float(y[i]):.6g} "
                          f"(x = {float(x.flatten()[i]):.6g}, scale = {float(scale.expand_as(x).flatten()[i]):.6g}"
                          f", clamped to ±{top:g})", hint)


def expect_dequantized(got, fp8: list, scale, what: str) -> None:
    """The dequantised tensor: the returned fp8 values (already checked) divided by their scales."""
    import torch

    expect_allclose(got, (torch.tensor(fp8, dtype=torch.float64) / scale.double().flatten()).tolist(), what, tol=1e-5)


def _inverted(amax: float, top: float) -> Mistake:
    return Mistake(amax * amax / (top * top), "amax/max instead of max/amax",
                   "the scale was inverted: it maps the largest |x| onto the format's max")


# --- 10.quantize_tensorwise ------------------------------------------------------------------------------------

QUANTIZE = exercise("10.quantize_tensorwise", entry=("run_quantize",), **TORCH)


def _expect_quantize(student, rng: random.Random, shape: tuple[int, ...], amax: float, fmt: str,
                     given: float | None = None, hint: str | None = None) -> None:
    import torch

    x = _drawn(rng, shape, amax) if amax else torch.zeros(shape)
    what = f"run_quantize(<{shape} float32 values, amax {amax:.4g}>, shape={list(shape)}, fmt={fmt!r}" + \
        (f", scale={given:.6g})" if given is not None else ")")
    got = driver(what, "a dict of fp8, dtype, scale and dequantized", student.run_quantize, x.flatten().tolist(),
                 list(shape), fmt, given)
    if got.get("dtype") != str(_dtype(fmt)):
        raise CheckFailed(f"{what}: the quantised tensor's dtype returned {got.get('dtype')!r}, expected "
                          f"{str(_dtype(fmt))!r}")
    scale = torch.tensor(given, dtype=torch.float32) if given is not None else \
        reference_scale(x.abs().max(), fmt)
    expect_close(got.get("scale"), float(scale), f"{what}: the scale", rel=1e-6,
                 mistakes=[_inverted(amax, FORMATS[fmt][1])] if amax and given is None else [])
    expect_fp8(got.get("fp8"), x, scale, fmt, f"{what}: the fp8 values", hint)
    expect_dequantized(got.get("dequantized"), got["fp8"], scale.expand(shape),
                       f"{what}: the dequantised values (fp8 / scale)")


def _shape(rng: random.Random) -> tuple[int, ...]:
    return tuple(rng.randrange(1, 9) for _ in range(rng.randrange(1, 4)))


@QUANTIZE.check(points=2, hint="the scale must map the tensor's largest magnitude onto the format's largest value; "
                               "dequantising undoes it")
def quantize_current_scale(student, rng):
    """a per-tensor scale max/amax: the fp8 values nearest x·scale, and back (e4m3 and e5m2)"""
    for fmt in ("e4m3", "e5m2", "e4m3"):
        _expect_quantize(student, rng, _shape(rng), 10 ** rng.uniform(-4, 4), fmt)


@QUANTIZE.check(points=1, hint="a scale chosen from another tensor's amax (delayed scaling) can push values past the "
                               "format's range, and the cast does not saturate for you (e5m2 gives ±inf; e4m3fn has "
                               "no inf at all)")
def quantize_saturates(student, rng):
    """a given scale that overflows some values: they saturate at ±max, never inf or NaN"""
    for fmt in ("e5m2", "e4m3"):
        amax = 10 ** rng.uniform(-2, 2)
        _expect_quantize(student, rng, (rng.randrange(4, 9), rng.randrange(4, 9)), amax, fmt,
                         given=FORMATS[fmt][1] / amax * rng.uniform(3.0, 8.0))


@QUANTIZE.check(points=1, hint="an all-zero tensor has amax = 0: what does your scale become, and what does 0 times "
                               "it give?")
def quantize_all_zeros(student, rng):
    """an all-zero tensor: scale 1, zeros back (no inf, no NaN)"""
    for fmt in ("e4m3", "e5m2"):
        _expect_quantize(student, rng, _shape(rng), 0.0, fmt)


# --- 10.loss_scale_update --------------------------------------------------------------------------------------

LOSS_SCALE = exercise("10.loss_scale_update", entry=("run_loss_scale",), **TORCH)


class _CountingOptimizer:
    """What GradScaler.step needs of an optimizer — param_groups and step() — counting the steps it was let take
    (a torch.optim optimizer would import torch._dynamo: 3 s in the grader)."""

    def __init__(self, params: list) -> None:
        self.param_groups, self.steps = [{"params": params}], 0

    def step(self) -> None:
        self.steps += 1


def grad_scaler_trajectory(found_infs: list[bool], init_scale: float, growth_factor: float, backoff_factor: float,
                           growth_interval: int) -> tuple[list[float], list[int], list[bool]]:
    """The scale, the growth tracker and whether the optimizer step was skipped, after each step of a
    `torch.amp.GradScaler` scaling the loss of one weight, an inf planted in its gradient where `found_infs` says."""
    import torch

    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = _CountingOptimizer([weight])
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=growth_factor,
                                  backoff_factor=backoff_factor, growth_interval=growth_interval)
    scales, trackers, skipped = [], [], []
    for found_inf in found_infs:
        weight.grad = None
        scaler.scale(weight.sum()).backward()
        if found_inf:
            weight.grad[0] = float("inf")
        steps = optimizer.steps
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        trackers.append(int(scaler._get_growth_tracker()))
        skipped.append(optimizer.steps == steps)
    return scales, trackers, skipped


def _expect_trajectory(student, found_infs: list[bool], init_scale: float, growth_factor: float,
                       backoff_factor: float, growth_interval: int) -> None:
    scales, trackers, skipped = grad_scaler_trajectory(found_infs, init_scale, growth_factor, backoff_factor,
                                                       growth_interval)
    steps = "".join("x" if f else "." for f in found_infs)
    what = f"run_loss_scale({init_scale:g}, found_infs='{steps}' (x: inf/nan), growth_factor={growth_factor:g}, " \
           f"backoff_factor={backoff_factor:g}, growth_interval={growth_interval})"
    got = driver(what, "a dict of scales, trackers and skipped", student.run_loss_scale, init_scale,
                 list(found_infs), growth_factor, backoff_factor, growth_interval)
    # GradScaler keeps its scale in float32: a float64 answer drifts by ~6e-8 per multiplication
    expect_allclose(got.get("scales"), scales, f"{what}: the scale after each step", tol=1e-5)
    expect_equal(got.get("trackers"), trackers, f"{what}: the growth tracker after each step")
    if got.get("skipped") != skipped:
        raise CheckFailed(f"{what}: skipped returned {preview(got.get('skipped') or [])}, expected "
                          f"{preview(skipped)} (the steps with an inf/nan gradient)")


@LOSS_SCALE.check(points=2, hint="the scale grows after growth_interval clean steps in a row, and a growth starts a "
                                 "new count")
def loss_scale_growth(student, rng):
    """clean steps: the scale grows by growth_factor every growth_interval steps, the tracker restarts"""
    interval = rng.randrange(2, 7)
    _expect_trajectory(student, [False] * (3 * interval + rng.randrange(interval)), 2.0 ** rng.randrange(8, 17),
                       2.0, 0.5, interval)


@LOSS_SCALE.check(points=2, hint="an inf/nan step backs the scale off and restarts the count of clean steps")
def loss_scale_backoff(student, rng):
    """an inf/nan step: back-off, the tracker restarts, the step is skipped"""
    interval = rng.randrange(2, 6)
    found = [False] * (interval - 1) + [True] + [False] * interval + [True, True] + [False] * interval
    found += [rng.random() < 0.3 for _ in range(12)]
    _expect_trajectory(student, found, 2.0 ** 16, 2.0, 0.5, interval)


@LOSS_SCALE.check(points=1, hint="growth multiplies by growth_factor, back-off by backoff_factor: read them from the "
                                 "arguments (GradScaler's defaults are 2.0, 0.5 and 2000)")
def loss_scale_random_factors(student, rng):
    """random growth and back-off factors and intervals, a long random trajectory"""
    interval = rng.randrange(2, 6)
    found = [False] * interval + [rng.random() < 0.2 for _ in range(60)]
    _expect_trajectory(student, found, 2.0 ** rng.randrange(4, 20), rng.uniform(1.5, 4.0), rng.uniform(0.1, 0.9),
                       interval)


# --- 10.delayed_scaling ----------------------------------------------------------------------------------------

DELAYED = exercise("10.delayed_scaling", entry=("run_delayed",), requires=("10.quantize_tensorwise",), **TORCH)


def delayed_reference(xs: list, length: int, fmt: str) -> list[float]:
    """The scale of each step under delayed scaling (`lab.precision.fp8.AmaxHistory`): fp8 max / the largest amax
    of the `length` steps before it; the first step, whose history is empty, bootstraps from its own amax."""
    from lab.precision.fp8 import AmaxHistory, Scaling, amax, scale_from_amax

    scaling, history, scales = Scaling(fmt=fmt, timing="delayed", history=length), AmaxHistory(length), []
    for x in xs:
        now = amax(x, scaling)
        scales.append(float(history.scale(fmt) if len(history) else scale_from_amax(now, fmt)))
        history.update(now)
    return scales


def _expect_delayed(student, rng: random.Random, amaxes: list[float], length: int, fmt: str,
                    hint: str | None = None) -> None:
    import torch

    shape = (rng.randrange(2, 6), rng.randrange(2, 9))
    xs = [_drawn(rng, shape, a) for a in amaxes]
    amaxes = [float(x.abs().max()) for x in xs]  # float32
    what = f"run_delayed(<{len(xs)} steps of {shape} values, amaxes {preview(amaxes, 3)}>, length={length}, " \
           f"fmt={fmt!r})"
    got = driver(what, "a dict of scales and fp8", student.run_delayed, [x.flatten().tolist() for x in xs],
                 list(shape), length, fmt)
    scales = delayed_reference(xs, length, fmt)
    expect_allclose(got.get("scales"), scales, f"{what}: the scale of each step", tol=1e-6)
    fp8 = got.get("fp8")
    if not (isinstance(fp8, list) and len(fp8) == len(xs)):
        raise CheckFailed(f"{what}: fp8 returned {repr(fp8)[:80]}, expected one list of fp8 values per step")
    for step, (x, values) in enumerate(zip(xs, fp8, strict=True)):
        expect_fp8(values, x, torch.tensor(scales[step], dtype=torch.float32), fmt, f"{what}: step {step}'s fp8",
                   hint)


@DELAYED.check(points=2, hint="delayed scaling uses only the steps before this one: mind the order of reading the "
                              "history, quantising, and recording this step's amax")
def delayed_history(student, rng):
    """the scale of step t comes from the amaxes of the `length` steps before it (the first: its own amax)"""
    length = rng.randrange(2, 5)
    amaxes = [10 ** rng.uniform(-1, 1) for _ in range(length + 7)]
    amaxes[1] *= 50  # a spike that must leave the history `length` steps later
    _expect_delayed(student, rng, amaxes, length, rng.choice(("e4m3", "e5m2")))


@DELAYED.check(points=1, hint="a step whose amax exceeds the history's max is quantised with the old, too-large "
                              "scale: its largest values saturate at ±max (quantize clamps) — that is the price of "
                              "delayed scaling, not a reason to use the current amax")
def delayed_spike_saturates(student, rng):
    """a step whose amax is far above its history's: its largest values saturate at ±max"""
    base = 10 ** rng.uniform(-1, 1)
    amaxes = [base * rng.uniform(0.5, 1.0) for _ in range(3)] + [base * rng.uniform(10, 40)]
    _expect_delayed(student, rng, amaxes, rng.randrange(2, 5), "e5m2")


# --- 10.tilewise_scales ----------------------------------------------------------------------------------------

TILEWISE = exercise("10.tilewise_scales", entry=("run_tilewise",), requires=("10.quantize_tensorwise",), **TORCH)


def tilewise_reference(x):
    """One e4m3 scale per 1×TILE tile of each row of x (rows, cols), the last tile of a row as wide as what is
    left (`lab.precision.fp8` with `Scaling(granularity="tile")`): (rows, ceil(cols / TILE)) scales, and each
    element's scale (rows, cols)."""
    from lab.precision.fp8 import Scaling, amax, scale_from_amax

    scales = scale_from_amax(amax(x, Scaling(fmt="e4m3", granularity="tile", tile=TILE)), "e4m3")
    return scales, scales.repeat_interleave(TILE, dim=1)[:, :x.shape[1]]


def _expect_tilewise(student, rng: random.Random, rows: int, cols: int, zero_tile: bool = False,
                     hint: str | None = None) -> None:
    import torch

    n_tiles = -(-cols // TILE)
    x = torch.cat([_drawn(rng, (rows, min(TILE, cols - t * TILE)), 10 ** rng.uniform(-3, 3))
                   for t in range(n_tiles)], dim=1)
    for _ in range(rows):  # each row gets its own tile magnitudes
        row, tile = rng.randrange(rows), rng.randrange(n_tiles)
        x[row, tile * TILE:(tile + 1) * TILE] *= 10 ** rng.uniform(-2, 2)
    if zero_tile:
        x[rng.randrange(rows), rng.randrange(n_tiles) * TILE:][:TILE] = 0
    scales, per_element = tilewise_reference(x)
    what = f"run_tilewise(<{rows} x {cols} float32 values>, rows={rows}, cols={cols})"
    got = driver(what, "a dict of scales, fp8 and dequantized", student.run_tilewise, x.flatten().tolist(), rows,
                 cols)
    expect_allclose(got.get("scales"), scales.flatten().tolist(),
                    f"{what}: the scales ({rows} rows x {n_tiles} tiles, row by row)", tol=1e-6)
    expect_fp8(got.get("fp8"), x, per_element, "e4m3", f"{what}: the fp8 values", hint)
    expect_dequantized(got.get("dequantized"), got["fp8"], per_element,
                       f"{what}: the dequantised values (each fp8 value / its tile's scale)")


@TILEWISE.check(points=3, hint="one scale per 128 consecutive values of a row: check that each amax covers one tile "
                               "of one row, and that dequantising pairs every value with its own tile's scale")
def tilewise_whole_tiles(student, rng):
    """rows of whole 1×128 tiles: one scale per tile, the fp8 values and back"""
    _expect_tilewise(student, rng, rng.randrange(2, 7), TILE * rng.randrange(2, 4))


@TILEWISE.check(points=2, hint="when 128 does not divide the row, the last tile is narrower: it still gets its own "
                               "scale")
def tilewise_ragged_tile(student, rng):
    """a ragged last tile (cols not a multiple of 128), one row, and an all-zero tile (scale 1)"""
    _expect_tilewise(student, rng, rng.randrange(2, 6), TILE * rng.randrange(1, 3) + rng.randrange(1, TILE),
                     zero_tile=True)
    _expect_tilewise(student, rng, 1, TILE * rng.randrange(1, 3) + rng.randrange(1, TILE))


# --- 10.zero3_gather_bytes -------------------------------------------------------------------------------------------

GATHER = exercise("10.zero3_gather_bytes", entry=("zero3_bytes_per_step",))
BYTES_PER_PARAMETER = {"fp32": 4, "bf16": 2, "fp8": 1}  # what each ZeRO-3 all-gather moves per parameter


def reference_zero3_bytes(n_params: int, n_tensors: int, dp: int, grad_accum: int, gather: str) -> dict[str, float]:
    """The bytes one rank sends in one step for one unit under `lab.parallel.zero.Zero`, with ring collectives
    (`lab.calc.comms.bus_factor`): the unit padded to a multiple of dp; two all-gathers per micro-batch (before its
    forward and before its backward), each forwarding dp − 1 shards and preceded in FP8 by an all-reduce of one
    fp32 amax per tensor (2(dp − 1)/dp of it sent); one reduce-scatter of the fp32 gradient per step (dp − 1
    shards). tests/test_zero_fp8_gather.py holds it equal to what `count_collectives` counts on the engine."""
    shard = -(-n_params // dp)
    gathers = 2 * grad_accum
    return {"all_gather": gathers * (dp - 1) * shard * BYTES_PER_PARAMETER[gather],
            "all_reduce": gathers * 2 * (dp - 1) / dp * 4 * n_tensors if gather == "fp8" else 0.0,
            "reduce_scatter": (dp - 1) * shard * 4}


def _expect_zero3_bytes(student, n_params: int, n_tensors: int, dp: int, grad_accum: int, gather: str) -> None:
    call = (f"zero3_bytes_per_step(n_params={n_params}, n_tensors={n_tensors}, dp={dp}, grad_accum={grad_accum}, "
            f"gather={gather!r})")
    expected = reference_zero3_bytes(n_params, n_tensors, dp, grad_accum, gather)
    got = driver(call, f"a dict of {', '.join(expected)}", student.zero3_bytes_per_step, n_params, n_tensors, dp,
                 grad_accum, gather)
    for key, value in expected.items():
        expect_number(got.get(key), value, f"{call}[{key!r}]")


def _unit(rng: random.Random, dp: int, divides: bool) -> int:
    """A unit's parameter count, from a tiny block to a Llama-3-70B block (856M), that dp divides or not."""
    n = rng.randrange(10**4, 9 * 10**8)
    return n - n % dp if divides else n - n % dp + rng.randrange(1, dp)


@GATHER.check(points=1, hint="ZeRO-3 frees a unit's parameters after its forward, so it gathers them again before "
                             "its backward; on a ring, each rank passes on every shard but the one it receives last")
def gather_one_micro_batch(student, rng):
    """one micro-batch in fp32 and bf16, dp dividing the unit: two gathers of the shard, one reduce-scatter"""
    for gather in ("fp32", "bf16"):
        dp = rng.choice((2, 4, 8, 64, 512))
        _expect_zero3_bytes(student, _unit(rng, dp, True), rng.randrange(2, 12), dp, 1, gather)


@GATHER.check(points=1, hint="every rank must dequantise with the same scale: before each gather, one all-reduce of "
                             "one 4-byte amax per parameter tensor, which a ring runs as a reduce-scatter and an "
                             "all-gather")
def gather_fp8(student, rng):
    """fp8: one byte a parameter gathered, and one fp32 amax per tensor all-reduced before each gather"""
    for dp in (2, rng.choice((8, 64, 256))):
        _expect_zero3_bytes(student, _unit(rng, dp, True), rng.randrange(2, 12), dp, 1, "fp8")


@GATHER.check(points=1, hint="the first micro-batches' gradients accumulate locally (no_sync) and are reduce-scattered "
                             "once a step; a unit that dp does not divide is padded up to a multiple of dp")
def gather_accumulation_and_padding(student, rng):
    """several micro-batches, and a unit dp does not divide: two gathers per micro-batch, shards rounded up"""
    for gather in ("fp32", "bf16", "fp8"):
        dp = rng.choice((3, 4, 6, 8, 48))
        _expect_zero3_bytes(student, _unit(rng, dp, False), rng.randrange(2, 12), dp, rng.randrange(2, 9), gather)


# --- 10.mxfp4_block --------------------------------------------------------------------------------------------

MXFP4 = exercise("10.mxfp4_block", entry=("run_mxfp4",), **TORCH)
MX_BLOCK = 32  # OCP MX v1.0: 32 elements share one E8M0 scale
TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]  # halfway between two E2M1 neighbours: 0/.5, .5/1, 1/1.5, ... 4/6


def mxfp4_reference(x):
    """(scale, elements) of one block by `lab.precision.microscaling`: the E8M0 scale 2^(floor(log2 amax) - 2)
    (2^-127 for an all-zero block) and x / scale rounded to E2M1, ties to even, saturating at ±6."""
    from lab.precision.microscaling import quantize

    q = quantize(x, "mxfp4")
    return float(q.scales[0]), q.elements


def _expect_mxfp4(student, x, hint: str | None = None) -> None:
    scale, elements = mxfp4_reference(x)
    what = f"run_mxfp4(<{MX_BLOCK} values, amax {float(x.abs().max()):.6g}>)"
    got = driver(what, "a dict of scale, elements and dequantized", student.run_mxfp4, x.tolist())
    expect_close(got.get("scale"), scale, f"{what}: the shared scale", rel=1e-9,
                 mistakes=[Mistake(2.0, "ceil instead of floor",
                                   "floor(log2 amax) - 2: the scale is rounded *down*, and what lands past 6 "
                                   "saturates")])
    expect_allclose(got.get("elements"), elements.tolist(), f"{what}: the E2M1 elements (x / scale on the grid)",
                    tol=1e-9)
    expect_allclose(got.get("dequantized"), (elements.double() * scale).tolist(),
                    f"{what}: the dequantised values (elements · scale)", tol=1e-7)


def _block(rng: random.Random, amax: float, negative: bool):
    """A float32 block of Gaussian values whose largest |value| is `amax`, that value negative if `negative`."""
    x = _drawn(rng, (MX_BLOCK,), amax)
    return x if bool(x[int(x.abs().argmax())] < 0) == negative else -x


@MXFP4.check(points=2, hint="the scale is 2^(floor(log2 amax) - 2), amax the largest *magnitude*; each x / scale then "
                            "goes to the nearest E2M1 value: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives")
def mxfp4_random_blocks(student, rng):
    """random blocks over twelve decades, one all negative: the scale 2^(floor(log2 amax) - 2) and E2M1 elements"""
    for i in range(6):
        _expect_mxfp4(student, _block(rng, 10 ** rng.uniform(-6, 6), negative=i % 2 == 1))
    _expect_mxfp4(student, -_block(rng, 10 ** rng.uniform(-3, 3), negative=False).abs())


@MXFP4.check(points=1, hint="a value halfway between two E2M1 neighbours goes to the one with an even mantissa (0, "
                            "1, 2, 4 rather than 0.5, 1.5, 3, 6): torch.round rounds half to even")
def mxfp4_ties_to_even(student, rng):
    """values halfway between two E2M1 neighbours: ties go to the even one (2.5 -> 2, 3.5 -> 4, 5 -> 4)"""
    import torch

    scale = 2.0 ** rng.randrange(-8, 8)
    values = [rng.choice(TIES) * rng.choice((1, -1)) for _ in range(MX_BLOCK - 1)] + [6.0]  # amax 6: the scale
    rng.shuffle(values)
    _expect_mxfp4(student, torch.tensor(values, dtype=torch.float32) * scale)


@MXFP4.check(points=1, hint="floor(log2 amax) - 2 leaves amax / scale anywhere in [4, 8): past 6 nothing is left on "
                            "the grid, so clamp to ±6; and an all-zero block has no log2 at all")
def mxfp4_saturates_and_zero(student, rng):
    """a block whose amax / scale lands past 6 saturates at ±6; an all-zero block gives zeros, no NaN"""
    import torch

    # amax / scale in (7, 8): rounded on the grid extended past 6 it would become 8
    x = _block(rng, 2.0 ** rng.randrange(-6, 6) * rng.uniform(7.1, 7.9), negative=rng.random() < 0.5)
    _expect_mxfp4(student, x)
    zeros = torch.zeros(MX_BLOCK)
    what = f"run_mxfp4(<{MX_BLOCK} zeros>)"
    got = driver(what, "a dict of scale, elements and dequantized", student.run_mxfp4, zeros.tolist())
    scale = got.get("scale")
    if not (isinstance(scale, (int, float)) and 0 < scale < float("inf")):
        raise CheckFailed(f"{what}: the scale returned {shown(scale) if isinstance(scale, float) else scale!r}, "
                          "expected a positive finite number (any scale stores zeros; lab uses 2^-127)")
    expect_allclose(got.get("elements"), [0.0] * MX_BLOCK, f"{what}: the elements", tol=0)
    expect_allclose(got.get("dequantized"), [0.0] * MX_BLOCK, f"{what}: the dequantised values", tol=0)
