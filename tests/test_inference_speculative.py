"""lab.inference.speculative: speculative decoding and its exact rejection sampler (issue 20).

Three tiers, as vLLM tests its rejection sampler (tests/v1/sample/test_rejection_sampler.py): greedy outputs equal
to the target's own greedy decoding, bit for bit, whatever the draft; the sampler's tokens distributed as the
target's, whatever the draft; seeded determinism, and acceptance counts that follow Leviathan et al. (2023), eq. 1.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from test_model import SMALL_VARIANTS

import lab.inference.speculative as speculative
from lab.inference.kv_cache import generate
from lab.inference.sampling import SamplingParams, filtered_probabilities
from lab.inference.speculative import (
    acceptance_histogram,
    acceptance_rate,
    draw,
    expected_tokens_per_round,
    rejection_sample,
    speculative_generate,
)
from lab.model import build_model, materialize

CFG = SMALL_VARIANTS["gqa"]  # vocab 64, 3 layers
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def models():
    """The target, and three drafts: the target itself (accepts everything), its first layer (the weights are
    initialised by name, so it shares the target's embedding, layer 0 and output: it agrees often), and a one-layer
    model of another seed (agrees rarely)."""
    one_layer = dataclasses.replace(CFG, n_layers=1)
    target = materialize(build_model(CFG), seed=0).eval()
    return {"target": target, "same": target, "shallow": materialize(build_model(one_layer), seed=0).eval(),
            "other": materialize(build_model(one_layer), seed=1).eval()}


def _prompt(length: int) -> torch.Tensor:
    """The first `length` tokens of one fixed random prompt (1, 7)."""
    return torch.randint(0, CFG.vocab_size, (1, 7), generator=torch.Generator().manual_seed(0))[:, :length]


# --- tier 1: greedy is exact -------------------------------------------------------------------------------------

@pytest.mark.parametrize("draft, k, prompt_len", [
    ("same", 1, 7), ("same", 4, 7), ("shallow", 1, 7), ("shallow", 3, 1), ("shallow", 5, 7), ("other", 3, 7)])
def test_greedy_speculative_output_is_the_targets_greedy_output(models, draft, k, prompt_len):
    """Fails when a cache is not rolled back after a rejection, the draft's cache misses the tokens of a round that
    accepted all k, or the target's distributions are taken one position off."""
    prompt, params = _prompt(prompt_len), SamplingParams(max_tokens=MAX_TOKENS)
    result = speculative_generate(models["target"], models[draft], prompt[0] if prompt_len == 1 else prompt, params, k)
    assert result.tokens == generate(models["target"], prompt, params)[0].tolist()
    rounds = len(result.accepted)
    assert result.target_forwards == rounds and result.draft_forwards == k * rounds
    assert sum(result.acceptance_histogram) == rounds and sum(n + 1 for n in result.accepted) >= MAX_TOKENS
    if draft == "same":  # every proposal is the target's own argmax: k + 1 tokens a round
        assert result.accepted == [k] * math.ceil(MAX_TOKENS / (k + 1)), result.accepted
        assert result.tokens_per_round == k + 1
    if draft == "shallow":  # both paths taken: full acceptance and rejection
        assert min(result.accepted) < k and max(result.accepted) > 0, result.accepted
    if draft == "other":
        assert 0 in result.accepted


def test_a_stop_token_ends_the_output(models):
    """The stop token is kept, and the tokens its round accepted after it are dropped."""
    params = SamplingParams(max_tokens=MAX_TOKENS)
    reference = generate(models["target"], _prompt(7), params)[0].tolist()
    stop = reference[3]
    result = speculative_generate(models["target"], models["shallow"], _prompt(7),
                                  dataclasses.replace(params, stop_token_ids=(stop,)), 3)
    assert result.tokens == reference[:reference.index(stop) + 1]
    assert sum(n + 1 for n in result.accepted) > len(result.tokens)  # the stop came mid-round: the rest is cut


def _one_hot(tokens: list[int], vocab: int = 6) -> torch.Tensor:
    return F.one_hot(torch.tensor(tokens), vocab).float()


def test_greedy_acceptance_is_the_longest_matching_prefix_then_the_targets_token():
    """One-hot distributions at the argmaxes: the rule reduces to greedy verification. The bonus token must come
    from the target's last distribution, not the draft's."""
    g, proposals = torch.Generator().manual_seed(0), [2, 3, 1]
    assert rejection_sample(proposals, _one_hot(proposals), _one_hot([2, 3, 1, 5]), g) == ([2, 3, 1, 5], 3)
    assert rejection_sample(proposals, _one_hot(proposals), _one_hot([2, 3, 4, 5]), g) == ([2, 3, 4], 2)
    assert rejection_sample(proposals, _one_hot(proposals), _one_hot([0, 3, 1, 5]), g) == ([0], 0)


# --- tier 2: the sampler's tokens follow the target ----------------------------------------------------------------

P1 = torch.tensor([0.10, 0.20, 0.30, 0.35, 0.05])  # the target at the proposal's position
P2 = torch.tensor([0.40, 0.05, 0.10, 0.15, 0.30])  # the target after it (the bonus token's distribution)
Q = torch.tensor([0.50, 0.30, 0.10, 0.05, 0.05])  # a bad draft: most of its mass where the target has little


def _assert_within_4_sigma(tokens: list[int], probs: torch.Tensor) -> None:
    n, probs = len(tokens), probs.double()
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).double()
    sd = (n * probs * (1 - probs)).sqrt()
    assert ((counts - n * probs).abs() <= 4 * sd + 1e-9).all(), (counts, n * probs)


