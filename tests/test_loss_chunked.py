"""lab.loss.chunked_cross_entropy: the output projection and the loss chunk by chunk of tokens.

It must be the plain loss — `cross_entropy(linear(hidden, weight).float(), targets)` — in value and in the gradients
of the hidden states and of the output weight, by the kernels' error-ratio rule (`lab.kernels.accuracy`: within
twice torch's own error against a float64 reference, or 16 ulps at the reference's scale), for chunks that divide
the tokens, that do not (a short last chunk), of one token and of more tokens than there are. And at a 128k
vocabulary it must hold at most a quarter of the whole micro-batch's fp32 logits at its peak, forward and backward.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from lab.kernels.accuracy import assert_error_ratio, error_ratio
from lab.loss import chunked_cross_entropy, cross_entropy
from lab.measure.memory import PeakAllocation

B, T, D, VOCAB = 2, 13, 16, 50
GRAD_SCALE = 0.37  # what backward multiplies in: a micro-batch's 1/n, fp16's loss scale


@pytest.fixture(scope="module")
def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(B, T, D, generator=gen), torch.randn(VOCAB, D, generator=gen) * 0.5,
            torch.randint(0, VOCAB, (B, T), generator=gen))


def _loss_and_grads(loss_fn, inputs, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden, weight, targets = inputs
    hidden = hidden.to(dtype).clone().requires_grad_()
    weight = weight.to(dtype).clone().requires_grad_()
    loss = loss_fn(hidden, weight, targets)
    (loss * GRAD_SCALE).backward()
    return loss.detach(), hidden.grad, weight.grad


def _plain(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return cross_entropy(F.linear(hidden, weight).float(), targets)


@pytest.fixture(scope="module")
def reference(inputs) -> tuple[torch.Tensor, ...]:
    return _loss_and_grads(_plain, inputs, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_tokens", [1, 4, 26, 64])  # of 26 tokens: one, a short last chunk, all, more
def test_chunked_loss_is_the_plain_loss_and_its_gradients(inputs, reference, dtype, chunk_tokens):
    baseline = _loss_and_grads(_plain, inputs, dtype)
    chunked = _loss_and_grads(lambda h, w, t: chunked_cross_entropy(h, w, t, chunk_tokens), inputs, dtype)
    for name, got, torch_own, ref in zip(("loss", "d hidden", "d weight"), chunked, baseline, reference,
                                         strict=True):
        assert got.dtype == torch_own.dtype
        assert_error_ratio(f"chunked_cross_entropy {name}, chunks of {chunk_tokens}", got, torch_own, ref)


def test_without_gradients_the_loss_is_the_same(inputs, reference):
    hidden, weight, targets = inputs
    with torch.no_grad():
        loss = chunked_cross_entropy(hidden, weight, targets, 4)
    assert_error_ratio("chunked_cross_entropy under no_grad", loss, _plain(hidden, weight, targets), reference[0])


def test_the_loss_of_a_128k_vocabulary_holds_under_a_quarter_of_its_fp32_logits():
    """Llama 3's 128,256 entries, few tokens, a hidden size of 2: the logits dominate every byte."""
    vocab, tokens, d = 128_256, 128, 2
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, tokens, d, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, d, generator=gen, requires_grad=True)
    targets = torch.randint(0, vocab, (1, tokens), generator=gen)
    with PeakAllocation() as peak:  # forward and backward: the gradients' storages are counted too
        chunked_cross_entropy(hidden, weight, targets, chunk_tokens=8).backward()
    logits_bytes = 4 * tokens * vocab
    assert peak.bytes <= logits_bytes / 4, f"peak {peak.bytes / logits_bytes:.2f}x the fp32 logits"
    assert hidden.grad is not None and weight.grad is not None


@pytest.mark.parametrize("chunk_tokens", [0, -3, 2.5, True])
def test_bad_chunk_size_is_refused_in_one_line(inputs, chunk_tokens):
    with pytest.raises(ValueError, match=rf"chunk_tokens={chunk_tokens!r} must be an integer >= 1"):
        chunked_cross_entropy(*inputs, chunk_tokens=chunk_tokens)


def test_mismatched_shapes_are_refused(inputs):
    hidden, weight, targets = inputs
    with pytest.raises(ValueError, match="must be"):
        chunked_cross_entropy(hidden, weight, targets[:, :-1])


def test_fp16_gradients_of_a_confident_model_survive_when_the_loss_scale_is_passed():
    """A model that already predicts its targets (p ≈ 1 - 4e-5) over 4096 tokens: every gradient, (p - onehot)/n,
    is below half of fp16's smallest subnormal and rounds to zero in fp16 — in the forward, where the chunked loss
    forms them. Told the loss scale (2^16) that backward then starts from, it forms them scaled, as torch's plain
    loss does in its backward: unscaled in fp32 they match, error for error. Not told, they are lost (zeros,
    which backward multiplies by 2^16, itself inf in fp16: nan)."""
    n, vocab, scale = 4096, 32, 2.0**16
    gen = torch.Generator().manual_seed(0)
    targets = torch.randint(0, vocab, (1, n), generator=gen)
    hidden = F.one_hot(targets, vocab).double() + 0.01 * torch.randn(1, n, vocab, generator=gen, dtype=torch.float64)
    weight = 14.0 * torch.eye(vocab, dtype=torch.float64)  # logit 14 at the target, ~0 elsewhere

    def unscaled(loss_fn, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        h, w = (t.to(dtype).clone().requires_grad_() for t in (hidden, weight))
        (loss_fn(h, w, targets) * scale).backward()
        return h.grad.float() / scale, w.grad.float() / scale

    reference, torch_own = unscaled(_plain, torch.float64), unscaled(_plain, torch.float16)
    told = unscaled(lambda h, w, t: chunked_cross_entropy(h, w, t, 1024, grad_scale=scale), torch.float16)
    for name, got, own, ref in zip(("d hidden", "d weight"), told, torch_own, reference, strict=True):
        assert ref.abs().max() > 1e-7 and own.abs().max() > 0  # real gradients, which fp16 keeps when scaled
        assert_error_ratio(f"chunked_cross_entropy {name}, fp16, loss scale passed", got, own, ref)
    not_told = unscaled(lambda h, w, t: chunked_cross_entropy(h, w, t, 1024), torch.float16)
    assert all(error_ratio(g, own, ref) > 100 for g, own, ref in zip(not_told, torch_own, reference, strict=True))


@pytest.mark.parametrize("grad_scale", [0.0, -1.0, float("inf"), float("nan"), True, "2"])
def test_a_bad_grad_scale_is_refused_in_one_line(inputs, grad_scale):
    with pytest.raises(ValueError, match=re.escape(f"grad_scale={grad_scale!r} must be a finite number > 0")):
        chunked_cross_entropy(*inputs, grad_scale=grad_scale)
