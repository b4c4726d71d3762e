"""A training run's precision by name (`python -m lab.train --precision NAME`): a policy, and perhaps an FP8 recipe.

    fp32            everything in fp32
    bf16            bf16 weights and compute, fp32 master weights, gradients summed in fp32, fp32 logits
    fp16            the same in fp16, with dynamic loss scaling (`lab.precision.loss_scale`)
    fp8-tensorwise  bf16, and the linears inside the blocks run their three GEMMs in FP8 with one scale a tensor
    fp8-rowwise     the same with torchao's rowwise scales: one power-of-two scale per row along each GEMM's
                    contraction axis, e4m3 for gradients too
    fp8-tilewise    the same with DeepSeek-V3's scales: 1×128 tiles for activations and gradients, 128×128 blocks
                    for weights

The fourth recipe of `fp8_linear.RECIPES`, Transformer Engine's delayed scaling, is no `--precision` name: its
amax histories are state that `lab.checkpoint` does not save, so a resumed run would quantise with other scales
than the run it continues.

FP8 leaves out what the recipes that train in FP8 leave out: the embedding, the output layer (its logits feed a
log-sum-exp over the whole vocabulary), the norms, attention's own matmuls, and a mixture of experts' router (a
small matrix whose rounding would move tokens between experts) — DeepSeek-V3 §3.3 keeps all of them in bf16 or
fp32, and TorchTitan's float8 skips the output layer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from lab.config import PRECISIONS
from lab.model import Linear
from lab.precision.fp8_linear import RECIPES, FP8Matmul, FP8Recipe
from lab.precision.master import DTYPES, MixedPrecisionPolicy

KEEP_IN_HIGH_PRECISION = ("router",)  # linears inside the blocks that FP8 leaves alone, by attribute name


@dataclass(frozen=True)
class PrecisionScheme:
    """What `--precision NAME` means: the policy (FSDP2's param_dtype / reduce_dtype / output_dtype) and, for the
    fp8-* names, the recipe of the linears' GEMMs."""

    name: str
    policy: MixedPrecisionPolicy
    fp8: FP8Recipe | None = None


def precision_scheme(name: str, reduce_dtype: str = "fp32") -> PrecisionScheme:
    """The scheme of a `--precision` name; `reduce_dtype` ("fp32", or the compute dtype) overrides the policy's."""
    if name not in PRECISIONS:
        raise ValueError(f"precision={name!r} must be one of {', '.join(PRECISIONS)}")
    if reduce_dtype not in DTYPES:
        raise ValueError(f"reduce_dtype={reduce_dtype!r} must be one of {', '.join(DTYPES)}")
    compute = name if name in DTYPES else "bf16"  # FP8 recipes compute everything else in bf16
    policy = replace(MixedPrecisionPolicy.preset(compute), reduce_dtype=DTYPES[reduce_dtype])
    recipe = RECIPES[name.removeprefix("fp8-")] if name.startswith("fp8-") else None
    return PrecisionScheme(name, policy, recipe)


def convert_to_fp8(model: nn.Module, recipe: FP8Recipe) -> list[str]:
    """Run every linear inside the transformer blocks through an FP8 GEMM (`lab.model.Linear`'s seam), except those
    named in KEEP_IN_HIGH_PRECISION; returns the names of those converted. Each gets its own `FP8Matmul`, which
    holds that layer's amax histories when the recipe's scaling is delayed, and its flags of a non-finite amax,
    named after the module and made on its weight's device before any compile. TP's column and row layers and the
    experts are `Linear`s too: one loop covers every layout."""
    converted = []
    for name, module in model.named_modules():
        inside_a_block = ".layers." in f".{name}"
        if isinstance(module, Linear) and inside_a_block and name.rsplit(".", 1)[-1] not in KEEP_IN_HIGH_PRECISION:
            module.kernel = FP8Matmul(recipe, name=name, device=module.weight.device)
            converted.append(name)
    return converted


def cast_model(model: nn.Module, policy: MixedPrecisionPolicy) -> nn.Module:
    """The model's parameters and floating buffers in `policy.param_dtype`, in place: the Parameter objects stay
    (so do their placements), only their data is converted."""
    if policy.param_dtype != torch.float32:
        model.to(policy.param_dtype)
    return model
