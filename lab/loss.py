"""The training objective, beside the model: what a step minimises, the same for every layout.

What belongs here: losses computed from the model's outputs and its layers' own records, on whole tensors — the
language-model cross-entropy on whole logits, the same loss computed from the final hidden states and the output
weight chunk by chunk of tokens (`chunked_cross_entropy`, which never holds the whole micro-batch's fp32 logits),
and a mixture of experts' router losses with their weights. What does not: a loss that needs a process group (the
vocabulary-parallel cross-entropy lives with TP in `lab.parallel.tp`), and a kernel that computes one of these
faster (`lab.kernels.cross_entropy` has `cross_entropy`'s signature and is passed in its place).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lab.config import ModelConfig
from lab.layout import CHUNK_TOKENS  # one home, which the torch-free memory calculator reads too

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean next-token loss of logits (B, T, vocab): the last pipeline stage's loss, and one process's."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          chunk_tokens: int = CHUNK_TOKENS, grad_scale: float = 1.0) -> torch.Tensor:
    """The mean next-token loss of the logits `hidden @ weightᵀ` (hidden (..., d), weight (vocab, d), targets
    (...)) — `cross_entropy(linear(hidden, weight).float(), targets)` — without ever holding more than
    `chunk_tokens` rows of logits. The output projection and the loss are computed chunk by chunk of tokens,
    each chunk's logits in the weight's dtype, upcast to fp32 for the log-sum-exp (as `lab.precision`'s
    `output_dtype` does for whole logits), and its gradients taken at once: the gradient of a chunk's logits is
    softmax − one-hot, known in the forward, so the forward multiplies it into the hidden states' and the
    weight's gradients and drops it; backward only scales them by the incoming gradient. Liger-Kernel's fused
    linear cross-entropy (src/liger_kernel/ops/fused_linear_cross_entropy.py) works so, without recomputing the
    logits in backward (what torchtune's chunked loss, which checkpoints each chunk, pays a matmul for).

    `grad_scale` is fp16's loss scale, the gradient backward will start from: the gradients are rounded to the
    weight's dtype here, in the forward, so the scale has to be in them before that rounding, or fp16 flushes the
    small ones to zero (what loss scaling exists to prevent). They are formed times `grad_scale` and backward
    multiplies by its incoming gradient over `grad_scale`, so the result is the plain loss's either way; a scale
    too large for fp16 overflows to inf here, as it would in the plain loss's backward, for the scaler to see.

    Memory, with c = chunk_tokens, n tokens, w bytes per weight element: a chunk's logits (c·vocab·(w + 4) in bf16:
    in the weight's dtype and in fp32), the weight's gradient summed in fp32 beside one chunk's share of it
    (vocab·d·(4 + w) — accumulating in the weight's dtype instead would save vocab·d·4 bytes, at up to 1.7x torch's
    own rounding error measured with 16-32 chunks in bf16) and the hidden states' gradient (n·d·w), instead of
    the 2 x 4·n·vocab bytes of whole logits (`lab.calc.memory.loss_bytes`; `chunked_loss_bytes` counts this one)."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r} must be an integer >= 1")
    if isinstance(grad_scale, bool) or not isinstance(grad_scale, int | float) or not 0 < grad_scale < math.inf:
        raise ValueError(f"grad_scale={grad_scale!r} must be a finite number > 0")
    if hidden.shape[:-1] != targets.shape or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and targets "
                         f"{tuple(targets.shape)} must be (..., d), (vocab, d) and (...)")
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunk_tokens, with_grad, float(grad_scale))


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
                with_grad: bool, grad_scale: float) -> torch.Tensor:
        flat, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1, 1)
        n = flat.shape[0]
        grad_hidden = torch.empty_like(flat) if with_grad else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if with_grad else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk_tokens):
            end = start + chunk_tokens
            total += _chunk(flat[start:end], weight, flat_targets[start:end], n / grad_scale,
                            grad_hidden[start:end] if with_grad else None, grad_weight)
        if with_grad:
            ctx.save_for_backward(grad_hidden.view_as(hidden), grad_weight.to(weight.dtype))
            ctx.grad_scale = grad_scale
        return total / n

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = (grad_output / ctx.grad_scale).to(grad_hidden.dtype)
        return (grad_hidden * scale if ctx.needs_input_grad[0] else None,
                grad_weight * scale if ctx.needs_input_grad[1] else None, None, None, None, None)


def _chunk(rows: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, n: float, grad_rows: torch.Tensor | None,
           grad_weight: torch.Tensor | None) -> torch.Tensor:
    """The summed loss of one chunk of tokens; with gradient buffers, the gradients of the sum over the tokens
    divided by `n` (the number of tokens over the gradient's scale) written into its rows of `grad_rows` and added
    into `grad_weight`. A function of its own so that the chunk's logits are freed when it returns, before the
    next chunk's are made."""
    logits = F.linear(rows, weight).float()
    peak = logits.amax(-1, keepdim=True)
    target_logit = logits.gather(-1, targets)
    exp = logits.sub_(peak).exp_()  # in place: one fp32 chunk of logits lives at a time
    sum_exp = exp.sum(-1, keepdim=True)
    loss = (peak + sum_exp.log() - target_logit).sum()  # log-sum-exp minus the target's logit
    if grad_rows is not None:  # d mean / d logits = (softmax − one-hot) / tokens, times the scale
        grad_logits = exp.div_(sum_exp).scatter_add_(-1, targets, exp.new_full(targets.shape, -1.0))
        grad_logits = grad_logits.div_(n).to(weight.dtype)
        grad_rows.copy_(grad_logits @ weight)
        grad_weight.add_(grad_logits.t() @ rows)  # summed in fp32, whatever the weight's dtype
    return loss


def model_loss(model: nn.Module, inputs: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor,
               loss_fn: LossFn | None, grad_scale: float = 1.0) -> torch.Tensor:
    """The loss a training step backpropagates from `model` (the whole model, or a pipeline's last stage) run on
    `inputs` at `positions`: `loss_fn` on its whole logits, or, `loss_fn` None, the model's own loss from its final
    hidden states and output weight (`lab.model.Transformer.forward(..., targets=)`: `chunked_cross_entropy`, no
    fp32 logits of the whole micro-batch), told `grad_scale`, the gradient backward will start from (fp16's loss
    scale), which it must put into its gradients in the forward. The one seam where a layout chooses between the
    two."""
    if loss_fn is None:
        return model(inputs, positions, targets=targets, grad_scale=grad_scale)
    return loss_fn(model(inputs, positions), targets)


def router_loss(module: nn.Module, cfg: ModelConfig) -> torch.Tensor:
    """The load-balancing and z losses of `module`'s MoE layers after its forward (the model, or a pipeline
    stage's chunk), with the weights `cfg` gives them: what is added to the cross-entropy before backward."""
    from lab.model import moe_losses  # deferred: lab.model imports this module for its chunked loss

    aux, z = moe_losses(module)
    return cfg.aux_loss_coef * aux + cfg.z_loss_coef * z
