"""Exact parameter counts of `lab.model`'s architecture, from a `ModelConfig` alone.

The count is checked against the real model built on the `meta` device for every preset, and against
the published sizes of the models the presets copy (Llama-3.1-8B has 8,030,261,248 parameters).
"""

from __future__ import annotations

from lab.config import ModelConfig


def _attention(cfg: ModelConfig) -> int:
    d, h = cfg.d_model, cfg.n_heads
    if cfg.attention == "gqa":
        q_and_out = 2 * d * h * cfg.head_dim
        k_and_v = 2 * d * cfg.n_kv_heads * cfg.head_dim
        return q_and_out + k_and_v
    qk_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if cfg.q_lora_rank:  # q = W_qb · norm(W_qa · x): a low-rank bottleneck with its own RMSNorm
        query = d * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * h * qk_dim
    else:
        query = d * h * qk_dim
    # keys and values share one compressed latent (plus a decoupled RoPE key shared by all heads)
    kv_down = d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
    kv_up = cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    out = h * cfg.v_head_dim * d
    return query + kv_down + kv_up + out


def _swiglu(d_model: int, d_ff: int) -> int:
    return 3 * d_model * d_ff  # gate, up and down projections


def param_breakdown(cfg: ModelConfig) -> dict[str, int]:
    """Parameters by component, with `total` and `active` (what one token touches in an MoE model)."""
    d, L = cfg.d_model, cfg.n_layers
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(L))
    dense_layers = L - moe_layers
    expert = _swiglu(d, cfg.d_ff_expert)
    parts = {
        "embedding": cfg.vocab_size * d,
        "attention": L * _attention(cfg),
        "dense_ffn": dense_layers * _swiglu(d, cfg.d_ff),
        "router": moe_layers * d * cfg.n_experts,
        "experts": moe_layers * cfg.n_experts * expert,
        "shared_experts": moe_layers * cfg.n_shared_experts * expert,
        "norms": L * 2 * d + d,
        "lm_head": 0 if cfg.tie_embeddings else cfg.vocab_size * d,
    }
    parts["total"] = sum(parts.values())
    parts["active"] = parts["total"] - moe_layers * (cfg.n_experts - cfg.top_k) * expert
    return parts


def count_params(cfg: ModelConfig) -> int:
    """Total number of parameters (tied embeddings counted once)."""
    return param_breakdown(cfg)["total"]
