"""Expert-parallel decode on 2 gloo ranks: a tiny MoE decodes greedily with the KV cache, its experts split over the
ranks, each rank its own sequences — the tokens and logits of one process decoding all of them, the all-to-alls
`lab.calc.inference.ep_decode` counts (plus the counts exchange) with the bytes it prices, and no token dropped
although the config's capacity factor would drop some in training."""

import dataclasses

import pytest
import torch

from lab.calc.inference import ep_counts_exchange, ep_decode
from lab.config import PRESETS
from lab.distributed import run
from lab.inference.sampling import SamplingParams
from lab.kernels.accuracy import FLOOR_ULPS
from lab.model import MoE, build_model, materialize
from lab.parallel.ep_decode import expert_parallel_decode, traced_generate

CFG = dataclasses.replace(PRESETS["tiny-moe"], n_layers=2, capacity_factor=1.0)  # 1.0: training would drop
EP, BATCH, PROMPT, NEW = 2, 3, 4, 5  # ranks, sequences per rank, prompt length, tokens generated
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0)
MOE_LAYERS = sum(map(CFG.is_moe_layer, range(CFG.n_layers)))


def _model() -> torch.nn.Module:
    return materialize(build_model(CFG), seed=3)


def _prompts() -> torch.Tensor:
    """EP x BATCH prompts; rank r decodes rows [r·BATCH, (r+1)·BATCH)."""
    return torch.randint(0, CFG.vocab_size, (EP * BATCH, PROMPT), generator=torch.Generator().manual_seed(0))


def _rank() -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    trace = expert_parallel_decode(_model(), _prompts()[rank * BATCH:(rank + 1) * BATCH], GREEDY)
    return dataclasses.asdict(trace)


@pytest.fixture(scope="module")
def decoded() -> tuple[list[dict], object]:
    """Both ranks' traces, and one process decoding all EP x BATCH prompts with every expert."""
    return run(_rank, EP), traced_generate(_model(), _prompts(), GREEDY)


def test_tokens_and_logits_equal_one_process(decoded):
    ranks, whole = decoded
    tolerance = FLOOR_ULPS * torch.finfo(torch.float32).eps * float(whole.logits.abs().max())
    for rank, got in enumerate(ranks):
        rows = slice(rank * BATCH, (rank + 1) * BATCH)
        assert torch.equal(got["tokens"], whole.tokens[rows]), f"rank {rank} decoded other tokens"
        torch.testing.assert_close(got["logits"], whole.logits[:, rows], rtol=0, atol=tolerance)


def test_all_to_alls_per_step_and_their_bytes_are_what_ep_decode_prices(decoded):
    """Every forward (prefill, then each decode step) makes 3 all-to-alls per MoE layer on each rank: the counts
    exchange, the dispatch and the combine. A rank dispatches its BATCH × top_k rows (ep_decode's dispatch bytes at
    fp32); what it combines is what its experts got, which differs between the ranks, but summed over the ranks
    it is what they dispatched: ep_decode's combine bytes on each."""
    ranks, _ = decoded
    priced = ep_decode(CFG, BATCH, EP, dispatch_bytes=4, combine_bytes=4)
    counts = ep_counts_exchange(CFG, EP)
    assert priced.moe_layers == MOE_LAYERS == 2
    for got in ranks:
        assert got["all_to_alls"] == [3 * MOE_LAYERS] * NEW
        decode_rows = got["dispatched_rows"][1:]  # the first forward is the prefill: PROMPT tokens a sequence
        assert [rows * CFG.d_model * 4 for rows in decode_rows] == [MOE_LAYERS * priced.dispatch.bytes] * (NEW - 1)
    step_bytes = [sum(got["all_to_all_bytes"][step] for got in ranks) for step in range(1, NEW)]
    per_layer = EP * (counts.bytes + priced.dispatch.bytes + priced.combine.bytes)
    assert step_bytes == [MOE_LAYERS * per_layer] * (NEW - 1)


def test_decode_drops_nothing_where_training_capacity_would(decoded):
    ranks, whole = decoded
    assert [got["dropped"] for got in ranks] == [0, 0] and whole.dropped == 0
    model = _model().train()
    model(_prompts()[:BATCH])  # one rank's prefill, in training: capacity 1.0 applies
    assert sum(m.dropped for m in model.modules() if isinstance(m, MoE)) > 0, "the capacity test would prove nothing"
