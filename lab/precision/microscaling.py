"""Block-scaled formats after FP8 — MXFP8, MXFP6, MXFP4 and NVFP4 — emulated on CPU.

FP8's recipes (`lab.precision.fp8`) keep one float32 scale per tensor, row or 1×128 tile, chosen in software.
Blackwell's tensor cores take the scales as part of the operand format instead: a *block* of consecutive values
along the GEMM's contraction axis K shares one small scale, and the hardware applies it inside the GEMM.

* MX (OCP Microscaling Formats v1.0, its table of concrete MX-compliant formats): 32 elements share one E8M0
  scale, a bare power of two 2^-127..2^127 (8 bits, no sign, no mantissa). The elements are FP8 (E4M3, E5M2),
  FP6 (E2M3, E3M2) or FP4 (E2M1). The scale of a block is the spec's §6.3, its recommended conversion:
  X = 2^(floor(log2(amax)) - emax_elem), emax_elem being the exponent of the element format's largest normal
  value, so the block's amax lands in the element format's top binade; each V/X is then rounded to the element
  grid, and what lands past the element's max (up to 2× it: X rounded the scale *down*) saturates to ±max. With
  `round_up=True` the scale is instead the power of two at or above amax / max, X = 2^ceil(log2(amax / max)),
  which never clips and costs the block's small values up to one binade: the rounding NVIDIA's MXFP8 training
  recipe uses (Mishra et al., "Recipes for Pre-training LLMs with MXFP8", arXiv 2506.08027) and torchao calls
  RCEIL.
* NVFP4 (NVIDIA, "Pretraining Large Language Models with NVFP4", arXiv 2509.25149, its section on the
  NVFP4 format; the Transformer Engine docs, "Using FP8 and FP4 with Transformer Engine"): E2M1 elements, 16 per
  block, each block scaled by an E4M3 number — 3 mantissa bits, so a block's amax lands within 1/8 of 6 instead of
  anywhere in a factor of two — and one float32 scale per tensor, which moves the whole tensor into E4M3's range
  for the block scales: s_tensor = amax_tensor / (448 · 6).

Here a quantised tensor is its element values (floats on the element grid, not bit codes: the bits are
`lab.calc.formats.encode`'s business) and its scales, with x ≈ element · block scale (· tensor scale). Note the
direction: MX's X *multiplies* the stored element, where `fp8.quantize`'s scale divides. Blocks run along the
last axis; a last axis that is not a multiple of the block size ends in a narrower block with its own scale (as
`fp8`'s ragged tiles; the hardware requires whole blocks and pads K). The element grids come from
`lab.calc.formats` (`FORMATS`): this module only rounds torch tensors onto them, ties to even.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lab.calc.formats import Format, get_format
from lab.precision.fp8 import Scaling, amax

E8M0_EXPONENTS = (-127, 127)  # the powers of two an E8M0 scale can hold (0xFF is its NaN)


@dataclass(frozen=True)
class BlockFormat:
    """A block-scaled format: `element` and `scale` are names in `lab.calc.formats.FORMATS`; `block` values
    share one scale; `tensor_scale` adds NVFP4's float32 scale per tensor; `round_up` rounds an MX scale up
    instead of the spec's floor (`mx_scales`)."""

    name: str
    element: str
    block: int
    scale: str
    tensor_scale: bool = False
    round_up: bool = False

    @property
    def element_format(self) -> Format:
        return get_format(self.element)

    def bits_per_value(self, numel: int | None = None) -> float:
        """Storage per element, scales included: element bits + scale bits / block (MXFP8 8.25, MXFP6 6.25,
        MXFP4 4.25, NVFP4 4.5), plus NVFP4's 32-bit tensor scale spread over `numel` values when given."""
        bits = self.element_format.bits + get_format(self.scale).bits / self.block
        if self.tensor_scale and numel is not None:
            if not isinstance(numel, int) or numel < 1:
                raise ValueError(f"numel={numel!r}: expected an int >= 1")
            bits += 32 / numel
        return bits


BLOCK_FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    BlockFormat("mxfp8_e4m3", "e4m3fn", 32, "e8m0"),
    BlockFormat("mxfp8_e5m2", "e5m2", 32, "e8m0"),
    BlockFormat("mxfp6_e2m3", "e2m3", 32, "e8m0"),
    BlockFormat("mxfp6_e3m2", "e3m2", 32, "e8m0"),
    BlockFormat("mxfp4", "e2m1", 32, "e8m0"),
    BlockFormat("nvfp4", "e2m1", 16, "e4m3fn", tensor_scale=True),
)}


def get_block_format(fmt: str | BlockFormat) -> BlockFormat:
    if isinstance(fmt, BlockFormat):
        return fmt
    if fmt not in BLOCK_FORMATS:
        raise ValueError(f"block format={fmt!r} must be one of {', '.join(map(repr, BLOCK_FORMATS))}")
    return BLOCK_FORMATS[fmt]


