"""Training FLOPs, model FLOPs utilisation (MFU) and hardware FLOPs utilisation (HFU).

A matmul of (n, k) by (k, m) costs 2nkm FLOPs. Forward, each token meets each weight once: 2N FLOPs for N
weights; backward needs the gradient with respect to both the input and the weight: twice that. Hence the
famous 6N per token — plus attention, whose QKᵀ and PV products have no weights: 2·2·s·h per token and
layer forward, 12·L·h·s forward + backward (the playbook's 6·s·N + 12·L·h·s² per sequence, PaLM's MFU
formula; it counts the full s x s matrix, as kernels and `FlopCounterMode` do, causal mask or not).

Two ways of counting, selected by `counting`:
* "6N": 6·N + 12·L·h·s per token with N all (active) parameters, the book's convention.
* "exact": the matmuls lab.model runs, 3 x (2 x matmul weights + attention) — the embedding lookup and
  norms do no matmul, a tied output layer does one; it equals `torch.utils.flop_counter.FlopCounterMode`
  with the math attention kernel (the counter has no formula for the CPU flash kernel and counts it as 0).

MFU divides the model's FLOPs by what the GPUs could have done in the step; HFU counts the FLOPs really
executed, including activation recomputation, so HFU >= MFU. With "6N" recompute adds a whole forward
(full: the 6N -> 8N of block remat) or the attention core's forward (selective); with "exact" it adds what
torch's checkpoint really reruns (see `_forward_flops`).
"""

from __future__ import annotations

from dataclasses import dataclass

from lab.calc.hardware import get_accelerator
from lab.calc.params import param_breakdown
from lab.config import RECOMPUTE_MODES, ModelConfig
from lab.layout import check_count

COUNTINGS = ("6N", "exact")


@dataclass(frozen=True)
class FlopsEstimate:
    tokens: int  # per step, all ranks together
    model_flops_per_token: float
    hardware_flops_per_token: float

    @property
    def model_flops(self) -> float:
        return self.tokens * self.model_flops_per_token

    @property
    def hardware_flops(self) -> float:
        return self.tokens * self.hardware_flops_per_token


def _attention_dims(cfg: ModelConfig) -> tuple[int, int]:
    """Width of the q·k products and of the p·v products, summed over heads."""
    if cfg.attention == "mla":
        return cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim), cfg.n_heads * cfg.v_head_dim
    return cfg.n_heads * cfg.head_dim, cfg.n_heads * cfg.head_dim


def _six_n_forward(n_params: float, n_layers: int, d_model: int, seq: int) -> tuple[float, dict[str, float]]:
    """The book's forward FLOPs per token, 2N + 4·L·h·s, and what each recompute mode runs again: the
    attention products (selective) or the whole forward (full)."""
    attention = 2 * 2 * d_model * seq * n_layers
    forward = 2 * n_params + attention
    return forward, {"none": 0.0, "selective": attention, "full": forward}


def six_n_flops_per_token(n_params: float, n_layers: int = 0, d_model: int = 0, seq: int = 0,
                          recompute: str = "none") -> tuple[float, float]:
    """(model, hardware) training FLOPs per token from the sizes alone: 6N + 12·L·h·s, and that plus what
    `recompute` runs again (HFU's numerator). With L = h = s = 0 it is the bare 6N of "6·N·D"."""
    if not n_params > 0:
        raise ValueError(f"n_params={n_params!r} must be > 0")
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={recompute!r} must be one of {', '.join(map(repr, RECOMPUTE_MODES))}")
    forward, recomputed = _six_n_forward(n_params, n_layers, d_model, seq)
    return 3 * forward, 3 * forward + recomputed[recompute]


