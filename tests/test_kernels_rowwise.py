"""The element-wise and row-wise Triton kernels of lab.kernels (add, softmax, RMSNorm, SwiGLU, cross-entropy)
against torch, by the error-ratio rule: the kernel's error, forward and every input's gradient, is at most 2x
torch's own error in the same dtype, both measured against float64 (`lab.kernels.accuracy`).

The shapes are a small zoo chosen to break the launch arithmetic: one row, one column, widths that are not
powers of two (the masked tail of the block), leading dims that flatten to rows, several programs, a loop over
row blocks (RMSNorm's backward) and over vocabulary chunks (cross-entropy). On CPU the kernels run in Triton's
interpreter (fp32 and fp16: it has no bf16); on a GPU compiled, with bf16 too.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from lab.kernels import DEVICE, MODE, interpreted  # before triton: it decides how triton's own @jit functions run

if MODE == "unavailable":
    pytest.skip("triton is not installed", allow_module_level=True)

from lab.kernels import rmsnorm as rmsnorm_module  # noqa: E402
from lab.kernels.accuracy import assert_error_ratio  # noqa: E402
from lab.kernels.add import add, add_reference  # noqa: E402
from lab.kernels.cross_entropy import cross_entropy, cross_entropy_reference  # noqa: E402
from lab.kernels.rmsnorm import rms_norm  # noqa: E402
from lab.kernels.softmax import softmax, softmax_reference  # noqa: E402
from lab.kernels.swiglu import swiglu  # noqa: E402
from lab.model import rms_norm as rms_norm_reference  # noqa: E402
from lab.model import swiglu as swiglu_reference  # noqa: E402

DTYPES = [torch.float32, torch.float16] + ([] if interpreted() else [torch.bfloat16])
EPS = 1e-6


def compare(name: str, kernel, reference, inputs: list[torch.Tensor], reference64=None,
            gradients: bool = True) -> None:
    """Run `kernel` and torch's `reference` on `inputs` (their dtype) and `reference64` (default: `reference`)
    on float64 copies; apply the error-ratio rule to the output and (`gradients`) to the gradient of every
    input, all three backpropagating the same random output gradient."""
    runs = {}
    for label, fn, dtype in (("kernel", kernel, None), ("torch", reference, None),
                             ("float64", reference64 or reference, torch.float64)):
        leaves = [x.detach().to(dtype or x.dtype).requires_grad_(gradients) for x in inputs]
        runs[label] = fn(*leaves), leaves
    (out, leaves), (base, base_leaves), (ref, ref_leaves) = runs["kernel"], runs["torch"], runs["float64"]
    assert out.dtype == base.dtype and out.shape == base.shape, f"{name}: {out.dtype} {out.shape} vs torch's"
    assert_error_ratio(name, out, base, ref)
    if not gradients:
        return
    grad_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for result, _ in runs.values():
        result.backward(grad_out.to(DEVICE, result.dtype))
    for i, (leaf, base_leaf, ref_leaf) in enumerate(zip(leaves, base_leaves, ref_leaves, strict=True)):
        assert_error_ratio(f"{name} grad[{i}]", leaf.grad, base_leaf.grad, ref_leaf.grad)


def randn(*shape: int, dtype: torch.dtype, seed: int = 0, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * scale + shift).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add(dtype):
    for shape in [(1,), (3, 5, 7), (70001,)]:  # 70001 > one interpreter block: two programs, a masked tail
        x, y = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype, seed=1)
        compare(f"add {shape}", add, add_reference, [x, y], gradients=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softmax(dtype):
    for shape in [(1, 1), (1, 781), (37, 100), (3, 5, 129)]:
        # all logits negative: a padding loaded as 0 instead of -inf would win the max and join the sum
        x = randn(*shape, dtype=dtype, scale=3.0, shift=-6.0)
        compare(f"softmax {shape}", softmax, softmax_reference, [x])


def rms_norm64(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """lab.model.rms_norm computes its statistics in fp32 even for float64 input; the truth stays in float64."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm(dtype):
    for shape in [(1, 1), (37, 100), (3, 5, 129), (600, 100)]:  # 600 rows: several programs
        x = randn(*shape, dtype=dtype, scale=2.0, shift=0.5)
        weight = randn(shape[-1], dtype=dtype, seed=1, scale=0.5, shift=1.0)
        compare(f"rms_norm {shape}", lambda x, w: rms_norm(x, w, EPS),
                lambda x, w: rms_norm_reference(x, w, EPS), [x, weight], rms_norm64)


