"""Chapter 07's JAX section: the MoE layer with its experts sharded over 8 simulated devices and rows moved by
`all_to_all` inside `shard_map` equals lab's PyTorch `MoE` on the same weights and tokens (each device's tokens
routed on their own, as each EP rank routes its own), with and without capacity drops; its compiled program
holds the all-to-alls, and without them the answer is wrong."""

import pytest

jax = pytest.importorskip("jax")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from lab.config import ModelConfig  # noqa: E402
from lab.jaxtrack.moe import moe_ep  # noqa: E402
from lab.jaxtrack.sim import collectives_in, make_mesh, simulated_devices  # noqa: E402
from lab.model import MoE  # noqa: E402

DEVICES, TOKENS, D_MODEL, D_FF, N_EXPERTS = 8, 6, 16, 8, 16  # 6 tokens and 2 experts per device


def torch_moe(top_k: int, gating: str, capacity_factor: float = 0.0, skew: float = 0.0) -> MoE:
    """lab.model.MoE drawn from a fixed seed; `skew` leans the router towards the first experts (so that capacity
    drops assignments)."""
    cfg = ModelConfig(d_model=D_MODEL, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=2, n_experts=N_EXPERTS,
                      top_k=top_k, d_ff_expert=D_FF, moe_gating=gating, capacity_factor=capacity_factor)
    torch.manual_seed(0)
    moe = MoE(cfg)
    with torch.no_grad():
        moe.router.weight.add_(skew * torch.linspace(1, -1, N_EXPERTS)[:, None])
    return moe


def jax_params(moe: MoE) -> dict:
    stack = {name: torch.stack([getattr(moe.experts[str(e)], name).weight for e in range(N_EXPERTS)])
             for name in ("w1", "w3", "w2")}
    return {"router": jax.numpy.asarray(moe.router.weight.detach().numpy()),
            **{name: jax.numpy.asarray(w.detach().numpy()) for name, w in stack.items()}}


@pytest.fixture(scope="module")
def mesh():
    simulated_devices(DEVICES)
    return make_mesh((DEVICES,), ("x",))


@pytest.fixture(scope="module")
def tokens():
    return torch.randn(DEVICES * TOKENS, D_MODEL, generator=torch.Generator().manual_seed(1)) + 0.5


def per_device_reference(moe: MoE, tokens: torch.Tensor) -> tuple[np.ndarray, int]:
    """lab's MoE on each device's tokens in turn (its routing and capacity per rank, as under EP), and the
    assignments it dropped."""
    with torch.no_grad():
        outs, dropped = [], 0
        for chunk in tokens.split(TOKENS):
            outs.append(moe(chunk))
            dropped += moe.dropped
    return torch.cat(outs).numpy(), dropped


@pytest.fixture(scope="module")
def top2(mesh, tokens):
    """lab's MoE (top-2, softmax) and the all-to-all layer compiled for its weights: the compiled program is both
    run and read."""
    moe = torch_moe(2, "softmax").eval()
    args = (jax_params(moe), jax.numpy.asarray(tokens.numpy()))
    return moe, args, moe_ep(mesh, 2).lower(*args).compile()


def test_all_to_all_moe_equals_lab_moe(top2, tokens):
    moe, args, compiled = top2
    want, _ = per_device_reference(moe, tokens)
    np.testing.assert_allclose(np.asarray(compiled(*args)), want, rtol=1e-5, atol=1e-6)


def test_sigmoid_top3_equals_lab_moe(mesh, tokens):
    moe = torch_moe(3, "sigmoid").eval()
    want, _ = per_device_reference(moe, tokens)
    got = moe_ep(mesh, 3, "sigmoid")(jax_params(moe), jax.numpy.asarray(tokens.numpy()))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_capacity_drops_the_same_assignments_as_lab(mesh, tokens):
    moe = torch_moe(2, "softmax", capacity_factor=1.0, skew=2.0).train()  # capacity applies in training
    want, dropped = per_device_reference(moe, tokens)
    assert dropped > 0  # the case tests something
    got = moe_ep(mesh, 2, "softmax", capacity_factor=1.0)(jax_params(moe), jax.numpy.asarray(tokens.numpy()))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_the_compiled_program_holds_the_all_to_alls(top2):
    assert collectives_in(top2[2])["all-to-all"] >= 2, "dispatch and combine"


def test_without_the_exchange_the_layer_is_wrong(mesh, top2, tokens, monkeypatch):
    """A planted bug: all_to_all replaced by the identity — each device runs its rows through its own experts,
    not the ones the router chose."""
    moe, args, _ = top2
    want, _ = per_device_reference(moe, tokens)
    monkeypatch.setattr(jax.lax, "all_to_all", lambda x, *args, **kwargs: x)
    got = moe_ep(mesh, 2)(*args)
    assert not np.allclose(np.asarray(got), want, rtol=1e-3, atol=1e-4)
