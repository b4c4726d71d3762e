"""Context parallelism: ring attention (contiguous and zig-zag) and Ulysses equal full attention, forward and
backward; zig-zag balances causal work; the messages on the ring and the activation bytes per rank are the
ones the theory says."""

import dataclasses
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lab.calc.cp import attention_work, block_work, chunk_ids, num_chunks
from lab.config import PRESETS, ParallelConfig
from lab.distributed import Mesh, RankError, count_collectives, run
from lab.model import build_model, materialize
from lab.parallel.cp import (
    apply_context_parallel,
    layout_of,
    sequence_positions,
    shard_sequence,
    ulysses_attention,
    unshard_sequence,
)
from lab.parallel.ring_attention import merge, ring_attention

B, H, KV, D = 2, 4, 2, 8  # GQA: 2 query heads per KV head
NAMES = ("out", "dq", "dk", "dv")


def _inputs(seq: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seq)
    return (torch.randn(B, H, seq, D, generator=g), torch.randn(B, KV, seq, D, generator=g),
            torch.randn(B, KV, seq, D, generator=g), torch.randn(B, H, seq, D, generator=g))


def _distributed(impl: str, seq: int, causal: bool, on_block=None) -> list[torch.Tensor]:
    """out, dq, dk, dv of this rank's shard."""
    rank, cp = dist.get_rank(), dist.get_world_size()
    layout = layout_of(impl)
    q, k, v, dout = (shard_sequence(x, rank, cp, layout, dim=2) for x in _inputs(seq))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    if impl == "ulysses":
        out = ulysses_attention(q, k, v, None)
    else:
        chunks = [chunk_ids(r, cp, layout) for r in range(cp)]
        out = ring_attention(q, k, v, None, chunks, causal=causal, on_block=on_block)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def _all_cases(impl: str, seq: int) -> dict[bool, list[torch.Tensor]]:
    return {causal: _distributed(impl, seq, causal) for causal in ((True,) if impl == "ulysses" else (True, False))}


@pytest.mark.parametrize("impl, cp, seq", [
    ("ring", 2, 20), ("ring", 3, 21), ("ring", 4, 20),
    ("zigzag", 2, 20), ("zigzag", 3, 18), ("zigzag", 4, 24),
    ("ulysses", 2, 22), ("ulysses", 4, 20),
])
def test_outputs_and_gradients_equal_full_attention(impl, cp, seq):
    """fp32, GQA, sequence lengths that are not powers of two, cp = 2, 3 and 4, causal and not."""
    results = run(_all_cases, cp, impl, seq)
    for causal in results[0]:
        q, k, v, dout = (x.requires_grad_() for x in _inputs(seq))
        reference = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        reference.backward(dout[:])
        for i, expected in enumerate((reference, q.grad, k.grad, v.grad)):
            got = unshard_sequence([rank_results[causal][i] for rank_results in results], layout_of(impl), dim=2)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5,
                                       msg=lambda m, i=i, c=causal: f"{impl} causal={c} {NAMES[i]}: {m}")


def test_merge_is_online_softmax():
    """Two halves of the keys, merged by log-sum-exp, give the softmax over all of them."""
    g = torch.Generator().manual_seed(0)
    scores, values = torch.randn(3, 10, generator=g), torch.randn(10, 4, generator=g)
    halves = [(scores[:, s].softmax(-1) @ values[s], scores[:, s].logsumexp(-1)) for s in (slice(0, 6), slice(6, 10))]
    out, lse = merge(*merge(None, None, *halves[0]), *halves[1])
    torch.testing.assert_close(out, scores.softmax(-1) @ values)
    torch.testing.assert_close(lse, scores.logsumexp(-1))
    empty = (torch.zeros(3, 4), torch.full((3,), float("-inf")))  # rows that saw no key in either part
    out, lse = merge(*empty, *empty)
    assert torch.equal(out, torch.zeros(3, 4)) and torch.isneginf(lse).all()