def test_rms_norm_backward_loops_over_row_blocks(monkeypatch):
    """With one program for 300 rows, the backward's single program walks all 5 row blocks and its dweight
    partial sum is the whole sum."""
    monkeypatch.setattr(rmsnorm_module, "MAX_PROGRAMS", 1)
    x, weight = randn(300, 48, dtype=torch.float32), randn(48, dtype=torch.float32, seed=1, shift=1.0)
    compare("rms_norm, one backward program", lambda x, w: rms_norm(x, w, EPS),
            lambda x, w: rms_norm_reference(x, w, EPS), [x, weight], rms_norm64)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu(dtype):
    for shape in [(1,), (37, 100), (3, 5, 129)]:
        gate = randn(*shape, dtype=dtype, scale=4.0)
        gate.view(-1)[-2:] = torch.tensor([-30.0, 30.0])[-gate.numel():]  # sigmoid saturated at both ends
        compare(f"swiglu {shape}", swiglu, swiglu_reference, [gate, randn(*shape, dtype=dtype, seed=1)])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cross_entropy(dtype):
    # (token shape, vocabulary, block_v): one class; V a whole block; chunks of 256 and 64 with a masked tail,
    # so the running max and sum are rescaled across chunks
    for shape, vocab, block_v in [((1,), 1, None), ((4, 16), 256, None), ((37,), 1000, 256), ((2, 9), 257, 64)]:
        logits = randn(*shape, vocab, dtype=dtype, scale=3.0)
        targets = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
        compare(f"cross_entropy {shape} V={vocab} block_v={block_v}",
                partial(cross_entropy, targets=targets, block_v=block_v),
                partial(cross_entropy_reference, targets=targets), [logits])
        training = cross_entropy(logits.detach().requires_grad_(), targets, block_v=block_v)
        with torch.no_grad():  # the evaluation path skips the gradient pass; the loss is the same
            assert torch.equal(cross_entropy(logits, targets, block_v=block_v), training.detach())


def test_cross_entropy_first_chunk_all_minus_inf():
    """Logits masked to -inf over a whole first chunk (a vocabulary's padding or banned tokens): the running max
    is still -inf after it, and an unguarded rescale exp(-inf - -inf) would make every later sum nan."""
    logits = randn(3, 257, dtype=torch.float32, scale=3.0)
    logits[:, :64] = float("-inf")
    targets = torch.tensor([64, 100, 256], device=DEVICE)
    compare("cross_entropy, first chunk -inf", partial(cross_entropy, targets=targets, block_v=64),
            partial(cross_entropy_reference, targets=targets), [logits])


def test_bad_input_raises_one_clear_error():
    x = randn(4, 8, dtype=torch.float32)
    cases = [
        (lambda: add(x, randn(4, 9, dtype=torch.float32)), "y is float32 \\(4, 9\\): it must have x's shape"),
        (lambda: add(x.double(), x.double()), "x dtype float64 is not supported"),
        (lambda: softmax(x.double()), "x dtype float64 is not supported"),
        (lambda: rms_norm(x, randn(7, dtype=torch.float32), EPS), "weight shape \\(7,\\) does not match"),
        (lambda: swiglu(x, x.half()), "up is float16 \\(4, 8\\)"),
        (lambda: cross_entropy(x, torch.zeros(5, dtype=torch.int64)), "targets shape \\(5,\\) does not match"),
        (lambda: cross_entropy(x, torch.zeros(4, dtype=torch.int32)), "targets dtype int32"),
        (lambda: cross_entropy(x, torch.full((4,), 8)), "target 8 is out of range: targets must be in \\[0, 8\\)"),
        (lambda: cross_entropy(x, torch.zeros(4, dtype=torch.int64), block_v=6), "block_v 6 must be a power"),
    ]
    if interpreted():
        cases.append((lambda: softmax(x.bfloat16()), "bfloat16 is not supported in Triton's interpreter"))
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
