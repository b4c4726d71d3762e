"""lab.loss.chunked_cross_entropy: the output projection and the loss chunk by chunk of tokens.

It must be the plain loss — `cross_entropy(linear(hidden, weight).float(), targets)` — in value and in the gradients
of the hidden states and of the output weight, by the kernels' error-ratio rule (`lab.kernels.accuracy`: within
twice torch's own error against a float64 reference, or 16 ulps at the reference's scale), for chunks that divide
the tokens, that do not (a short last chunk), of one token and of more tokens than there are. And at a 128k
vocabulary it must hold at most a quarter of the whole micro-batch's fp32 logits at its peak, forward and backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lab.kernels.accuracy import assert_error_ratio
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
