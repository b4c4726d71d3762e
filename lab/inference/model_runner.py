"""The model side of the engine: the paged K/V tensors, and one scheduled step run through `lab.model`.

A step is a list of (sequence, n): n new tokens of each sequence — a chunk of a prompt (prefill) or the one token
sampled last step (decode), mixed freely. They are laid end to end as one batch of N tokens (batch 1, length N,
each token with its own position), so that every per-token layer — embeddings, norms, projections, experts — runs
once over all of them. Only attention needs to know which tokens belong together, and it learns that from the
cache seam (`lab.model.LayerCache`):

1. write: the new tokens' keys and values go to their *slots* — slot = block_table[p // block_size] · block_size
   + p % block_size for position p (the `BlockManager` owns the block tables and the slot mapping);
2. read: each sequence's queries attend over the keys of positions 0 .. its context length, gathered block by
   block through its block table, masked by absolute position. All sequences at once: queries, keys and values
   are padded to the longest segment and context of the step, and the mask also hides the padding — one
   attention call per layer whatever the batch, so a step's cost grows little with the sequences it holds
   (`attend_each` is the same, one sequence at a time with `kv_cache.attend_with_offset`: the reference).

The K/V cache of each layer is (num_blocks, block_size, kv_heads, head_dim): the layout of the Triton paged
decode kernel of chapter 09 (`lab.kernels.paged_attention`), which a pure decode step can use instead of the
gather (`attention="triton"`); the gather in pure torch is the reference, and the default on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lab.inference.block_manager import BlockManager
from lab.inference.kv_cache import attend_with_offset
from lab.inference.sequence import Sequence

ATTENTION = ("torch", "triton")


@dataclass(frozen=True)
class Segment:
    """One sequence's part of a step: `n` new tokens whose last position is `context - 1`, attending over
    positions 0 .. context - 1 of the blocks in `block_table`."""

    n: int
    context: int
    block_table: tuple[int, ...]


class PagedKVCache:
    """Keys and values in fixed-size blocks, per layer (allocated at the layer's first write), and what the step
    being run needs to use them: where each new token goes (`slots`) and each sequence's segment."""

    def __init__(self, num_blocks: int, block_size: int, attention: str = "torch") -> None:
        if attention not in ATTENTION:
            raise ValueError(f"attention={attention!r} must be one of {', '.join(map(repr, ATTENTION))}")
        self.num_blocks, self.block_size, self.attention = num_blocks, block_size, attention
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.slots = torch.empty(0, dtype=torch.long)
        self.segments: list[Segment] = []

    def layer(self, index: int) -> _PagedLayer:
        return _PagedLayer(self, index)

    def storage(self, index: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if index not in self.keys:
            shape = (self.num_blocks, self.block_size, k.shape[1])
            self.keys[index] = k.new_zeros(*shape, k.shape[-1])
            self.values[index] = v.new_zeros(*shape, v.shape[-1])
        return self.keys[index], self.values[index]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values()))


