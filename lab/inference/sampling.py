"""Turning the last position's logits into the next token: greedy, temperature, top-k, top-p.

Each request carries its own `SamplingParams`, and its own seeded generator, so that a request's tokens do not
depend on which other requests share its batch (continuous batching changes the batch every step): the same seed
gives the same continuation alone or in any company.

The order of the filters is vLLM's and Hugging Face's: temperature scales the logits, top-k keeps the k largest,
top-p keeps the smallest set of the most likely tokens whose probabilities sum to at least p, and the token is
drawn from what is left, renormalised. Temperature 0 is greedy (argmax), whatever the other knobs say.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. `max_tokens`: tokens to generate at most; `stop_token_ids`: tokens that end the
    request (the stop token is kept in the output); `seed`: the request's own random stream (None: unseeded)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1: no top-p filter
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature!r} must be >= 0 (0: greedy)")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= 0 (0: no top-k filter)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1] (1: no top-p filter)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """A fresh generator for this request (None when unseeded or greedy)."""
        if self.seed is None or self.greedy:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


def filtered_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled token is drawn from, (..., vocab): softmax(logits / T) with the top-k and top-p
    filters applied and renormalised. The speculative decoder's rejection sampler needs these probabilities."""
    logits = logits.float() / max(params.temperature, 1e-6)
    if params.top_k:
        kth = logits.topk(min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the tokens more likely than this one
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)  # the most likely one always stays
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs / probs.sum(dim=-1, keepdim=True)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """One token from one position's logits (vocab,)."""
    if logits.dim() != 1:
        raise ValueError(f"sample() takes one position's logits (vocab,), got shape {tuple(logits.shape)}")
    if params.greedy:
        return int(logits.argmax())
    probs = filtered_probabilities(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator))
