"""Batch-1 decode near the memory roofline: a static KV cache and one CUDA graph per decode step (gpt-fast's way).

A decode step of a dense model reads every weight once and does ~2 FLOPs per weight: it is memory-bound, and its
floor is bytes / HBM bandwidth (2.5 GB of bf16 weights: 0.5 ms on an H200). Eager PyTorch does not get near it
at batch 1: the host launches some 50 small kernels per layer, each a few microseconds of Python and driver
work, and the GPU waits between them (chapter 11's benchmark: 4-14% of the bandwidth).

A CUDA graph records the step's kernels once and replays them with one launch. Recording needs a step whose
shapes and addresses never change, so the cache must not grow:

- `StaticKVCache` holds max_len positions from the start, writes the new keys and values at the positions given
  as a *tensor* (`index_copy_`), and attends over its first `span` slots with a mask by position — the same result
  as `kv_cache.KVCache`'s growing slices, at a shape fixed for as long as `span` is;
- `GraphedDecoder` captures `model(token, position, cache)` for one token into a graph whose inputs are copied
  into fixed buffers before each replay — one graph per *length bucket*: a step at position p attends over the
  first ceil((p + 1) / bucket) · bucket slots, not all max_len.

Why buckets of a fixed 256 slots rather than powers of two: a graph can only read the span it was captured with,
so every slot between the sequence's length and the bucket's end is read for nothing. Power-of-two buckets waste
up to half of what they read — at a 32k context, up to 16k tokens of keys and values (0.5 GiB for Llama 3.2 1B,
32 KiB a token, a fifth of its weights) on every step, exactly where the cache's bytes matter. A fixed step wastes
at most 255 slots (8 MiB for that model) whatever the length; it costs more graphs (max_len / 256, each captured
on first use and sharing one memory pool, a few MB of activations at batch 1), a price paid once.
Reading every max_len slot under a mask, as gpt-fast's static cache does (its model.py, `KVCache` and
`Attention.forward`), makes a step at position 100 of a 32k cache read over 300 times the keys it needs.

On a CPU there is no graph: the same static cache runs eagerly, each step reading exactly the filled positions
(bucket 1), or the buckets it is given (the tests check both equal the growing cache).

`CompiledDecoder` is the other way to the same end, gpt-fast's (generate.py, `decode_one_token` under
`torch.compile(mode="reduce-overhead", fullgraph=True)`): Inductor fuses the step's elementwise ops and captures
it in a CUDA graph itself, over the static cache at its full max_len span (one shape, one graph) — the
comparison the GPU lane records beside `GraphedDecoder`.
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
        span = self.cache.span
        keys, values = keys[:, :, :span], values[:, :, :span]                # a view: nothing past span is read
        mask = torch.arange(span, device=q.device)[None, :] <= self.cache.positions[:, None]  # (T, span)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                              enable_gqa=keys.shape[1] != q.shape[1])


class StaticKVCache:
    """max_len positions per layer, allocated at the first forward; `positions` (T,) says where the tokens of the
    next forward go (a tensor: a captured graph reads it from the same address every replay); `span` (a Python
    int, part of a graph's shape) how many slots from 0 its attention reads — at least max(positions) + 1."""

    def __init__(self, batch: int, max_len: int, device: torch.device | str) -> None:
        self.batch, self.max_len, self.span = batch, max_len, max_len
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


BUCKET = 256  # slots per length bucket of a captured decode step (see the module docstring)


class GraphedDecoder:
    """Greedy decoding of a dense `model` with a static cache; on CUDA each decode step is one graph replay.

    `bucket`: a decode step at position p attends over the first ceil((p + 1) / bucket) · bucket slots (capped at
    max_len); None means BUCKET on CUDA, where each bucket is one captured graph, and 1 elsewhere (eager: exactly
    the filled positions)."""

    def __init__(self, model: nn.Module, batch: int, max_len: int, bucket: int | None = None) -> None:
        if any(type(m).__name__ == "MoE" for m in model.modules()):
            raise ValueError("GraphedDecoder decodes dense models: an MoE layer's routing has data-dependent shapes")
        if bucket is not None and (not isinstance(bucket, int) or bucket < 1):
            raise ValueError(f"bucket={bucket!r}: expected an int >= 1 (slots per length bucket) or None")
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.bucket = bucket if bucket is not None else BUCKET if self.device.type == "cuda" else 1
        self.cache = StaticKVCache(batch, max_len, self.device)
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self.position = torch.zeros(1, dtype=torch.long, device=self.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # span -> (graph, its logits)

    def span(self, position: int) -> int:
        """Slots a decode step at `position` reads: the end of its length bucket, at most max_len."""
        return min(-(-(position + 1) // self.bucket) * self.bucket, self.cache.max_len)

    def _step(self) -> torch.Tensor:
        self.cache.positions = self.position
        return self.model(self.token, self.position, self.cache)[:, -1]

    @torch.no_grad()
    def _capture(self) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """A graph of one decode step at the cache's current span. The warm-up steps write the same key and value
        at the same position as the replay will, so they change nothing. Every bucket's graph allocates from the
        first one's memory pool: they never run at once, and a step's logits are read before the next step."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up on a side stream, as capture requires
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        pool = next(iter(self.graphs.values()))[0].pool() if self.graphs else None
        with torch.cuda.graph(graph, pool=pool):
            logits = self._step()
        return graph, logits

    @torch.no_grad()
    def decode(self, token: torch.Tensor, position: int) -> torch.Tensor:
        """The logits (batch, vocab) after `token` (batch, 1) at `position`, its key and value now cached; on CUDA
        a buffer of the bucket's graph, valid until the next decode."""
        self.token.copy_(token)
        self.position.fill_(position)
        self.cache.span = self.span(position)
        if self.device.type != "cuda":
            return self._step()
        if self.cache.span not in self.graphs:
            self.graphs[self.cache.span] = self._capture()
        graph, logits = self.graphs[self.cache.span]
        graph.replay()
        return logits

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, max_tokens: int) -> torch.Tensor:
        """Greedy continuation of `prompts` (batch, T) by `max_tokens` tokens: an eager prefill, then one decode
        step (a graph replay on CUDA) per token."""
        T = prompts.shape[1]
        if T + max_tokens > self.cache.max_len:
            raise ValueError(f"{T} prompt + {max_tokens} new tokens exceed the cache's max_len={self.cache.max_len}")
        self.cache.positions, self.cache.span = torch.arange(T, device=self.device), T
        token = self.model(prompts, self.cache.positions, self.cache)[:, -1].argmax(-1, keepdim=True)
        new = [token]
        for i in range(max_tokens - 1):
            token = self.decode(token, T + i).argmax(-1, keepdim=True)
            new.append(token)
        return torch.cat(new, dim=1)


class CompiledDecoder:
    """Greedy decoding with one `torch.compile`d decode step over the whole static cache (gpt-fast's method).

    `compile_options` go to torch.compile; the default, {"mode": "reduce-overhead"}, fuses and captures a CUDA
    graph on a GPU (a CPU test passes {"backend": "eager"}: it checks that the step traces as one graph). The
    cache and the token and position buffers are marked static, so that the graph reads and writes them in place
    (HF transformers marks its StaticCache the same way) instead of copying them in on every replay."""

    def __init__(self, model: nn.Module, batch: int, max_len: int, **compile_options: object) -> None:
        if any(type(m).__name__ == "MoE" for m in model.modules()):
            raise ValueError("CompiledDecoder decodes dense models: an MoE layer's routing has data-dependent shapes")
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.cache = StaticKVCache(batch, max_len, self.device)
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self.position = torch.zeros(1, dtype=torch.long, device=self.device)
        self.step = torch.compile(self._step, fullgraph=True, **(compile_options or {"mode": "reduce-overhead"}))

    def _step(self) -> torch.Tensor:
        return self.model(self.token, self.position, self.cache)[:, -1]

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, max_tokens: int) -> torch.Tensor:
        """Greedy continuation of `prompts` (batch, T) by `max_tokens` tokens: an eager prefill (which allocates
        the cache), then the compiled step once per token."""
        T = prompts.shape[1]
        if T + max_tokens > self.cache.max_len:
            raise ValueError(f"{T} prompt + {max_tokens} new tokens exceed the cache's max_len={self.cache.max_len}")
        self.cache.positions, self.cache.span = torch.arange(T, device=self.device), T
        token = self.model(prompts, self.cache.positions, self.cache)[:, -1].argmax(-1, keepdim=True)
        for t in (*self.cache.keys.values(), *self.cache.values.values(), self.token, self.position):
            torch._dynamo.mark_static_address(t)
        self.cache.positions, self.cache.span = self.position, self.cache.max_len
        new = [token]
        for i in range(max_tokens - 1):
            self.token.copy_(token)
            self.position.fill_(T + i)
            token = self.step().argmax(-1, keepdim=True)
            new.append(token)
        return torch.cat(new, dim=1)
