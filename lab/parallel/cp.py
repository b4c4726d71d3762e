"""Context parallelism: split the sequence across ranks for the whole model, not only around norms.

Norms, the MLP, RoPE and the loss work token by token, so a rank holding T/cp tokens needs nothing from
the others for them: only attention mixes tokens. Two ways to make attention see the whole sequence:

- **Ring attention** (`lab.parallel.ring_attention`): queries stay, K/V blocks travel around the ring,
  partial results merged by log-sum-exp. Its layouts:
  - "contiguous" (impl "ring"): rank r holds chunk r of cp. Under a causal mask rank 0's queries see one
    block and rank cp-1's see cp: the last rank does ~2x the average work while the others wait.
  - "zigzag" (impl "zigzag"): the sequence is cut into 2·cp chunks and rank r holds chunks r and
    2·cp-1-r, an early and a late one, so every rank scores the same number of query-key pairs.
- **All-gather** (`allgather_attention`, Llama 3): K and V of the whole sequence all-gathered once, then one
  ordinary attention call per rank with the causal mask by global positions. Every rank holds all of K/V (small
  with GQA) and waits for the gather; any mask fits one kernel call.
- **Ulysses** (impl "ulysses"): an all-to-all turns "all heads, T/cp tokens" into "heads/cp, all tokens",
  each rank runs ordinary attention on its heads, and a second all-to-all turns it back. Needs cp to
  divide the number of heads; moves 4 tensors of activations per layer instead of K/V around a ring.

Gradients of the (replicated) weights differ per CP rank, since each saw other tokens: they are averaged
over the dp x cp ranks, like data parallelism (`Mesh.dp_cp_group`).

    apply_context_parallel(model, mesh.cp_group, "zigzag")
    tokens, targets = (shard_sequence(t, mesh.cp_rank, cp, "zigzag") for t in (tokens, targets))
    logits = model(tokens, positions=sequence_positions(T, mesh.cp_rank, cp, "zigzag"))
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lab.calc.cp import check_sequence, chunk_ids, num_chunks
from lab.collectives.p2p import group_info
from lab.config import CP_IMPLS
from lab.model import Transformer, causal_attention
from lab.parallel.a2a import all_to_all
from lab.parallel.ring_attention import ring_attention
from lab.parallel.tp_comms import gather_sequence


def layout_of(impl: str) -> str:
    """The sequence layout an implementation needs: zig-zag for "zigzag", contiguous chunks otherwise
    (Ulysses's all-to-all reassembles the sequence in rank order)."""
    if impl not in CP_IMPLS:
        raise ValueError(f"cp_impl={impl!r} must be one of {', '.join(map(repr, CP_IMPLS))}")
    return "zigzag" if impl == "zigzag" else "contiguous"


def shard_sequence(x: torch.Tensor, rank: int, cp: int, layout: str, dim: int = 1) -> torch.Tensor:
    """This rank's part of `x` along `dim` (the sequence): its chunks, concatenated."""
    check_sequence(x.shape[dim], cp, layout)
    parts = x.chunk(num_chunks(cp, layout), dim=dim)
    return torch.cat([parts[i] for i in chunk_ids(rank, cp, layout)], dim=dim)


def sequence_positions(seq_len: int, rank: int, cp: int, layout: str) -> torch.Tensor:
    """The global positions of this rank's tokens (what RoPE must rotate by)."""
    return shard_sequence(torch.arange(seq_len), rank, cp, layout, dim=0)


def unshard_sequence(parts: list[torch.Tensor], layout: str, dim: int = 1) -> torch.Tensor:
    """Inverse of `shard_sequence`: the full tensor from every rank's part (in rank order)."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * num_chunks(cp, layout)
    for rank, part in enumerate(parts):
        ids = chunk_ids(rank, cp, layout)
        for i, piece in zip(ids, part.chunk(len(ids), dim=dim), strict=True):
            chunks[i] = piece
    return torch.cat(chunks, dim=dim)


def _swap(x: torch.Tensor, scatter: int, gather: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Split dim `scatter` into world pieces, send piece j to rank j, concatenate what arrives along `gather`."""
    world = dist.get_world_size(group)
    pieces = torch.stack(x.chunk(world, dim=scatter))  # piece j for rank j
    rows = pieces.flatten(0, 1)  # the all-to-all splits rows: world equal blocks
    received = all_to_all(rows, [pieces.shape[1]] * world, [pieces.shape[1]] * world, group)
    return torch.cat(received.view_as(pieces).unbind(0), dim=gather)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None,
                      scale: float | None = None) -> torch.Tensor:
    """Causal attention for q, k, v (B, heads, T/cp, D) holding contiguous chunks of the sequence: all-to-all
    to (B, heads/cp, T, D), ordinary attention, all-to-all back."""
    _, cp, _ = group_info(group)
    n_heads = q.shape[1]
    if n_heads % cp:
        raise ValueError(f"ulysses needs cp={cp} to divide the attention heads on this rank ({n_heads})")
    if k.shape[1] % cp:  # too few KV heads to split: give every query head its own copy first
        k, v = (x.repeat_interleave(n_heads // x.shape[1], dim=1) for x in (k, v))
    q, k, v = (_swap(x, 1, 2, group) for x in (q, k, v))
    return _swap(causal_attention(q, k, v, scale), 2, 1, group)


def _ring_core(q, k, v, scale=None, *, group, chunks):
    return ring_attention(q, k, v, group, chunks, causal=True, scale=scale)


def _ulysses_core(q, k, v, scale=None, *, group):
    return ulysses_attention(q, k, v, group, scale)


def apply_context_parallel(model: Transformer, group: dist.ProcessGroup | None, impl: str = "zigzag") -> Transformer:
    """Replace every attention core of `model` by its context-parallel version (in place). The caller feeds
    each rank its `shard_sequence` of the tokens and the matching `sequence_positions`."""
    layout = layout_of(impl)
    _, cp, _ = group_info(group)
    if impl == "ulysses":
        core = partial(_ulysses_core, group=group)
    else:
        chunks = [chunk_ids(r, cp, layout) for r in range(cp)]
        core = partial(_ring_core, group=group, chunks=chunks)
    for block in model.layers.values():
        block.attn.core = core
    return model


def _positions(chunks: list[int], tokens: int) -> torch.Tensor:
    """Global positions of `tokens` tokens laid out as equal `chunks` (global chunk indices, in order)."""
    size = tokens // len(chunks)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks])


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None,
                        chunks: list[list[int]], scale: float | None = None) -> torch.Tensor:
    """Llama 3's context parallelism: all-gather K and V of the whole sequence, then one ordinary attention call of
    this rank's queries over it, the causal mask by global positions. q, k, v (B, heads, T/cp, D) hold the chunks
    `chunks[rank]` (any layout; Llama 3 uses zig-zag's 2·cp chunks). Differentiable: the all-gather's backward
    reduce-scatters dK and dV home. Unlike the ring, every rank holds the whole sequence's K/V (cheap with GQA's few
    KV heads) and the transfer is not overlapped with the attention; in exchange any mask fits one kernel call."""
    rank, _, _ = group_info(group)
    k_all, v_all = (gather_sequence(x.transpose(1, 2), group).transpose(1, 2) for x in (k, v))
    key_positions = torch.cat([_positions(c, k.shape[2]) for c in chunks])  # rank order: how the gather lays them
    visible = key_positions[None, :] <= _positions(chunks[rank], q.shape[2])[:, None]
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=visible.to(q.device), scale=scale,
                                          enable_gqa=k.shape[1] != q.shape[1])
