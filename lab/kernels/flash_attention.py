"""FlashAttention forward and backward: softmax(q kᵀ · scale) v without ever writing the T×S score matrix.

Why. Plain attention writes S = q kᵀ (T×S per head) to memory, reads it back for the softmax, writes P and reads
it again for P v: O(T·S) bytes moved for O(T·S·D) FLOPs, so at D = 64..128 it is memory-bound. Here a program
owns BLOCK_M query rows and streams the keys and values past them BLOCK_N at a time; scores live only in
registers/SRAM. Bytes moved per head: q, o once, k and v once per query block — O(T·D + (T/BLOCK_M)·S·D).

Online softmax (chapter 05's ring attention merges partial results by the same rule). For one row, after the
key blocks seen so far, keep the running max m, the running sum l = Σ exp(s_j - m) and the unnormalised output
acc = Σ exp(s_j - m) v_j. A new block with scores s' gives m' = max(m, max s'); rescaling by α = exp(m - m')
brings the old terms onto the new max: l' = α·l + Σ exp(s' - m'), acc' = α·acc + exp(s' - m') v'. At the end
o = acc / l, and the log-sum-exp m + log l is saved per row: the backward recomputes P = exp(s - lse) from it
exactly, without a second pass for the max. Exponentials are taken base 2 (exp2 is the hardware instruction):
scores are multiplied by scale·log2(e) once and the saved lse is in log2 units.

Backward (FlashAttention-2, paper §3.2, Algorithm 2). The backward reads q, k, v, o, the saved lse and dO, and
recomputes P = exp2(s - lse) block by block, exactly (the forward saves nothing else). With dP = dO vᵀ and
D_i = Σ_j P_ij dP_ij = rowsum(dO ∘ O) (a small preprocess kernel), the softmax backward is dS = P ∘ (dP - D); then
dV = Pᵀ dO, dK = scale · dSᵀ q, dQ = scale · dS k. Two paths, both one program per (key block, batch, kv head)
accumulating dK, dV over every query block of every query head of its group (grouped-query attention's sum over
heads happens in registers):
- single pass (the default): the same program also forms dQ_partial = scale · dS k for each query block it
  visits and adds it into an fp32 dQ buffer with `tl.atomic_add`, as FA2's own CUDA code does (§3.2 uses atomic
  adds to gather dQ across thread blocks); dQ is cast to the input dtype at the end. 5 block matmuls per (query
  block, key block) pair: S, dV, dP, dK, dQ. Atomics add in whatever order the programs reach them, so dQ's fp32
  sums differ in their last bits from run to run on a GPU.
- two kernels (deterministic): the key-block program leaves dQ out, and a second kernel, one program per query
  block, recomputes S and dP to accumulate dQ over the key blocks in a fixed order: 7 block matmuls per pair
  (S and dP twice), no atomics, bit-reproducible. `flash_attention(..., deterministic=None)` takes it when
  `torch.use_deterministic_algorithms(True)` is on, as torch's own non-deterministic kernels do.

Shapes: q (B, H, T, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv). Query head h reads key/value head h // (H // Hkv)
through its strides (no copy). Dv may differ from D (DeepSeek MLA). Head dims that are not powers of two are
padded to the next power of two in registers and masked on every load and store; so are the T and S tails.
Causal masking is aligned at position 0 (torch's is_causal) and needs T == S. Offsets are int64: b·stride_b
overflows int32 on large GPU tensors, and Triton's interpreter checks every int32 add and multiply for overflow,
which costs more than the op itself.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

# Importing this module runs lab/kernels/__init__.py first, which imports lab.kernels.runtime: the interpreter is
# chosen before the @triton.jit below decorate anything.
from lab.kernels.runtime import check_input, interpreted

LOG2E = 1.4426950408889634
PREPROCESS_ROWS = 64  # query rows a program of the backward's preprocess sums (delta = rowsum(dO ∘ O))


@triton.jit
def _fwd_kernel(Q, K, V, Out, LSE,
                sqb, sqh, sqt, sqd, skb, skh, sks, skd, svb, svh, svs, svd, sob, soh, sot, sod,
                H, GROUP, T, S, D, DV, qk_scale,
                CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    pid_m, pid_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    b, h = pid_bh // H, pid_bh % H
    hk = h // GROUP  # the key/value head this query head shares
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    offs_dv = tl.arange(0, BLOCK_DV).to(tl.int64)
    row_ok, d_ok, dv_ok = rows < T, offs_d < D, offs_dv < DV

    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqt + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    kT_ptrs = K + b * skb + hk * skh + offs_n[None, :] * sks + offs_d[:, None] * skd  # kᵀ tile, moved along S
    v_ptrs = V + b * svb + hk * svh + offs_n[:, None] * svs + offs_dv[None, :] * svd

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_DV], 0.0, tl.float32)
    end = S
    if CAUSAL:  # key blocks entirely above the diagonal contribute nothing: skip them
        end = tl.minimum(S, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, end, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < S
        kT = tl.load(kT_ptrs + start_n * sks, mask=col_ok[None, :] & d_ok[:, None], other=0.0)
        s = tl.dot(q, kT, input_precision="ieee") * qk_scale  # log2 units
        keep = col_ok[None, :]
        if CAUSAL:
            keep = keep & (rows[:, None] >= cols[None, :])
        s = tl.where(keep, s, float("-inf"))
        # every row sees key 0 in the first block, so m_new is finite from the first block on
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptrs + start_n * svs, mask=col_ok[:, None] & dv_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    acc = acc / l_i[:, None]
    tl.store(Out + b * sob + h * soh + rows[:, None] * sot + offs_dv[None, :] * sod, acc.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & dv_ok[None, :])
    tl.store(LSE + pid_bh * T + rows, m_i + tl.log2(l_i), mask=row_ok)


@triton.jit
def _bwd_preprocess(Out, DO, DELTA, sob, soh, sot, sod, sdb, sdh, sdt, sdd, H, T, DV,
                    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    """delta_i = Σ_d dO_id · O_id = Σ_j P_ij dP_ij, the term the softmax backward subtracts."""
    pid_m, pid_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    b, h = pid_bh // H, pid_bh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_dv = tl.arange(0, BLOCK_DV).to(tl.int64)
    mask = (rows[:, None] < T) & (offs_dv[None, :] < DV)
    o = tl.load(Out + b * sob + h * soh + rows[:, None] * sot + offs_dv[None, :] * sod, mask=mask, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + rows[:, None] * sdt + offs_dv[None, :] * sdd, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + pid_bh * T + rows, delta, mask=rows < T)


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV_, DQ,
                     sqb, sqh, sqt, sqd, skb, skh, sks, skd, svb, svh, svs, svd, sdb, sdh, sdt, sdd,
                     H, HKV, GROUP, T, S, D, DV, scale, qk_scale,
                     CAUSAL: tl.constexpr, ATOMIC_DQ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """One program per (key block, batch, kv head): dV = Σ Pᵀ dO and dK = scale · Σ dSᵀ q over the query
    blocks of every query head that reads this kv head. dK/dV are contiguous (B, Hkv, S, ·). With ATOMIC_DQ it
    also adds this key block's share of dQ, scale · dS k, into DQ (fp32, contiguous (B, H, T, D)) with relaxed
    atomics: the sum is only read after the kernel ends, so no ordering between programs is needed."""
    pid_n, pid_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    b, hk = pid_bh // HKV, pid_bh % HKV
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    offs_dv = tl.arange(0, BLOCK_DV).to(tl.int64)
    col_ok, d_ok, dv_ok = cols < S, offs_d < D, offs_dv < DV

    k = tl.load(K + b * skb + hk * skh + cols[:, None] * sks + offs_d[None, :] * skd,
                mask=col_ok[:, None] & d_ok[None, :], other=0.0)
    v = tl.load(V + b * svb + hk * svh + cols[:, None] * svs + offs_dv[None, :] * svd,
                mask=col_ok[:, None] & dv_ok[None, :], other=0.0)
    q_ptrs = Q + b * sqb + offs_m[:, None] * sqt + offs_d[None, :] * sqd  # + head and block offsets below
    do_ptrs = DO + b * sdb + offs_m[:, None] * sdt + offs_dv[None, :] * sdd
    dk = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
    dv = tl.full([BLOCK_N, BLOCK_DV], 0.0, tl.float32)
    start = 0
    if CAUSAL:  # query rows above this key block's first column see none of it
        start = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    for h in range(hk * GROUP, hk * GROUP + GROUP):
        lse_ptrs, delta_ptrs = LSE + (b * H + h) * T, DELTA + (b * H + h) * T
        for start_m in range(start, T, BLOCK_M):
            rows = start_m + offs_m
            row_ok = rows < T
            q = tl.load(q_ptrs + h * sqh + start_m * sqt, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            do = tl.load(do_ptrs + h * sdh + start_m * sdt, mask=row_ok[:, None] & dv_ok[None, :], other=0.0)
            lse = tl.load(lse_ptrs + rows, mask=row_ok, other=0.0)
            delta = tl.load(delta_ptrs + rows, mask=row_ok, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
            keep = row_ok[:, None] & col_ok[None, :]
            if CAUSAL:
                keep = keep & (rows[:, None] >= cols[None, :])
            p = tl.where(keep, tl.exp2(s - lse[:, None]), 0.0)  # the forward's P, recomputed exactly
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision="ieee")
            dp = tl.dot(do, tl.trans(v), input_precision="ieee")
            ds = (p * (dp - delta[:, None])).to(q.dtype)
            dk += tl.dot(tl.trans(ds), q, input_precision="ieee")
            if ATOMIC_DQ:
                dq = tl.dot(ds, k, input_precision="ieee") * scale
                tl.atomic_add(DQ + ((b * H + h) * T + rows[:, None]) * D + offs_d[None, :], dq,
                              mask=row_ok[:, None] & d_ok[None, :], sem="relaxed")

    out = pid_bh * S + cols[:, None]
    tl.store(DK + out * D + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty), mask=col_ok[:, None] & d_ok[None, :])
    tl.store(DV_ + out * DV + offs_dv[None, :], dv.to(DV_.dtype.element_ty), mask=col_ok[:, None] & dv_ok[None, :])


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ,
                   sqb, sqh, sqt, sqd, skb, skh, sks, skd, svb, svh, svs, svd, sdb, sdh, sdt, sdd,
                   H, GROUP, T, S, D, DV, scale, qk_scale,
                   CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """One program per (query block, batch, head): dQ = scale · Σ dS k over the key blocks. dQ is contiguous."""
    pid_m, pid_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    b, h = pid_bh // H, pid_bh % H
    hk = h // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    offs_dv = tl.arange(0, BLOCK_DV).to(tl.int64)
    row_ok, d_ok, dv_ok = rows < T, offs_d < D, offs_dv < DV

    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqt + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + rows[:, None] * sdt + offs_dv[None, :] * sdd,
                 mask=row_ok[:, None] & dv_ok[None, :], other=0.0)
    lse = tl.load(LSE + pid_bh * T + rows, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + pid_bh * T + rows, mask=row_ok, other=0.0)
    k_ptrs = K + b * skb + hk * skh + offs_n[:, None] * sks + offs_d[None, :] * skd
    vT_ptrs = V + b * svb + hk * svh + offs_n[None, :] * svs + offs_dv[:, None] * svd
    dq = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    end = S
    if CAUSAL:
        end = tl.minimum(S, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, end, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < S
        k = tl.load(k_ptrs + start_n * sks, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        vT = tl.load(vT_ptrs + start_n * svs, mask=col_ok[None, :] & dv_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        keep = row_ok[:, None] & col_ok[None, :]
        if CAUSAL:
            keep = keep & (rows[:, None] >= cols[None, :])
        p = tl.where(keep, tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, vT, input_precision="ieee")
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision="ieee")

    tl.store(DQ + (pid_bh * T + rows[:, None]) * D + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


# The single-pass backward's tiles on a GPU, autotuned per shape (`_autotuned_backward`). Why a choice at all: each
# key-block program streams every query block of its heads past its k, v tiles and adds a BLOCK_M × D fp32 dQ
# partial into memory with atomics for each: per head, S/BLOCK_N read-modify-writes of 4 bytes for every element of
# dQ, twice the bytes of re-reading q and dO. BLOCK_N divides that traffic, so 128 keys would be the pick (the
# 32 × 128 tiles of Triton's python/tutorials/06-fused-attention.py dk/dv loop) — but a program then holds fp32 dk
# and dv of 128 × D each (128 KiB at D = 128: 128 registers a thread at 8 warps) beside its s, dP and dQ tiles, and
# compiled for an H100 (`python -m lab.kernels.cross_compile --only flash`, sm_90a, bf16, D = 128) it spills: 255
# registers and 336 bytes of stack a thread at 32 × 128, 16 stack bytes at 32 × 64, none at 16 × 128 (whose 16 query
# rows are under wgmma's 64, so it runs on the older mma instructions). That is Triton 3.9's compiler; 3.6's (the
# lent H100's) spills 248 bytes at 32 × 128 and none at 32 × 64, but 16 bytes at 64 × 64 with D = 64, causal: which
# tile spills moves with the compiler version too. Spills against atomics against tensor-core width is a trade only
# the GPU can time, so it times it. The dQ buffer of one head is T × D × 4 B (2 MiB at
# T = 4096, D = 128): those of the heads in flight stay in the H100's 50 MiB L2, where the atomics resolve.
BACKWARD_ATOMIC_CONFIGS = [
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 128}, num_warps=8, num_stages=3),  # fewest atomics; spills at D = 128
    triton.Config({"BLOCK_M": 16, "BLOCK_N": 128}, num_warps=8, num_stages=2),  # no spill; mma, not wgmma
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 64}, num_warps=8, num_stages=3),  # twice the atomics; 16 stack bytes (3.9)
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=8, num_stages=2),  # wgmma-wide query blocks
]


SINGLE_PASS_MAX_ROW_BYTES = 512
"""The widest padded head row (BLOCK_D x bytes an element) the single-pass backward takes. Past it (fp32 heads wider
than 128), its 64-key tiles need 205-214 KB of shared memory, over an A100's 163 KiB, and spill 14-27 KB of stack a
thread on an H100 (compiled for sm_80 and sm_90a: `lab.kernels.cross_compile`), while the two-kernel backward's
32x32 tiles take ~100 KB: such rows take the two kernels, deterministic or not."""


def _head_block(D: int) -> int:
    """A head dim as a tile's width: tl.dot needs >= 16 on a GPU, tl.arange a power of two."""
    return max(16, triton.next_power_of_2(D))


