"""A contiguous KV cache and `generate()`: the two phases of inference on one batch of prompts.

Decoding token t+1 needs the keys and values of tokens 0..t in every layer. Recomputing them costs a forward over
the whole sequence per new token (quadratic); keeping them costs memory, 2 · layers · kv_heads · head_dim numbers
per token. The cache keeps them: *prefill* runs the prompt once, writing its keys and values; each *decode* step
runs one new token, appends its key and value, and attends over all of them.

This cache gives each sequence of the batch one contiguous row of `max_len` slots per layer — simple, and wasteful
when lengths differ (every row is sized for the longest): the paged cache of `lab.inference.model_runner` is the
answer to that. Here every sequence of the batch is at the same position (prompts of one length), so one
`length` says where the next tokens go.

The model sees the cache through one seam, `cache.layer(i).attend(q, k, v)` (`lab.model.LayerCache`): the new
keys and values are stored, and the queries attend over everything cached, with an explicit mask by absolute
position — `is_causal=True` would be wrong as soon as there are fewer queries than keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lab.inference.sampling import SamplingParams, sample


def attend_with_offset(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int,
                       scale: float | None = None) -> torch.Tensor:
    """Attention of queries at absolute positions offset..offset+T-1 over keys at 0..S-1 (S = offset + T): query i
    sees keys j <= offset + i. With offset 0 it is the training core's causal attention."""
    T, S = q.shape[-2], k.shape[-2]
    if S != offset + T:
        raise ValueError(f"{S} keys for {T} queries at offset {offset}: expected offset + T = {offset + T}")
    mask = torch.arange(S, device=q.device)[None, :] <= torch.arange(offset, offset + T, device=q.device)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


class _Layer:
    def __init__(self, cache: KVCache, index: int) -> None:
        self.cache, self.index = cache, index

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        keys, values = self.cache.store(self.index, k, v)
        return attend_with_offset(q, keys, values, self.cache.length, scale)


class KVCache:
    """Keys and values of `batch` sequences, up to `max_len` tokens each, per layer: (batch, kv_heads, max_len, hd),
    allocated at a layer's first write (in the dtype and head sizes the model gives; MLA's keys and values differ
    in width). `length` is how many positions are filled; the caller advances it after each forward."""

    def __init__(self, batch: int, max_len: int) -> None:
        if batch < 1 or max_len < 1:
            raise ValueError(f"batch={batch} and max_len={max_len} must be >= 1")
        self.batch, self.max_len, self.length = batch, max_len, 0
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def layer(self, index: int) -> _Layer:
        return _Layer(self, index)

    def store(self, index: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' k, v at [length, length + T) of layer `index`; return the keys and values of
        positions [0, length + T)."""
        end = self.length + k.shape[-2]
        if end > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} positions; writing up to {end}")
        if index not in self.keys:
            self.keys[index] = k.new_zeros(self.batch, k.shape[1], self.max_len, k.shape[-1])
            self.values[index] = v.new_zeros(self.batch, v.shape[1], self.max_len, v.shape[-1])
        self.keys[index][:, :, self.length:end] = k
        self.values[index][:, :, self.length:end] = v
        return self.keys[index][:, :, :end], self.values[index][:, :, :end]

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds (allocated layers, every slot)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values()))


@torch.no_grad()
def generate(model: nn.Module, prompts: torch.Tensor, params: SamplingParams, use_cache: bool = True
             ) -> torch.Tensor:
    """Continue each prompt of `prompts` (B, T) by `params.max_tokens` tokens; returns them, (B, max_tokens).

    With the cache: one prefill over the prompts, then one forward of one token per step. Without it: a forward
    over the whole sequence so far for every token (what the cache saves; greedy outputs are the same). Stop
    tokens do not end a row early here (rows of one batch stay in step); the engine handles stopping."""
    if prompts.dim() != 2 or prompts.shape[1] < 1:
        raise ValueError(f"prompts must be (batch, length >= 1) token ids, got shape {tuple(prompts.shape)}")
    was_training = model.training
    model.eval()
    try:
        # row b draws from its own stream, seeded seed + b: a row's tokens do not depend on the others
        generators = [None if params.seed is None or params.greedy else
                      torch.Generator(prompts.device).manual_seed(params.seed + b) for b in range(prompts.shape[0])]
        sequence, new = prompts, []
        cache = KVCache(prompts.shape[0], prompts.shape[1] + params.max_tokens) if use_cache else None
        step_input = prompts
        for _ in range(params.max_tokens):
            if cache is not None:
                positions = torch.arange(cache.length, cache.length + step_input.shape[1], device=prompts.device)
                logits = model(step_input, positions, cache)[:, -1]
                cache.length += step_input.shape[1]
            else:
                logits = model(sequence)[:, -1]
            token = torch.tensor([[sample(row, params, g)] for row, g in zip(logits, generators, strict=True)],
                                 device=prompts.device)
            new.append(token)
            sequence = torch.cat([sequence, token], dim=1)
            step_input = token
        return torch.cat(new, dim=1)
    finally:
        model.train(was_training)
