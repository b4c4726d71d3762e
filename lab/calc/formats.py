"""The number formats of mixed-precision and FP8 training, bit by bit: what a value becomes when it is stored.

A binary float stores a sign, an exponent field E and a mantissa field M. With `m` mantissa bits and a bias, a
*normal* pattern means (1 + M / 2^m) x 2^(E - bias); exponent field 0 holds the *subnormals* M / 2^m x 2^(1 - bias),
which fill the gap down to zero in even steps. Every binade [2^e, 2^(e+1)) holds 2^m equally spaced values, so
the relative gap is about 2^-m everywhere: `epsilon`, the gap above 1 (the playbook's "Mixed precision training"
section, its table of formats). The exponent bits buy range, the mantissa bits resolution; the formats of this
chapter split 8 to 32 bits differently:

    fp32   1/8/23  IEEE binary32                   bf16   1/8/7   fp32's range, 2^-7 resolution
    tf32   1/8/10  fp32's range, fp16's mantissa   fp16   1/5/10  IEEE binary16, max 65504
    e4m3fn 1/4/3   OCP FP8, no inf, max 448        e5m2   1/5/2   OCP FP8, IEEE-like, max 57344
    e8m0   0/8/0   OCP MX block scale: only powers of two 2^-127..2^127, no sign, no zero, 0xFF is NaN
    e2m3   1/2/3   OCP MX FP6, no inf or NaN, max 7.5    e3m2   1/3/2   OCP MX FP6, no inf or NaN, max 28
    e2m1   1/2/1   OCP MX FP4, no inf or NaN, max 6: the whole grid is ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}

What the top exponent field holds is each format's choice. IEEE formats (fp32, tf32, fp16, bf16, e5m2) give it
to the infinities (M = 0) and NaNs (M != 0). e4m3fn ("fn": finite, NaN) keeps only S.1111.111 as NaN and uses
the rest as ordinary values, which lifts its max from 240 to 448 (Micikevicius et al. 2022, "FP8 Formats for
Deep Learning", Table 1). e8m0's whole top field is its one NaN, and its field 0 is the ordinary value 2^-127.
The FP6 and FP4 element formats of the OCP Microscaling Formats (MX) v1.0 specification (its section "Element data
types") have no special values at all: every pattern is a number, and a conversion past ±max saturates (there is
nothing to overflow to). `lab.precision.microscaling` rounds torch tensors onto these grids.

`encode` rounds a Python float to the nearest representable value, ties to the even significand, in exact
integer arithmetic (a float is n / 2^t: no float64 operation, so no double rounding). A value past the largest
finite one either overflows — to ±inf where the format has infinities, to NaN where it has none (e4m3fn, e8m0): IEEE's
rule and the OCP FP8 spec's non-saturating mode — or, with `saturate=True`, is clamped to ±max (infinities
too), as FP8 recipes clamp before casting. torch's casts to fp16, bf16 and e5m2 overflow; torch's cast to
float8_e4m3fn saturates (since the 2.x releases: earlier ones gave NaN), so it equals `saturate=True`.
tf32 is rounded to nearest-even here like the others; NVIDIA's fp32 -> tf32 conversion instruction
(cvt.rna) rounds ties away from zero instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

VALUES_LIMIT = 100_000  # values_between refuses longer grids (fp32 has 2^23 values in every binade)


@dataclass(frozen=True)
class Format:
    """A binary floating-point format. `nan="ieee"`: the top exponent field is inf (M = 0) or NaN (M != 0);
    `nan="all_ones"`: only the all-ones pattern (per sign) is NaN, the rest of the top field holds values;
    `nan="none"` (MX's FP6 and FP4): no NaN and no inf, every pattern is a value, overflow saturates.
    Without subnormals (e8m0) exponent field 0 is an ordinary binade, so the format has no zero."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    signed: bool = True
    has_inf: bool = True
    nan: str = "ieee"
    has_subnormals: bool = True
    torch_dtype: str | None = None  # the torch.<dtype> holding it, None if torch has none (tf32 lives in fp32)

    @property
    def sign_bits(self) -> int:
        return 1 if self.signed else 0

    @property
    def bits(self) -> int:
        return self.sign_bits + self.exponent_bits + self.mantissa_bits

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value (exponent field 1, or 0 without subnormals)."""
        return (1 if self.has_subnormals else 0) - self.bias

    @property
    def max_pattern(self) -> int:
        """The largest finite value's bits without the sign: the last pattern before inf or NaN."""
        top = (1 << self.exponent_bits) - 1  # the top exponent field
        if self.nan == "none":
            return (top << self.mantissa_bits) | ((1 << self.mantissa_bits) - 1)
        if self.has_inf or self.mantissa_bits == 0:  # the whole top field is special
            return (top << self.mantissa_bits) - 1
        return (top << self.mantissa_bits) | ((1 << self.mantissa_bits) - 2)  # all but S.1..1.1..1

    @property
    def emax(self) -> int:
        """Exponent of the largest finite value."""
        return (self.max_pattern >> self.mantissa_bits) - self.bias

    @property
    def max(self) -> float:
        return _magnitude_value(self.max_pattern, self)

    @property
    def min_normal(self) -> float:
        return 2.0**self.emin

    @property
    def min_subnormal(self) -> float | None:
        """The smallest positive value, 2^(emin - m); None for a format without subnormals."""
        return 2.0 ** (self.emin - self.mantissa_bits) if self.has_subnormals else None

    @property
    def min_positive(self) -> float:
        return self.min_subnormal if self.has_subnormals else self.min_normal

    @property
    def epsilon(self) -> float:
        """The gap between 1 and the next value above it, 2^-m: the relative resolution."""
        return 2.0**-self.mantissa_bits

    @property
    def decades(self) -> float:
        """Orders of magnitude from the smallest positive to the largest finite value."""
        return math.log10(self.max / self.min_positive)

    @property
    def nan_encoding(self) -> str:
        e, m = "1" * self.exponent_bits, self.mantissa_bits
        sign = "S." if self.signed else ""
        if self.nan == "none":
            return "none (every pattern is a value)"
        if self.nan == "all_ones":
            return f"{sign}{e}" + (f".{'1' * m}" if m else "") + " only"
        return f"{sign}{e}.M with M != 0 ({2**m - 1} patterns per sign)"


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("fp32", 8, 23, 127, torch_dtype="float32"),
    Format("tf32", 8, 10, 127),
    Format("fp16", 5, 10, 15, torch_dtype="float16"),
    Format("bf16", 8, 7, 127, torch_dtype="bfloat16"),
    Format("e4m3fn", 4, 3, 7, has_inf=False, nan="all_ones", torch_dtype="float8_e4m3fn"),
    Format("e5m2", 5, 2, 15, torch_dtype="float8_e5m2"),
    Format("e8m0", 8, 0, 127, signed=False, has_inf=False, nan="all_ones", has_subnormals=False,
           torch_dtype="float8_e8m0fnu"),
    # MX elements (OCP MX v1.0's element data types): torch has no unpacked dtype for them (float4_e2m1fn_x2
    # packs two per byte)
    Format("e2m3", 2, 3, 1, has_inf=False, nan="none"),
    Format("e3m2", 3, 2, 3, has_inf=False, nan="none"),
    Format("e2m1", 2, 1, 1, has_inf=False, nan="none"),
)}


