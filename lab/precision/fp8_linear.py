"""The FP8 linear: the three GEMMs of y = x·Wᵀ, each with its own scaling, as one autograd function.

A linear layer runs three GEMMs per step, and they want different things:

    output       y  = x  · Wᵀ    (M,K)·(K,N)   forward: activations and weights, e4m3 for precision
    grad_input   dx = dy · W     (M,N)·(N,K)   backward: the gradient dy spans a wider range, e5m2 by default
    grad_weight  dW = dyᵀ · x    (N,M)·(M,K)   backward: contracts over tokens M, so row/tile scales run along M

`fp8.fp8_matmul` computes a @ b.T with both operands stored contraction-axis-last, so each GEMM quantises its
operands in that orientation: Wᵀ for grad_input, dyᵀ and xᵀ for grad_weight. For tensor scales (one scale) and
128×128 block scales (a block of the transpose is the transpose of a block) the forward's FP8 copy can simply be
transposed and reused; for row and 1×128 tile scales the groups of the transpose are different elements, and
quantising the transpose from the FP8 copy rounds twice (see `double_quantization_error`), so it is quantised
again from high precision (Transformer Engine quantises both orientations from high precision for this reason).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from lab.precision.fp8 import (
    ACCUM_BITS,
    AmaxHistory,
    NonFiniteFlags,
    Scaling,
    amax,
    dequantize,
    fp8_matmul,
    quantize,
    scale_from_amax,
    sqnr,
)

Pair = tuple[Scaling, Scaling]

# The operands a linear quantises, by the key its history and flag go under, and what a message calls each.
OPERANDS = {"output.x": "input", "output.w": "weight", "grad_input.dy": "output gradient",
            "grad_input.wt": "weight (transposed)", "grad_weight.dyt": "output gradient (transposed)",
            "grad_weight.xt": "input (transposed)"}


@dataclass(frozen=True)
class FP8Recipe:
    """One (a, b) pair of Scalings per GEMM of a linear, in fp8_matmul's a @ b.T orientation:
    output = (x, W), grad_input = (dy, Wᵀ), grad_weight = (dyᵀ, xᵀ)."""

    output: Pair
    grad_input: Pair
    grad_weight: Pair


def _recipe(x: Scaling, w: Scaling, dy: Scaling) -> FP8Recipe:
    """The usual shape of a recipe: one Scaling for activations, one for weights, one for gradients."""
    return FP8Recipe(output=(x, w), grad_input=(dy, w), grad_weight=(dy, x))


_E4M3, _E5M2 = Scaling("e4m3"), Scaling("e5m2")
_ROW = Scaling("e4m3", "row", power_of_2=True)
_TILE, _BLOCK = Scaling("e4m3", "tile"), Scaling("e4m3", "block")
_DELAYED = dict(timing="delayed", history=1024)

RECIPES: dict[str, FP8Recipe] = {
    # torchao Float8LinearRecipeName.TENSORWISE (torchao/float8/config.py): one current scale per tensor,
    # e4m3 input and weight, e5m2 grad_output; the fastest (a single cuBLAS scaled GEMM).
    "tensorwise": _recipe(_E4M3, _E4M3, _E5M2),
    # torchao ROWWISE: axiswise scales along each GEMM's contraction axis, e4m3 for every operand including
    # grad_output, scales rounded to powers of two.
    "rowwise": _recipe(_ROW, _ROW, _ROW),
    # DeepSeek-V3 (arXiv 2412.19437 §3.3): e4m3 everywhere, 1×128 tiles for activations and gradients, 128×128
    # blocks for weights, current (online) scales, promotion to fp32 every 128 along K (fp8_matmul's default).
    "tilewise": _recipe(_TILE, _BLOCK, _TILE),
    # Transformer Engine DelayedScaling (transformer_engine/common/recipe): per-tensor scales from the max of a
    # 1024-long amax history, "HYBRID" format: e4m3 forward, e5m2 backward.
    "delayed": _recipe(replace(_E4M3, **_DELAYED), replace(_E4M3, **_DELAYED), replace(_E5M2, **_DELAYED)),
}


def retile(recipe: FP8Recipe, tile: int) -> FP8Recipe:
    """The same recipe with `tile`-wide tiles and blocks: DeepSeek-V3's 128 is small against its K = 7168,
    but at a toy width (d_model = 64) a 1×128 tile is a whole row and a 128×128 block a whole matrix."""
    def re(pair: Pair) -> Pair:
        return replace(pair[0], tile=tile), replace(pair[1], tile=tile)

    return FP8Recipe(output=re(recipe.output), grad_input=re(recipe.grad_input), grad_weight=re(recipe.grad_weight))


def _transposable(scaling: Scaling) -> bool:
    """Whether the FP8 copy of a tensor, transposed, is the FP8 copy of its transpose (same groups)."""
    return scaling.granularity in ("tensor", "block")


def _transpose(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Transpose an FP8 payload and its tensor or block scales together."""
    return q.t().contiguous(), scale if scale.dim() == 0 else scale.t().contiguous()


