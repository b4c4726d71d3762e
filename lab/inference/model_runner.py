"""The model side of the engine: the paged K/V tensors, and one scheduled step run through `lab.model`.

A step is a list of (sequence, n): n new tokens of each sequence — a chunk of a prompt (prefill) or the one token
sampled last step (decode), mixed freely. They are laid end to end as one batch of N tokens (batch 1, length N,
each token with its own position), so that every per-token layer — embeddings, norms, projections, experts — runs
once over all of them. Only attention needs to know which tokens belong together, and it learns that from the
cache seam (`lab.model.LayerCache`):

1. write: the new tokens' keys and values go to their *slots* — slot = block_table[p // block_size] · block_size
   + p % block_size for position p (the `BlockManager` owns the block tables and the slot mapping);
2. read: each sequence's queries attend over the keys of its positions 0 .. context - 1, found through its
   block table, masked by absolute position. All sequences at once: the keys of every sequence are gathered end
   to end by their slots, and one block-diagonal mask lets a query see only earlier keys of its own sequence —
   one gather and one attention call per layer whatever the batch, so a step's cost grows little with the
   sequences it holds (`attend_each`, one sequence at a time with `kv_cache.attend_with_offset`, is the
   reference it is tested against).

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


@dataclass
class StepLayout:
    """Where a step's tokens go and what they read, computed once per step for every layer: the slot of each new
    token (N,), the slots of every sequence's keys end to end (K,), and the (N, K) mask of which keys each query
    sees (its own sequence's, up to its position)."""

    segments: list[Segment]
    slots: torch.Tensor
    key_slots: torch.Tensor
    mask: torch.Tensor

    @classmethod
    def build(cls, segments: list[Segment], slots: list[int], key_slots: list[int],
              device: torch.device) -> StepLayout:
        query_seq = torch.repeat_interleave(torch.arange(len(segments)), torch.tensor([s.n for s in segments]))
        key_seq = torch.repeat_interleave(torch.arange(len(segments)), torch.tensor([s.context for s in segments]))
        query_pos = torch.cat([torch.arange(s.context - s.n, s.context) for s in segments])
        key_pos = torch.cat([torch.arange(s.context) for s in segments])
        mask = (query_seq[:, None] == key_seq[None, :]) & (key_pos[None, :] <= query_pos[:, None])
        as_long = {"dtype": torch.long, "device": device}
        return cls(segments, torch.tensor(slots, **as_long), torch.tensor(key_slots, **as_long), mask.to(device))


class PagedKVCache:
    """Keys and values in fixed-size blocks, per layer (allocated at the layer's first write), and the layout of
    the step being run."""

    def __init__(self, num_blocks: int, block_size: int, attention: str = "torch") -> None:
        if attention not in ATTENTION:
            raise ValueError(f"attention={attention!r} must be one of {', '.join(map(repr, ATTENTION))}")
        self.num_blocks, self.block_size, self.attention = num_blocks, block_size, attention
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.step: StepLayout | None = None

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


def attend_step(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step: StepLayout,
                scale: float | None = None) -> torch.Tensor:
    """The same as `attend_each` in one attention call: q (1, H, N, hd) over the keys of every sequence of the
    step, gathered end to end by their slots, under the step's block-diagonal causal mask."""
    keys = k_cache.flatten(0, 1)[step.key_slots].transpose(0, 1)[None]  # (K, kv_heads, hd) -> (1, kv_heads, K, hd)
    values = v_cache.flatten(0, 1)[step.key_slots].transpose(0, 1)[None]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=step.mask, scale=scale,
                                          enable_gqa=keys.shape[1] != q.shape[1])


class _PagedLayer:
    def __init__(self, cache: PagedKVCache, index: int) -> None:
        self.cache, self.index = cache, index

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """q (1, H, N, hd), k and v (1, kv_heads, N, hd): the step's N tokens end to end."""
        cache, step = self.cache, self.cache.step
        k_cache, v_cache = cache.storage(self.index, k, v)
        k_cache.view(-1, *k_cache.shape[2:])[step.slots] = k[0].transpose(0, 1)  # (N, kv_heads, hd) into slots
        v_cache.view(-1, *v_cache.shape[2:])[step.slots] = v[0].transpose(0, 1)
        if cache.attention == "triton" and all(s.n == 1 for s in step.segments):
            return self._decode_with_triton(q, k_cache, v_cache, scale)
        return attend_step(q, k_cache, v_cache, step, scale)

    def _decode_with_triton(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            scale: float | None) -> torch.Tensor:
        from lab.kernels.paged_attention import paged_attention_decode

        segments = self.cache.step.segments
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
        tokens, positions, key_slots, segments = [], [], [], []
        for seq, n in scheduled:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            if n < 1 or end > len(seq.token_ids):
                raise ValueError(f"sequence {seq.seq_id}: {n} new tokens from position {start} runs past its "
                                 f"{len(seq.token_ids)} tokens")
            tokens += seq.token_ids[start:end]
            positions += range(start, end)
            key_slots += self.block_manager.slot_mapping(seq, 0, end)
            segments.append(Segment(n, end, tuple(seq.block_table)))
        slots = [slot for seg, end in zip(segments, torch.tensor([s.context for s in segments]).cumsum(0).tolist(),
                                          strict=True) for slot in key_slots[end - seg.n:end]]
        self.cache.step = StepLayout.build(segments, slots, key_slots, self.device)
        as_tensor = {"dtype": torch.long, "device": self.device}
        logits = self.model(torch.tensor([tokens], **as_tensor), torch.tensor([positions], **as_tensor), self.cache)
        ends = torch.tensor([s.n for s in segments]).cumsum(0) - 1
        return {seq.seq_id: logits[0, end] for (seq, _), end, segment in zip(scheduled, ends.tolist(), segments,
                                                                              strict=True)
                if segment.context == len(seq.token_ids)}
