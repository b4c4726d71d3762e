"""Synthetic, learnable token streams: no downloads, deterministic by seed, resumable.

The text is a sparse Markov chain: each token has `branching` possible successors (picked by a hash of
the token), chosen with fixed Zipf-like probabilities. A tiny model learns it within tens of steps, so
the loss visibly falls from ln(vocab) towards a floor that is known exactly: the entropy of the
successor distribution (`SyntheticTokens.loss_floor`). A learner can see how far from optimal a run
is — something a downloaded corpus cannot tell.

Batch k is generated from (seed, k) alone, so the stream can resume anywhere from `state_dict()`, and
every data-parallel rank can build the same global batch and keep only its own rows.
"""

from __future__ import annotations

import math

import torch

_MASK = (1 << 31) - 1


def _mix(token: torch.Tensor, seed: int) -> torch.Tensor:
    """A cheap integer hash of token ids (int64, kept below 2^31 so products never overflow)."""
    x = (token * 0x9E3779B1 + seed * 0x27D4EB2F) & _MASK
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _MASK
    x = ((x ^ (x >> 12)) * 0x297A2D39) & _MASK
    return x ^ (x >> 15)


def successor_probs(branching: int) -> torch.Tensor:
    """Probabilities of the `branching` successors: proportional to 1, 1/2, 1/3, ... (Zipf-like)."""
    weights = 1.0 / torch.arange(1, branching + 1, dtype=torch.float64)
    return weights / weights.sum()


class SyntheticTokens:
    """An endless stream of global batches of (inputs, targets), each (global_batch, seq_len) int64.

    `targets` are `inputs` shifted by one, as in language-model pre-training.
    """

    def __init__(self, vocab_size: int, seq_len: int, global_batch: int, seed: int = 0,
                 branching: int = 4) -> None:
        for name, value, low in (("vocab_size", vocab_size, 2), ("seq_len", seq_len, 1),
                                 ("global_batch", global_batch, 1), ("branching", branching, 1)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r} must be an integer >= {low}")
        if branching > vocab_size:
            raise ValueError(f"branching={branching} must be <= vocab_size={vocab_size}")
        self.vocab_size, self.seq_len, self.global_batch = vocab_size, seq_len, global_batch
        self.seed, self.branching = seed, branching
        self.step = 0
        self._cumulative = successor_probs(branching).cumsum(0)
        # successor j of a context is hash + j*stride (mod vocab): distinct for j < branching because
        # stride is coprime with vocab_size
        self._stride = next(s for s in range(vocab_size // 2 + 1, 2 * vocab_size)
                            if math.gcd(s, vocab_size) == 1)

    @property
    def loss_floor(self) -> float:
        """The best achievable mean cross-entropy (nats/token) on every target after the first token."""
        p = successor_probs(self.branching)
        return float(-(p * p.log()).sum())

    def successors(self, tokens: torch.Tensor) -> torch.Tensor:
        """The `branching` possible next tokens of each of `tokens`, (..., branching), the most likely first: what
        a model that learnt the stream should predict (a greedy continuation follows successor 0 every time)."""
        offsets = torch.arange(self.branching, device=tokens.device) * self._stride
        return (_mix(tokens, self.seed)[..., None] + offsets) % self.vocab_size

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch number `index`, independent of any state."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        n, total = self.global_batch, self.seq_len + 1
        tokens = torch.empty(n, total, dtype=torch.int64)
        tokens[:, 0] = torch.randint(0, self.vocab_size, (n,), generator=generator)
        choices = torch.searchsorted(self._cumulative, torch.rand(n, total, generator=generator, dtype=torch.float64))
        choices.clamp_(max=self.branching - 1)
        for t in range(1, total):
            tokens[:, t] = self.successors(tokens[:, t - 1]).gather(1, choices[:, t:t + 1]).squeeze(1)
        return tokens[:, :-1].clone(), tokens[:, 1:].clone()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch(self.step)
        self.step += 1
        return batch

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"state seed={state['seed']} does not match this stream's seed={self.seed}")
        self.step = int(state["step"])


def shard_rows(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """The contiguous block of rows that data-parallel rank `rank` of `world` trains on."""
    if batch.shape[0] % world:
        raise ValueError(f"world={world} must divide the global batch of {batch.shape[0]} rows")
    rows = batch.shape[0] // world
    return batch[rank * rows:(rank + 1) * rows]
