"""The model: parameter counts equal lab.calc's, weights do not depend on the layout, recompute is exact."""

import dataclasses
from collections import Counter

import pytest
import torch

from lab.calc import count_params
from lab.config import PRESETS, ModelConfig
from lab.model import build_model, init_tensor, materialize, num_params, set_recompute


@pytest.mark.parametrize("name", [n for n in PRESETS if n != "deepseek-v3"] + [
    pytest.param("deepseek-v3", marks=pytest.mark.timeout(120))])
def test_meta_model_parameter_count_equals_calc(name):
    model = build_model(PRESETS[name])
    assert next(model.parameters()).device.type == "meta"
    assert num_params(model) == count_params(PRESETS[name])


def _small(name: str, **changes) -> ModelConfig:
    small = dict(vocab_size=64, d_model=32, n_layers=3, d_ff=48, head_dim=0)
    return dataclasses.replace(PRESETS[name], **{**small, **changes})


SMALL_VARIANTS = {
    "gqa": _small("tiny"),
    "tied": _small("smollm-135m", n_heads=4, n_kv_heads=2),
    "moe+shared": _small("tiny-moe", n_shared_experts=1, n_dense_layers=1),
    "mla": _small("deepseek-v3", n_heads=4, n_kv_heads=4, n_experts=4, top_k=2, d_ff_expert=16, n_dense_layers=1,
                  q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
    "mla-no-q-lora": _small("deepseek-v3", n_heads=4, n_kv_heads=4, n_experts=0, q_lora_rank=0, kv_lora_rank=8,
                            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
}


@pytest.mark.parametrize("variant", SMALL_VARIANTS)
def test_materialised_variants_run_and_match_calc(variant):
    cfg = SMALL_VARIANTS[variant]
    model = materialize(build_model(cfg), seed=0)
    assert num_params(model) == count_params(cfg)
    logits = model(torch.randint(0, cfg.vocab_size, (2, 8)))
    assert logits.shape == (2, 8, cfg.vocab_size) and torch.isfinite(logits).all()
    if cfg.tie_embeddings:
        assert model.output.weight is model.tok_embeddings.weight


def test_init_is_deterministic_by_name_and_independent_of_build_order():
    cfg = PRESETS["tiny"]
    a = materialize(build_model(cfg), seed=3).state_dict()
    b = materialize(build_model(cfg), seed=3).state_dict()
    c = materialize(build_model(cfg), seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attn.wq.weight"], c["layers.0.attn.wq.weight"])
    # a pipeline stage that keeps only layers 4..7 gets exactly the same weights for them
    stage = build_model(cfg)
    for i in range(4):
        del stage.layers[str(i)]
    stage.tok_embeddings = None
    stage = materialize(stage, seed=3).state_dict()
    assert all(torch.equal(stage[k], a[k]) for k in stage)
    # a tensor-parallel shard is a slice of the full tensor
    full = init_tensor("layers.0.attn.wq.weight", (64, 64), cfg, seed=3)
    assert torch.equal(full, a["layers.0.attn.wq.weight"])


def test_causality_future_tokens_do_not_change_past_logits():
    cfg = PRESETS["tiny"]
    model = materialize(build_model(cfg), seed=0)
    x = torch.randint(0, cfg.vocab_size, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % cfg.vocab_size
    torch.testing.assert_close(model(x)[:, :10], model(y)[:, :10])


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_recompute_changes_memory_not_gradients(name):
    cfg = PRESETS[name]
    model = materialize(build_model(cfg), seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 32))
    grads = {}
    for mode in ("none", "selective", "full"):
        set_recompute(model, mode)
        model.zero_grad()
        model(tokens).logsumexp(-1).mean().backward()
        grads[mode] = [p.grad.clone() for p in model.parameters()]
    for mode in ("selective", "full"):
        for g0, g1 in zip(grads["none"], grads[mode], strict=True):
            torch.testing.assert_close(g0, g1, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="recompute='some' must be one of"):
        set_recompute(model, "some")


def test_moe_every_expert_gets_a_gradient():
    cfg = PRESETS["tiny-moe"]
    model = materialize(build_model(cfg), seed=0)
    model(torch.randint(0, cfg.vocab_size, (1, 4))).sum().backward()
    assert all(p.grad is not None for p in model.parameters())



def test_top1_router_learns_from_the_lm_loss_alone():
    """Switch Transformer (Fedus et al. 2021, §2.1) gates its one expert with the raw router probability p_i(x):
    that is what carries the language-model loss's gradient to the router. Renormalised, a single gate is
    p/p = 1 and the router would learn only from the aux and z losses (here 0)."""
    cfg = dataclasses.replace(PRESETS["tiny-moe"], n_layers=1, top_k=1, aux_loss_coef=0.0, z_loss_coef=0.0)
    assert not cfg.renormalizes_gates
    model = materialize(build_model(cfg), seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    router, expert = model.layers["0"].ffn.router.weight.grad, model.layers["0"].ffn.experts["0"].w2.weight.grad
    assert router.abs().max() > 1e-3 * expert.abs().max(), (router.abs().max(), expert.abs().max())


MLA = dict(q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)


@pytest.mark.parametrize("name, gate_norm, top_k, renormalizes, scale", [
    ("tiny-moe", "auto", 2, True, 1.0),  # GShard top-2 / Mixtral: the two gates sum to one
    ("tiny-moe", "auto", 1, False, 1.0),  # Switch: the raw probability
    ("tiny-moe", "none", 2, False, 1.0),  # e.g. Qwen1.5-MoE's norm_topk_prob=false
    ("mixtral-8x7b", "topk", 2, True, 1.0),
    ("deepseek-v3", "topk", 8, True, 2.5),  # sigmoid scores, normalised, times routed_scaling_factor 2.5
])
def test_gates_follow_the_architecture(name, gate_norm, top_k, renormalizes, scale):
    """The presets' gates: Mixtral's config (HF MixtralSparseMoeBlock) renormalises its top-2; DeepSeek-V3's
    (scoring_func=sigmoid, norm_topk_prob=true, routed_scaling_factor=2.5) normalises its top-8 sigmoid scores
    and scales them; tiny-moe's "auto" renormalises top-2 and leaves top-1 raw (Switch)."""
    assert PRESETS[name].moe_gate_norm == gate_norm or name == "tiny-moe"
    cfg = _small(name, n_heads=4, n_kv_heads=4, n_experts=8, top_k=top_k, d_ff_expert=16, n_dense_layers=0,
                 moe_gate_norm=gate_norm, **(MLA if name == "deepseek-v3" else {}))
    assert cfg.renormalizes_gates == renormalizes and cfg.moe_route_scale == scale
    moe = materialize(build_model(cfg), seed=0).layers["0"].ffn
    x = torch.randn(12, cfg.d_model, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        gates, chosen = moe.route(x)
        logits = moe.router(x)
    scores = logits.softmax(-1) if cfg.moe_gating == "softmax" else logits.sigmoid()
    raw = scores.gather(1, chosen)
    want = raw / raw.sum(-1, keepdim=True) if renormalizes else raw
    torch.testing.assert_close(gates, want * scale)


def test_renormalised_top1_is_refused():
    with pytest.raises(ValueError, match="moe_gate_norm='topk' with top_k=1 makes every gate 1"):
        dataclasses.replace(PRESETS["mixtral-8x7b"], top_k=1)


@pytest.mark.parametrize("variant", SMALL_VARIANTS)
def test_every_weight_matrix_is_multiplied_through_the_linear_seam(variant):
    """An FP8 recipe is installed on `Linear.kernel`: it reaches every matmul with a weight only if each one
    goes through the seam — attention, MLA, experts, router and output layer alike (the embedding is a lookup)."""
    from lab.model import Linear, MoE

    cfg = SMALL_VARIANTS[variant]
    model = materialize(build_model(cfg), "cpu", seed=0)
    seen = []
    for module in model.modules():
        if isinstance(module, Linear):
            module.kernel = lambda x, weight, seen=seen: seen.append(weight) or torch.nn.functional.linear(x, weight)
    model(torch.randint(0, cfg.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0)))
    assert all(bool((m.load > 0).all()) for m in model.modules() if isinstance(m, MoE)), "every expert gets tokens"
    matrices = {id(p) for n, p in model.named_parameters() if p.dim() == 2 and "tok_embeddings" not in n}
    matrices.add(id(model.output.weight))  # tied, it is the embedding's (listed once, under the embedding's name)
    assert {id(w) for w in seen} == matrices


@pytest.mark.parametrize("variant", ["gqa", "tied"])
def test_targets_give_the_loss_of_the_logits_without_them(variant):
    """`model(tokens, targets=...)` (the chunked loss) is the cross-entropy of `model(tokens)`'s logits, and every
    parameter's gradient is the same — the output weight's, tied to the embedding or not, included — by the
    kernels' error-ratio rule against the model in float64."""
    from lab.kernels.accuracy import assert_error_ratio
    from lab.loss import cross_entropy

    cfg = SMALL_VARIANTS[variant]
    gen = torch.Generator().manual_seed(0)
    tokens, targets = torch.randint(0, cfg.vocab_size, (2, 2, 16), generator=gen)

    def loss_and_grads(dtype: torch.dtype, chunked: bool) -> list[torch.Tensor]:
        model = materialize(build_model(cfg), "cpu", seed=0).to(dtype)
        loss = model(tokens, targets=targets) if chunked else cross_entropy(model(tokens), targets)
        loss.backward()
        return [loss.detach()] + [p.grad for p in model.parameters()]

    reference = loss_and_grads(torch.float64, chunked=False)
    for i, (got, torch_own, ref) in enumerate(zip(loss_and_grads(torch.float32, True),
                                                  loss_and_grads(torch.float32, False), reference, strict=True)):
        assert_error_ratio(f"{variant}: {'loss' if i == 0 else f'parameter {i - 1} gradient'}", got, torch_own, ref)


def test_targets_on_a_vocabulary_shard_are_refused():
    cfg = SMALL_VARIANTS["gqa"]
    model = materialize(build_model(cfg), "cpu", seed=0)
    model.output.weight = torch.nn.Parameter(model.output.weight[: cfg.vocab_size // 2].detach())  # as a TP shard
    tokens = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=f"output layer of {cfg.vocab_size // 2} of the {cfg.vocab_size} vocabulary"):
        model(tokens, targets=tokens)


def test_bf16_norms_and_rope_keep_no_fp32_copy_of_the_activations():
    """In a bf16 model only a norm's (rows, 1) statistic and the RoPE tables' angles are kept in fp32: no fp32
    tensor of an activation's size is saved for backward (the old `rms_norm` kept two fp32 copies of x), RoPE makes
    none (it upcast q and k), and a norm makes three, transiently: x and its squares for the statistic, and x
    times it, rounded once to bf16."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lab.model import RMSNorm

    cfg = SMALL_VARIANTS["gqa"]
    model = materialize(build_model(cfg), "cpu", seed=0).to(torch.bfloat16)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    activation_size = tokens.numel() * cfg.head_dim  # the smallest activation: one head of q or k
    saved, made = [], []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.numel() >= activation_size:
                made.append(func)
            return out

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), Record():
        model(tokens)
    assert [t for t in saved if t.dtype == torch.float32 and t.numel() >= activation_size] == []
    norms = sum(isinstance(m, RMSNorm) for m in model.modules())
    assert len(made) == 3 * norms, f"fp32 activation-sized tensors made: {Counter(map(str, made))}, not 3 a norm"