def test_the_rejection_sampler_emits_the_targets_distribution_whatever_the_draft():
    """8,000 rounds of one proposal drawn from a bad draft: the first token is distributed as the target's p1 (each
    token's count within 4 standard deviations), the bonus token after an acceptance as p2, and a proposal is
    accepted with probability α = Σ min(p1, q) = 0.5. Fails without the residual's renormalisation, without the
    min in min(1, p/q), or with the bonus drawn from the draft."""
    g, n = torch.Generator().manual_seed(0), 8000
    proposals = torch.multinomial(Q, n, replacement=True, generator=g).tolist()
    rounds = [rejection_sample([x], Q[None], torch.stack([P1, P2]), g) for x in proposals]
    _assert_within_4_sigma([tokens[0] for tokens, _ in rounds], P1)
    _assert_within_4_sigma([tokens[1] for tokens, accepted in rounds if accepted], P2)
    accepted = sum(a for _, a in rounds)
    assert acceptance_rate(P1, Q) == pytest.approx(0.5)
    assert abs(accepted - n * 0.5) <= 4 * math.sqrt(n * 0.25)


def test_a_draft_equal_to_the_target_is_always_accepted():
    g, k = torch.Generator().manual_seed(1), 4
    for _ in range(50):
        p = torch.rand(k + 1, 8, generator=g).softmax(-1)
        proposals = [draw(row, g) for row in p[:k]]
        tokens, accepted = rejection_sample(proposals, p[:k], p, g)
        assert accepted == k and tokens[:k] == proposals


def test_sampled_rounds_hand_the_sampler_each_models_distribution_at_the_right_position(models, monkeypatch):
    """The sampled path's plumbing: in every round, the distributions given to the rejection sampler equal the
    filtered distributions of the target and of the draft recomputed without a cache, at the prefix plus the
    proposals before each position. Fails on a cache not rolled back or a distribution one position off."""
    calls = []

    def recording(proposals, draft_probs, target_probs, generator):
        out = rejection_sample(proposals, draft_probs, target_probs, generator)
        calls.append((proposals, draft_probs, target_probs, out[0]))
        return out

    monkeypatch.setattr(speculative, "rejection_sample", recording)
    params, k, prompt = SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=5), 3, _prompt(5)
    result = speculative_generate(models["target"], models["other"], prompt, params, k)
    assert min(result.accepted) < k  # a rejection happened: later rounds run on rolled-back caches
    prefix = prompt[0].tolist()
    with torch.no_grad():
        for proposals, draft_probs, target_probs, emitted in calls:
            for i in range(k + 1):
                context = torch.tensor([prefix + proposals[:i]])
                expected = filtered_probabilities(models["target"](context)[0, -1], params)
                torch.testing.assert_close(target_probs[i], expected, rtol=1e-4, atol=1e-6)
                if i < k:
                    expected = filtered_probabilities(models["other"](context)[0, -1], params)
                    torch.testing.assert_close(draft_probs[i], expected, rtol=1e-4, atol=1e-6)
            prefix += emitted
    assert result.tokens == prefix[5:5 + params.max_tokens]


