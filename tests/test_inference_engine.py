"""lab.inference's engine with the model: the paged cache, continuous batching, prefix caching, preemption, and
`python -m lab serve` (issue 20).

The reference is `generate()` on each prompt alone with the contiguous cache (itself equal to recomputation,
tests/test_inference_kv_cache.py): whatever the engine's budgets — chunked prefill, a cache so small that requests
are preempted and re-prefilled, prefix caching on or off, the requests in another order — each request's greedy
tokens are those. A wrong slot, block table, mask offset or logits row changes them.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_model import SMALL_VARIANTS

from lab.config import load_config
from lab.data import SyntheticTokens
from lab.inference.engine import EngineConfig, LLMEngine
from lab.inference.kv_cache import generate
from lab.inference.sampling import SamplingParams
from lab.inference.sequence import SequenceStatus
from lab.model import build_model, materialize
from lab.serve import follows_stream, main, serve

GREEDY = SamplingParams(max_tokens=8)
BUDGETS = {
    "roomy": EngineConfig(num_blocks=64, block_size=4),
    "chunked": EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=12, max_num_seqs=3),
    "preempting": EngineConfig(num_blocks=12, block_size=4, max_num_batched_tokens=16),
    "no-prefix-cache": EngineConfig(num_blocks=64, block_size=4, enable_prefix_caching=False),
    "whole-prompts": EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=64, chunked_prefill=False),
}


def _prompts(n: int = 5, vocab: int = 64) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for length in (3, 9, 16, 5, 22)[:n]]


def _alone(model, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [generate(model, torch.tensor([p]), params)[0].tolist() for p in prompts]


@pytest.fixture(scope="module")
def models():
    return {v: materialize(build_model(SMALL_VARIANTS[v]), seed=0).eval() for v in ("gqa", "moe+shared", "mla")}


@pytest.mark.parametrize("budget", BUDGETS)
def test_every_budget_gives_each_request_its_greedy_tokens_alone(models, budget):
    model, prompts = models["gqa"], _prompts()
    engine = LLMEngine(model, BUDGETS[budget])
    assert engine.generate(prompts, GREEDY) == _alone(model, prompts)
    if budget == "preempting":
        assert sum(seq.preemptions for seq in engine.sequences.values()) > 0  # the budget did force recompute
    if budget == "chunked":
        assert max(record.tokens for record in engine.timeline) <= 12
        assert any(0 < n < len(p) for record in engine.timeline for _, n in record.ran for p in prompts[2:3])


@pytest.mark.parametrize("variant", ["moe+shared", "mla"])
def test_moe_and_mla_models_batch_as_they_run_alone(models, variant):
    prompts = _prompts()
    assert LLMEngine(models[variant], BUDGETS["chunked"]).generate(prompts, GREEDY) == _alone(models[variant], prompts)


def test_request_order_does_not_change_any_request(models):
    prompts = _prompts()
    forward = LLMEngine(models["gqa"], BUDGETS["chunked"]).generate(prompts, GREEDY)
    backward = LLMEngine(models["gqa"], BUDGETS["chunked"]).generate(prompts[::-1], GREEDY)
    assert backward == forward[::-1]


def test_a_shared_prefix_is_computed_once_and_changes_no_output(models):
    """Four requests on one 16-token prefix (4 full blocks): the first computes it, the others find its blocks."""
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, 64, (16,), generator=g).tolist()
    prompts = [prefix + torch.randint(0, 64, (n,), generator=g).tolist() for n in (1, 3, 4, 6)]
    with_cache = LLMEngine(models["gqa"], EngineConfig(num_blocks=64, block_size=4, max_num_seqs=1))
    assert with_cache.generate(prompts, GREEDY) == _alone(models["gqa"], prompts)
    assert with_cache.block_manager.prefix_hits >= 3 * 16


def test_seeded_sampling_gives_a_request_the_same_tokens_alone_or_batched(models):
    prompts = _prompts()
    params = [SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=s) for s in range(len(prompts))]
    batched = LLMEngine(models["gqa"], BUDGETS["chunked"]).generate(prompts, params)
    alone = [LLMEngine(models["gqa"], BUDGETS["roomy"]).generate([p], [sp])[0] for p, sp in zip(prompts, params,
                                                                                                   strict=True)]
    assert batched == alone


def test_the_triton_paged_decode_kernel_gives_the_same_tokens(models):
    pytest.importorskip("triton")
    prompts = _prompts(3)
    config = dataclasses.replace(BUDGETS["roomy"], attention="triton")
    assert LLMEngine(models["gqa"], config).generate(prompts, SamplingParams(max_tokens=3)) == \
        _alone(models["gqa"], prompts, SamplingParams(max_tokens=3))


def test_continuous_batching_admits_a_request_as_soon_as_one_finishes(models):
    """max_num_seqs=2, three requests: the third starts in the step after the first one finishes, not after both."""
    prompts = _prompts(3)
    params = [SamplingParams(max_tokens=2), SamplingParams(max_tokens=8), SamplingParams(max_tokens=4)]
    engine = LLMEngine(models["gqa"], EngineConfig(num_blocks=64, block_size=4, max_num_seqs=2))
    engine.generate(prompts, params)
    first_finish = next(i for i, r in enumerate(engine.timeline) if 0 in r.finished)
    third_start = next(i for i, r in enumerate(engine.timeline) if any(sid == 2 for sid, _ in r.ran))
    assert third_start == first_finish + 1 and not any(1 in r.finished for r in engine.timeline[:third_start])


def test_an_aborted_request_frees_its_blocks_and_changes_no_other(models):
    """Abort a running request and a waiting one between steps (a server's client went away): both leave the
    scheduler, every KV block is back in the pool once the rest finish, the others get their tokens alone, and
    `pop` forgets the aborted ones."""
    model, prompts = models["gqa"], _prompts(4)
    engine = LLMEngine(model, EngineConfig(num_blocks=64, block_size=4, max_num_seqs=2))
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    engine.step()
    running, waiting = engine.sequences[ids[1]], engine.sequences[ids[3]]
    assert running.status is SequenceStatus.RUNNING and waiting.status is SequenceStatus.WAITING
    engine.abort(ids[1])
    engine.abort(ids[3])
    assert running.block_table == [] and running.status is waiting.status is SequenceStatus.ABORTED
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert [engine.sequences[i].generated for i in ids[::2]] == _alone(model, prompts[::2])
    assert engine.pop(ids[1]) is running and ids[1] not in engine.sequences
    with pytest.raises(ValueError, match="abort it"):
        engine.pop(engine.add_request(prompts[0], GREEDY))


def test_a_cache_too_small_for_one_request_says_so(models):
    engine = LLMEngine(models["gqa"], EngineConfig(num_blocks=2, block_size=4))
    with pytest.raises((ValueError, RuntimeError), match="block"):
        engine.generate([list(range(30))], GREEDY)


# --- python -m lab serve ------------------------------------------------------------------------------------------


def test_a_trained_model_continues_the_training_stream(tmp_path):
    """60 steps of the 2-layer tiny model: its greedy continuations are the stream's own successors (a random
    model's follow it about branching/vocab = 4/256 of the time)."""
    from lab.train import main as train

    assert train(["--set", "model.n_layers=2", "--steps", "60", "--checkpoint-dir", str(tmp_path), "--quiet"]) == 0
    config = load_config(None, ["model.n_layers=2"])
    engine_config, params = EngineConfig(num_blocks=64), SamplingParams(max_tokens=12)
    trained, _ = serve(config, engine_config, params, 6, (4, 20), checkpoint=str(tmp_path))
    untrained, _ = serve(config, engine_config, params, 6, (4, 20))
    assert trained.follows_stream > 0.9 and untrained.follows_stream < 0.2, (trained, untrained)


def test_tensor_parallel_decode_equals_one_rank():
    config = load_config(None, ["model.n_layers=2"])
    one = serve(config, EngineConfig(num_blocks=64), GREEDY, 4, (4, 20))[1]
    assert serve(config, EngineConfig(num_blocks=64), GREEDY, 4, (4, 20), tp=2)[1] == one


def test_follows_stream_counts_the_streams_successors():
    data = SyntheticTokens(256, 2, 1)
    allowed = data.successors(torch.tensor(7)).tolist()
    other = next(t for t in range(256) if t not in allowed)
    # prompt [3, 7]; generated: successor 1 of 7, then a token the stream never puts after it
    assert follows_stream(data, [3, 7, allowed[1], other], 2) == 0.5


def test_serve_cli_prints_the_report_and_bad_input_is_one_line(capsys):
    assert main(["--set", "model.n_layers=2", "--requests", "3", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "served 3 requests, 12 tokens" in out and "time to first token" in out and "roofline" in out
    assert main(["--requests", "0"]) == 2
    assert capsys.readouterr().err.strip() == "python -m lab serve: error: --requests=0 must be >= 1"
    assert main(["--prompt-len", "9", "4"]) == 2
    assert "--prompt-len 9 4: need 1 <= MIN <= MAX" in capsys.readouterr().err


def test_one_attention_call_per_step_equals_one_call_per_sequence():
    """The model runner's attention (every sequence's keys end to end, a block-diagonal causal mask) against the
    plain loop over sequences, on a step mixing a decode, a prefill chunk at an offset and a whole prompt."""
    from lab.inference.model_runner import Segment, StepLayout, attend_each, attend_step

    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(10, 4, 2, 8, generator=g), torch.randn(10, 4, 2, 8, generator=g)
    segments = [Segment(1, 7, (3, 5)), Segment(5, 11, (0, 9, 2)), Segment(6, 6, (4, 8))]
    key_slots = [b * 4 + p % 4 for s in segments for b, p in ((s.block_table[p // 4], p) for p in range(s.context))]
    ends = torch.tensor([s.context for s in segments]).cumsum(0).tolist()
    slots = [slot for s, end in zip(segments, ends, strict=True) for slot in key_slots[end - s.n:end]]
    q = torch.randn(1, 4, 12, 8, generator=g)
    step = StepLayout.build(segments, slots, key_slots, torch.device("cpu"))
    torch.testing.assert_close(attend_step(q, k_cache, v_cache, step), attend_each(q, k_cache, v_cache, segments))
