"""Triton kernels for chapter 09, each beside the pure-torch op it must match, and `patch` to train with them.

Importing the package first decides how kernels run (`runtime`: compiled on a GPU, Triton's interpreter on CPU),
which must happen before any kernel is decorated. The kernels: `add` (vector add), `softmax` (fused row softmax,
one block per row or online in chunks for long rows), `rmsnorm` (forward and backward), `swiglu` (forward and
backward), `cross_entropy` (fused loss and gradient), `matmul` (tiled, grouped ordering, autotuned on a GPU; and
`matmul_persistent`, one program per SM with TMA loads on Hopper), `flash_attention` (forward, and a single-pass or
deterministic two-kernel backward) and `paged_attention` (a decode step over a block table). `accuracy` holds the
error-ratio rule they are tested by.

The model has a seam for each op a kernel replaces, as it has `Attention.core` for context parallelism:
`RMSNorm.kernel`, `FeedForward.kernel` (silu(gate)·up) and the attention `core`; `patch` swaps them in place,
and `lab.kernels.cross_entropy.cross_entropy` has the signature of the trainer's loss.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from lab.kernels.runtime import DEVICE, MODE, interpreted, require_triton, supported_dtypes

PATCHABLE = ("rms_norm", "swiglu", "attention")


def patch(model: nn.Module, kernels: Iterable[str] = PATCHABLE) -> nn.Module:
    """Swap the Triton kernels named in `kernels` into every RMSNorm, SwiGLU feed-forward and attention core of
    `model` (in place; returned for chaining). An attention core that is not the model's own — context
    parallelism's ring attention — is left as it is: it already replaced the op."""
    from lab import model as eager

    kernels = tuple(kernels)
    unknown = sorted(set(kernels) - set(PATCHABLE))
    if unknown:
        raise ValueError(f"unknown kernel {unknown[0]!r}: choose from {', '.join(PATCHABLE)}")
    require_triton()
    from lab.kernels.flash_attention import flash_attention
    from lab.kernels.rmsnorm import rms_norm
    from lab.kernels.swiglu import swiglu

    for module in model.modules():
        if isinstance(module, eager.RMSNorm) and "rms_norm" in kernels:
            module.kernel = rms_norm
        elif isinstance(module, eager.FeedForward) and "swiglu" in kernels:
            module.kernel = swiglu
        elif (isinstance(module, eager.Attention | eager.LatentAttention) and "attention" in kernels
              and module.core is eager.causal_attention):
            module.core = flash_attention
    return model


__all__ = ["DEVICE", "MODE", "PATCHABLE", "interpreted", "patch", "require_triton", "supported_dtypes"]