# --- tier 3: seeded determinism and the acceptance law ------------------------------------------------------------

def test_the_same_seed_gives_the_same_tokens_and_another_seed_others(models):
    def run(seed: int):
        params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=seed)
        return speculative_generate(models["target"], models["other"], _prompt(7), params, 3)

    a, b, c = run(3), run(3), run(4)
    assert a.tokens == b.tokens and a.accepted == b.accepted
    assert a.tokens != c.tokens


def test_the_acceptance_histogram_follows_the_closed_form():
    """i.i.d. positions with α = Σ min(p, q) = 0.5 and k = 4: a round accepts n < k proposals with probability
    α^n (1 - α) and all k with α^k, and yields E = (1 - α^(k+1)) / (1 - α) = 1.9375 tokens on average (Leviathan
    et al. 2023, eq. 1). 8,000 rounds, each count and the mean within 4 standard deviations."""
    p, q, k, n = torch.tensor([0.4, 0.3, 0.2, 0.1]), torch.tensor([0.1, 0.1, 0.4, 0.4]), 4, 8000
    alpha = acceptance_rate(p, q)
    assert alpha == pytest.approx(0.5) and expected_tokens_per_round(alpha, k) == pytest.approx(1.9375)
    assert expected_tokens_per_round(1.0, k) == k + 1 and expected_tokens_per_round(0.0, k) == 1
    g = torch.Generator().manual_seed(2)
    proposals = torch.multinomial(q, n * k, replacement=True, generator=g).view(n, k).tolist()
    accepted = [rejection_sample(row, q.expand(k, -1), p.expand(k + 1, -1), g)[1] for row in proposals]
    law = torch.tensor([alpha ** m * (1 - alpha) for m in range(k)] + [alpha ** k], dtype=torch.float64)
    _assert_within_4_sigma(accepted, law)
    assert acceptance_histogram(accepted, k) == torch.bincount(torch.tensor(accepted), minlength=k + 1).tolist()
    tokens = torch.arange(1, k + 2, dtype=torch.float64)  # a round that accepts m yields m + 1 tokens
    mean, sd = float(law @ tokens), math.sqrt(float(law @ tokens ** 2) - float(law @ tokens) ** 2)
    assert mean == pytest.approx(expected_tokens_per_round(alpha, k))
    assert abs(sum(a + 1 for a in accepted) / n - mean) <= 4 * sd / math.sqrt(n)


# --- bad input -----------------------------------------------------------------------------------------------------

def test_bad_input_is_one_line(models):
    target, params = models["target"], SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="num_speculative=0 must be an integer >= 1"):
        speculative_generate(target, target, _prompt(3), params, 0)
    small_vocab = materialize(build_model(dataclasses.replace(CFG, vocab_size=32, n_layers=1)), seed=0)
    with pytest.raises(ValueError, match=r"the draft's vocabulary \(32 tokens\) differs from the target's \(64\)"):
        speculative_generate(target, small_vocab, _prompt(3), params)
    with pytest.raises(ValueError, match=r"prompt must be \(length >= 1,\) or \(1, length\) token ids, got shape "
                                         r"\(2, 3\)"):
        speculative_generate(target, target, torch.zeros(2, 3, dtype=torch.long), params)
    with pytest.raises(ValueError, match=r"2 proposals need draft_probs \(k, vocab\) and target_probs \(k \+ 1, "
                                         r"vocab\), got \(2, 5\) and \(2, 5\)"):
        rejection_sample([0, 1], Q.expand(2, -1), Q.expand(2, -1))
    with pytest.raises(ValueError, match="probabilities sum to 0.5000, not 1: renormalise them before drawing"):
        draw(Q / 2)