class _FP8MatmulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, owner: FP8Matmul) -> torch.Tensor:  # noqa: ANN001
        x2 = x.reshape(-1, x.shape[-1])
        sx, sw = owner.recipe.output
        qx, scx = owner.quantize("output.x", x2, sx)
        qw, scw = owner.quantize("output.w", weight, sw)
        y = owner.matmul(qx, scx, qw, scw, sx, sw, x.dtype)
        # Keep FP8 copies where the backward can reuse them (a quarter of the bytes of fp32), else the
        # high-precision tensor to quantise again in the other orientation.
        reuse_x = owner.recipe.grad_weight[1] == sx and _transposable(sx)
        reuse_w = owner.recipe.grad_input[1] == sw and _transposable(sw)
        x_parts, w_parts = (qx, scx) if reuse_x else (x2,), (qw, scw) if reuse_w else (weight,)
        ctx.owner, ctx.x_shape, ctx.w_dtype, ctx.n_x = owner, x.shape, weight.dtype, len(x_parts)
        ctx.save_for_backward(*x_parts, *w_parts)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:  # noqa: ANN001
        owner: FP8Matmul = ctx.owner
        saved = ctx.saved_tensors
        xs, ws = saved[: ctx.n_x], saved[ctx.n_x:]                   # (fp8, scale) to reuse, or (high precision,)
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = q_dy = None
        if ctx.needs_input_grad[0]:                                          # dx = dy · W = dy @ (Wᵀ)ᵀ
            sdy, swt = owner.recipe.grad_input
            q_dy = owner.quantize("grad_input.dy", dy2, sdy)
            qwt, scwt = _transpose(*ws) if len(ws) == 2 else owner.quantize("grad_input.wt", ws[0].t(), swt)
            dx = owner.matmul(*q_dy, qwt, scwt, sdy, swt, dy.dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:                                          # dW = dyᵀ · x = dyᵀ @ (xᵀ)ᵀ
            sdyt, sxt = owner.recipe.grad_weight
            reuse_dy = q_dy is not None and sdyt == owner.recipe.grad_input[0] and _transposable(sdyt)
            qdyt, scdyt = _transpose(*q_dy) if reuse_dy else owner.quantize("grad_weight.dyt", dy2.t(), sdyt)
            qxt, scxt = _transpose(*xs) if len(xs) == 2 else owner.quantize("grad_weight.xt", xs[0].t(), sxt)
            dw = owner.matmul(qdyt, scdyt, qxt, scxt, sdyt, sxt, ctx.w_dtype)
        return dx, dw, None


class FP8Matmul:
    """y = x @ weight.T with its three GEMMs in FP8: a drop-in for F.linear without bias.

    One instance per linear layer: it owns that layer's amax histories (delayed scaling), one per quantised
    operand of each GEMM, keyed like "output.x" or "grad_weight.dyt", and its `nonfinite` flags, one per operand,
    named after the layer (`name`, e.g. "layers.3.attn.wq": `scheme.convert_to_fp8` passes the module's name)
    so that `fp8.raise_if_nonfinite` can say "amax of layers.3.attn.wq's input is not finite"; they are made on
    `device` now (`scheme.convert_to_fp8` passes the weight's), on another device at its first eager call: a
    linear compiled to run on a GPU needs `device=` (see `NonFiniteFlags`). `promote_every`, `accum_bits` and
    `backend` are passed to `fp8_matmul`.
    """

    def __init__(self, recipe: FP8Recipe | str = "tensorwise", promote_every: int | None = 128, *,
                 accum_bits: int | None = ACCUM_BITS, backend: str = "auto", name: str = "an FP8 linear",
                 device: torch.device | str = "cpu") -> None:
        if isinstance(recipe, str):
            if recipe not in RECIPES:
                raise ValueError(f"FP8 recipe {recipe!r}: expected one of {sorted(RECIPES)}")
            recipe = RECIPES[recipe]
        self.recipe = recipe
        self.promote_every, self.accum_bits, self.backend = promote_every, accum_bits, backend
        self.histories: dict[str, AmaxHistory] = {}
        self.name = name
        self.sites = {key: f"{name}'s {operand}" for key, operand in OPERANDS.items()}  # what a message names
        self.nonfinite = NonFiniteFlags(tuple(self.sites.values()), (device,),
                                        frozenset(site for key, site in self.sites.items() if key.startswith("grad_")))

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != weight.shape[-1] or weight.dim() != 2:
            raise ValueError(f"FP8Matmul: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match "
                             "(expected x (..., K), weight (N, K))")
        self.nonfinite.on(x.device)  # made here, not inside the autograd function compile traces as a whole
        return _FP8MatmulFunction.apply(x, weight, self)

    def quantize(self, key: str, t: torch.Tensor, scaling: Scaling) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantise one operand; for delayed scaling, with the scale of its history, which is then updated
        with this tensor's amax (the first use bootstraps from its own amax). Either way the amax measured
        now is recorded in `nonfinite` under this operand's name."""
        site = self.sites[key]
        if scaling.timing == "current":
            return quantize(t, scaling, flags=self.nonfinite, site=site)
        history = self.histories.setdefault(key, AmaxHistory(scaling.history))
        now = amax(t, scaling)
        scale = history.scale(scaling.fmt, scaling.power_of_2).to(t.device) if len(history) else \
            scale_from_amax(now, scaling.fmt, scaling.power_of_2)
        q = quantize(t, scaling, scale)
        history.update(now, self.nonfinite, site)
        return q

    def matmul(self, a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
               a_scaling: Scaling, b_scaling: Scaling, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One GEMM, its result in `out_dtype` (the dtype of the tensor it becomes: no separate cast)."""
        return fp8_matmul(a, sa, b, sb, a_scaling, b_scaling, self.promote_every,
                          accum_bits=self.accum_bits, backend=self.backend, out_dtype=out_dtype)

    def __repr__(self) -> str:
        return f"FP8Matmul({self.recipe})"


def nonfinite_flags(model: torch.nn.Module) -> list[NonFiniteFlags]:
    """The `nonfinite` flags of every FP8 linear in `model` (a `lab.model.Linear` whose kernel is an
    `FP8Matmul`), for `fp8.raise_if_nonfinite`; empty when the model has none."""
    return [m.kernel.nonfinite for m in model.modules() if isinstance(getattr(m, "kernel", None), FP8Matmul)]


class DoubleQuantization(NamedTuple):
    """SQNR (dB) of xᵀ quantised from high precision (`single_db`) and from x's FP8 copy (`double_db`)."""

    single_db: float
    double_db: float


def double_quantization_error(x: torch.Tensor, scaling: Scaling) -> DoubleQuantization:
    """What re-quantising the transpose from FP8 costs (the grad_weight GEMM needs xᵀ scaled along tokens).

    Single: quantise xᵀ from x itself. Double: quantise x (groups along K), dequantise, then quantise that
    transpose (groups along M) — the second rounding lands on a grid chosen for other groups, so errors add.
    With tensor scales the two coincide (the same scale, and FP8 values are already on its grid); with row or
    tile scales double is worse, which is why torchao and Transformer Engine keep the high-precision tensor
    for the backward. Unless the scales are powers of two: multiplying by 2^k only moves the exponent, so
    every group's grid is the same 3-bit mantissa grid (away from underflow) and re-quantising FP8 values is
    exact — which is how DeepSeek-V3 re-tiles the activations it caches in FP8 from 1×128 to 128×1 for the
    backward ("all the scaling factors are round scaled, i.e., integral power of 2", §3.3.3).
    """
    ref = x.detach().float().t()
    q, s = quantize(ref, scaling)
    single = sqnr(ref, dequantize(q, s, scaling))
    qx, sx = quantize(x, scaling)
    twice = dequantize(qx, sx, scaling).t()
    q2, s2 = quantize(twice, scaling)
    return DoubleQuantization(single, sqnr(ref, dequantize(q2, s2, scaling)))
