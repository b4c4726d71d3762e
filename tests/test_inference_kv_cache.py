"""lab.inference.kv_cache and sampling, and the model's cache seam (issue 20).

The reference for every cached result is the model without a cache: greedy generation recomputing the whole
sequence for every token, and a prompt's logits from one forward. Each check fails when the mask offset, the write
position, RoPE's positions or MoE's batch independence is wrong.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_model import SMALL_VARIANTS

from lab.inference.kv_cache import KVCache, attend_with_offset, generate
from lab.inference.sampling import SamplingParams, filtered_probabilities, sample
from lab.model import MoE, build_model, causal_attention, materialize

VARIANTS = ["gqa", "moe+shared", "mla"]


def _model(variant: str) -> torch.nn.Module:
    return materialize(build_model(SMALL_VARIANTS[variant]), seed=0).eval()


def _prompts(batch: int = 3, length: int = 7, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_generation_with_the_cache_equals_recomputation(variant):
    model, prompts = _model(variant), _prompts()
    params = SamplingParams(max_tokens=10)
    assert torch.equal(generate(model, prompts, params), generate(model, prompts, params, use_cache=False))


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_prompt_prefilled_in_chunks_gives_the_logits_of_one_forward(variant):
    """Chunked prefill: 3 + 1 + 4 tokens through the cache, each chunk's logits equal to the whole forward's at
    those positions (queries fewer than keys: the mask must be by absolute position)."""
    model, prompts = _model(variant), _prompts(length=8)
    with torch.no_grad():
        whole = model(prompts)
        cache, chunks = KVCache(prompts.shape[0], 8), []
        for lo, hi in ((0, 3), (3, 4), (4, 8)):
            chunks.append(model(prompts[:, lo:hi], torch.arange(lo, hi), cache))
            cache.length = hi
    torch.testing.assert_close(torch.cat(chunks, dim=1), whole, rtol=1e-5, atol=1e-5)


def test_attention_with_offset_zero_is_the_training_core_and_masks_by_position():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g) for _ in range(3))
    torch.testing.assert_close(attend_with_offset(q, k[:, :2], v[:, :2], 0), causal_attention(q, k[:, :2], v[:, :2]))
    # the last query at offset 4 sees all 5 keys: the same as the last row of full causal attention
    last = attend_with_offset(q[:, :, 4:], k, v, 4)
    torch.testing.assert_close(last, causal_attention(q, k, v)[:, :, 4:])
    with pytest.raises(ValueError, match="5 keys for 1 queries at offset 3: expected offset \\+ T = 4"):
        attend_with_offset(q[:, :, 4:], k, v, 3)


def test_the_cache_refuses_to_overflow_and_counts_its_bytes():
    model, prompts = _model("gqa"), _prompts(batch=1, length=4)
    cache = KVCache(1, 4)
    with torch.no_grad():
        model(prompts, torch.arange(4), cache)
    cfg = SMALL_VARIANTS["gqa"]
    assert cache.nbytes == 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4 * 4  # K and V, fp32, 4 positions
    cache.length = 4
    with pytest.raises(ValueError, match="the cache holds 4 positions; writing up to 5"), torch.no_grad():
        model(prompts[:, :1], torch.arange(4, 5), cache)


def test_moe_in_eval_mode_routes_each_token_alone():
    """No balancing losses and no capacity limit at inference: a token's output does not depend on its batch."""
    cfg = SMALL_VARIANTS["moe+shared"]
    model = materialize(build_model(cfg.__class__(**{**cfg.__dict__, "capacity_factor": 1.0})), seed=0)
    prompts = _prompts(batch=4)
    with torch.no_grad():
        model.train()
        model(prompts)
        moes = [m for m in model.modules() if isinstance(m, MoE)]
        assert all(m.aux_loss is not None for m in moes) and sum(m.dropped for m in moes) > 0
        model.eval()
        alone, together = model(prompts[:1]), model(prompts)[:1]
        assert all(m.aux_loss is None and m.dropped == 0 for m in moes)
    torch.testing.assert_close(alone, together, rtol=1e-5, atol=1e-6)


def test_seeded_sampling_is_deterministic_and_greedy_ignores_the_seed():
    model, prompts = _model("gqa"), _prompts()
    sampled = SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=3)
    a, b = generate(model, prompts, sampled), generate(model, prompts, sampled)
    assert torch.equal(a, b) and not torch.equal(a, generate(model, prompts, SamplingParams(
        max_tokens=12, temperature=1.0, top_k=20, seed=4)))
    assert torch.equal(generate(model, prompts, SamplingParams(max_tokens=5, seed=1)),
                       generate(model, prompts, SamplingParams(max_tokens=5, seed=2)))


def test_top_k_and_top_p_keep_what_they_should():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    top2 = filtered_probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (top2[2:] == 0).all() and torch.allclose(top2[:2], logits[:2].softmax(-1))
    # softmax: 0.61, 0.22, 0.14, 0.03 -> top-p 0.7 keeps the first two (0.61 < 0.7, 0.83 >= 0.7)
    assert filtered_probabilities(logits, SamplingParams(temperature=1.0, top_p=0.7)).nonzero().flatten().tolist() \
        == [0, 1]
    assert filtered_probabilities(logits, SamplingParams(temperature=1.0, top_p=0.5)).nonzero().flatten().tolist() \
        == [0]  # the most likely token always stays
    cold = filtered_probabilities(logits, SamplingParams(temperature=0.1))
    assert cold[0] > 0.9999