def get_format(fmt: str | Format) -> Format:
    if isinstance(fmt, Format):
        return fmt
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise ValueError(f"format={fmt!r} must be one of {', '.join(map(repr, FORMATS))}")
    return FORMATS[fmt]


@dataclass(frozen=True)
class Encoding:
    """`input` stored in `format`: its `bits` (sign, exponent field, mantissa field) and the `value` they mean.
    Flags: `rounded` (value != input), `subnormal` (stored as a subnormal), `underflowed` (a nonzero input stored
    as zero), `overflowed` (a finite input past the largest finite value), `saturated` (a larger magnitude, inf
    included, clamped to ±max). `relative_error` is |value − input| / |input|: 0 when equal, inf when a finite
    input became inf or NaN (or e8m0 stored 0 as 2^-127), NaN when an infinite input changed."""

    format: Format
    input: float
    bits: int
    value: float
    rounded: bool
    subnormal: bool
    underflowed: bool
    overflowed: bool
    saturated: bool
    relative_error: float

    @property
    def sign(self) -> int:
        return self.bits >> (self.format.bits - 1) if self.format.signed else 0

    @property
    def exponent(self) -> int:
        return (self.bits >> self.format.mantissa_bits) & ((1 << self.format.exponent_bits) - 1)

    @property
    def mantissa(self) -> int:
        return self.bits & ((1 << self.format.mantissa_bits) - 1)

    @property
    def bit_string(self) -> str:
        return format(self.bits, f"0{self.format.bits}b")

    @property
    def fields(self) -> tuple[str, str, str]:
        """The bit string cut into sign, exponent and mantissa ('' for a field the format lacks)."""
        s, e = self.format.sign_bits, self.format.exponent_bits
        return self.bit_string[:s], self.bit_string[s:s + e], self.bit_string[s + e:]