def _forward_flops(cfg: ModelConfig, seq: int, counting: str) -> tuple[float, dict[str, float]]:
    """Forward FLOPs per token, and what each recompute mode adds to them."""
    parts = param_breakdown(cfg)
    d, L = cfg.d_model, cfg.n_layers
    if counting == "6N":
        return _six_n_forward(parts["active"], L, d, seq)
    qk, pv = _attention_dims(cfg)
    latent_norms = L * (cfg.q_lora_rank + cfg.kv_lora_rank) if cfg.attention == "mla" else 0
    layer_weights = parts["active"] - parts["embedding"] - parts["lm_head"] - parts["norms"] - latent_norms
    forward = 2 * (layer_weights + cfg.vocab_size * d) + 2 * seq * (qk + pv) * L
    # torch's checkpoint stops recomputing once backward has every tensor it saved (early stop): the last
    # FFN projection w2 of a block (shared experts' in MoE blocks) and the attention core's p·v product
    # (math kernel) produce nothing that is saved, so they are not run again.
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(L))
    w2 = (L - moe_layers) * d * cfg.d_ff + moe_layers * cfg.n_shared_experts * d * cfg.d_ff_expert
    full = 2 * (layer_weights - w2) + 2 * seq * (qk + pv) * L
    return forward, {"none": 0.0, "selective": 2 * seq * qk * L, "full": full}


def training_flops(cfg: ModelConfig, seq: int, tokens: int | None = None, *, recompute: str = "none",
                   counting: str = "6N") -> FlopsEstimate:
    """FLOPs of training on `tokens` tokens per step (default: one sequence) in sequences of `seq`."""
    tokens = seq if tokens is None else tokens
    check_count("seq", seq)
    check_count("tokens", tokens)
    if counting not in COUNTINGS:
        raise ValueError(f"counting={counting!r} must be one of {', '.join(map(repr, COUNTINGS))}")
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={recompute!r} must be one of {', '.join(map(repr, RECOMPUTE_MODES))}")
    forward, recomputed = _forward_flops(cfg, seq, counting)
    return FlopsEstimate(tokens, 3 * forward, 3 * forward + recomputed[recompute])


def utilization(flops: float, step_time_s: float, n_gpus: int, peak_flops: float | str, dtype: str = "bf16") -> float:
    """flops / (step_time · n_gpus · peak); `peak_flops` in FLOP/s or a name from `lab.calc.hardware`."""
    if not step_time_s > 0:
        raise ValueError(f"step_time={step_time_s!r} must be > 0 seconds")
    check_count("n_gpus", n_gpus)
    peak = get_accelerator(peak_flops).peak_flops(dtype) if isinstance(peak_flops, str) else peak_flops
    return flops / (step_time_s * n_gpus * peak)


def mfu(estimate: FlopsEstimate, step_time_s: float, n_gpus: int, gpu: float | str = "h100",
        dtype: str = "bf16") -> float:
    """Model FLOPs utilisation: recomputation does not count (it is the implementation's choice)."""
    return utilization(estimate.model_flops, step_time_s, n_gpus, gpu, dtype)


def hfu(estimate: FlopsEstimate, step_time_s: float, n_gpus: int, gpu: float | str = "h100",
        dtype: str = "bf16") -> float:
    """Hardware FLOPs utilisation: every FLOP executed, recomputation included."""
    return utilization(estimate.hardware_flops, step_time_s, n_gpus, gpu, dtype)


def training_time_s(flops: float, n_gpus: int, peak_flops: float, mfu: float) -> float:
    """Seconds to do `flops` of training on `n_gpus` GPUs of `peak_flops` FLOP/s each, running at `mfu`
    (`utilization` turned around)."""
    if not flops >= 0:
        raise ValueError(f"flops={flops!r} must be >= 0")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu={mfu!r} must be in (0, 1]")
    return utilization(flops, 1.0, n_gpus, peak_flops) / mfu  # seconds at 100% of peak, stretched by 1/MFU


def tokens_per_second(mfu: float, flops_per_token: float, peak_flops: float) -> float:
    """Tokens one GPU trains per second at `mfu`: the FLOP/s it really does over the FLOPs each token costs."""
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu={mfu!r} must be in (0, 1]")
    if not flops_per_token > 0:
        raise ValueError(f"flops_per_token={flops_per_token!r} must be > 0")
    return mfu * peak_flops / flops_per_token
