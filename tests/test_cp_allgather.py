"""The all-gather variant of context parallelism (Llama 3): K/V all-gathered, then one attention call per rank —
outputs and gradients equal attention over the whole sequence in one process (zig-zag and contiguous, GQA, 2 and
3 ranks), with one all-gather of K and one of V forward and a reduce-scatter of each backward."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lab.calc.cp import chunk_ids
from lab.distributed import count_collectives, run
from lab.parallel.cp import allgather_attention, shard_sequence, unshard_sequence

B, H, KV, D = 2, 4, 2, 8  # GQA: 2 query heads per KV head


def _inputs(seq: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seq)
    return (torch.randn(B, H, seq, D, generator=g), torch.randn(B, KV, seq, D, generator=g),
            torch.randn(B, KV, seq, D, generator=g), torch.randn(B, H, seq, D, generator=g))


def _allgather(seq: int, layout: str) -> tuple[list[torch.Tensor], dict]:
    rank, cp = dist.get_rank(), dist.get_world_size()
    q, k, v, dout = (shard_sequence(x, rank, cp, layout, dim=2) for x in _inputs(seq))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    with count_collectives() as counts:
        out = allgather_attention(q, k, v, None, [chunk_ids(r, cp, layout) for r in range(cp)])
        out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad], dict(counts.calls)


@pytest.mark.parametrize("layout, cp, seq", [("zigzag", 2, 20), ("zigzag", 3, 18), ("contiguous", 3, 21)])
def test_allgather_attention_equals_full_attention(layout, cp, seq):
    results = run(_allgather, cp, seq, layout)
    q, k, v, dout = (x.requires_grad_() for x in _inputs(seq))
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    reference.backward(dout)
    for i, expected in enumerate((reference, q.grad, k.grad, v.grad)):
        got = unshard_sequence([tensors[i] for tensors, _ in results], layout, dim=2)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    calls = results[0][1]
    assert (calls.get("all_gather_single"), calls.get("reduce_scatter_single")) == (2, 2), calls
