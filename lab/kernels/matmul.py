"""Tiled matmul C = A B with a K loop, an fp32 accumulator and grouped ("super-grouped") program order.

Why tiles. Each program computes one BLOCK_M × BLOCK_N tile of C. It walks K in steps of BLOCK_K, loading a
BLOCK_M × BLOCK_K tile of A and a BLOCK_K × BLOCK_N tile of B into SRAM and multiplying them on the tensor cores
(`tl.dot`), so every element loaded is reused BLOCK_N (for A) or BLOCK_M (for B) times. Bytes moved from memory
fall from 2·M·N·K elements (one A and one B element per multiply-add) to about M·N·K·(1/BLOCK_N + 1/BLOCK_M),
and the arithmetic intensity grows with the tile: with 128×128 tiles in fp16, each unit of K costs 2·128·128
FLOPs for 2·(128+128) bytes loaded, 64 FLOP/byte (the roofline ridge of an H100 is ~300 FLOP/byte: L2 reuse
across programs, which the grouped order below improves, supplies the rest).

Why grouped order. Programs run roughly in the order of their id. Numbered row by row, consecutive programs
share one row of A tiles but each needs a different column of B tiles: N/BLOCK_N columns of B pass through L2
for every row of C. Numbered in groups of GROUP_M tile rows (down a group's column first, then the next column),
a wave of programs touches GROUP_M rows of A and a few columns of B, and both stay in L2 while they are reused.
The result is the same; only the L2 hit rate (and so HBM traffic) changes.

The accumulator is fp32 whatever the input dtype, as torch's own matmul does. Comparisons against CPU use
`input_precision="ieee"` (true fp32 products); on a GPU, fp32 inputs use TF32 only when torch itself would
(`torch.backends.cuda.matmul.allow_tf32`). Tails: M, N and K need not be multiples of the blocks — every load
and store is masked, and masked-off A/B elements load as 0 so they add nothing to the dot product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Importing this module runs lab/kernels/__init__.py first, which imports lab.kernels.runtime: the interpreter is
# chosen before the @triton.jit below is decorated.
from lab.kernels.runtime import check_input, interpreted


@triton.jit
def _matmul_kernel(A, B, C, M, N, K, sam, sak, sbk, sbn, scm, scn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   PRECISION: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # int64 offsets: no int32 overflow on large matrices
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # grouped order: program ids run down GROUP_M tile rows before moving to the next tile column
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)  # the last group may be shorter
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    a_ptrs = A + rows[:, None] * sam + offs_k[None, :] * sak  # the first k step's tiles; moved by BLOCK_K below
    b_ptrs = B + offs_k[:, None] * sbk + cols[None, :] * sbn
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = k + offs_k < K
        a = tl.load(a_ptrs + k * sak, mask=(rows[:, None] < M) & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs + k * sbk, mask=k_ok[:, None] & (cols[None, :] < N), other=0.0)
        acc += tl.dot(a, b, input_precision=PRECISION)
    tl.store(C + rows[:, None] * scm + cols[None, :] * scn, acc.to(C.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def _config(M: int, N: int, K: int, dtype: torch.dtype) -> dict:
    """Interpreted: one pinned config of 64×64×32 tiles (cost is per program and per block op, so few, large
    tiles). Compiled: 128×128×64 tiles with 4 pipeline stages and 8 warps for 16-bit inputs (32 KiB of A and B per
    stage: 4 stages fit an H100's 228 KiB of shared memory), 32-wide K for fp32 (twice the bytes per element);
    64×64 tiles when the matrix is too small to give every SM a 128×128 tile. tl.dot needs every dim ≥ 16."""
    if interpreted():
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=4, PRECISION="ieee")
    tf32 = dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    precision = "tf32" if tf32 else "ieee"
    if M * N < 128 * 128 * 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, PRECISION=precision, num_warps=4, num_stages=3)
    block_k = 32 if dtype == torch.float32 else 64
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=block_k, GROUP_M=8, PRECISION=precision, num_warps=8,
                num_stages=4 if dtype != torch.float32 else 3)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (M, K) @ b (K, N) -> (M, N) in a's dtype, accumulated in fp32. Any strides; any M, N, K (K = 0 gives zeros)."""
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"matmul takes 2-D a (M, K) and b (K, N), got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"inner dims differ: a is {tuple(a.shape)}, b is {tuple(b.shape)} (need a.K == b.K)")
    if a.dtype != b.dtype:
        raise ValueError(f"a and b dtypes differ: {a.dtype} and {b.dtype}")
    check_input(a, "a")
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty(M, N, dtype=a.dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    cfg = _config(M, N, K, a.dtype)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    _matmul_kernel[grid](a, b, c, M, N, K, *a.stride(), *b.stride(), *c.stride(), **cfg)
    return c


def grouped_order(num_pid_m: int, num_pid_n: int, group_m: int) -> list[tuple[int, int]]:
    """The (tile row, tile column) each program id computes, in id order: the kernel's mapping in plain Python,
    for printing and for checking that it visits every tile once."""
    order = []
    for pid in range(num_pid_m * num_pid_n):
        in_group = group_m * num_pid_n
        first_m = (pid // in_group) * group_m
        size_m = min(num_pid_m - first_m, group_m)
        order.append((first_m + (pid % in_group) % size_m, (pid % in_group) // size_m))
    return order


def matmul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The definition: (a @ b) computed in float64, returned in float64."""
    return a.double() @ b.double()
