"""lab.calc.formats against the published format tables and against torch's own casts, bit for bit.

Sources: the playbook's format table and resolution figure (its section "Mixed precision training");
Micikevicius et al. 2022, "FP8 Formats for Deep Learning", Table 1 (E4M3 and E5M2: bias, max, min normal, min
subnormal, inf and NaN patterns); the OCP Microscaling (MX) Formats Specification v1.0, the E8M0 scale (bias 127,
2^-127..2^127, 0xFF NaN, no sign, no zero); IEEE 754 binary16/binary32;
NVIDIA's TF32 (8 exponent bits, 10 mantissa bits).
"""

import math
import random
import struct
import subprocess
import sys

import pytest

from lab.calc.formats import (
    FORMATS,
    decode,
    encode,
    get_format,
    neighbours,
    representable_near_one,
    values_between,
)

# name: (sign, exponent, mantissa bits, bias, max, min normal, min subnormal, epsilon)
PUBLISHED = {
    "fp32": (1, 8, 23, 127, (2 - 2**-23) * 2.0**127, 2.0**-126, 2.0**-149, 2.0**-23),
    "tf32": (1, 8, 10, 127, (2 - 2**-10) * 2.0**127, 2.0**-126, 2.0**-136, 2.0**-10),
    "fp16": (1, 5, 10, 15, 65504.0, 2.0**-14, 2.0**-24, 2.0**-10),
    "bf16": (1, 8, 7, 127, (2 - 2**-7) * 2.0**127, 2.0**-126, 2.0**-133, 2.0**-7),
    "e4m3fn": (1, 4, 3, 7, 448.0, 2.0**-6, 2.0**-9, 2.0**-3),  # FP8 paper Table 1
    "e5m2": (1, 5, 2, 15, 57344.0, 2.0**-14, 2.0**-16, 2.0**-2),  # FP8 paper Table 1
    "e8m0": (0, 8, 0, 127, 2.0**127, 2.0**-127, None, 1.0),  # OCP MX v1.0: exponent only
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_every_format_has_its_published_layout_and_range(name):
    sign, exponent, mantissa, bias, top, normal, subnormal, eps = PUBLISHED[name]
    fmt = get_format(name)
    assert (fmt.sign_bits, fmt.exponent_bits, fmt.mantissa_bits, fmt.bias) == (sign, exponent, mantissa, bias)
    assert (fmt.max, fmt.min_normal, fmt.min_subnormal, fmt.epsilon) == (top, normal, subnormal, eps)
    assert representable_near_one(fmt, 1)[2] == 1 + eps  # epsilon is the gap above 1


def test_the_numbers_people_quote():
    assert get_format("fp16").max == 65504 and get_format("fp16").min_subnormal == pytest.approx(5.96e-8, rel=1e-3)
    assert get_format("bf16").max == pytest.approx(3.39e38, rel=1e-3)
    assert get_format("fp32").epsilon == pytest.approx(1.19e-7, rel=1e-2)  # the playbook: "1.19×10⁻⁷"
    assert get_format("fp32").decades == pytest.approx(83.4, abs=0.1)  # "~80 orders of magnitude"
    # playbook, "Mixed precision training", resolution figure: e4m3 has 7 values strictly inside (1, 2), e5m2 has 3
    assert [len(values_between(1, 2, f)) - 2 for f in ("e4m3fn", "e5m2")] == [7, 3]
    # FP8 paper Table 1: E4M3 max S.1111.110 and NaN S.1111.111 (no inf); E5M2 inf S.11111.00, NaN S.11111.xx
    assert encode(448, "e4m3fn").bit_string == "01111110" and math.isnan(decode("0 1111 111", "e4m3fn"))
    assert decode("1 1111 111", "e4m3fn") != decode("1 1111 111", "e4m3fn")  # NaN
    assert decode("0 11111 00", "e5m2") == math.inf and math.isnan(decode("0 11111 01", "e5m2"))
    assert decode("0 11110 11", "e5m2") == 57344
    # OCP MX: E8M0 0x00 is 2^-127, 0x7F is 1, 0xFE is 2^127, 0xFF is NaN
    assert [decode(b, "e8m0") for b in (0, 127, 254)] == [2.0**-127, 1.0, 2.0**127] and math.isnan(decode(255, "e8m0"))


@pytest.mark.parametrize(("name", "pattern"), [("e4m3fn", "S.1111.111 only"), ("e5m2", "S.11111.M with M != 0 "
                                               "(3 patterns per sign)"), ("e8m0", "11111111 only")])
def test_nan_encodings_are_described(name, pattern):
    assert get_format(name).nan_encoding == pattern


# --- rounding, overflow, saturation -------------------------------------------------------------------------------


def test_ties_go_to_the_even_significand():
    # 1 + eps/2 is halfway between 1 (even) and 1 + eps (odd): down; 1 + 3 eps/2 between odd and even: up
    for name in ("fp16", "bf16", "e4m3fn", "e5m2", "tf32"):
        eps = get_format(name).epsilon
        assert encode(1 + eps / 2, name).value == 1.0, name
        assert encode(1 + 3 * eps / 2, name).value == 1 + 2 * eps, name
        assert encode(-(1 + 3 * eps / 2), name).value == -(1 + 2 * eps), name
    # e8m0 has one significand per binade: 1.5 is halfway to 2 and goes up (2 = 1 x 2^1 ... M = 2, even)
    assert encode(1.5, "e8m0").value == 2.0 and encode(1.4999, "e8m0").value == 1.0


def test_fp16_overflow_edge_65504():
    assert encode(65504, "fp16").value == 65504 and not encode(65504, "fp16").rounded
    below = encode(65519.99, "fp16")  # less than half an ulp (32) above max: rounds back to max
    assert (below.value, below.overflowed, below.saturated) == (65504, False, False)
    over = encode(65520, "fp16")  # exactly halfway to 65536 (even): overflows to inf
    assert (over.value, over.overflowed, over.fields) == (math.inf, True, ("0", "11111", "0000000000"))
    assert over.relative_error == math.inf
    clamped = encode(65520, "fp16", saturate=True)
    assert (clamped.value, clamped.overflowed, clamped.saturated) == (65504, True, True)
    assert encode(-1e9, "fp16", saturate=True).value == -65504


def test_e4m3fn_has_no_inf_overflow_is_nan_or_saturates():
    # 464 is halfway between 448 (S.1111.110, even) and the NaN pattern's 480: rounds to 448
    assert encode(464, "e4m3fn").value == 448 and not encode(464, "e4m3fn").overflowed
    for x in (465, 1e6, math.inf):
        assert math.isnan(encode(x, "e4m3fn").value), x
        assert encode(x, "e4m3fn", saturate=True).value == 448 and encode(x, "e4m3fn", saturate=True).saturated
    assert encode(-465, "e4m3fn").bit_string == "11111111" and encode(-465, "e4m3fn").overflowed
    # e5m2 is IEEE-like: 61440 is halfway between 57344 (odd) and 65536: overflows to inf
    assert encode(61439, "e5m2").value == 57344 and encode(61440, "e5m2").value == math.inf
    assert encode(math.inf, "e5m2").value == math.inf and encode(math.inf, "e5m2", saturate=True).value == 57344


def test_subnormals_and_underflow():
    fp16 = get_format("fp16")
    tiny = encode(3e-8, fp16)  # above half of 2^-24: the smallest subnormal
    assert (tiny.value, tiny.subnormal, tiny.fields[1]) == (2.0**-24, True, "00000")
    assert encode(2.0**-25, fp16).value == 0 and encode(2.0**-25, fp16).underflowed  # tie to even: zero
    assert encode(2.0**-25 * 3, fp16).value == 2.0**-23  # 1.5 ulps: tie, to the even 2 ulps
    gone = encode(-1e-30, "e4m3fn")
    assert gone.underflowed and gone.bit_string == "10000000" and gone.relative_error == 1.0
    assert not encode(fp16.min_normal, fp16).subnormal and encode(fp16.min_normal / 2, fp16).subnormal
    # e8m0 has no zero: anything below 2^-127 is stored as 2^-127
    assert encode(0.0, "e8m0").value == 2.0**-127 and encode(1e-300, "e8m0").bits == 0


def test_nan_zero_and_sign_survive():
    assert encode(-0.0, "e4m3fn").bit_string == "10000000" and encode(-0.0, "bf16").bits == 0x8000
    nan = encode(-math.nan, "fp16")
    assert math.isnan(nan.value) and nan.fields == ("1", "11111", "1000000000") and nan.relative_error == 0
    assert math.isnan(encode(math.nan, "e8m0").value) and math.isnan(encode(2.0**127 * 1.5, "e8m0").value)


def test_encoding_fields_and_relative_error():
    e = encode(0.1, "bf16")
    assert e.fields == ("0", "01111011", "1001101") and e.bit_string == "0011110111001101"
    assert (e.sign, e.exponent, e.mantissa) == (0, 123, 0b1001101)
    assert e.value == 0.10009765625 and e.relative_error == pytest.approx(9.765625e-4, rel=1e-6)
    assert encode(1.0, "e8m0").fields == ("", "01111111", "")
    assert decode(e.bits, "bf16") == decode(e.bit_string, "bf16") == e.value


def test_neighbours_values_between_and_the_grid_near_one():
    assert neighbours(1.0, "fp16") == (1 - 2**-11, 1 + 2**-10)  # the binade under 1 is twice as dense
    assert neighbours(1.05, "e4m3fn") == (1.0, 1.125)
    assert neighbours(448, "e4m3fn") == (416, None) and neighbours(1e6, "fp16") == (65504, math.inf)
    assert neighbours(-1e6, "e5m2") == (-math.inf, -57344) and neighbours(math.inf, "bf16")[1] is None
    assert neighbours(0.0, "fp16") == (-(2.0**-24), 2.0**-24) and neighbours(0.0, "e8m0") == (None, 2.0**-127)
    assert values_between(0.5, 4, "e5m2") == [0.5, 0.625, 0.75, 0.875, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4]
    assert values_between(-0.01, 0.01, "e4m3fn") == [k * 2.0**-9 for k in range(-5, 6)]  # subnormals, one zero
    assert representable_near_one("e4m3fn", 2) == [0.875, 0.9375, 1, 1.125, 1.25]
    assert representable_near_one("e8m0", 2) == [0.25, 0.5, 1, 2, 4]
    assert len(values_between(-math.inf, math.inf, "e4m3fn")) == 253  # 256 − 2 NaNs − (−0)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: get_format("fp4"), "format='fp4' must be one of 'fp32', 'tf32', 'fp16', 'bf16', 'e4m3fn'"),
    (lambda: encode("1e-5", "fp16"), "value='1e-5' must be a real number"),
    (lambda: encode(10**400, "fp16"), "value=1000.* is too large for a float"),
    (lambda: encode(-1.0, "e8m0"), r"value=-1.0 has no e8m0 encoding: e8m0 is unsigned \(a scale\)"),
    (lambda: decode(256, "e4m3fn"), r"bits=256 must be an integer in \[0, 255\] for e4m3fn"),
    (lambda: decode("0101", "fp16"), "bits='0101' must be 16 binary digits for fp16"),
    (lambda: neighbours(math.nan, "fp16"), "value=nan has no neighbours"),
    (lambda: values_between(2, 1, "fp16"), "lo=2.0, hi=1.0 must be numbers with lo <= hi"),
    (lambda: values_between(1, 4, "fp32"), "holds 16,777,217 fp32 values, more than limit=100,000"),
    (lambda: representable_near_one("fp16", 0), r"n=0 must be an integer in \[1, 1000\]"),
])
def test_bad_input_is_one_clear_line(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_fp32_matches_the_c_cast():
    # struct's "f" is the C double -> float cast (IEEE round to nearest even), torch-free; struct refuses to
    # overflow, _float32 gives IEEE's answer, inf
    rng = random.Random(0)
    for x in [rng.uniform(-1, 1) * 2.0 ** rng.randint(-160, 130) for _ in range(500)]:
        assert encode(x, "fp32").value == _float32(x), x


def test_importing_calc_formats_imports_no_torch():
    code = "import sys, lab.calc.formats; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


# --- against torch's casts ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


def _edge_values(name: str, rng: random.Random, n: int = 1500) -> list[float]:
    """fp32-exact values around `name`'s range: random ones over every binade from below the smallest
    subnormal to past max, every halfway point between neighbours (the round-to-even cases) and one float32
    ulp either side, and the edges (max, just past it, half the smallest subnormal, zeros, inf, NaN)."""
    fmt = get_format(name)
    low, high = math.floor(math.log2(fmt.min_positive)) - 2, fmt.emax + 2
    values = [rng.choice((-1, 1)) * rng.randint(1 << 23, (1 << 24) - 1) * 2.0 ** (rng.randint(low, high) - 23)
              for _ in range(n)]
    subnormals = values_between(-4 * fmt.min_normal, 4 * fmt.min_normal, fmt, limit=10**6)
    grid = subnormals[::2 ** max(0, fmt.mantissa_bits - 4)]
    for a in grid + [fmt.max, 2 * fmt.max, 1.0, 3.0] + [rng.choice(values) for _ in range(200)]:
        for b in neighbours(a, fmt):
            if b is not None and math.isfinite(b):
                mid = (a + b) / 2
                values += [mid, math.nextafter(mid, -math.inf), math.nextafter(mid, math.inf)]
    values += [fmt.max, -fmt.max, fmt.min_positive / 2, 0.75 * fmt.min_positive, 0.0, -0.0, math.inf, -math.inf,
               math.nan, 1e-45, 3e38]
    return [_float32(v) for v in values]


def _float32(x: float) -> float:
    """x rounded to float32 (what torch's cast reads), past float32's max: ±inf."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _torch_bits(torch, values: list[float], dtype) -> list[int]:
    width = torch.finfo(dtype).bits
    view = {8: torch.uint8, 16: torch.int16, 32: torch.int32}[width]
    return [b & ((1 << width) - 1) for b in torch.tensor(values, dtype=torch.float32).to(dtype).view(view).tolist()]


def _e4m3fn_saturates(torch) -> bool:
    """torch's float8_e4m3fn cast saturates since 2.x (c10's fp8e4m3fn_from_fp32_value: "finite overflow or
    inf -> saturate to max finite value"); earlier releases gave NaN. Either way it is one of encode's modes."""
    out = torch.tensor([1e6], dtype=torch.float32).to(torch.float8_e4m3fn).float().item()
    assert out == 448 or math.isnan(out)
    return out == 448


@pytest.mark.parametrize("name", ["fp16", "bf16", "e4m3fn", "e5m2"])
def test_encode_is_torchs_cast_bit_for_bit(torch, name):
    """Every bit pattern equal to torch's cast from float32 (NaN: any NaN pattern). fp16, bf16, e5m2 overflow to
    inf like encode's default; e4m3fn is compared with the mode this torch uses (see _e4m3fn_saturates)."""
    dtype = getattr(torch, get_format(name).torch_dtype)
    saturate = name == "e4m3fn" and _e4m3fn_saturates(torch)
    values = _edge_values(name, random.Random(name))
    assert len(values) > 2000
    for x, bits in zip(values, _torch_bits(torch, values, dtype), strict=True):
        mine = encode(x, name, saturate=saturate)
        if math.isnan(mine.value):
            assert math.isnan(decode(bits, name)), (name, x)
        else:
            assert mine.bits == bits, (name, x, mine.bit_string, format(bits, f"0{mine.format.bits}b"))


def test_e8m0_is_torchs_float8_e8m0fnu_cast(torch):
    """Positive fp32-normal inputs: torch's cast ignores the sign (e8m0 has none: encode refuses negatives) and
    rounds fp32 subnormals in (2^-127, 1.5·2^-127) up, where the nearest value is 2^-127."""
    if not hasattr(torch, "float8_e8m0fnu"):
        pytest.skip("this torch has no float8_e8m0fnu")
    rng = random.Random(8)
    values = [abs(v) for v in _edge_values("e8m0", rng, n=500) if not abs(v) < 2.0**-126]
    values += [1.5 * 2.0**k for k in range(-126, 128)] + [2.0**127 * 1.49, 2.0**127 * 1.5, 0.0]
    for x, bits in zip(values, _torch_bits(torch, values, torch.float8_e8m0fnu), strict=True):
        assert encode(x, "e8m0").bits == bits, x


@pytest.mark.parametrize("name", ["fp16", "bf16", "e4m3fn", "e5m2", "e8m0"])
def test_decode_every_pattern_like_torch(torch, name):
    fmt = get_format(name)
    step = 1 if fmt.bits == 8 else 11  # every 8-bit pattern; an 11-stride sweep (all fields) of the 16-bit ones
    patterns = list(range(0, 1 << fmt.bits, step))
    view = {8: torch.uint8, 16: torch.int16}[fmt.bits]
    signed = [p - (1 << 16) if view == torch.int16 and p >= 1 << 15 else p for p in patterns]
    theirs = torch.tensor(signed, dtype=view).view(getattr(torch, fmt.torch_dtype)).double().tolist()
    for p, t in zip(patterns, theirs, strict=True):
        mine = decode(p, fmt)
        assert mine == t or (math.isnan(mine) and math.isnan(t)), (name, p)
        if math.isfinite(mine):
            assert encode(mine, fmt).bits == p or mine == 0, (name, p)  # round trip (−0 keeps its sign bit)


@pytest.mark.parametrize("name", ["fp16", "bf16", "e4m3fn", "e5m2"])
def test_formats_agree_with_torch_finfo(torch, name):
    fmt, info = get_format(name), torch.finfo(getattr(torch, FORMATS[name].torch_dtype))
    assert (fmt.max, fmt.epsilon, fmt.min_normal, fmt.bits) == (info.max, info.eps, info.smallest_normal, info.bits)


def test_torch_rounds_float64_through_float32_encode_does_not(torch):
    """Why the torch comparisons feed float32 values: torch casts a float64 to bf16 via float32, rounding
    twice. Halfway between 1 and 1 + 2^-7 plus 2^-40 is nearer 1 + 2^-7; the first rounding lands on the
    midpoint, the second on the even 1."""
    x = 1 + 2**-8 + 2**-40
    assert torch.tensor(x, dtype=torch.float64).to(torch.bfloat16).item() == 1.0
    assert encode(x, "bf16").value == 1 + 2**-7