def _row_bytes(D: int, Dv: int, dtype: torch.dtype) -> int:
    """Bytes of the widest padded row a program holds (of q, dO, k or v): what every tile choice here scales by."""
    return max(_head_block(D), _head_block(Dv)) * torch.finfo(dtype).bits // 8


def single_pass_fits(D: int, Dv: int, dtype: torch.dtype) -> bool:
    """Whether the single-pass backward can take heads of D (Dv) in `dtype` (`SINGLE_PASS_MAX_ROW_BYTES`)."""
    return _row_bytes(D, Dv, dtype) <= SINGLE_PASS_MAX_ROW_BYTES


def prune_backward(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """The autotuner's early prune: past 256 bytes a row (fp32 heads beyond 64 wide, 16-bit beyond 128) the
    128-key tiles' fp32 dk and dv alone would fill every register, so only the 64-key ones are tried."""
    row_bytes = _row_bytes(kwargs["BLOCK_D"], kwargs["BLOCK_DV"], named_args["Q"].dtype)
    return [c for c in configs if row_bytes <= 256 or c.kwargs["BLOCK_N"] <= 64]


@functools.cache
def _autotuned_backward():
    """The single-pass dk/dv/dQ kernel autotuned, built on first use on a GPU (the interpreter cannot time). Each
    trial adds into dQ, so the autotuner zeroes it before every trial and again before the real run."""
    return triton.autotune(BACKWARD_ATOMIC_CONFIGS, key=["T", "S", "D", "DV", "GROUP", "CAUSAL"],
                           reset_to_zero=["DQ"], prune_configs_by={"early_config_prune": prune_backward}
                           )(_bwd_dkdv_kernel)


def _config(D: int, Dv: int, dtype: torch.dtype, kind: str = "forward") -> dict:
    """Block sizes and launch options of `kind`: "forward", "backward" (the two-kernel, deterministic backward)
    or "backward_atomic" (the single-pass backward). tl.dot needs every dim >= 16 on a GPU, so head dims are
    padded to at least 16 (and to a power of two, for tl.arange). Interpreted: one pinned config of 64×64 tiles
    (the cost is per program and per block op, never per element).

    Compiled, forward: 128 query rows × 64 keys, 8 warps, 3 pipeline stages for 16-bit heads up to 128 wide (q
    tile 32 KiB + 3 stages of k and v tiles, 96 KiB, fit the ~228 KiB of shared memory of an H100); half the rows
    and stages for fp32 or wider heads. Two-kernel backward: 64×64 tiles, 32×32 for wide rows (each program holds
    k, v, q, dO and the fp32 dk, dv where the forward holds q, k, v).

    Single-pass backward: interpreted, the pinned tiles; on a GPU the tiles are autotuned over
    `BACKWARD_ATOMIC_CONFIGS` (see there why), so this returns only the head-dim blocks."""
    block_d, block_dv = _head_block(D), _head_block(Dv)
    blocks = dict(BLOCK_D=block_d, BLOCK_DV=block_dv)
    if kind not in ("forward", "backward", "backward_atomic"):
        raise ValueError(f"kind {kind!r} must be one of 'forward', 'backward', 'backward_atomic'")
    if interpreted():
        return dict(BLOCK_M=64, BLOCK_N=64, **blocks)
    row_bytes = _row_bytes(D, Dv, dtype)
    if kind == "backward_atomic":
        return blocks
    if kind == "backward":  # halve the tiles past 256 B (fp32 beyond 64, 16-bit beyond 128)
        tile = 64 if row_bytes <= 256 else 32
        return dict(BLOCK_M=tile, BLOCK_N=tile, num_warps=4 if max(block_d, block_dv) <= 64 else 8, num_stages=2,
                    **blocks)
    if max(block_d, block_dv) <= 128 and dtype != torch.float32:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, **blocks)
    return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2, **blocks)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
        check_input(t, name)
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v dtypes must match, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, H, T, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"batch sizes differ: q {B}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[3] != D:
        raise ValueError(f"k head_dim {k.shape[3]} must equal q's {D}")
    if v.shape[1] != k.shape[1] or v.shape[2] != k.shape[2]:
        raise ValueError(f"v (heads, seq) {tuple(v.shape[1:3])} must equal k's {tuple(k.shape[1:3])}")
    Hkv = k.shape[1]
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"kv heads {Hkv} must divide query heads {H} (1 <= Hkv <= {H}, H % Hkv == 0)")
    if k.shape[2] < 1 or D < 1 or v.shape[3] < 1:
        raise ValueError(f"key length {k.shape[2]} and head dims {D}, {v.shape[3]} must be >= 1")
    if causal and k.shape[2] != T:
        raise ValueError(f"causal attention needs key length == query length, got S={k.shape[2]}, T={T}")


