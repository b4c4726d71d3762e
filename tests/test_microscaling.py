"""lab.precision.microscaling: MX's E8M0 block scales (OCP MX v1.0 §6.3), NVFP4's two-level scales, the element
grids of lab.calc.formats rounded ties-to-even, ragged blocks, and what each format costs in bits and in SQNR."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lab.calc.formats import encode, get_format, values_between
from lab.precision.fp8 import Scaling, sqnr
from lab.precision.fp8 import dequantize as fp8_dequantize
from lab.precision.fp8 import quantize as fp8_quantize
from lab.precision.microscaling import (
    BLOCK_FORMATS,
    dequantize,
    mx_scales,
    quantize,
    quantize_dequantize,
    round_to_grid,
)

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
MX = [name for name, f in BLOCK_FORMATS.items() if not f.tensor_scale]


@pytest.fixture(scope="module")
def with_outliers() -> torch.Tensor:
    """A Gaussian (tokens, features) activation with three outlier channels 50× the rest."""
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))
    x[:, [7, 300, 900]] *= 50
    return x


def test_the_element_grids_are_the_mx_spec_s():
    """E2M1 is ±{0, .5, 1, 1.5, 2, 3, 4, 6}; the FP6 grids top out at 7.5 and 28; none has inf or NaN."""
    assert values_between(0, math.inf, "e2m1") == E2M1
    assert values_between(-math.inf, 0, "e2m1") == [-v for v in reversed(E2M1)][:-1] + [0.0]
    assert (get_format("e2m3").max, get_format("e3m2").max) == (7.5, 28.0)
    assert len(values_between(-math.inf, math.inf, "e2m3")) == 2**6 - 1  # every pattern a value, ±0 once
    assert encode(100.0, "e2m1").value == 6.0 and encode(100.0, "e2m1").saturated  # saturates, never overflows
    with pytest.raises(ValueError, match="e2m1 has no NaN"):
        encode(math.nan, "e2m1")


def test_round_to_grid_lands_on_the_grid_ties_to_even():
    x = torch.linspace(-8, 8, 4001)
    assert sorted(set(round_to_grid(x, "e2m1").abs().tolist())) == E2M1
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, 7.0])
    assert round_to_grid(ties, "e2m1").tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, 6.0]


@pytest.mark.parametrize(("element", "dtype"), [("e4m3fn", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_round_to_grid_is_torch_s_fp8_cast(element, dtype):
    """On the FP8 grids the emulated rounding is torch's cast, subnormals and ties included."""
    g = torch.Generator().manual_seed(1)
    top = get_format(element).max
    x = (torch.randn(50_000, generator=g) * torch.exp2(torch.randint(-24, 14, (50_000,), generator=g).float()))
    x = x.clamp(-top, top)
    assert torch.equal(round_to_grid(x, element), x.to(dtype).float())


@pytest.mark.parametrize(("fmt", "block_amax", "scale"), [
    ("mxfp4", 6.0, 1.0), ("mxfp4", 7.9, 1.0), ("mxfp4", 8.0, 2.0), ("mxfp4", 0.3, 2.0**-4),
    ("mxfp8_e4m3", 448.0, 1.0), ("mxfp8_e4m3", 1.0, 2.0**-8), ("mxfp8_e5m2", 1.0, 2.0**-15),
    ("mxfp6_e2m3", 7.5, 1.0), ("mxfp6_e3m2", 20.0, 1.0), ("mxfp6_e3m2", 40.0, 2.0)])
def test_the_mx_scale_is_two_to_floor_log2_amax_minus_emax(fmt, block_amax, scale):
    """X = 2^(floor(log2 amax) - emax_elem) (OCP MX v1.0 §6.3), hand-picked: 7.9 and 6 share X = 1 in MXFP4."""
    x = torch.zeros(32)
    x[5] = -block_amax
    q = quantize(x, fmt)
    assert q.scales.tolist() == [scale]
    assert float(mx_scales(torch.tensor(block_amax), BLOCK_FORMATS[fmt].element)) == scale


def test_a_rounded_up_scale_never_clips():
    """round_up: X = 2^ceil(log2(amax / max)), so 7.9 gets X = 2 in MXFP4 (no saturation), 6 and 448 keep X = 1."""
    amaxes = torch.tensor([6.0, 7.9, 3.0, 0.0])
    assert mx_scales(amaxes, "e2m1", round_up=True).tolist() == [1.0, 2.0, 0.5, 2.0**-127]
    assert mx_scales(torch.tensor([448.0, 449.0]), "e4m3fn", round_up=True).tolist() == [1.0, 2.0]
    up = dataclasses.replace(BLOCK_FORMATS["mxfp8_e4m3"], round_up=True)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(4))
    q = quantize(x, up)
    assert float(q.elements.abs().max()) <= 448
    assert sqnr(x, dequantize(q)) > sqnr(x, quantize_dequantize(x, "mxfp8_e4m3"))


def test_mx_scales_are_e8m0_powers_of_two(with_outliers):
    for name in MX:
        scales = quantize(with_outliers * 1e-3, name).scales
        assert all(encode(s, "e8m0").value == s for s in scales.unique().tolist()), name
    assert mx_scales(torch.tensor([0.0, 1e-45, 3e38]), "e2m1").tolist() == [2.0**-127, 2.0**-127, 2.0**125]


@pytest.mark.parametrize("name", MX)
def test_representable_values_round_trip_exactly(name):
    """Values on the element grid times a power of two, the block's max on the top of the grid: stored exactly."""
    element = get_format(BLOCK_FORMATS[name].element)
    grid = torch.tensor(values_between(-element.max, element.max, element))
    picks = torch.randint(len(grid), (4, 64), generator=torch.Generator().manual_seed(2))
    x = grid[picks] * 2.0**-5
    x[:, 0], x[:, 40] = element.max * 2.0**-5, -element.max * 2.0**-5  # each block's amax at the top
    assert torch.equal(quantize_dequantize(x, name), x)