def encode(value: float, fmt: str | Format, saturate: bool = False) -> Encoding:
    """`value` rounded to nearest-even in `fmt`; past ±max it overflows to ±inf (NaN where the format has no
    inf), or is clamped to ±max with `saturate=True`. NaN stays NaN, keeping its sign bit. A format without
    special values (nan="none": MX's FP6, FP4) always saturates, and has no encoding for NaN."""
    fmt, x = get_format(fmt), _real(value)
    if fmt.nan == "none":
        if math.isnan(x):
            raise ValueError(f"value={x!r} has no {fmt.name} encoding: {fmt.name} has no NaN (OCP MX v1.0's "
                             "element data types)")
        saturate = True
    if x < 0 and not fmt.signed:
        raise ValueError(f"value={x!r} has no {fmt.name} encoding: {fmt.name} is unsigned (a scale), values "
                         f"must be >= 0")
    negative = fmt.signed and math.copysign(1.0, x) < 0  # -0.0 and -nan keep their sign bit
    sign = 1 << (fmt.bits - 1) if negative else 0
    overflowed = saturated = False
    if math.isnan(x):
        magnitude = _nan_pattern(fmt)
    elif math.isinf(x):
        saturated = saturate
        magnitude = fmt.max_pattern if saturate else _overflow_pattern(fmt)
    else:
        magnitude = _magnitude_pattern(abs(x), fmt, "even")
        if magnitude > fmt.max_pattern:
            overflowed, saturated = True, saturate
            magnitude = fmt.max_pattern if saturate else _overflow_pattern(fmt)
        magnitude = max(magnitude, 0)  # e8m0 has no zero: below 2^-127 rounds to it
    bits = sign | magnitude
    stored = decode(bits, fmt)
    return Encoding(
        format=fmt, input=x, bits=bits, value=stored,
        rounded=not (stored == x or (math.isnan(stored) and math.isnan(x))),
        subnormal=fmt.has_subnormals and magnitude >> fmt.mantissa_bits == 0 and magnitude != 0,
        underflowed=stored == 0 and x != 0,
        overflowed=overflowed,
        saturated=saturated,
        relative_error=_relative_error(x, stored))


