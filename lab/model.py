"""A Llama-style decoder that knows nothing of parallelism.

RMSNorm, rotary position embeddings, grouped-query attention (or DeepSeek's multi-head latent attention),
and a SwiGLU feed-forward (or a mixture of SwiGLU experts). Parallelisms are *applied* to this model by
`lab.parallel`; to make that possible it follows three rules borrowed from TorchTitan:

1. Head counts are read from tensor shapes in `forward` (`view(B, T, -1, head_dim)`), so a tensor-parallel
   layer that keeps a slice of the heads needs no change here.
2. Blocks live in an `nn.ModuleDict` keyed by their layer index, and the embedding, final norm and output
   layer may be set to `None`, so a pipeline stage can drop what it does not own and keep the same names.
3. It is built on the `meta` device (no memory) and materialised with `init_weights`, which draws every
   parameter from a generator seeded by the run seed and the parameter's *name*: the full weights are
   bit-identical whatever the parallel layout, which is what lets every parallel run be compared with a
   single-process one.
"""

from __future__ import annotations

import math
import zlib
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lab.config import RECOMPUTE_MODES, ModelConfig
from lab.layout import expert_capacity
from lab.loss import chunked_cross_entropy


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x²) + eps) · weight over the last dim, the statistics in float32 whatever x's dtype; the
    normalised x is rounded to x's dtype before the weight multiplies it."""
    return _Normalize.apply(x, eps) * weight


class _Normalize(torch.autograd.Function):
    """x / sqrt(mean(x²) + eps), keeping for backward only x as it is and the (rows, 1) fp32 reciprocal root: no
    fp32 copy of x, which autograd's own graph of the same ops would save.

    Only the mean of squares needs fp32 (a bf16 sum of d squares keeps 8 bits); x times that statistic is rounded
    once to x's dtype, as when the whole row went through fp32, and the backward, rstd·(g − x̂·mean(g·x̂)), is
    computed in fp32 too. On fp32 input these are eager PyTorch's six kernels, byte for byte the count of
    `lab.calc.roofline.rms_norm_fusion`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd)
        return (x * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        x, rstd = ctx.saved_tensors
        normed, grad = x * rstd, grad.to(rstd.dtype)
        return (rstd * (grad - normed * (grad * normed).mean(-1, keepdim=True))).to(x.dtype), None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.kernel = rms_norm  # the op itself; `lab.kernels.patch` swaps in a fused kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.eps)

    @torch.no_grad()
    def weight_gradient(self, inputs: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        """d loss / d weight from the input and the output's gradient (the zero-bubble W pass): the sum over
        tokens of grad_output · x̂, where x̂ is the normalised input — the op run with a weight of ones, so that
        a kernel-backed norm gives the gradient of the very values it computed."""
        normed = self.kernel(inputs, torch.ones_like(self.weight), self.eps)
        return (grad_output * normed).flatten(0, -2).sum(0)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x Wᵀ: every matmul with a weight in the model (and in its tensor-parallel pieces) goes through here."""
    return F.linear(x, weight)


class Linear(nn.Linear):
    """nn.Linear without a bias, whose matmul is a seam (`kernel(x, weight)`, as `Attention.core`): an FP8
    recipe (`lab.precision.fp8_linear`) is swapped in on every linear layer at once, the column- and
    row-parallel pieces of tensor parallelism (which subclass this) and the experts included."""

    def __init__(self, in_features: int, out_features: int, device: torch.device | str | None = None) -> None:
        super().__init__(in_features, out_features, bias=False, device=device)
        self.kernel = linear

    def reset_parameters(self) -> None:
        """nn.Linear's random init, skipped on the meta device: there it fills nothing, yet took 4.4 of the 10.4 s
        of a DeepSeek-V3 dry run (45,000 expert matmuls); `materialize` initialises every weight by name."""
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight)


