"""Batch-1 decode near the memory roofline: a static KV cache and one CUDA graph per decode step (gpt-fast's way).

A decode step of a dense model reads every weight once and does ~2 FLOPs per weight: it is memory-bound, and its
floor is bytes / HBM bandwidth (2.5 GB of bf16 weights: 0.5 ms on an H200). Eager PyTorch does not get near it
at batch 1: the host launches some 50 small kernels per layer, each a few microseconds of Python and driver
work, and the GPU waits between them (chapter 11's benchmark: 4-14% of the bandwidth).

A CUDA graph records the step's kernels once and replays them with one launch. Recording needs a step whose
shapes and addresses never change, so the cache must not grow:

- `StaticKVCache` holds max_len positions from the start, writes the new keys and values at the positions given
  as a *tensor* (`index_copy_`), and attends over all max_len slots with a mask by position — the same result as
  `kv_cache.KVCache`'s growing slices, at fixed shapes;
- `GraphedDecoder` captures `model(token, position, cache)` for one token into a graph whose inputs are copied
  into fixed buffers before each replay.

On a CPU there is no graph: the same static cache runs eagerly (the tests check it equals the growing cache).
Dense models only: an MoE layer's routing has data-dependent shapes, which a graph cannot hold.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _StaticLayer:
    def __init__(self, cache: StaticKVCache, index: int) -> None:
        self.cache, self.index = cache, index

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        keys, values = self.cache.store(self.index, k, v)
        positions = self.cache.positions
        mask = torch.arange(keys.shape[2], device=q.device)[None, :] <= positions[:, None]  # (T, max_len)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                              enable_gqa=keys.shape[1] != q.shape[1])


class StaticKVCache:
    """max_len positions per layer, allocated up front by `allocate`; `positions` (T,) says where the tokens of the
    next forward go (a tensor: a captured graph reads it from the same address every replay)."""

    def __init__(self, batch: int, max_len: int, device: torch.device | str) -> None:
        self.batch, self.max_len = batch, max_len
        self.positions = torch.zeros(1, dtype=torch.long, device=device)
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def layer(self, index: int) -> _StaticLayer:
        return _StaticLayer(self, index)

    def store(self, index: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if index not in self.keys:  # the first (eager) forward allocates; a captured step finds them all
            self.keys[index] = k.new_zeros(self.batch, k.shape[1], self.max_len, k.shape[-1])
            self.values[index] = v.new_zeros(self.batch, v.shape[1], self.max_len, v.shape[-1])
        self.keys[index].index_copy_(2, self.positions, k)
        self.values[index].index_copy_(2, self.positions, v)
        return self.keys[index], self.values[index]


class GraphedDecoder:
    """Greedy decoding of a dense `model` with a static cache; on CUDA each decode step is one graph replay."""

    def __init__(self, model: nn.Module, batch: int, max_len: int) -> None:
        if any(type(m).__name__ == "MoE" for m in model.modules()):
            raise ValueError("GraphedDecoder decodes dense models: an MoE layer's routing has data-dependent shapes")
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.cache = StaticKVCache(batch, max_len, self.device)
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self.position = torch.zeros(1, dtype=torch.long, device=self.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def _step(self) -> torch.Tensor:
        self.cache.positions = self.position
        return self.model(self.token, self.position, self.cache)[:, -1]

    @torch.no_grad()
    def _capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up on a side stream, as capture requires
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._step()

    @torch.no_grad()
    def decode(self, token: torch.Tensor, position: int) -> torch.Tensor:
        """The logits (batch, vocab) after `token` (batch, 1) at `position`, its key and value now cached."""
        self.token.copy_(token)
        self.position.fill_(position)
        if self.device.type != "cuda":
            return self._step()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.logits

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, max_tokens: int) -> torch.Tensor:
        """Greedy continuation of `prompts` (batch, T) by `max_tokens` tokens: an eager prefill, then one decode
        step (a graph replay on CUDA) per token."""
        T = prompts.shape[1]
        if T + max_tokens > self.cache.max_len:
            raise ValueError(f"{T} prompt + {max_tokens} new tokens exceed the cache's max_len={self.cache.max_len}")
        self.cache.positions = torch.arange(T, device=self.device)
        token = self.model(prompts, self.cache.positions, self.cache)[:, -1].argmax(-1, keepdim=True)
        new = [token]
        for i in range(max_tokens - 1):
            token = self.decode(token, T + i).argmax(-1, keepdim=True)
            new.append(token)
        return torch.cat(new, dim=1)
