"""Expert parallelism on real ranks: an MoE layer whose experts are spread over ep ranks gives every rank the
outputs, router losses and gradients of the whole layer on its tokens — with routing so imbalanced that some
experts get no token and one gets most; the all-to-alls move the bytes `lab.calc.moe` predicts."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lab.calc.moe import expected_all_to_all_bytes, layer_all_to_all_bytes
from lab.config import PRESETS
from lab.distributed import Mesh, count_collectives, run
from lab.model import MoE, build_model, materialize, moe_losses
from lab.parallel.ep import ExpertDataParallel, apply_expert_parallel

CFG = dataclasses.replace(PRESETS["tiny-moe"], n_layers=1, n_shared_experts=1)
D = CFG.d_model


def _layer(capacity: float, gating: str, imbalanced: bool, **gates) -> MoE:
    cfg = dataclasses.replace(CFG, capacity_factor=capacity, moe_gating=gating, **gates)
    model = materialize(build_model(cfg), seed=1)
    moe = model.layers["0"].ffn
    if imbalanced:  # every token prefers expert 3, then 5: experts 0-2, 4, 6, 7 get nothing
        with torch.no_grad():
            moe.router.weight.zero_()
            moe.router.weight[3] += 1.0
            moe.router.weight[5] += 0.5
    return model, moe


def _tokens(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank a different number of tokens, all with a positive component along (1, ..., 1)."""
    g = torch.Generator().manual_seed(rank)
    n = 10 + 7 * rank
    return torch.randn(1, n, D, generator=g) + 0.5, torch.randn(1, n, D, generator=g)


def _results(moe: MoE, x: torch.Tensor, dout: torch.Tensor) -> dict:
    x = x.clone().requires_grad_()
    out = moe(x)
    (out * dout).sum().backward(retain_graph=True)
    (moe.aux_loss + moe.z_loss).backward()
    return {"out": out.detach(), "dx": x.grad, "aux": moe.aux_loss.item(), "z": moe.z_loss.item(),
            "load": moe.load.tolist(), "dropped": moe.dropped,
            "grads": {n: p.grad.clone() for n, p in moe.named_parameters()}}


def _expert_parallel(capacity: float, gating: str, imbalanced: bool, gates: dict) -> dict:
    mesh = Mesh(dp=dist.get_world_size(), ep=dist.get_world_size())
    model, moe = _layer(capacity, gating, imbalanced, **gates)
    apply_expert_parallel(model, mesh.ep_group)
    return _results(moe, *_tokens(mesh.ep_rank))


SWITCH = {"top_k": 1}  # "auto": the raw probability of the one expert
DEEPSEEK = {"top_k": 4, "moe_gate_norm": "topk", "moe_route_scale": 2.5}  # normalised sigmoid scores, x2.5


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("capacity, gating, imbalanced, gates", [
    (0.0, "softmax", True, {}), (0.0, "sigmoid", False, {}), (1.0, "softmax", False, {}), (1.5, "softmax", True, {}),
    (0.0, "softmax", False, SWITCH), (1.0, "softmax", True, SWITCH), (0.0, "sigmoid", False, DEEPSEEK)])