def test_saturation_past_the_element_max():
    """The floor rule leaves the block max up to 2x the element max: it saturates, never inf or NaN."""
    x = torch.tensor([7.6, 0.5] + [0.0] * 30)
    q = quantize(x, "mxfp4")
    assert q.scales.tolist() == [1.0] and q.elements[:2].tolist() == [6.0, 0.5]
    y = torch.full((32,), 500.0)
    assert quantize_dequantize(y, "mxfp8_e4m3").unique().tolist() == [448.0]


def test_blocks_of_32_along_the_last_axis_and_a_ragged_last_block():
    """70 values: blocks [0, 32), [32, 64) and a 6-wide last block with its own scale (zeros pad it for the amax).
    A large value scales only its own block: the one at index 31 flushes its block-mates, not index 32."""
    x = torch.full((2, 70), 1.0)
    x[0, 31], x[1, 66] = 64.0, 1024.0
    q = quantize(x, "mxfp4")
    assert q.scales.shape == (2, 3) and q.elements.shape == x.shape
    assert q.scales.tolist() == [[16.0, 0.25, 0.25], [0.25, 0.25, 256.0]]
    back = dequantize(q)
    assert back[0, :31].unique().tolist() == [0.0]  # 1/16 is under E2M1's smallest step: flushed by index 31
    assert back[0, 32:].unique().tolist() == [1.0] and back[1, :64].unique().tolist() == [1.0]
    assert back[1, 64:].tolist() == [0.0, 0.0, 1024.0, 0.0, 0.0, 0.0]  # 1 is under half the step of 256
    assert quantize(torch.ones(10), "mxfp8_e4m3").scales.shape == (1,)


def test_nvfp4_scales_blocks_of_16_with_e4m3_under_a_tensor_scale():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    q = quantize(x, "nvfp4")
    assert q.scales.shape == (4, 4) and q.tensor_scale is not None
    assert float(q.tensor_scale) == pytest.approx(float(x.abs().max()) / (448 * 6), rel=1e-6)
    assert torch.equal(round_to_grid(q.scales, "e4m3fn"), q.scales) and float(q.scales.max()) == 448.0
    assert torch.equal(q.elements, round_to_grid(q.elements, "e2m1"))


def test_nvfp4_s_tensor_scale_makes_it_indifferent_to_magnitude(with_outliers):
    """Without the float32 tensor scale, E4M3 block scales (2^-9..448) flush a tensor of tiny gradients to zero
    and clip a large one; with it, the SQNR is the same over 20 decades."""
    ref = sqnr(with_outliers, quantize_dequantize(with_outliers, "nvfp4"))
    for magnitude in (1e-10, 1e-6, 1e4, 1e10):
        y = with_outliers * magnitude
        assert sqnr(y, quantize_dequantize(y, "nvfp4")) == pytest.approx(ref, abs=0.1), magnitude


def test_sqnr_ordering_mxfp8_mxfp6_mxfp4_and_nvfp4_s_finer_scale(with_outliers):
    """More element bits, more SQNR; at 4 bits NVFP4's 16-wide blocks with a 3-mantissa-bit scale beat MXFP4's
    32-wide power-of-two ones by several dB; FP8 tensorwise loses the other values to a large outlier channel,
    MXFP8 only the outlier's block-mates."""
    db = {name: sqnr(with_outliers, quantize_dequantize(with_outliers, name)) for name in BLOCK_FORMATS}
    assert db["mxfp8_e4m3"] > db["mxfp6_e2m3"] > db["mxfp4"] + 8
    assert db["mxfp8_e5m2"] > db["mxfp6_e3m2"] - 0.5 and db["mxfp6_e3m2"] > db["mxfp4"] + 5
    assert db["nvfp4"] > db["mxfp4"] + 4
    spiky = with_outliers.clone()
    spiky[:, 7] *= 1e4  # one channel 500,000x the typical value: the SQNR of the other channels
    tensorwise = Scaling("e4m3")
    fp8 = sqnr(spiky[:, 8:], fp8_dequantize(*fp8_quantize(spiky, tensorwise), tensorwise)[:, 8:])
    assert sqnr(spiky[:, 8:], quantize_dequantize(spiky, "mxfp8_e4m3")[:, 8:]) > fp8 + 10


@pytest.mark.parametrize(("name", "bits"), [("mxfp8_e4m3", 8.25), ("mxfp8_e5m2", 8.25), ("mxfp6_e2m3", 6.25),
                                            ("mxfp6_e3m2", 6.25), ("mxfp4", 4.25), ("nvfp4", 4.5)])
def test_bits_per_value_include_the_scales(name, bits):
    assert BLOCK_FORMATS[name].bits_per_value() == bits
    extra = 32 / 4096 if BLOCK_FORMATS[name].tensor_scale else 0.0
    assert BLOCK_FORMATS[name].bits_per_value(4096) == bits + extra


def test_bad_input_is_one_line_naming_it():
    with pytest.raises(ValueError, match="block format='mxfp5' must be one of 'mxfp8_e4m3'"):
        quantize(torch.ones(4), "mxfp5")
    with pytest.raises(ValueError, match="x is not finite: mxfp4 has no encoding"):
        quantize(torch.tensor([1.0, math.inf]), "mxfp4")
    with pytest.raises(ValueError, match="numel=0: expected an int >= 1"):
        BLOCK_FORMATS["nvfp4"].bits_per_value(0)
