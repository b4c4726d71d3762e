"""Speculative decoding: a small draft model guesses k tokens, the target model checks them in one forward.

Decoding one token at a time is memory-bound: every step reads all the target's weights to do two FLOPs per weight,
and the chip mostly waits. A forward over k + 1 tokens reads the same weights once, so while decoding stays
memory-bound it costs about as much as a forward over one (the Scaling Book, chapter 7, appendix D). Speculative
decoding spends that idle compute: a cheap draft model proposes k tokens, one forward each; the target scores all of
them in a single forward; a rejection sampler keeps a prefix of the proposals and adds one token of the target's
own. A round yields between 1 and k + 1 tokens for one forward of the target.

The rejection sampler (Leviathan et al. 2023, Chen et al. 2023) makes this exact: whatever the draft, the tokens
are distributed as if the target had sampled them alone. With p the target's distribution and q the draft's at one
position, the draft's token x is accepted with probability min(1, p(x) / q(x)); at the first rejection the token is
drawn from the residual max(0, p - q), renormalised; if all k are accepted, the target's distribution after the last
proposal gives one bonus token. Why it is exact: a token x comes out either as an accepted proposal, with
probability q(x) · min(1, p(x)/q(x)) = min(p(x), q(x)), or from the residual after a rejection, with probability
(1 - α) · max(0, p(x) - q(x)) / (1 - α), where α = Σ min(p, q) is the chance of accepting; the sum is p(x).

If each proposal is accepted with probability α independently, a round yields (1 - α^(k+1)) / (1 - α) tokens on
average (Leviathan et al. 2023, eq. 1): `expected_tokens_per_round`.

Greedy decoding is the case where p and q are one-hot at the two models' argmaxes: a proposal is accepted exactly
when it is the target's argmax, and the residual is one-hot at the target's argmax. The same code then gives, bit for
bit, the target's own greedy output, whatever the draft; a good draft only makes it faster.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lab.inference.kv_cache import KVCache
from lab.inference.sampling import SamplingParams, filtered_probabilities
from lab.model import Transformer


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token from a distribution (vocab,) that must sum to 1. `torch.multinomial` alone would take any
    non-negative weights and normalise them itself, hiding a forgotten renormalisation; here it is an error."""
    total = float(probs.sum())
    if abs(total - 1) > 1e-3:
        raise ValueError(f"probabilities sum to {total:.4f}, not 1: renormalise them before drawing")
    return int(torch.multinomial(probs, 1, generator=generator))