@pytest.mark.parametrize("seq, cp, layout, message", [
    (30, 4, "zigzag", "seq_len=30 must be divisible by 2*cp = 8 for the zigzag layout"),
    (30, 4, "contiguous", "seq_len=30 must be divisible by cp = 4 for the contiguous layout"),
    (32, 4, "stripes", "layout='stripes' must be one of 'contiguous', 'zigzag'"),
])
def test_bad_sequence_or_layout_is_one_clear_line(seq, cp, layout, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        shard_sequence(torch.zeros(1, seq), 0, cp, layout)
    assert "\n" not in str(info.value)


def test_ulysses_needs_cp_to_divide_the_heads():
    with pytest.raises(RankError, match="ulysses needs cp=3 to divide the attention heads on this rank"):
        run(_distributed, 3, "ulysses", 12, True)


def test_layouts_and_positions():
    assert [chunk_ids(r, 4, "zigzag") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert sequence_positions(8, 1, 2, "zigzag").tolist() == [2, 3, 4, 5]
    assert sequence_positions(8, 0, 2, "zigzag").tolist() == [0, 1, 6, 7]
    x = torch.arange(24).view(1, 24)
    for layout in ("contiguous", "zigzag"):
        assert torch.equal(unshard_sequence([shard_sequence(x, r, 3, layout) for r in range(3)], layout), x)


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_zigzag_balances_causal_work_and_contiguous_does_not(cp):
    """Query-key pairs scored per rank at seq 960: zig-zag's max/mean is 1 (every rank 2 diagonal and 2cp-2
    full blocks); the contiguous split's is (2cp-1)/cp — rank cp-1 scores cp-1 full blocks and a diagonal,
    rank 0 one diagonal (the playbook's 1, 3, 5, 7 of 16 at cp=4, counted in half-blocks)."""
    contiguous, zigzag = attention_work(960, cp, "contiguous"), attention_work(960, cp, "zigzag")
    assert sum(contiguous) == sum(zigzag) == 960 * 961 // 2  # the causal triangle, split two ways
    assert max(zigzag) / (sum(zigzag) / cp) <= 1.001
    assert max(contiguous) / (sum(contiguous) / cp) == pytest.approx((2 * cp - 1) / cp, rel=0.01)
    if cp == 4:
        half_blocks = [round(w / (240 * 240 / 2)) for w in contiguous]
        assert half_blocks == [1, 3, 5, 7]
    assert attention_work(960, cp, "zigzag", causal=False) == [960 * 960 // cp] * cp


def _work_seen_on_the_ring(impl: str, seq: int) -> int:
    chunk = seq // num_chunks(dist.get_world_size(), layout_of(impl))
    work = []
    _distributed(impl, seq, True, on_block=lambda step, src, q, k, kind: work.append(block_work(kind, chunk, chunk)))
    return sum(work)


@pytest.mark.parametrize("impl", ["ring", "zigzag"])
def test_the_ring_does_the_work_the_schedule_says(impl):
    assert run(_work_seen_on_the_ring, 4, impl, 32) == attention_work(32, 4, layout_of(impl))


def _ring_messages(seq: int):
    with count_collectives() as counts:
        _distributed("zigzag", seq, True)
    return counts.calls["isend"], counts.bytes["isend"], counts.calls["all_to_all_single"]


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_sends_cp_minus_one_kv_blocks_forward_and_cp_gradients_back(cp):
    """Forward: cp-1 sends of this rank's K/V (stacked, 2·KV heads); backward: cp-1 K/V again and cp sends of
    their gradients (the last hop brings them home). Point-to-point only, no all-to-all."""
    seq = 8 * cp
    kv_bytes = 2 * B * KV * (seq // cp) * D * 4
    for calls, nbytes, all_to_all in run(_ring_messages, cp, seq):
        assert calls == 3 * (cp - 1) + 1 and all_to_all == 0
        assert nbytes == calls * kv_bytes


def _ulysses_messages(seq: int):
    with count_collectives() as counts:
        _distributed("ulysses", seq, True)
    return counts.calls["all_to_all_single"], counts.calls["isend"]


def test_ulysses_is_four_all_to_alls_forward_and_four_backward():
    for all_to_all, sends in run(_ulysses_messages, 2, 16):
        assert (all_to_all, sends) == (8, 0)


# ---- the whole model -------------------------------------------------------------------------------------------

CFG = dataclasses.replace(PRESETS["tiny"], n_layers=2, vocab_size=96, d_ff=80)


def _model_grads(impl: str | None, seq: int) -> tuple[float, dict[str, torch.Tensor]]:
    tokens = torch.randint(0, CFG.vocab_size, (2, seq + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    model = materialize(build_model(CFG), seed=1)
    positions = None
    if impl is not None:
        mesh = Mesh(cp=dist.get_world_size())
        apply_context_parallel(model, mesh.cp_group, impl)
        layout = layout_of(impl)
        inputs, targets = (shard_sequence(t, mesh.cp_rank, mesh.cp, layout) for t in (inputs, targets))
        positions = sequence_positions(seq, mesh.cp_rank, mesh.cp, layout)
    loss = F.cross_entropy(model(inputs, positions).flatten(0, 1), targets.flatten())
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    if impl is not None:  # each rank's tokens are 1/cp of the sequence: average like data parallelism
        for grad in grads.values():
            dist.all_reduce(grad, op=dist.ReduceOp.AVG)
        loss = loss.detach().clone()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    return loss.item(), grads


@pytest.mark.parametrize("impl, cp", [("ring", 2), ("zigzag", 4), ("ulysses", 2)])
def test_model_loss_and_gradients_equal_single_process(impl, cp):
    """RoPE at each token's global position, the loss over local tokens, gradients averaged over cp."""
    ref_loss, ref_grads = _model_grads(None, 32)
    for loss, grads in run(_model_grads, cp, impl, 32):
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def _measured_activations(seq: int, recompute: str) -> dict[str, int]:
    from lab.measure.memory import saved_activation_bytes
    from lab.model import set_recompute

    mesh = Mesh(cp=dist.get_world_size())
    model = apply_context_parallel(materialize(build_model(CFG), seed=1), mesh.cp_group, "zigzag")
    set_recompute(model, recompute)
    tokens = torch.randint(0, CFG.vocab_size, (2, seq), generator=torch.Generator().manual_seed(0))
    return saved_activation_bytes(model, shard_sequence(tokens, mesh.cp_rank, mesh.cp, "zigzag"))


@pytest.mark.parametrize("cp", [2, 4])
def test_activation_bytes_per_rank_are_one_over_cp_and_equal_the_calculator(cp):
    """Saved-tensor hooks on each CP rank vs `calc.memory`'s exact model with cp: every region holds seq/cp
    tokens, and ring attention keeps what a flash kernel keeps (no s x s scores). The hooks measure the loss on
    whole logits (`saved_activation_bytes`), so calc is asked for that loss."""
    from lab.calc.memory import estimate_memory

    for recompute in ("none", "selective", "full"):
        predicted = estimate_memory(CFG, 64, 2, ParallelConfig(cp=cp, recompute=recompute), precision="fp32",
                                    activation_model="exact", loss="whole").activations_breakdown
        alone = estimate_memory(CFG, 64, 2, ParallelConfig(recompute=recompute), precision="fp32",
                                activation_model="exact", flash=True, loss="whole").activations_breakdown
        for measured in run(_measured_activations, cp, 64, recompute):
            assert {k: measured[k] for k in predicted} == predicted, recompute
            assert sum(predicted.values()) == pytest.approx(sum(alone.values()) / cp, rel=0.02)