def decode(bits: int | str, fmt: str | Format) -> float:
    """The value a bit pattern means: an int, or a string of 0s and 1s (spaces, '_' and '.' ignored)."""
    fmt = get_format(fmt)
    if isinstance(bits, str):
        digits = bits.replace(" ", "").replace("_", "").replace(".", "")
        if len(digits) != fmt.bits or set(digits) - {"0", "1"}:
            raise ValueError(f"bits={bits!r} must be {fmt.bits} binary digits for {fmt.name}")
        bits = int(digits, 2)
    if not (isinstance(bits, int) and not isinstance(bits, bool) and 0 <= bits < 1 << fmt.bits):
        raise ValueError(f"bits={bits!r} must be an integer in [0, {(1 << fmt.bits) - 1}] for {fmt.name}")
    sign = -1.0 if fmt.signed and bits >> (fmt.bits - 1) else 1.0
    magnitude = bits & ((1 << (fmt.exponent_bits + fmt.mantissa_bits)) - 1)
    if magnitude > fmt.max_pattern:
        mantissa = magnitude & ((1 << fmt.mantissa_bits) - 1)
        special = math.inf if fmt.has_inf and mantissa == 0 else math.nan
        return math.copysign(special, sign)
    return sign * _magnitude_value(magnitude, fmt)


def neighbours(value: float, fmt: str | Format) -> tuple[float | None, float | None]:
    """The representable values just below and just above `value` (strictly: an exactly representable value
    is not its own neighbour). Past ±max the neighbour is ±inf where the format has it, else None."""
    fmt, x = get_format(fmt), _real(value)
    if math.isnan(x):
        raise ValueError(f"value={x!r} has no neighbours: it is not on the real line")
    low, high = _ordinal_range(fmt)
    if math.isinf(x):
        return (_ordinal_value(high, fmt), None) if x > 0 else (None, _ordinal_value(low, fmt))
    below, above = _ordinal(x, fmt, "floor"), _ordinal(x, fmt, "ceil")
    if below == above:  # representable
        below, above = below - 1, above + 1
    return _ordinal_value(min(below, high), fmt), _ordinal_value(max(above, low), fmt)


def values_between(lo: float, hi: float, fmt: str | Format, limit: int = VALUES_LIMIT) -> list[float]:
    """Every finite representable value in [lo, hi], ascending (zero once): the format's grid, for a plot."""
    fmt, lo, hi = get_format(fmt), _real(lo, "lo"), _real(hi, "hi")
    if math.isnan(lo) or math.isnan(hi) or lo > hi:
        raise ValueError(f"lo={lo!r}, hi={hi!r} must be numbers with lo <= hi")
    low, high = _ordinal_range(fmt)
    first = low if lo == -math.inf else max(low, _ordinal(lo, fmt, "ceil"))
    last = high if hi == math.inf else min(high, _ordinal(hi, fmt, "floor"))
    if last - first + 1 > limit:
        raise ValueError(f"[{lo!r}, {hi!r}] holds {last - first + 1:,} {fmt.name} values, more than limit={limit:,}:"
                         f" narrow the interval")
    return [_ordinal_value(n, fmt) for n in range(first, last + 1)]


def representable_near_one(fmt: str | Format, n: int = 4) -> list[float]:
    """The `n` representable values below 1, 1 itself and the `n` above: 1 − 2^-(m+1) steps below (the binade
    under 1 is twice as dense), 1 + epsilon steps above."""
    fmt = get_format(fmt)
    if not (isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 1000):
        raise ValueError(f"n={n!r} must be an integer in [1, 1000]")
    one, (low, high) = _ordinal(1.0, fmt, "floor"), _ordinal_range(fmt)
    return [_ordinal_value(k, fmt) for k in range(max(low, one - n), min(high, one + n) + 1)]


# --- exact arithmetic on the grid ---------------------------------------------------------------------------------
# A finite value's bits without the sign (its "magnitude pattern") grow with the value, so the signed ordinal
# ±pattern numbers the whole grid in order: ordinal k and k + 1 are adjacent values, 0 is zero (2^-127 in e8m0).


