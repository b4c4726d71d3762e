"""Tensor and sequence parallelism: gradients equal the single-process model's, and the collectives per
block are the ones the theory says."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lab.config import PRESETS
from lab.distributed import Mesh, count_collectives, run
from lab.model import build_model, materialize
from lab.parallel.placement import grad_norm
from lab.parallel.tp import (
    apply_tensor_parallel,
    sync_tensor_parallel_grads,
    torch_tp_plan,
    vocab_parallel_cross_entropy,
)

# 4 query heads, 2 KV heads (replicated at tp=4), d_ff and vocab divisible by 4; 2 layers keep it quick
CFG = dataclasses.replace(PRESETS["tiny"], n_layers=2, vocab_size=96, d_ff=80)


def _reference(tokens: torch.Tensor, targets: torch.Tensor):
    model = materialize(build_model(CFG), seed=1)
    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _tp_grads(tokens, targets, sequence_parallel):
    mesh = Mesh(tp=dist.get_world_size())
    model = apply_tensor_parallel(materialize(build_model(CFG), seed=1), mesh.tp_group, sequence_parallel)
    loss = vocab_parallel_cross_entropy(model(tokens), targets, mesh.tp_group)
    loss.backward()
    sync_tensor_parallel_grads(model, mesh.tp_group)
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _full_slice(name: str, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Which part of the single-process gradient this rank's shard must equal."""
    if name.endswith(("wk.weight", "wv.weight")) and CFG.n_kv_heads % tp:  # replicated KV head
        heads = full.view(CFG.n_kv_heads, -1, full.shape[1])
        return heads[rank // (tp // CFG.n_kv_heads)]
    if name.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight", "output.weight",
                      "tok_embeddings.weight")):
        return full.chunk(tp, 0)[rank]
    if name.endswith(("wo.weight", "w2.weight")):
        return full.chunk(tp, 1)[rank]
    return full  # norms: replicated


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_gradients_equal_single_process(tp, sequence_parallel):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CFG.vocab_size, (2, 16), generator=g)
    targets = torch.randint(0, CFG.vocab_size, (2, 16), generator=g)
    ref_loss, ref_grads = _reference(tokens, targets)
    for rank, (loss, grads) in enumerate(run(_tp_grads, tp, tokens, targets, sequence_parallel)):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert set(grads) == set(ref_grads)
        for name, grad in grads.items():
            expected = _full_slice(name, ref_grads[name], rank, tp)
            torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")


def _tp_grad_norm(tokens, targets):
    mesh = Mesh(tp=dist.get_world_size())
    model = apply_tensor_parallel(materialize(build_model(CFG), seed=1), mesh.tp_group)
    vocab_parallel_cross_entropy(model(tokens), targets, mesh.tp_group).backward()
    sync_tensor_parallel_grads(model, mesh.tp_group)
    return grad_norm(model.parameters(), mesh.tp_group).item()


@pytest.mark.parametrize("tp", [2, 4])
def test_grad_norm_equals_single_process(tp):
    """Shards add up over the TP ranks, replicas (norms, and at tp=4 > n_kv_heads=2 each KV head held by two
    ranks) count once: the norm that clipping uses is the single-process one."""
    assert CFG.n_kv_heads < 4
    g = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, CFG.vocab_size, (2, 16), generator=g) for _ in range(2))
    _, ref_grads = _reference(tokens, targets)
    expected = torch.sqrt(sum(grad.pow(2).sum() for grad in ref_grads.values())).item()
    for rank, norm in enumerate(run(_tp_grad_norm, tp, tokens, targets)):
        assert norm == pytest.approx(expected, rel=1e-5), f"rank {rank}"


def _collectives_per_step(sequence_parallel):
    mesh = Mesh(tp=2)
    model = apply_tensor_parallel(materialize(build_model(CFG), seed=1), mesh.tp_group, sequence_parallel)
    tokens = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with count_collectives() as forward:
        logits = model(tokens)
    loss = logits.float().pow(2).mean()  # a local loss: counts only the model's own collectives
    with count_collectives() as backward:
        loss.backward()
    return dict(forward.calls), dict(backward.calls)


def test_collective_counts_match_the_theory():
    layers = CFG.n_layers
    forward, backward = run(_collectives_per_step, 2, False)[0]
    # forward: g after attention and after the MLP of each block, plus the embedding's all-reduce
    assert forward == {"all_reduce": 2 * layers + 1}
    # backward: f at the attention input and at the MLP input of each block, plus the output layer's input
    assert backward == {"all_reduce": 2 * layers + 1}
    forward, backward = run(_collectives_per_step, 2, True)[0]
    # SP: every all-reduce becomes an all-gather / reduce-scatter pair around the sharded regions
    assert forward == {"reduce_scatter_single": 2 * layers + 1, "all_gather_single": 2 * layers + 1}
    assert backward == {"reduce_scatter_single": 2 * layers + 1, "all_gather_single": 2 * layers + 1}


