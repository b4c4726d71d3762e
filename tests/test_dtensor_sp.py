"""PyTorch's own sequence parallelism — a DTensor plan with `SequenceParallel`, `PrepareModuleInput` and
`loss_parallel` (TorchTitan's Llama plan) — computes what `lab.parallel.tp`'s SP computes: the same vocab-sharded
logits, the same loss, and after backward the same gradient shard on every rank, on CPU gloo ranks.

The norms show the one difference in bookkeeping: DTensor leaves their gradients `Partial(sum)` (each rank saw its
tokens only) until they are redistributed to the weight's `Replicate()` placement — an all-reduce, what lab's
`sync_tensor_parallel_grads` does for weights it marks `tp_partial`."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lab.config import PRESETS
from lab.distributed import run

CFG = dataclasses.replace(PRESETS["tiny"], n_layers=2, vocab_size=96, d_ff=80)


def _lab_and_dtensor(tokens: torch.Tensor, targets: torch.Tensor) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    from lab.distributed import Mesh
    from lab.model import build_model, materialize
    from lab.parallel.tp import (
        apply_tensor_parallel,
        sync_tensor_parallel_grads,
        torch_sp_plan,
        vocab_parallel_cross_entropy,
    )

    mesh = Mesh(tp=dist.get_world_size())
    ours = apply_tensor_parallel(materialize(build_model(CFG), seed=1), mesh.tp_group, sequence_parallel=True)
    our_logits = ours(tokens)
    our_loss = vocab_parallel_cross_entropy(our_logits, targets, mesh.tp_group)
    our_loss.backward()
    sync_tensor_parallel_grads(ours, mesh.tp_group)

    theirs = materialize(build_model(CFG), seed=1)
    parallelize_module(theirs, mesh.device_mesh()["tp"], torch_sp_plan(theirs))
    their_logits = theirs(tokens)  # a DTensor, Shard(-1): never gathered
    with loss_parallel():
        their_loss = F.cross_entropy(their_logits.flatten(0, 1), targets.flatten())
        their_loss.backward()
    grads = {}
    for name, param in theirs.named_parameters():
        grads[name] = {"placement": repr(param.grad.placements[0]),
                       "theirs": param.grad.redistribute(placements=param.placements).to_local(),
                       "ours": dict(ours.named_parameters())[name].grad}
    return {"loss": (our_loss.item(), their_loss.full_tensor().item()), "grads": grads,
            "logits": (our_logits.detach(), their_logits.to_local().detach())}


@pytest.fixture(scope="module")
def ranks():
    g = torch.Generator().manual_seed(0)
    tokens, targets = torch.randint(0, CFG.vocab_size, (2, 8), generator=g), torch.randint(0, CFG.vocab_size, (2, 8),
                                                                                           generator=g)
    return run(_lab_and_dtensor, 2, tokens, targets)


def test_the_dtensor_sp_plan_gives_lab_sps_logits_and_loss(ranks):
    for r in ranks:
        ours, theirs = r["logits"]
        assert ours.shape == theirs.shape == (2, 8, CFG.vocab_size // 2)  # each rank: its half of the vocabulary
        torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)
        assert r["loss"][1] == pytest.approx(r["loss"][0], rel=1e-6)


def test_every_gradient_shard_equals_lab_sps_after_reduction(ranks):
    for rank, r in enumerate(ranks):
        for name, g in r["grads"].items():
            torch.testing.assert_close(g["theirs"], g["ours"], rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {name}")


def test_norm_gradients_are_partial_until_reduced(ranks):
    placements = {name: g["placement"] for name, g in ranks[0]["grads"].items()}
    assert {p for name, p in placements.items() if name.endswith("norm.weight")} == {"Partial(sum)"}
    assert placements["layers.0.attn.wq.weight"] == "Shard(dim=0)"
    assert placements["layers.0.ffn.w2.weight"] == "Shard(dim=1)"