def _real(value: float, name: str = "value") -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name}={value!r} must be a real number (int or float)")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name}={value!r} is too large for a float (max ~1.8e308)") from None


def _magnitude_pattern(x: float, fmt: Format, rounding: str) -> int:
    """The magnitude pattern of a finite x >= 0 rounded ("floor", "ceil" or "even": nearest, ties to the even
    significand) on the format's grid extended without limit above: past max_pattern means overflow, and -1
    (e8m0 only) below its smallest value. In x's binade [2^e, 2^(e+1)) the grid is the integers M times
    2^(e - m): M = 2^m starts the binade, M = 2^(m+1) the next, and the subnormals are the M < 2^m of the
    lowest binade. Exact: x is n / 2^t in integers (float.as_integer_ratio), M = x / 2^(e - m) with remainder."""
    m = fmt.mantissa_bits
    n, d = x.as_integer_ratio()
    t = d.bit_length() - 1  # d is a power of two
    e = fmt.emin if n == 0 else max(n.bit_length() - 1 - t, fmt.emin)
    shift = t + e - m  # M = n / 2^shift
    if shift <= 0:
        significand = n << -shift
    else:
        significand, rest = n >> shift, n & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        if rounding == "ceil":
            significand += rest > 0
        elif rounding == "even":
            significand += rest > half or (rest == half and significand & 1)
    return ((e + fmt.bias) << m) + significand - (1 << m)


def _magnitude_value(pattern: int, fmt: Format) -> float:
    """Exact in a float64: every value here has at most 24 significant bits and an exponent >= -149."""
    m = fmt.mantissa_bits
    field, mantissa = pattern >> m, pattern & ((1 << m) - 1)
    if fmt.has_subnormals and field == 0:
        return math.ldexp(mantissa, fmt.emin - m)
    return math.ldexp((1 << m) + mantissa, field - fmt.bias - m)


def _ordinal_range(fmt: Format) -> tuple[int, int]:
    return (-fmt.max_pattern if fmt.signed else 0), fmt.max_pattern


def _ordinal(x: float, fmt: Format, rounding: str) -> int:
    """The ordinal of x rounded down ("floor") or up ("ceil") on the grid, unbounded on both sides."""
    if x >= 0:
        return _magnitude_pattern(x, fmt, rounding)
    return -_magnitude_pattern(-x, fmt, "ceil" if rounding == "floor" else "floor")


def _ordinal_value(k: int, fmt: Format) -> float | None:
    """The value numbered k; past either end ±inf where the format has infinities, else None."""
    low, high = _ordinal_range(fmt)
    if k > high:
        return math.inf if fmt.has_inf else None
    if k < low:
        return -math.inf if fmt.has_inf and fmt.signed else None
    return math.copysign(_magnitude_value(abs(k), fmt), k)


def _nan_pattern(fmt: Format) -> int:
    """The quiet NaN: exponent all ones and the top mantissa bit (IEEE); the one all-ones pattern otherwise."""
    top = ((1 << fmt.exponent_bits) - 1) << fmt.mantissa_bits
    return top | ((1 << (fmt.mantissa_bits - 1)) if fmt.nan == "ieee" else (1 << fmt.mantissa_bits) - 1)


def _overflow_pattern(fmt: Format) -> int:
    """What a non-saturating overflow stores: inf, or NaN in a format without one."""
    return ((1 << fmt.exponent_bits) - 1) << fmt.mantissa_bits if fmt.has_inf else _nan_pattern(fmt)


def _relative_error(x: float, stored: float) -> float:
    if stored == x or (math.isnan(stored) and math.isnan(x)):
        return 0.0
    if math.isnan(x) or math.isinf(x):
        return math.nan
    if math.isnan(stored) or math.isinf(stored) or x == 0:
        return math.inf
    return abs(stored - x) / abs(x)  # float64: exact to a few ulps, plenty for a percentage