def _cross_entropy(logits, targets):
    mesh = Mesh(tp=dist.get_world_size())
    local = logits.chunk(mesh.tp, dim=-1)[mesh.tp_rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, mesh.tp_group)
    loss.backward()
    return loss.item(), local.grad


def test_vocab_parallel_cross_entropy_equals_the_full_softmax():
    logits = torch.randn(3, 5, 12) * 4
    targets = torch.randint(0, 12, (3, 5))
    full = logits.clone().requires_grad_()
    expected = F.cross_entropy(full.flatten(0, 1), targets.flatten())
    expected.backward()
    for rank, (loss, grad) in enumerate(run(_cross_entropy, 3, logits, targets)):
        assert loss == pytest.approx(expected.item(), rel=1e-6)
        torch.testing.assert_close(grad, full.grad.chunk(3, -1)[rank])


def _bad_tp():
    mesh = Mesh(tp=3)
    apply_tensor_parallel(materialize(build_model(PRESETS["tiny"]), seed=0), mesh.tp_group)


def test_degrees_that_do_not_divide_fail_clearly():
    with pytest.raises(Exception, match="tp=3 must divide n_heads=4"):
        run(_bad_tp, 3)


def _lab_and_dtensor_outputs(tokens, targets):
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = Mesh(tp=dist.get_world_size())
    ours = apply_tensor_parallel(materialize(build_model(CFG), seed=1), mesh.tp_group)
    our_loss = vocab_parallel_cross_entropy(ours(tokens), targets, mesh.tp_group)
    theirs = materialize(build_model(CFG), seed=1)
    parallelize_module(theirs, mesh.device_mesh()["tp"], torch_tp_plan(theirs))
    their_loss = F.cross_entropy(theirs(tokens).flatten(0, 1), targets.flatten())
    return our_loss.item(), their_loss.item()


def test_same_loss_as_torch_parallelize_module():
    g = torch.Generator().manual_seed(3)
    tokens, targets = (torch.randint(0, CFG.vocab_size, (2, 16), generator=g) for _ in range(2))
    for ours, theirs in run(_lab_and_dtensor_outputs, 2, tokens, targets):
        assert ours == pytest.approx(theirs, rel=1e-5)


def _measured_activations(tp: int, sp: bool, recompute: str, flash: bool) -> dict[str, int]:
    from lab.measure.memory import saved_activation_bytes
    from lab.model import set_recompute

    group = Mesh(tp=tp).tp_group
    model = apply_tensor_parallel(materialize(build_model(CFG), seed=1), group, sp)
    set_recompute(model, recompute)
    tokens = torch.randint(0, CFG.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    return saved_activation_bytes(model, tokens, flash=flash,
                                  loss_fn=lambda logits, targets: vocab_parallel_cross_entropy(logits, targets, group))


def _activation_grid(tp: int) -> list[tuple[tuple, dict[str, int]]]:
    grid = [(sp, recompute, flash) for sp in (False, True) for recompute in ("none", "selective", "full")
            for flash in (False, True) if not (flash and recompute != "none")]
    return [(key, _measured_activations(tp, *key)) for key in grid]


@pytest.mark.parametrize("tp", [2, 4])
def test_activation_bytes_per_rank_equal_the_calculator(tp):
    """Saved-tensor hooks on every TP rank vs `calc.memory`'s exact model for TP and TP+SP: heads, KV heads
    (replicated at tp=4) and FFN split by tp; with SP the norms hold s/tp tokens but each column group's
    gathered input is kept whole. Korthikanti's formulas (16-bit, dropout, Megatron's re-gather) are the
    same shape: the test also checks that SP's saving is what both models call it, everything but the
    gathered inputs divided by tp."""
    from lab.calc.memory import estimate_memory
    from lab.config import ParallelConfig

    results = run(_activation_grid, tp, tp)
    for rank_results in results:
        for (sp, recompute, flash), measured in rank_results:
            parallel = ParallelConfig(tp=tp, sp=sp, recompute=recompute)
            predicted = estimate_memory(CFG, 32, 2, parallel, precision="fp32", activation_model="exact",
                                        flash=flash).activations_breakdown
            for region in ("embedding", "layers", "logits"):
                assert measured[region] == predicted[region], (tp, sp, recompute, flash, region, measured, predicted)
    assert all(r == results[0] for r in results)  # every rank holds the same bytes