def rejection_sample(draft_tokens: list[int] | torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """The exact acceptance rule: keep a prefix of the draft's k proposals, then add one token of the target's.

    draft_tokens (k,): the proposals, each drawn from its row of draft_probs (k, vocab), the draft's distributions;
    target_probs (k + 1, vocab): the target's distributions at the same k positions and at the one after the last
    proposal. Returns (tokens to append, num_accepted): the first num_accepted proposals, then a token drawn from
    the residual at the first rejection, or the bonus token when all k were accepted. The tokens follow the target's
    distributions whatever the draft; the draft only decides how many come out per round."""
    draft_tokens = torch.as_tensor(draft_tokens).tolist()
    k = len(draft_tokens)
    if draft_probs.shape[0] != k or target_probs.shape[0] != k + 1 or draft_probs.shape[1:] != target_probs.shape[1:]:
        raise ValueError(f"{k} proposals need draft_probs (k, vocab) and target_probs (k + 1, vocab), got "
                         f"{tuple(draft_probs.shape)} and {tuple(target_probs.shape)}")
    tokens = []
    for i, x in enumerate(draft_tokens):
        p, q = target_probs[i], draft_probs[i]
        if q[x] <= 0:
            raise ValueError(f"proposal {i} (token {x}) has draft probability 0: it cannot have come from the draft")
        # accept x with probability min(1, p(x) / q(x)): always when the target likes x at least as much as the draft
        if torch.bernoulli(torch.clamp(p[x] / q[x], max=1.0), generator=generator):
            tokens.append(x)
            continue
        # rejected: draw from what the target wants more than the draft offered, max(0, p - q), renormalised
        residual = (p - q).clamp(min=0)
        if residual.sum() <= 0:  # p equals q up to rounding: nothing to correct
            residual = p
        tokens.append(draw(residual / residual.sum(), generator))
        return tokens, i
    # all k accepted: the target's distribution after the last proposal is already computed, one token for free
    tokens.append(draw(target_probs[k], generator))
    return tokens, k


def acceptance_rate(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> float:
    """α = Σ min(p, q): the probability that a proposal drawn from q is accepted by a target p."""
    return float(torch.minimum(target_probs, draft_probs).sum())


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """Tokens a round yields on average, accepted proposals plus the target's own, when each of the k proposals is
    accepted with probability alpha independently: 1 + α + ... + α^k = (1 - α^(k+1)) / (1 - α) (Leviathan et al.
    2023, eq. 1)."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha={alpha!r} must be in [0, 1]")
    return float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def acceptance_histogram(accepted: list[int], k: int) -> list[int]:
    """histogram[n]: how many rounds accepted exactly n of their k proposals, n = 0..k."""
    return [accepted.count(n) for n in range(k + 1)]


@dataclass
class SpeculativeResult:
    """What a speculative generation produced and what it cost. `accepted[r]`: proposals accepted in round r
    (0..k); every round runs the target once and the draft k times."""

    num_speculative: int
    tokens: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    target_forwards: int = 0
    draft_forwards: int = 0

    @property
    def acceptance_histogram(self) -> list[int]:
        return acceptance_histogram(self.accepted, self.num_speculative)

    @property
    def tokens_per_round(self) -> float:
        """Mean tokens a round yielded (accepted + 1), before the cut at max_tokens: the closed form's E."""
        return sum(n + 1 for n in self.accepted) / len(self.accepted)


def _forward(model: Transformer, cache: KVCache, tokens: list[int], device: torch.device) -> torch.Tensor:
    """Run `tokens` through `model` after the cache's `length` positions; their logits, (len(tokens), vocab)."""
    positions = torch.arange(cache.length, cache.length + len(tokens), device=device)
    logits = model(torch.tensor([tokens], device=device), positions, cache)[0]
    cache.length += len(tokens)
    return logits


@torch.no_grad()
def speculative_generate(target: Transformer, draft: Transformer, prompt: torch.Tensor, params: SamplingParams,
                         num_speculative: int = 4) -> SpeculativeResult:
    """Continue `prompt` (T,) or (1, T) by `params.max_tokens` tokens of `target`, with `draft` proposing
    `num_speculative` tokens a round. Greedy params give exactly `generate(target, ...)`'s tokens; sampled ones
    follow the target's distribution, reproducibly for a given `params.seed`. A stop token ends the output (kept)."""
    k = num_speculative
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"num_speculative={k!r} must be an integer >= 1")
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        raise ValueError(f"the draft's vocabulary ({draft.cfg.vocab_size} tokens) differs from the target's "
                         f"({target.cfg.vocab_size}): its proposals must be the target's token ids")
    if prompt.dim() == 2 and prompt.shape[0] == 1:
        prompt = prompt[0]
    if prompt.dim() != 1 or prompt.numel() < 1:
        raise ValueError(f"prompt must be (length >= 1,) or (1, length) token ids, got shape {tuple(prompt.shape)}")
    device, vocab = prompt.device, target.cfg.vocab_size

    def distribution(logits: torch.Tensor) -> torch.Tensor:  # greedy: one-hot at the argmax, so every draw is certain
        return F.one_hot(logits.argmax(-1), vocab).float() if params.greedy else filtered_probabilities(logits, params)

    # one stream for the request's randomness: the draft's proposals, the acceptance tests, the residual and bonus
    # draws. Greedy draws are certain; a fixed stream keeps torch's global one untouched.
    generator = torch.Generator(device).manual_seed(0) if params.greedy else params.generator(device)
    was_training = target.training, draft.training
    target.eval()
    draft.eval()
    try:
        sequence = prompt.tolist()
        # a round writes at most k + 1 positions past the last token, and starts before max_tokens are generated
        target_cache = KVCache(1, len(sequence) + params.max_tokens + k)
        draft_cache = KVCache(1, len(sequence) + params.max_tokens + k)
        result = SpeculativeResult(num_speculative=k)
        while len(result.tokens) < params.max_tokens:
            # 1. the draft proposes k tokens, one forward each. Its first forward takes whatever its cache lacks:
            #    the prompt in the first round, the last proposal and the bonus token after a round that took all k.
            proposals, draft_probs, new = [], [], sequence[draft_cache.length:]
            for _ in range(k):
                q = distribution(_forward(draft, draft_cache, new, device)[-1])
                proposals.append(draw(q, generator))
                draft_probs.append(q)
                new = proposals[-1:]
            # 2. the target scores them in one forward, with the tokens its cache lacks (the prompt in the first
            #    round, the last token since): k + 1 distributions, at each proposal and after the last one
            target_logits = _forward(target, target_cache, sequence[target_cache.length:] + proposals, device)
            tokens, num_accepted = rejection_sample(proposals, torch.stack(draft_probs),
                                                    distribution(target_logits[-(k + 1):]), generator)
            # 3. roll the caches back to the tokens that stay: everything but the newest token, whose keys and
            #    values the next round writes (a rejected proposal's are overwritten; `length` is only a counter)
            sequence += tokens
            target_cache.length = len(sequence) - 1
            draft_cache.length = min(draft_cache.length, len(sequence) - 1)
            result.tokens += tokens
            result.accepted.append(num_accepted)
            result.target_forwards += 1
            result.draft_forwards += k
            if any(t in params.stop_token_ids for t in tokens):
                break
        stops = [i for i, t in enumerate(result.tokens) if t in params.stop_token_ids]
        result.tokens = result.tokens[:min([params.max_tokens, *(i + 1 for i in stops)])]
        return result
    finally:
        target.train(was_training[0])
        draft.train(was_training[1])
