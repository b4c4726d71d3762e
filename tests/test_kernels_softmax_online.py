"""The online softmax of lab.kernels.softmax (rows streamed in chunks, a running max and a rescaled running sum)
against torch by the error-ratio rule, forward and backward, and the choice between it and the one-block kernel.

The chunk is set to 64 columns here (in either lane), smaller than the rows, so that the loop, the rescale of the
running sum and the masked tail of the last chunk all run on tiny shapes. The values are chosen to break each of
them: all-negative logits (a tail read as 0 instead of -inf would win the max), logits near 1e4 (a sum not
rescaled, or a pass 2 that divides by another max, overflows), whole chunks of -inf (exp(-inf - -inf) is nan).
"""

from __future__ import annotations

import pytest
import torch

from lab.kernels import DEVICE, MODE  # before triton: it decides how triton's own @jit functions run

if MODE == "unavailable":
    pytest.skip("triton is not installed", allow_module_level=True)

from test_kernels_rowwise import DTYPES, compare, randn  # noqa: E402

from lab.kernels import softmax as softmax_module  # noqa: E402
from lab.kernels.runtime import MAX_ROW, next_power_of_2  # noqa: E402
from lab.kernels.softmax import ONLINE_ABOVE, online_chunk, softmax, softmax_reference  # noqa: E402

CHUNK = 64


@pytest.fixture
def small_chunk(monkeypatch):
    """Chunks of CHUNK columns in either lane (the interpreter's and a GPU's chunk are both wider)."""
    monkeypatch.setattr(softmax_module, "online_chunk", lambda n_cols, dtype: min(next_power_of_2(n_cols), CHUNK))


def softmax_online(x: torch.Tensor) -> torch.Tensor:
    return softmax(x, online=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_online_matches_float64(dtype, small_chunk):
    # 200 = 3 chunks and a masked tail of 8; 64 = exactly one chunk; 1 column; leading dims that flatten to rows
    for shape in [(3, 200), (2, 64), (4, 1), (2, 3, 130)]:
        x = randn(*shape, dtype=dtype, scale=3.0, shift=-6.0)  # all negative: a tail read as 0 would win the max
        compare(f"online softmax {shape}", softmax_online, softmax_reference, [x])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_online_huge_and_infinite_logits(dtype, small_chunk):
    # logits near 1e4, rising along the row so that every chunk raises the max: exp overflows (fp32's limit is
    # exp(88)) unless every exp is taken against the running max and the old sum is rescaled to the new one
    ramp = torch.linspace(0.0, 300.0, 200)
    x = (randn(3, 200, dtype=torch.float32, scale=30.0) + 1e4 + ramp).to(dtype)
    compare("online softmax, logits ~1e4", softmax_online, softmax_reference, [x])
    # -inf: a whole first chunk (the running max is -inf there), scattered entries, and a row with one finite
    # entry, in the tail
    x = randn(3, 200, dtype=dtype, scale=3.0)
    x[0, :CHUNK + 10] = -float("inf")
    x[1, ::7] = -float("inf")
    x[2, :-1] = -float("inf")
    compare("online softmax, -inf entries", softmax_online, softmax_reference, [x])


def test_online_row_wider_than_one_block():
    """A row wider than any single-block kernel takes (MAX_ROW), at the interpreter's own chunk: 5 chunks."""
    x = randn(1, MAX_ROW + 100, dtype=torch.float32, scale=3.0, shift=-6.0)
    compare(f"online softmax (1, {MAX_ROW + 100})", softmax, softmax_reference, [x])
    with pytest.raises(ValueError, match=f"x's last dim {MAX_ROW + 100} is out of range for online=False: the "
                       f"one-block kernel takes 1 to {MAX_ROW} columns"):
        softmax(x, online=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_online_at_the_gpu_chunk(dtype, monkeypatch):
    """The GPU's chunk (GPU_CHUNK_BYTES of the row: 2048 fp32 or 4096 fp16 columns), traced in the interpreter on
    rows of 5000 columns: chunks with a masked tail."""
    monkeypatch.setattr(softmax_module, "interpreted", lambda: False)
    assert online_chunk(5000, dtype) == 8192 // dtype.itemsize
    x = randn(2, 5000, dtype=dtype, scale=3.0, shift=-6.0)
    compare("online softmax, GPU chunk", softmax_online, softmax_reference, [x])


def test_the_kernel_is_chosen_by_width(monkeypatch):
    launched = []
    launch = softmax_module._launch
    monkeypatch.setattr(softmax_module, "_launch", lambda kernel, *args: launched.append(kernel) or launch(kernel,
                                                                                                           *args))
    for width, choice in [(ONLINE_ABOVE, None), (ONLINE_ABOVE + 1, None), (8, True), (ONLINE_ABOVE + 1, False)]:
        launched.clear()
        softmax(randn(1, width, dtype=torch.float32).requires_grad_(), online=choice).sum().backward()
        chosen = width > ONLINE_ABOVE if choice is None else choice
        expected = ["_softmax_online_forward", "_softmax_online_backward"] if chosen else ["_softmax_forward",
                                                                                          "_softmax_backward"]
        assert [kernel.fn.__name__ for kernel in launched] == expected, (width, choice)


@pytest.mark.parametrize("online", [None, True, False])
def test_refuses_an_empty_row(online):
    with pytest.raises(ValueError, match="x's last dim 0 is out of range: softmax takes rows of at least 1"):
        softmax(torch.zeros(3, 0, device=DEVICE), online=online)