def test_expert_parallel_layer_equals_the_whole_layer(ep, capacity, gating, imbalanced, gates):
    """Rank r's outputs, input gradients, aux and z losses, load and drops equal the whole layer's on r's
    tokens; replicated weights (router, shared expert) get r's own gradient; an expert's owner gets the sum
    of every rank's contribution to it (zeros for experts nobody chose). Also with top-1 raw gates (Switch)
    and DeepSeek-V3's scaled sigmoid gates."""
    results = run(_expert_parallel, ep, capacity, gating, imbalanced, gates)
    expert_sums: dict[str, torch.Tensor] = {}
    for rank, got in enumerate(results):
        _, reference = _layer(capacity, gating, imbalanced, **gates)
        want = _results(reference, *_tokens(rank))
        for key in ("out", "dx"):
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)
        assert got["aux"] == pytest.approx(want["aux"], rel=1e-6) and got["z"] == pytest.approx(want["z"], rel=1e-6)
        assert (got["load"], got["dropped"]) == (want["load"], want["dropped"])
        for name, grad in want["grads"].items():
            if name.startswith("experts."):
                expert_sums[name] = expert_sums.get(name, 0) + grad
            else:
                torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-6)
    owned = {name: grad for got in results for name, grad in got["grads"].items() if name.startswith("experts.")}
    assert set(owned) == set(expert_sums)  # each expert on exactly one rank
    for name, grad in owned.items():
        torch.testing.assert_close(grad, expert_sums[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    if imbalanced:
        load = results[0]["load"]
        assert {e for e, n in enumerate(load) if n} == ({3, 5} if gates.get("top_k", 2) == 2 else {3})


def _counted_bytes() -> tuple[int, list[int], int]:
    mesh = Mesh(dp=dist.get_world_size(), ep=dist.get_world_size())
    model, moe = _layer(0.0, "softmax", False)
    apply_expert_parallel(model, mesh.ep_group)
    x, dout = _tokens(mesh.ep_rank)
    with count_collectives() as counts:
        (moe(x.requires_grad_()) * dout).sum().backward()
    rows_to = moe.load.view(mesh.ep, -1).sum(dim=1)  # kept rows for each rank's experts
    return counts.bytes["all_to_all_single"], rows_to.tolist(), mesh.ep_rank


@pytest.mark.parametrize("ep", [2, 4])
def test_all_to_all_bytes_equal_the_calculator_for_the_observed_routing(ep):
    """Counts, dispatch and combine forward, their gradients backward: what `layer_all_to_all_bytes` says."""
    results = run(_counted_bytes, ep)
    for counted, rows_to, rank in results:
        rows_from = [other_rows_to[rank] for _, other_rows_to, _ in results]
        predicted = layer_all_to_all_bytes(rows_to, rows_from, rank, D, CFG.n_experts, dtype_bytes=4)
        assert counted == predicted["forward"] + predicted["backward"]
        assert predicted["on_wire_forward"] < predicted["dispatch"] + predicted["combine"]


def test_expected_bytes_under_uniform_routing():
    """DeepSeek-V3-like: 4096 tokens x top-8 x 7168 wide in bf16 over ep=64: 4 x 4096·8·63/64·7168·2 bytes."""
    assert expected_all_to_all_bytes(4096, 8, 7168, 64) == pytest.approx(4 * 4096 * 8 * 63 / 64 * 7168 * 2)
    assert expected_all_to_all_bytes(4096, 8, 7168, 1) == 0
    with pytest.raises(ValueError, match="ep=0 must be an integer >= 1"):
        expected_all_to_all_bytes(4096, 8, 7168, 0)


def test_capacity_drops_the_latest_assignments_and_no_drop_keeps_all():
    _, moe = _layer(1.0, "softmax", True)  # everyone wants experts 3 and 5: capacity 1·n·2/8 each
    x, _ = _tokens(0)
    moe(x)
    capacity = -(-x.shape[1] * 2 // 8)
    assert moe.load.tolist()[3] == moe.load.tolist()[5] == capacity
    assert moe.dropped == 2 * x.shape[1] - 2 * capacity
    _, free = _layer(0.0, "softmax", True)
    free(x)
    assert free.dropped == 0 and free.load[3] == free.load[5] == x.shape[1]


def test_aux_loss_is_one_when_balanced_and_grows_with_skew():
    """Switch's n·Σ_e f_e·P_e: with uniform router probabilities P_e = 1/n it is Σ f_e = 1 whatever the
    assignment; when the probabilities follow a skewed assignment it grows (up to n for one expert)."""
    model, moe = _layer(0.0, "softmax", False)
    with torch.no_grad():
        moe.router.weight.zero_()
    moe(torch.randn(1, 16, D))
    assert moe.aux_loss.item() == pytest.approx(1.0, rel=1e-6)
    _, skewed = _layer(0.0, "softmax", True)
    skewed(torch.randn(1, 16, D) + 0.5)
    assert skewed.aux_loss.item() > 1.0


# --- ExpertDataParallel.finish: the averaged gradients themselves, before any optimizer ------------------------

DDP_CFG = dataclasses.replace(PRESETS["tiny-moe"], n_layers=2, n_shared_experts=1, n_dense_layers=1)


def _batch(rank: int) -> torch.Tensor:
    return torch.randint(0, DDP_CFG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(100 + rank))


def _loss(model, tokens: torch.Tensor) -> torch.Tensor:
    """lab.train's objective: next-token cross-entropy plus the weighted router losses."""
    logits = model(tokens[:, :-1])
    aux, z = moe_losses(model)
    return (F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            + DDP_CFG.aux_loss_coef * aux + DDP_CFG.z_loss_coef * z)


def _finished_gradients(dp: int, ep: int) -> dict[str, torch.Tensor]:
    mesh = Mesh(dp=dp, ep=ep)
    model = apply_expert_parallel(materialize(build_model(DDP_CFG), seed=2), mesh.ep_group)
    engine = ExpertDataParallel(model, mesh.dp_group, mesh.ep_dp_group)
    _loss(model, _batch(mesh.rank)).backward()
    engine.finish()  # nothing else: no clipping, no step
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("dp, ep", [(2, 2), (4, 2)])
def test_expert_data_parallel_finish_gives_the_single_process_gradient(dp, ep):
    """Right after `finish()`, every rank's gradient of every parameter it holds equals the gradient of the
    global batch's mean loss, (1/dp)·Σ_r loss_r, computed in one process: the replicated weights (attention,
    router, shared and dense FFN, embeddings) averaged over dp; an expert's summed over the ranks holding it
    (ep_dp) and divided by dp — not by ep_dp's size, and not summed over the EP group, whose other ranks hold
    other experts. AdamW with clipping would hide a uniform scale; the gradients themselves do not."""
    whole = materialize(build_model(DDP_CFG), seed=2)
    for rank in range(dp):
        (_loss(whole, _batch(rank)) / dp).backward()
    want = {name: p.grad for name, p in whole.named_parameters()}
    results = run(_finished_gradients, dp, dp, ep)
    held: dict[str, int] = {}
    for rank, grads in enumerate(results):
        for name, grad in grads.items():
            held[name] = held.get(name, 0) + 1
            torch.testing.assert_close(grad, want[name], rtol=1e-4, atol=1e-7,
                                       msg=lambda m, n=name, r=rank: f"rank {r}, {n}: {m}")
    experts = {name for name in want if ".experts." in name}
    assert set(held) == set(want)
    assert all(held[name] == dp // ep for name in experts) and all(held[n] == dp for n in set(want) - experts)