def gather_blocks(cache: torch.Tensor, block_table: tuple[int, ...], length: int) -> torch.Tensor:
    """The first `length` positions of one sequence, (kv_heads, length, hd), from its blocks in order."""
    blocks = cache[list(block_table[: -(-length // cache.shape[1])])]  # (n_blocks, block_size, kv_heads, hd)
    return blocks.flatten(0, 1)[:length].transpose(0, 1)


def attend_each(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, segments: list[Segment],
                scale: float | None = None) -> torch.Tensor:
    """The step's attention one sequence at a time: q (1, H, N, hd) -> (1, H, N, hd)."""
    outputs, start = [], 0
    for segment in segments:
        keys = gather_blocks(k_cache, segment.block_table, segment.context)[None]
        values = gather_blocks(v_cache, segment.block_table, segment.context)[None]
        queries = q[:, :, start:start + segment.n]
        outputs.append(attend_with_offset(queries, keys, values, segment.context - segment.n, scale))
        start += segment.n
    return torch.cat(outputs, dim=2)


def attend_padded(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, segments: list[Segment],
                  scale: float | None = None) -> torch.Tensor:
    """The same as `attend_each` in one attention call: each sequence's queries padded to the step's longest
    segment (S, H, T, hd), its blocks gathered and padded to the longest table (S, kv_heads, C, hd), and a mask
    that lets query t of a sequence see key j only if j <= its absolute position."""
    device, block_size = q.device, k_cache.shape[1]
    width = max(len(s.block_table) for s in segments)
    table = torch.tensor([list(s.block_table) + [0] * (width - len(s.block_table)) for s in segments], device=device)
    keys = k_cache[table].flatten(1, 2).transpose(1, 2)  # (S, width, block_size, kv_heads, hd) -> (S, kv, C, hd)
    values = v_cache[table].flatten(1, 2).transpose(1, 2)
    n = torch.tensor([s.n for s in segments], device=device)
    context = torch.tensor([s.context for s in segments], device=device)
    steps = torch.arange(int(n.max()), device=device)
    valid = steps[None, :] < n[:, None]  # (S, T): real queries, not padding
    token = (n.cumsum(0) - n)[:, None] + steps[None, :]  # each query's index among the step's N tokens
    queries = q[0][:, token.clamp(max=q.shape[2] - 1)].transpose(0, 1)  # (H, S, T, hd) -> (S, H, T, hd)
    query_pos = (context - n)[:, None] + steps[None, :]
    key_pos = torch.arange(width * block_size, device=device)
    mask = key_pos <= query_pos[..., None]  # also hides the padded keys: a query's position is below its context
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask[:, None], scale=scale,
                                         enable_gqa=keys.shape[1] != queries.shape[1])
    # the real queries, in the step's token order (a padding query's row, all masked, may be NaN: it is dropped)
    return out.transpose(0, 1)[:, valid][None]  # (1, H, N, hd)


class _PagedLayer:
    def __init__(self, cache: PagedKVCache, index: int) -> None:
        self.cache, self.index = cache, index

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """q (1, H, N, hd), k and v (1, kv_heads, N, hd): the step's N tokens end to end."""
        cache = self.cache
        k_cache, v_cache = cache.storage(self.index, k, v)
        k_cache.view(-1, *k_cache.shape[2:])[cache.slots] = k[0].transpose(0, 1)  # (N, kv_heads, hd) into slots
        v_cache.view(-1, *v_cache.shape[2:])[cache.slots] = v[0].transpose(0, 1)
        if cache.attention == "triton" and all(s.n == 1 for s in cache.segments):
            return self._decode_with_triton(q, k_cache, v_cache, scale)
        return attend_padded(q, k_cache, v_cache, cache.segments, scale)

    def _decode_with_triton(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            scale: float | None) -> torch.Tensor:
        from lab.kernels.paged_attention import paged_attention_decode

        segments = self.cache.segments
        width = max(len(s.block_table) for s in segments)
        table = torch.tensor([list(s.block_table) + [0] * (width - len(s.block_table)) for s in segments],
                             dtype=torch.int32, device=q.device)
        lens = torch.tensor([s.context for s in segments], dtype=torch.int32, device=q.device)
        out = paged_attention_decode(q[0].transpose(0, 1).contiguous(), k_cache, v_cache, table, lens, scale)
        return out.transpose(0, 1)[None]  # (B, H, Dv) -> (1, H, N = B, Dv)


class ModelRunner:
    """Runs scheduled steps of `model` over a paged KV cache of `block_manager`'s blocks."""

    def __init__(self, model: nn.Module, block_manager: BlockManager, attention: str = "torch") -> None:
        self.model = model.eval()
        self.block_manager = block_manager
        self.cache = PagedKVCache(block_manager.num_blocks, block_manager.block_size, attention)
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def run(self, scheduled: list[tuple[Sequence, int]]) -> dict[int, torch.Tensor]:
        """Forward the step's new tokens; return the last position's logits (vocab,) of each sequence whose chunk
        reaches the end of its known tokens (those sample a token this step), by seq_id."""
        if not scheduled:
            return {}
        tokens, positions, slots, segments = [], [], [], []
        for seq, n in scheduled:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            if n < 1 or end > len(seq.token_ids):
                raise ValueError(f"sequence {seq.seq_id}: {n} new tokens from position {start} runs past its "
                                 f"{len(seq.token_ids)} tokens")
            tokens += seq.token_ids[start:end]
            positions += range(start, end)
            slots += self.block_manager.slot_mapping(seq, start, end)
            segments.append(Segment(n, end, tuple(seq.block_table)))
        self.cache.slots = torch.tensor(slots, dtype=torch.long, device=self.device)
        self.cache.segments = segments
        as_tensor = {"dtype": torch.long, "device": self.device}
        logits = self.model(torch.tensor([tokens], **as_tensor), torch.tensor([positions], **as_tensor), self.cache)
        ends = torch.tensor([s.n for s in segments]).cumsum(0) - 1
        return {seq.seq_id: logits[0, end] for (seq, _), end, segment in zip(scheduled, ends.tolist(), segments,
                                                                              strict=True)
                if segment.context == len(seq.token_ids)}
