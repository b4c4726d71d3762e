"""The tiled matmul against torch by the error-ratio rule, on shapes that are not multiples of its tiles.

The kernel runs in Triton's interpreter here (64×64 tiles, K steps of 32, groups of 4 tile rows), fp32 with
input_precision="ieee" and fp16 with an fp32 accumulator; torch's own matmul in the same dtype is the baseline
and a float64 product the reference.
"""

from __future__ import annotations

import pytest
import torch

from lab.kernels import DEVICE  # before triton: lab.kernels decides the interpreter before triton is imported

pytest.importorskip("triton")

from lab.kernels.accuracy import assert_error_ratio, dot_product_ratio  # noqa: E402
from lab.kernels.matmul import grouped_order, matmul, matmul_reference  # noqa: E402

#        M    K    N
ZOO = [(1, 1, 1),       # one element
       (1, 37, 5),      # one row, K below one step
       (64, 64, 64),    # exact tiles
       (150, 100, 70),  # 3 tile rows (a short last group of GROUP_M=4), 2 tile columns, K tail of 4
       (5, 129, 130)]   # K one past a multiple of the step, N two past a tile
DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", ZOO, ids=lambda s: "M{}K{}N{}".format(*s))
def test_matmul_matches_torch(shape, dtype):
    M, K, N = shape
    gen = torch.Generator().manual_seed(M * 7 + K * 3 + N)
    a = torch.randn(M, K, generator=gen).to(dtype=dtype, device=DEVICE)
    b = torch.randn(K, N, generator=gen).to(dtype=dtype, device=DEVICE)
    got = matmul(a, b)
    assert got.dtype == dtype
    assert_error_ratio("matmul", got, a @ b, matmul_reference(a, b), dot_product_ratio(got.dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_matmul_gpu_tiles_in_interpreter(monkeypatch, dtype):
    """The 128×128 tiles (K step 64 for fp16, 32 for fp32, GROUP_M=8) a 4096³ GPU launch picks, run through the
    interpreter by pretending to compile, on a matrix of 3 tile rows (one short group) × 2 tile columns."""
    import lab.kernels.matmul as mm

    monkeypatch.setattr(mm, "interpreted", lambda: False)
    big = mm._config(4096, 4096, 4096, dtype)
    assert (big["BLOCK_M"], big["BLOCK_N"], big["GROUP_M"]) == (128, 128, 8)
    monkeypatch.setattr(mm, "_config", lambda *shape: big)
    M, K, N = 300, 200, 130
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(M, K, generator=gen).to(dtype=dtype, device=DEVICE)
    b = torch.randn(K, N, generator=gen).to(dtype=dtype, device=DEVICE)
    assert_error_ratio("matmul (GPU tiles)", matmul(a, b), a @ b, matmul_reference(a, b), dot_product_ratio(a.dtype))


def test_matmul_strided_inputs():
    """Transposed views go through their strides, not a copy."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(70, 40, generator=gen).to(DEVICE).t()  # (40, 70), column-major
    b = torch.randn(33, 70, generator=gen).to(DEVICE).t()  # (70, 33)
    assert_error_ratio("matmul strided", matmul(a, b), a @ b, matmul_reference(a, b), dot_product_ratio(a.dtype))


def test_matmul_empty_k_gives_zeros():
    assert torch.equal(matmul(torch.ones(3, 0, device=DEVICE), torch.ones(0, 4, device=DEVICE)),
                       torch.zeros(3, 4, device=DEVICE))


@pytest.mark.parametrize("num_pid_m, num_pid_n, group_m", [(3, 2, 4), (8, 5, 4), (7, 3, 2), (1, 9, 8)])
def test_grouped_order_visits_every_tile_once(num_pid_m, num_pid_n, group_m):
    order = grouped_order(num_pid_m, num_pid_n, group_m)
    assert sorted(order) == [(m, n) for m in range(num_pid_m) for n in range(num_pid_n)]
    # the first group_m programs walk down one tile column (that is what keeps B's column in L2)
    assert order[:min(group_m, num_pid_m)] == [(m, 0) for m in range(min(group_m, num_pid_m))]


@pytest.mark.parametrize("a_shape, b_shape, dtype, match", [
    ((4, 5), (6, 3), torch.float32, r"inner dims differ: a is \(4, 5\), b is \(6, 3\)"),
    ((2, 4, 5), (5, 3), torch.float32, "matmul takes 2-D"),
    ((4, 5), (5, 3), torch.float64, "a dtype float64 is not supported"),
])
def test_matmul_rejects_bad_input(a_shape, b_shape, dtype, match):
    with pytest.raises(ValueError, match=match):
        matmul(torch.zeros(a_shape, dtype=dtype, device=DEVICE), torch.zeros(b_shape, dtype=dtype, device=DEVICE))
