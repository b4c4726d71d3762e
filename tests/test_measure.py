"""lab.measure.memory on real tensors: the `exact` activation model within 2% of what autograd keeps, two
independent measurements that agree (checkpointing included), and static bytes equal to the calculator."""

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lab.calc import estimate_memory
from lab.config import PRESETS, ModelConfig, ParallelConfig
from lab.measure.memory import ACCURACY_GRID, MODES, accuracy_rows, live_activation_bytes, saved_activation_bytes
from lab.measure.memory import static_bytes as measured_static_bytes
from lab.model import build_model, materialize, set_recompute

SMALL = ModelConfig(name="small", vocab_size=96, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2, d_ff=80,
                    max_seq_len=64)


def _tokens(cfg: ModelConfig, mbs: int, seq: int) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (mbs, seq), generator=torch.Generator().manual_seed(1))


def test_exact_model_within_two_percent_on_the_grid():
    rows = accuracy_rows()
    assert len(ACCURACY_GRID) >= 12 and {r["recompute"] for r in rows} == {"none", "selective", "full"}
    for key in ("seq", "mbs", "d_model", "n_heads", "n_kv_heads", "n_layers"):
        assert len({shape[key] for shape in ACCURACY_GRID}) >= 3, f"the grid must vary {key}"
    worst = max(abs(r["exact"] - r["measured"]) / r["measured"] for r in rows)
    assert worst <= 0.02, f"exact activation model off by {worst:.2%}"


@pytest.mark.parametrize("recompute, flash", MODES)
def test_breakdown_matches_exact_model(recompute, flash):
    model = materialize(build_model(SMALL), seed=0)
    set_recompute(model, recompute)
    measured = saved_activation_bytes(model, _tokens(SMALL, 2, 24), flash=flash)
    est = estimate_memory(SMALL, 24, 2, ParallelConfig(recompute=recompute), precision="fp32", flash=flash,
                          activation_model="exact", loss="whole")  # the hooks measure F.cross_entropy's
    assert {k: measured[k] for k in ("layers", "embedding", "logits")} == est.activations_breakdown


@pytest.mark.parametrize("recompute, flash", MODES)
def test_hooks_agree_with_storage_liveness(recompute, flash):
    """The hooks see what checkpointed regions keep (their inputs): a measurement that knows nothing of
    autograd, which storages created in forward are still alive after it, gives the same bytes."""
    model = materialize(build_model(SMALL), seed=0)
    set_recompute(model, recompute)
    tokens = _tokens(SMALL, 2, 24)
    assert saved_activation_bytes(model, tokens, flash=flash)["total"] == live_activation_bytes(model, tokens,
                                                                                               flash=flash)


def test_policy_checkpointing_hides_from_hooks_but_not_from_liveness(monkeypatch):
    """Selective checkpointing with a policy keeps matmul outputs in its own cache, out of the hooks' sight
    (`torch.utils.checkpoint.create_selective_checkpoint_contexts`, torch/utils/checkpoint.py): only the liveness
    measurement counts them."""
    model = materialize(build_model(SMALL), seed=0)
    block_forward = type(model.layers["0"]).forward
    policy = functools.partial(create_selective_checkpoint_contexts, lambda ctx, op, *a, **k: (
        CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE))
    monkeypatch.setattr(type(model.layers["0"]), "forward", lambda self, x, cos, sin: checkpoint(
        block_forward, self, x, cos, sin, use_reentrant=False, context_fn=policy))
    tokens = _tokens(SMALL, 2, 24)
    assert live_activation_bytes(model, tokens) > saved_activation_bytes(model, tokens)["total"]


def test_bf16_bytes_by_dtype():
    """A bf16 model saves bf16 tensors (2 bytes) next to fp32 ones (RMSNorm and RoPE upcast): the hooks count
    each storage at its own element size, as the liveness measurement does."""
    model = materialize(build_model(dataclasses.replace(SMALL, n_layers=1)), seed=0).bfloat16()
    tokens = _tokens(SMALL, 1, 8)
    assert saved_activation_bytes(model, tokens)["total"] == live_activation_bytes(model, tokens)


@pytest.mark.parametrize("cfg", [SMALL, dataclasses.replace(SMALL, tie_embeddings=True), PRESETS["tiny-moe"]],
                         ids=["untied", "tied", "moe"])
def test_static_bytes_equal_the_calculator(cfg):
    model = materialize(build_model(cfg), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = _tokens(cfg, 2, 16)
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    optimizer.step()
    est = estimate_memory(cfg, 16, 2, precision="fp32")
    assert measured_static_bytes(model, optimizer) == {k: est.per_gpu[k] for k in ("params", "grads", "optimizer")}