def rope_angles(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, shape (T, dim/2) for positions (T,) shared by the batch, (B, 1, T, dim/2)
    for positions (B, T) of each sequence (inference: each at its own offset): pair i of position p turns by
    p·theta^(-2i/dim)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim)
    angles = positions.float()[..., None] * inv_freq
    if positions.dim() == 2:
        angles = angles[:, None]  # broadcast over the heads of (B, H, T, D)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (first half, second half) pairs of the last dim of x (B, H, T, D) — the Hugging Face layout — in x's
    dtype when cos and sin are given in it (`Transformer.forward` casts the tables once per forward, as Hugging
    Face's Llama does): a rotation sums two products, nothing there needs fp32's accumulation, and a bf16 model's
    q and k make no fp32 round trip. fp32 tables give an fp32 rotation, rounded once to x's dtype."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)


class LayerCache(Protocol):
    """One layer's KV cache as attention sees it (`lab.inference` has a contiguous and a paged one)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Store the new tokens' k, v (B, n_kv_heads, T, hd) and return the attention (B, n_heads, T, hd) of q over
        every cached key of its sequence, causally by absolute position."""


class KVCacheLike(Protocol):
    def layer(self, index: int) -> LayerCache: ...


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """softmax(q kᵀ · scale + causal mask) v, with fewer KV heads than query heads allowed (GQA)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


class Attention(nn.Module):
    """Grouped-query attention: n_heads query heads share n_kv_heads key/value heads.

    With a `cache` (inference, `lab.inference`), the new tokens' keys and values go into it and the queries attend
    over everything it holds, causally by absolute position: `cache.attend(q, k, v)` replaces the causal core,
    whose `is_causal=True` is only right when the queries and keys are the same tokens. Training passes none."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = Linear(cfg.d_model, cfg.n_heads * cfg.head_dim)
        self.wk = Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim)
        self.wv = Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim)
        self.wo = Linear(cfg.n_heads * cfg.head_dim, cfg.d_model)
        self.recompute_core = False
        self.core = causal_attention  # softmax(qkᵀ)v; context parallelism swaps in a distributed version

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerCache | None = None
                ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            out = cache.attend(q, k, v)
        elif self.recompute_core:  # selective recompute: keep q, k, v; redo softmax(qkᵀ)v in backward
            out = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            out = self.core(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class LatentAttention(nn.Module):
    """DeepSeek's multi-head latent attention (MLA).

    Keys and values are rebuilt from one small latent per token (kv_lora_rank wide) — that latent is all
    an inference KV cache needs to store. Position goes through a separate RoPE part of each query and a
    single RoPE key shared by all heads, because a rotation cannot be folded into the latent projection.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        qk_dim = self.nope_dim + self.rope_dim
        if cfg.q_lora_rank:
            self.wq_a = Linear(cfg.d_model, cfg.q_lora_rank)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.wq_b = Linear(cfg.q_lora_rank, cfg.n_heads * qk_dim)
        else:
            self.wq = Linear(cfg.d_model, cfg.n_heads * qk_dim)
        self.wkv_a = Linear(cfg.d_model, cfg.kv_lora_rank + self.rope_dim)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        self.wkv_b = Linear(cfg.kv_lora_rank, cfg.n_heads * (self.nope_dim + self.v_dim))
        self.wo = Linear(cfg.n_heads * self.v_dim, cfg.d_model)
        self.recompute_core = False
        self.core = causal_attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerCache | None = None
                ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)
        q = q.view(B, T, -1, self.nope_dim + self.rope_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.wkv_b.in_features, self.rope_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(B, T, -1, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k_rope = apply_rope(k_rope.view(B, 1, T, self.rope_dim), cos, sin).expand(-1, k_nope.shape[1], -1, -1)
        q = torch.cat((q_nope, apply_rope(q_rope, cos, sin)), dim=-1)
        k = torch.cat((k_nope, k_rope), dim=-1)
        scale = 1.0 / math.sqrt(self.nope_dim + self.rope_dim)
        if cache is not None:  # keys and values as rebuilt from the latent (a latent cache would store less)
            out = cache.attend(q, k, v, scale)
        elif self.recompute_core:
            out = checkpoint(self.core, q, k, v, scale, use_reentrant=False)
        else:
            out = self.core(q, k, v, scale)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up: the gated activation between a SwiGLU feed-forward's two projections."""
    return F.silu(gate) * up


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1·x) * w3·x)."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w1 = Linear(d_model, d_ff)
        self.w3 = Linear(d_model, d_ff)
        self.w2 = Linear(d_ff, d_model)
        self.kernel = swiglu  # `lab.kernels.patch` swaps in a fused kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.kernel(self.w1(x), self.w3(x)))