class FlashAttention(torch.autograd.Function):
    """forward saves q, k, v, o and the per-row log-sum-exp (nothing else: the backward recomputes P from them);
    backward runs the single-pass kernel (5 block matmuls per block pair, dQ by fp32 atomics) or, when
    `deterministic`, the two-kernel pair (7, no atomics)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                deterministic: bool) -> torch.Tensor:
        B, H, T, D = q.shape
        Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
        cfg = _config(D, Dv, q.dtype)
        o = torch.empty(B, H, T, Dv, dtype=q.dtype, device=q.device)
        lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
        grid = (triton.cdiv(T, cfg["BLOCK_M"]), B * H)
        _fwd_kernel[grid](q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
                          H, H // Hkv, T, S, D, Dv, scale * LOG2E, CAUSAL=causal, **cfg)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.scale, ctx.causal, ctx.deterministic = scale, causal, deterministic
        return o

    @staticmethod
    def backward(ctx, do: torch.Tensor):
        q, k, v, o, lse = ctx.saved_tensors
        B, H, T, D = q.shape
        Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
        atomic = not ctx.deterministic and single_pass_fits(D, Dv, q.dtype)
        cfg = _config(D, Dv, q.dtype, "backward_atomic" if atomic else "backward")
        strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
        delta = torch.empty_like(lse)
        _bwd_preprocess[(triton.cdiv(T, PREPROCESS_ROWS), B * H)](
            o, do, delta, *o.stride(), *do.stride(), H, T, Dv, BLOCK_M=PREPROCESS_ROWS, BLOCK_DV=cfg["BLOCK_DV"])
        # the atomics' target is fp32 whatever the inputs: S/BLOCK_N partials summed in 16 bits would each round
        dq = torch.zeros(B, H, T, D, dtype=torch.float32, device=q.device) if atomic else torch.empty_like(q)
        dk = torch.empty(B, Hkv, S, D, dtype=k.dtype, device=k.device)
        dv = torch.empty(B, Hkv, S, Dv, dtype=v.dtype, device=v.device)
        scale = ctx.scale
        args = (q, k, v, do, lse, delta, dk, dv, dq if atomic else None, *strides, H, Hkv, H // Hkv, T, S, D, Dv,
                scale, scale * LOG2E)
        if atomic and not interpreted():  # the grid depends on the tile the autotuner tries
            _autotuned_backward()[lambda meta: (triton.cdiv(S, meta["BLOCK_N"]), B * Hkv)](
                *args, CAUSAL=ctx.causal, ATOMIC_DQ=True, **cfg)
        else:
            _bwd_dkdv_kernel[(triton.cdiv(S, cfg["BLOCK_N"]), B * Hkv)](*args, CAUSAL=ctx.causal, ATOMIC_DQ=atomic,
                                                                         **cfg)
        if atomic:
            return dq.to(q.dtype), dk, dv, None, None, None
        _bwd_dq_kernel[(triton.cdiv(T, cfg["BLOCK_M"]), B * H)](
            q, k, v, do, lse, delta, dq, *strides, H, H // Hkv, T, S, D, Dv, scale, scale * LOG2E,
            CAUSAL=ctx.causal, **cfg)
        return dq, dk, dv, None, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                    causal: bool = True, *, deterministic: bool | None = None) -> torch.Tensor:
    """softmax(q kᵀ · scale [+ causal mask]) v for q (B, H, T, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv).

    A drop-in `Attention.core` (core(q, k, v)) and `LatentAttention.core` (core(q, k, v, scale)); differentiable.
    scale defaults to 1/sqrt(D). `deterministic` picks the backward: False, the single pass (5 block matmuls per
    block pair, dQ summed by fp32 atomics, so its last bits vary run to run on a GPU) where its tiles fit (heads up
    to 128 wide in fp32, 256 in 16 bits: `single_pass_fits`; wider ones take the two kernels); True, the two-kernel
    backward (7 matmuls, bit-reproducible); None (the default), True exactly when
    `torch.are_deterministic_algorithms_enabled()`, as torch decides for its own non-deterministic kernels."""
    _check(q, k, v, causal)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    if 0 in q.shape[:3]:
        return q.new_empty(*q.shape[:3], v.shape[3])
    return FlashAttention.apply(q, k, v, float(scale), bool(causal), bool(deterministic))


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                        causal: bool = True) -> torch.Tensor:
    """The same op in plain torch, materialising the scores: the definition the kernel is tested against."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:
        T, S = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(T, S, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return scores.softmax(dim=-1) @ v
