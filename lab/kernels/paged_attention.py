"""Paged attention for one decode step: each new token attends to its sequence's KV cache through a block table.

Why pages. A serving engine does not know how long each sequence will grow, so reserving max_seq_len of KV cache
per sequence wastes most of the memory. vLLM's PagedAttention stores the cache in fixed-size blocks of
block_size tokens, like virtual-memory pages: a sequence owns a list of physical block ids (its row of the block
table) and grows one block at a time; a finished sequence hands its blocks back. The cost moves into the kernel,
which must look up where each block lives before loading it: an indirect load (the block id is read from memory,
then K is read at an address computed from it). Triton's interpreter supports that; it is checked by the tests.

The kernel. One program per (sequence, query head) walks the sequence's blocks in order: load the physical block
id, load that block's K (block_size × D) for the head's key/value head (h // (H // Hkv) under grouped-query
attention), score it against the single query vector, and fold it in with the online softmax of
`lab.kernels.flash_attention` (running max m, running sum l, running output acc rescaled by exp(m_old - m_new)).
The last block is masked to the sequence's length. A decode step reads the whole KV cache once per query head and
does ~2 FLOPs per byte of it: memory-bound, so its speed is bytes moved / bandwidth; programs of one KV head
group read the same blocks, which L2 mostly serves (vLLM's kernels go further and share them in SRAM).

Shapes: q (B, H, D); k_cache (num_blocks, block_size, Hkv, D); v_cache (num_blocks, block_size, Hkv, Dv);
block_table (B, max_blocks) int32 of physical block ids; seq_lens (B,) int32, each in [1, max_blocks·block_size].
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# Importing this module runs lab/kernels/__init__.py first, which imports lab.kernels.runtime: the interpreter is
# chosen before the @triton.jit below is decorated.
from lab.kernels.flash_attention import LOG2E, attention_reference
from lab.kernels.runtime import check_input


@triton.jit
def _paged_decode_kernel(Q, KC, VC, TABLE, LENS, Out,
                         sqb, sqh, sqd, skn, skt, skh, skd, svn, svt, svh, svd, stb, stj, sob, soh, sod,
                         H, GROUP, BLOCK_SIZE, D, DV, qk_scale,
                         BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    pid_bh = tl.program_id(0).to(tl.int64)  # int64 offsets: block ids times the cache's strides get large
    b, h = pid_bh // H, pid_bh % H
    hk = h // GROUP
    offs_t = tl.arange(0, BLOCK_T).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    offs_dv = tl.arange(0, BLOCK_DV).to(tl.int64)
    d_ok, dv_ok = offs_d < D, offs_dv < DV
    seq_len = tl.load(LENS + b)

    q = tl.load(Q + b * sqb + h * sqh + offs_d * sqd, mask=d_ok, other=0.0).to(tl.float32)
    k_tile = KC + offs_t[:, None] * skt + hk * skh + offs_d[None, :] * skd  # offsets inside one block
    v_tile = VC + offs_t[:, None] * svt + hk * svh + offs_dv[None, :] * svd
    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.full([], 0.0, tl.float32)
    acc = tl.full([BLOCK_DV], 0.0, tl.float32)
    for j in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        block = tl.load(TABLE + b * stb + j * stj).to(tl.int64)  # physical block id: the indirect step
        tok_ok = (offs_t < BLOCK_SIZE) & (j * BLOCK_SIZE + offs_t < seq_len)
        k = tl.load(k_tile + block * skn, mask=tok_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.sum(k.to(tl.float32) * q[None, :], 1) * qk_scale  # log2 units
        s = tl.where(tok_ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))  # block j holds at least one token of the sequence
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        v = tl.load(v_tile + block * svn, mask=tok_ok[:, None] & dv_ok[None, :], other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)
        m_i = m_new
    tl.store(Out + b * sob + h * soh + offs_dv * sod, (acc / l_i).to(Out.dtype.element_ty), mask=dv_ok)


def _check(q, k_cache, v_cache, block_table, seq_lens) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D (batch, heads, head_dim), got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(f"k_cache and v_cache must be 4-D (num_blocks, block_size, kv_heads, head_dim), got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_input(t, name)
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"q, k_cache, v_cache dtypes must match, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    B, H, D = q.shape
    num_blocks, block_size, Hkv, Dk = k_cache.shape
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"v_cache (num_blocks, block_size, kv_heads) {tuple(v_cache.shape[:3])} must equal "
                         f"k_cache's {tuple(k_cache.shape[:3])}")
    if Dk != D:
        raise ValueError(f"k_cache head_dim {Dk} must equal q's {D}")
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"kv heads {Hkv} must divide query heads {H} (1 <= Hkv <= {H}, H % Hkv == 0)")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != B:
        raise ValueError(f"block_table must be int32 of shape ({B}, max_blocks), got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (B,):
        raise ValueError(f"seq_lens must be int32 of shape ({B},), got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    # Values are checked too (one host sync): a bad id or length would make the kernel read outside the cache.
    longest = block_table.shape[1] * block_size
    if B and not bool(((seq_lens >= 1) & (seq_lens <= longest)).all()):
        raise ValueError(f"seq_lens {seq_lens.tolist()} must lie in [1, max_blocks*block_size = {longest}]")
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] * block_size < seq_lens[:, None]
    ids = block_table[used]
    if ids.numel() and not bool(((ids >= 0) & (ids < num_blocks)).all()):
        raise ValueError(f"block ids in use must lie in [0, {num_blocks - 1}], got {sorted(set(ids.tolist()))}")


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float | None = None) -> torch.Tensor:
    """Attention of one new query per sequence over its cached keys/values, found through `block_table`.
    Returns (B, H, Dv) in q's dtype. scale defaults to 1/sqrt(D). Forward only (inference)."""
    _check(q, k_cache, v_cache, block_table, seq_lens)
    B, H, D = q.shape
    block_size, Hkv, Dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = torch.empty(B, H, Dv, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    _paged_decode_kernel[(B * H,)](
        q, k_cache, v_cache, block_table, seq_lens, out,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_table.stride(), *out.stride(),
        H, H // Hkv, block_size, D, Dv, float(scale) * LOG2E,
        BLOCK_T=triton.next_power_of_2(block_size), BLOCK_D=triton.next_power_of_2(D),
        BLOCK_DV=triton.next_power_of_2(Dv))
    return out


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, row: int) -> torch.Tensor:
    """Sequence `row`'s cached tokens, (Hkv, seq_len, D): its blocks in table order, cut to its length."""
    n_blocks = -(-seq_len // cache.shape[1])
    blocks = cache[block_table[row, :n_blocks].long()]  # (n_blocks, block_size, Hkv, D)
    return blocks.flatten(0, 1)[:seq_len].transpose(0, 1)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_table: torch.Tensor, seq_lens: torch.Tensor,
                              scale: float | None = None) -> torch.Tensor:
    """The same op in plain torch: gather each sequence's blocks into a contiguous K and V, then attend (the new
    token sees every cached token, itself included: no causal mask)."""
    rows = []
    for row, n in enumerate(seq_lens.tolist()):
        k, v = gather_kv(k_cache, block_table, n, row), gather_kv(v_cache, block_table, n, row)
        rows.append(attention_reference(q[row, :, None, :][None], k[None], v[None], scale, causal=False)[0, :, 0])
    return torch.stack(rows) if rows else q.new_empty(0, q.shape[1], v_cache.shape[3])