class MoE(nn.Module):
    """Top-k routed SwiGLU experts (plus optional always-on shared experts).

    Each token's router scores (softmax over experts, or DeepSeek-V3's per-expert sigmoid) pick its top_k
    experts and weight their outputs (the *gates*). The gates are the chosen scores, divided by their sum
    when `cfg.renormalizes_gates` (GShard's top-2, Mixtral, DeepSeek-V3; not Switch's top-1, whose gate is
    the raw probability — a renormalised single gate is 1 and carries no gradient to the router), times
    `cfg.moe_route_scale` (DeepSeek-V3: 2.5). With a `capacity_factor` c an expert takes at most
    c·tokens·top_k/n_experts assignments, first come first served in token order (a token's choices best
    first), and the rest are dropped (their token keeps only the residual). The expert computation is
    grouped: assignments are sorted by expert so that each expert runs once on a contiguous block — the
    layout expert parallelism sends over all-to-all, which is why `compute` is a swappable step
    (`lab.parallel.ep` replaces it).

    Every forward in training mode leaves, for the trainer and the logs, `aux_loss` (Switch/GShard:
    n_experts·Σ_e f_e·P_e, f_e the share of assignments and P_e the mean score of expert e; 1 when perfectly
    balanced), `z_loss` (ST-MoE: the mean squared log-sum-exp of the router logits), `load` (assignments per
    expert, after drops) and `dropped` (assignments dropped). In eval mode (inference) there are no balancing
    losses and no capacity limit: a token's output must not depend on which other tokens share its batch.

    `routing_bias` (None until `update_routing_bias` first runs) is DeepSeek-V3's auxiliary-loss-free balancing:
    a per-expert bias added to the scores only to *choose* the top-k experts; the gates stay the unbiased scores,
    so the bias steers the load without entering the output or the gradient. It is a buffer (saved with the
    model, replicated like the router), updated outside autograd after each step.
    """

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.layer = layer  # the block it sits in: a log of `load` per layer names it
        self.top_k, self.n_experts = cfg.top_k, cfg.n_experts
        self.gating, self.capacity_factor = cfg.moe_gating, cfg.capacity_factor
        self.renormalize, self.route_scale = cfg.renormalizes_gates, cfg.moe_route_scale
        self.router = Linear(cfg.d_model, cfg.n_experts)
        # keyed by the global expert index: an expert-parallel rank keeps only its own, under the same names
        self.experts = nn.ModuleDict({str(e): FeedForward(cfg.d_model, cfg.d_ff_expert) for e in range(cfg.n_experts)})
        self.shared = (FeedForward(cfg.d_model, cfg.n_shared_experts * cfg.d_ff_expert)
                       if cfg.n_shared_experts else None)
        self.compute = self.compute_local
        self.aux_loss = self.z_loss = self.load = None
        self.dropped = 0
        self.register_buffer("routing_bias", None)

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (gates, expert ids), both (n_tokens, top_k), best expert first; record the router losses."""
        logits = self.router(tokens).float()
        scores = logits.softmax(dim=-1) if self.gating == "softmax" else logits.sigmoid()
        if self.routing_bias is None:
            weights, chosen = scores.topk(self.top_k, dim=-1)
        else:  # the bias picks the experts; their gates are still the unbiased scores
            chosen = (scores + self.routing_bias).topk(self.top_k, dim=-1).indices
            weights = scores.gather(-1, chosen)
        if self.training:
            share = torch.zeros(self.n_experts, device=tokens.device).index_add_(
                0, chosen.flatten(), torch.ones(chosen.numel(), device=tokens.device)) / chosen.numel()
            probability = (scores / scores.sum(dim=-1, keepdim=True)).mean(dim=0)
            self.aux_loss = self.n_experts * (share * probability).sum()
            self.z_loss = torch.logsumexp(logits, dim=-1).pow(2).mean()
        else:
            self.aux_loss = self.z_loss = None
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights * self.route_scale).type_as(tokens), chosen

    @torch.no_grad()
    def update_routing_bias(self, load: torch.Tensor, rate: float) -> None:
        """One step of DeepSeek-V3's balancing (its γ = `rate`, 0.001 in the paper): lower the bias of every
        expert whose `load` (assignments over the step, every rank's) is above the mean by `rate`, raise the others'
        by `rate` (sign, not size: the step is the same for a slightly and a badly overloaded expert)."""
        if not rate > 0:
            raise ValueError(f"rate={rate!r} must be > 0")
        if load.shape != (self.n_experts,):
            raise ValueError(f"load has shape {tuple(load.shape)}, expected ({self.n_experts},): one count per expert")
        if self.routing_bias is None:
            self.routing_bias = torch.zeros(self.n_experts, device=load.device)
        load = load.float()
        self.routing_bias += rate * torch.sign(load.mean() - load)

    def capacity_mask(self, chosen: torch.Tensor) -> torch.Tensor:
        """(n_tokens, top_k) bool: which assignments fit their expert's capacity (all, without a factor or when
        not training)."""
        if not self.capacity_factor or not self.training:
            return torch.ones_like(chosen, dtype=torch.bool)
        capacity = expert_capacity(chosen.shape[0], chosen.shape[1], self.n_experts, self.capacity_factor)
        flat = F.one_hot(chosen.flatten(), self.n_experts)  # assignments in token order, then slot order
        position = (flat.cumsum(dim=0) * flat).sum(dim=-1)  # 1-based place in its expert's queue
        return (position <= capacity).view_as(chosen)

    def compute_local(self, inputs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Run expert e on its block of `inputs` (sorted by expert, counts[e] rows each)."""
        blocks = inputs.split(counts)
        return torch.cat([self.experts[str(e)](block) for e, block in enumerate(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = self.route(tokens)
        keep = self.capacity_mask(chosen)
        token_of = torch.arange(tokens.shape[0], device=x.device).repeat_interleave(self.top_k)[keep.flatten()]
        expert_of, weight_of = chosen.flatten()[keep.flatten()], weights.flatten()[keep.flatten()]
        order = expert_of.argsort(stable=True)  # group the kept assignments by expert
        counts = torch.bincount(expert_of, minlength=self.n_experts)
        self.load, self.dropped = counts.detach(), int((~keep).sum())
        outputs = self.compute(tokens[token_of[order]], counts.tolist())
        out = torch.zeros_like(tokens).index_add_(0, token_of[order], outputs * weight_of[order, None])
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.view_as(x)


def moe_losses(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over the MoE layers of the last forward's load-balancing and z losses (zeros for a dense model)."""
    layers = [m for m in model.modules() if isinstance(m, MoE) and m.aux_loss is not None]
    zero = next(model.parameters()).new_zeros(())
    return sum((m.aux_loss for m in layers), zero), sum((m.z_loss for m in layers), zero)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = LatentAttention(cfg) if cfg.attention == "mla" else Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = MoE(cfg, layer) if cfg.is_moe_layer(layer) else FeedForward(cfg.d_model, cfg.d_ff)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerCache | None = None
                ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, cache)
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output: Linear | None = Linear(cfg.d_model, cfg.vocab_size)
        self.recompute = "none"
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the output layer when the config says so (SmolLM, Llama-3.2-1B)."""
        if self.cfg.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache: KVCacheLike | None = None,
                targets: torch.Tensor | None = None, grad_scale: float = 1.0) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, vocab), or with `targets` (B, T) the mean next-token loss (nanoGPT's
        `model(idx, targets)`), computed from the final hidden states and the output weight chunk by chunk of tokens
        (`lab.loss.chunked_cross_entropy`, told `grad_scale`, fp16's loss scale that backward will start from): the
        batch's fp32 logits never exist, only a chunk's. A pipeline stage
        without the embedding gets hidden states (B, T, d_model) instead and, without the output layer, returns
        hidden states.
        `positions` (T,) defaults to 0..T-1; context parallelism passes the positions of its chunks; inference
        passes (B, T), each sequence's own, with a `cache` (`lab.inference`) whose `layer(i)` each block's
        attention stores its keys and values in and attends over."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if positions is None:  # from the input, not h: sequence parallelism hands the blocks a shard of h
            positions = torch.arange(tokens.shape[1], device=h.device)
        rope_dim = self.cfg.qk_rope_head_dim if self.cfg.attention == "mla" else self.cfg.head_dim
        cos, sin = (table.to(h.dtype) for table in rope_angles(positions, rope_dim, self.cfg.rope_theta))
        for name, block in self.layers.items():
            if cache is not None:
                h = block(h, cos, sin, cache.layer(int(name)))
            elif self.recompute == "full":  # keep only each block's input; redo the block in backward
                h = checkpoint(block, h, cos, sin, use_reentrant=False)
            else:
                h = block(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        if targets is None:
            return self.output(h)
        if self.output.weight.shape[0] != self.cfg.vocab_size:
            raise ValueError(f"targets given to an output layer of {self.output.weight.shape[0]} of the "
                             f"{self.cfg.vocab_size} vocabulary rows (a TP shard): take its logits to "
                             "lab.parallel.tp.vocab_parallel_cross_entropy")
        return chunked_cross_entropy(h, self.output.weight, targets, grad_scale=grad_scale)


def set_recompute(model: Transformer, mode: str) -> None:
    """Activation recomputation: "none", "selective" (attention core only) or "full" (every block)."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={mode!r} must be one of {', '.join(map(repr, RECOMPUTE_MODES))}")
    model.recompute = mode
    for block in model.layers.values():
        block.attn.recompute_core = mode == "selective"


def build_model(cfg: ModelConfig, device: str | torch.device = "meta") -> Transformer:
    """Build the model. On "meta" (the default) no memory is used: count parameters, apply parallelisms,
    then `materialize`."""
    with torch.device(device):
        return Transformer(cfg)


def _is_output_projection(name: str) -> bool:
    return name.endswith(("wo.weight", "w2.weight"))


def init_tensor(name: str, shape: tuple[int, ...], cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The full initial value of parameter `name`, on the CPU, independent of any sharding.

    Norm weights start at one; other weights are N(0, 0.02), with projections back into the residual
    stream scaled by 1/sqrt(2·n_layers) (GPT-2) so the residual's variance does not grow with depth.
    A parallel layer that owns a shard takes its slice of this tensor.
    """
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
    std = 0.02 / math.sqrt(2 * cfg.n_layers) if _is_output_projection(name) else 0.02
    return torch.randn(shape, generator=generator) * std


@torch.no_grad()
def init_weights(model: Transformer, seed: int) -> None:
    for name, param in model.named_parameters():
        param.copy_(init_tensor(name, tuple(param.shape), model.cfg, seed))


def materialize(model: Transformer, device: str | torch.device = "cpu", seed: int = 0) -> Transformer:
    """Allocate a meta-device model on `device` and initialise it deterministically by parameter name."""
    model.to_empty(device=device)
    model.tie_weights()  # to_empty creates new tensors and would silently untie shared weights
    init_weights(model, seed)
    return model


def num_params(model: nn.Module) -> int:
    """Parameters of a (possibly meta) model; shared tensors counted once."""
    return sum(p.numel() for p in model.parameters())