def round_to_grid(x: torch.Tensor, element: str | Format) -> torch.Tensor:
    """x rounded to the nearest value of an element format, ties to even, saturating at ±max (MX's rule for
    FP6/FP4, which have nothing to overflow to; `fp8.quantize` clamps likewise before its casts).

    In x's binade [2^e, 2^(e+1)) the grid steps by 2^(e - m), and below the smallest normal binade the
    subnormals keep emin's step; dividing by a power of two is exact, so torch.round (half to even) on
    x / step is the exact rounding. float32 in and out."""
    fmt = get_format(element)
    x = x.float()
    _, exponent = torch.frexp(x)                                  # x = f · 2^exponent, 0.5 <= |f| < 1
    e = (exponent - 1).clamp(min=fmt.emin)                        # floor(log2|x|), at least emin (subnormals)
    step = torch.ldexp(torch.ones_like(x), e - fmt.mantissa_bits)
    return (torch.round(x / step) * step).clamp(-fmt.max, fmt.max)


@dataclass(frozen=True)
class BlockQuantized:
    """A tensor in a block format: x ≈ elements · scales (each block's, broadcast) · tensor_scale.
    `elements` has x's shape; `scales` has x's shape with the last axis counted in blocks."""

    fmt: BlockFormat
    elements: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor | None = None


def _per_element(scales: torch.Tensor, block: int, length: int) -> torch.Tensor:
    """Each block's scale repeated over its block, the ragged last block cropped to the tensor."""
    return scales.repeat_interleave(block, dim=-1)[..., :length]


def mx_scales(block_amax: torch.Tensor, element: str | Format, round_up: bool = False) -> torch.Tensor:
    """MX's shared scale per block (OCP MX v1.0 §6.3): X = 2^(floor(log2 amax) - emax_elem), or with `round_up`
    2^ceil(log2(amax / max_elem)); clamped to E8M0's 2^-127..2^127. An all-zero block gets 2^-127 (any scale
    stores zeros exactly)."""
    fmt = get_format(element)
    if round_up:
        mantissa, exponent = torch.frexp(block_amax.double() / fmt.max)  # amax / max = mantissa · 2^exponent
        shared = exponent - (mantissa.abs() == 0.5).int()              # ceil(log2): exact powers of two stay
    else:
        _, exponent = torch.frexp(block_amax.float())
        shared = exponent - 1 - fmt.emax
    shared = shared.clamp(*E8M0_EXPONENTS)
    shared = torch.where(block_amax > 0, shared, torch.full_like(shared, E8M0_EXPONENTS[0]))
    return torch.ldexp(torch.ones_like(block_amax, dtype=torch.float64), shared.double())


def quantize(x: torch.Tensor, fmt: str | BlockFormat) -> BlockQuantized:
    """x (any shape, blocks along the last axis) in a block format: MX's power-of-two block scales, or NVFP4's
    E4M3 block scales under a float32 tensor scale. A non-finite x raises: no scale can store inf or NaN."""
    fmt = get_block_format(fmt)
    x = x.detach().float()
    if x.dim() == 0:
        raise ValueError("block formats need a tensor of >= 1 dims, got a scalar")
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"x is not finite: {fmt.name} has no encoding for inf or NaN")
    block_amax = amax(x, Scaling(granularity="tile", tile=fmt.block))   # fp8's ragged tiles: zero-padded
    top = fmt.element_format.max
    tensor_scale = None
    if fmt.tensor_scale:
        scale_top = get_format(fmt.scale).max
        tensor_amax = x.abs().amax().double()
        tensor_scale = torch.where(tensor_amax > 0, tensor_amax / (scale_top * top), torch.ones_like(tensor_amax))
        # the block scale amax / 6 in units of the tensor scale, rounded to E4M3 (at most 448 by construction)
        scales = round_to_grid((block_amax.double() / top / tensor_scale).float(), fmt.scale).double()
        tensor_scale = tensor_scale.float()
    else:
        scales = mx_scales(block_amax, fmt.element, fmt.round_up)
    divisor = _per_element(scales, fmt.block, x.shape[-1]) * (tensor_scale if tensor_scale is not None else 1.0)
    scaled = torch.where(divisor > 0, x.double() / divisor, torch.zeros_like(divisor))  # an E4M3 scale can be 0
    return BlockQuantized(fmt, round_to_grid(scaled.float(), fmt.element), scales.float(), tensor_scale)


def dequantize(q: BlockQuantized) -> torch.Tensor:
    """float32 elements · block scales (· the tensor scale)."""
    x = q.elements.double() * _per_element(q.scales.double(), q.fmt.block, q.elements.shape[-1])
    if q.tensor_scale is not None:
        x = x * q.tensor_scale.double()
    return x.float()


def quantize_dequantize(x: torch.Tensor, fmt: str | BlockFormat) -> torch.Tensor:
    """x as the block format stores it, back in float32: what a GEMM on it computes with."""
    return dequantize(quantize(x, fmt))
