"""DeepSeek-V3's auxiliary-loss-free balancing (`MoE.routing_bias`, `lab.parallel.ep.balance_routing`): the bias
changes which experts are chosen and never the gates, its updates move the load towards balance, and on several
ranks every replica takes the same step (DeepSeek-V3 technical report, arXiv:2412.19437, §2.1.2, eq. 16). And each
MoE layer knows its block, for a log of the load per layer."""

import dataclasses

import pytest
import torch

from lab.config import PRESETS, ModelConfig
from lab.distributed import run
from lab.model import MoE, build_model
from lab.parallel.ep import balance_routing

N_EXPERTS, D_MODEL = 8, 16


def skewed_moe(gating: str = "sigmoid", top_k: int = 2) -> MoE:
    """A layer whose router prefers the low-numbered experts."""
    cfg = ModelConfig(d_model=D_MODEL, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=2, n_experts=N_EXPERTS,
                      top_k=top_k, d_ff_expert=8, moe_gating=gating)
    torch.manual_seed(0)
    moe = MoE(cfg)
    with torch.no_grad():
        moe.router.weight.add_(torch.linspace(1.5, -1.5, N_EXPERTS)[:, None] / D_MODEL**0.5)
    return moe


def tokens(n: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, D_MODEL, generator=torch.Generator().manual_seed(seed)) + 1.0


@pytest.mark.parametrize("gating", ["sigmoid", "softmax"])
def test_the_bias_changes_the_choice_and_not_the_gates(gating):
    moe, x = skewed_moe(gating), tokens(64)
    with torch.no_grad():
        scores = moe.router(x).float()
        scores = scores.softmax(-1) if gating == "softmax" else scores.sigmoid()
        _, before = moe.route(x)
        moe.routing_bias = torch.linspace(-1, 1, N_EXPERTS)  # pushes the choice towards the high-numbered experts
        weights, chosen = moe.route(x)
    assert not torch.equal(chosen, before)
    assert torch.equal(chosen, (scores + moe.routing_bias).topk(2).indices)
    unbiased = scores.gather(-1, chosen)
    torch.testing.assert_close(weights, unbiased / unbiased.sum(-1, keepdim=True))  # the scores, not score + bias


def test_no_bias_and_a_zero_bias_route_alike():
    moe, x = skewed_moe(), tokens(64)
    with torch.no_grad():
        plain = moe(x)
        moe.update_routing_bias(torch.full((N_EXPERTS,), 16.0), rate=1e-3)  # balanced: the bias stays 0
        assert torch.equal(moe.routing_bias, torch.zeros(N_EXPERTS))
        torch.testing.assert_close(moe(x), plain, rtol=0, atol=0)


def test_updates_move_the_load_towards_balance():
    moe = skewed_moe()
    x = torch.randn(256, D_MODEL, generator=torch.Generator().manual_seed(0)) + 0.3  # leaning: the skew shows
    imbalance = []
    with torch.no_grad():
        for _ in range(60):
            _, chosen = moe.route(x)  # the load a forward records (no capacity), without running the experts
            load = torch.bincount(chosen.flatten(), minlength=N_EXPERTS)
            imbalance.append((load.max() / load.float().mean()).item())
            moe.update_routing_bias(load, rate=2e-2)
    assert moe.routing_bias[0] < 0 < moe.routing_bias[-1]  # the favourite pushed down, the shunned pulled up
    assert imbalance[0] > 2.5 and max(imbalance[-10:]) < 1.5, (imbalance[0], imbalance[-10:])


def test_bad_input():
    moe = skewed_moe()
    with pytest.raises(ValueError, match=r"rate=0 must be > 0"):
        moe.update_routing_bias(torch.ones(N_EXPERTS), 0)
    with pytest.raises(ValueError, match=r"load has shape \(4,\), expected \(8,\)"):
        moe.update_routing_bias(torch.ones(4), 1e-3)
    with pytest.raises(ValueError, match="run the model once first"):
        balance_routing(torch.nn.Sequential(skewed_moe()), 1e-3)


def rank_tokens(rank: int) -> torch.Tensor:
    """Rank 0's tokens lean towards the router's favourites, rank 1's away from them: their loads disagree."""
    return torch.randn(32, D_MODEL, generator=torch.Generator().manual_seed(rank)) + (1.0 if rank == 0 else -1.0)


def _bias_after_one_step() -> list[float]:
    """Each rank routes its own tokens, then balance_routing: the bias every rank ends with."""
    import torch.distributed as dist

    moe = skewed_moe()
    with torch.no_grad():
        moe(rank_tokens(dist.get_rank()))
    balance_routing(torch.nn.Sequential(moe), rate=0.5)
    return moe.routing_bias.tolist()


def test_every_rank_takes_the_step_of_the_summed_load():
    biases = run(_bias_after_one_step, 2)
    assert biases[0] == biases[1]
    moe, load, alone = skewed_moe(), torch.zeros(N_EXPERTS), []
    with torch.no_grad():
        for rank in range(2):
            moe(rank_tokens(rank))
            load += moe.load
            alone.append(torch.sign(moe.load.float().mean() - moe.load.float()))
    assert not torch.equal(alone[0], alone[1])  # each rank alone would step its own way
    moe.update_routing_bias(load, rate=0.5)
    assert biases[0] == moe.routing_bias.tolist()


def test_each_moe_layer_knows_its_block():
    cfg = dataclasses.replace(PRESETS["tiny-moe"], n_dense_layers=1)  # DeepSeek-V3's shape: dense blocks first
    layers = [m.layer for m in build_model(cfg).modules() if isinstance(m, MoE)]  # on meta: nothing allocated
    assert layers == list(range(1, cfg.n_layers))