def test_sampling_follows_the_filtered_distribution():
    """20,000 draws: each token's frequency within 4 standard deviations of its probability."""
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -3.0])
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=0)
    probs, g, n = filtered_probabilities(logits, params), params.generator(), 20_000
    counts = torch.bincount(torch.tensor([sample(logits, params, g) for _ in range(n)]), minlength=5).double()
    sd = (n * probs.double() * (1 - probs.double())).sqrt()
    assert ((counts - n * probs.double()).abs() <= 4 * sd + 1e-9).all(), (counts, n * probs)
    assert counts[-1] == 0  # cut by top-p


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens=0 must be an integer >= 1"),
    ({"temperature": -1.0}, "temperature=-1.0 must be >= 0"),
    ({"top_k": -2}, "top_k=-2 must be an integer >= 0"),
    ({"top_p": 0.0}, r"top_p=0.0 must be in \(0, 1\]"),
])
def test_bad_sampling_params_are_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("variant", ["gqa", "tied", "mla-no-q-lora"])
def test_the_static_cache_of_cuda_graph_decoding_gives_the_same_tokens(variant):
    """GraphedDecoder's static cache (max_len slots, a mask by position tensor) against the growing cache;
    on a CPU it runs eagerly, on CUDA each decode step is a graph replay (benchmarks/serving.py's GPU lane)."""
    from lab.inference.cuda_graph import GraphedDecoder

    model, prompts = _model(variant), _prompts()
    decoder = GraphedDecoder(model, prompts.shape[0], max_len=32)
    assert torch.equal(decoder.generate(prompts, 10), generate(model, prompts, SamplingParams(max_tokens=10)))
    with pytest.raises(ValueError, match="7 prompt \\+ 30 new tokens exceed the cache's max_len=32"):
        decoder.generate(prompts, 30)
    with pytest.raises(ValueError, match="dense models"):
        GraphedDecoder(_model("moe+shared"), 1, 8)


def _key_lengths(monkeypatch, run) -> tuple[list[int], list[int]]:
    """Run `run()` with a spy on the attention call: the key length and the K+V bytes each call is given."""
    lengths, nbytes = [], []
    attention = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        lengths.append(k.shape[-2])
        nbytes.append(k.numel() * k.element_size() + v.numel() * v.element_size())
        return attention(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    run()
    return lengths, nbytes


@pytest.mark.parametrize("bucket", [None, 8])
def test_a_static_decode_step_reads_the_filled_slots_or_its_bucket_not_max_len(monkeypatch, bucket):
    """Issue 36: the static cache reads keys and values up to the current length (eagerly, bucket 1) or to the end
    of the length bucket a graph was captured for — bytes per step grow with the sequence, not with max_len — and
    the tokens stay those of the growing cache."""
    from lab.inference.cuda_graph import GraphedDecoder

    model, prompts = _model("gqa"), _prompts(batch=1)
    T, new, max_len = prompts.shape[1], 10, 256
    expected = generate(model, prompts, SamplingParams(max_tokens=new))
    decoder = GraphedDecoder(model, 1, max_len, bucket=bucket)
    tokens = []
    lengths, nbytes = _key_lengths(monkeypatch, lambda: tokens.append(decoder.generate(prompts, new)))
    assert torch.equal(tokens[0], expected)
    layers = len(lengths) // new                                          # one prefill, new - 1 decode steps
    step = bucket or 1
    spans = [T] + [-(-(p + 1) // step) * step for p in range(T, T + new - 1)]
    assert lengths == [s for s in spans for _ in range(layers)]
    assert spans[1:] == ([8, 16, 16, 16, 16, 16, 16, 16, 16] if bucket else list(range(T + 1, T + new)))
    per_slot = nbytes[0] // T                                             # K and V of one position, all heads
    assert nbytes == [s * per_slot for s in lengths] and max(nbytes) * 16 <= max_len * per_slot


def test_the_compiled_decode_step_traces_as_one_graph_and_gives_the_same_tokens():
    """CompiledDecoder (gpt-fast's torch.compile'd step over the full static cache): dynamo's eager backend checks on
    a CPU that the step is one graph (fullgraph=True raises at a break), without Inductor's C++ build."""
    import torch._dynamo

    from lab.inference.cuda_graph import CompiledDecoder

    one_layer = dataclasses.replace(SMALL_VARIANTS["gqa"], n_layers=1)  # tracing costs ~0.45 s a layer
    model, prompts = materialize(build_model(one_layer), seed=0).eval(), _prompts(batch=1)
    torch._dynamo.reset()
    decoder = CompiledDecoder(model, 1, max_len=24, backend="eager")
    expected = generate(model, prompts, SamplingParams(max_tokens=8))
    assert torch.equal(decoder.generate(prompts, 8), expected)
    assert torch.equal(decoder.generate(prompts, 8), expected)  # a second prompt reuses the step and the cache
    with pytest.raises(ValueError, match="7 prompt \\+ 30 new tokens exceed the cache's max_len=24"):
        decoder.generate(prompts, 30)
