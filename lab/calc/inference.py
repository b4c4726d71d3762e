"""Serving costs on paper: the KV cache, the decode and prefill bounds, the critical batch and how many sequences
fit (How to Scale Your Model, ch. 7-8). Torch-free.

Generation has two phases. **Prefill** runs the whole prompt through the model at once: T tokens meet every
weight, so it is compute-bound and its time is its FLOPs over peak x MFU (`prefill_time`). **Decode** produces one
token per sequence per step: a step reads every weight and every sequence's KV cache from HBM to do
2 FLOPs per weight per sequence, so at small batch it is bound by HBM bandwidth (`decode_step`):

    latency bound   (weight bytes + batch x KV bytes per sequence) / (tp x HBM bandwidth)
    general step    attention: max(KV bytes / bandwidth, its FLOPs / peak)      the KV cache, always memory-bound
                  + weight matmuls: max(weight bytes / bandwidth, 2·N·batch / peak)  compute-bound past B_crit
                  (+ TP's all-reduces, when asked: 2 per layer, `lab.calc.comms`)

(the book's "T_step = B·KV/(N·W_hbm) + max(2·B·P/(N·C), P_bytes/(N·W_hbm))", ch. 7). The weight matmuls turn
compute-bound at the **critical batch** (`critical_batch`): FLOPs 2·B per weight against weight_bytes per
weight, so B_crit = ridge x weight_bytes / 2 — 240 on a TPU v5e and ~300 on an H100 in bf16, half with int8
weights and bf16 compute, and E/k times more for a mixture of experts (each token meets k of E experts).
The KV cache is each sequence's own, so batching never amortises it: attention stays memory-bound however large
the batch, which is why GQA, MLA and KV quantization matter (`kv_bytes_per_token`).

Tensor parallelism over tp chips divides the weights (every matrix split, Megatron-style; the replicated norms
are a rounding error) and the KV cache: over KV heads up to n_kv_heads ways, then over the batch (ch. 7's
KV[2, B_Z, S, K_Y, H]), so a chip holds ceil(batch / (tp / heads)) sequences' KV for its heads. MLA's latent is
shared by all heads of a token and splits over the batch only.

Counting conventions: a step reads the stored weights once (MoE: the experts some token of the batch routes to,
`weight_bytes_read`); FLOPs are lab.calc.flops' "6N" forward — 2 per active parameter and 4·d_model·context per
layer for q·kᵀ and p·v (the full matrix, causal or not; MLA's absorbed attention does more per cached byte, a
kernel detail this leaves out). Bytes everywhere; `kv_bytes` / `weight_bytes` are bytes
per element (2 bf16, 1 int8/fp8, 0.5 int4: `STORAGE_BYTES`).

Storage and compute are separate knobs. `weight_bytes` is how the weights are *stored*; `precision` is the dtype the
weight matmuls *compute* in, whose peak (`lab.calc.hardware`) prices their FLOPs. The default, precision="bf16", is
**weight-only quantisation** (W8A16, W4A16): the weights are read in fp8 or int4 and dequantised to bf16 before the
matmul, so they save memory and HBM traffic, never compute — past the critical batch an int4 plan runs no faster
than an fp8 one. precision="fp8" is **W8A8**: weights and activations both in fp8, the matmuls at the FP8 peak
(twice bf16's on an H100). Attention's q·kᵀ and p·v stay at the bf16 peak either way (`attention_precision`): an fp8
KV cache is dequantised for them, as serving engines do.

The chapter's widget calls

    inference_roofline(model, hardware, batch, context, tp=1, kv_bytes=2, weight_bytes=2) -> dict

with `intensity` (FLOPs per HBM byte of the step) and `ridge` (the chip's), `latency_bound_s` (the bytes over
bandwidth), `compute_s` (the FLOPs at peak), `step_s` (the general step), `bound` ("memory" or "compute": which
one the weight matmuls sit on), `tokens_per_s`, `tokens_per_s_per_chip` and `critical_batch`.
`throughput_latency` gives the book's curves as rows (one per batch) and `serving_plan` the ch. 8 reasoning
("serve LLaMA-3 70B") in numbers.

**Expert parallelism at decode** (`ep_decode`): a mixture of experts served over ep GPUs, each GPU holding
n_experts/ep experts and running attention for its own `batch` sequences (DeepSeek-V3's decoding layout: data-parallel
attention, experts spread over the group; DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", §3.4 "Inference and
Deployment"). Every MoE layer of every decode step sends each token's hidden state to its top-k experts and brings
the k outputs back: two all-to-alls (dispatch, combine) of batch × top_k × d_model × bytes per GPU, priced by
`lab.calc.comms`'s α–β model. At small batch the messages are tiny and the α per hop is the whole cost: a floor
(the same all-to-alls of zero bytes) that no batch size lowers, paid 2 × (MoE layers) times a token. An
implementation that sizes its receive buffers exactly (`lab.parallel.ep`) first exchanges the per-expert counts:
a third, nearly empty all-to-all per layer (`ep_counts_exchange`); `lab.parallel.ep_decode` measures all three.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from lab.calc.comms import CommCost, collective_time
from lab.calc.flops import training_flops
from lab.calc.hardware import Accelerator, get_accelerator
from lab.calc.network import SYSTEMS
from lab.calc.params import param_breakdown
from lab.calc.roofline import DTYPE_BYTES, peak_flops, ridge_point
from lab.config import ModelConfig, ParallelConfig
from lab.layout import check_count

STORAGE_BYTES = {**DTYPE_BYTES, "int4": 0.5}  # what weights and the KV cache may be stored in
ACTIVATION_BYTES = 2  # bf16 activations: what tensor parallelism's all-reduces carry


def _model(model: ModelConfig | str) -> ModelConfig:
    return model if isinstance(model, ModelConfig) else ModelConfig.from_preset(model)


def _chip(hardware: str | Accelerator) -> Accelerator:
    return hardware if isinstance(hardware, Accelerator) else get_accelerator(hardware)


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"{name}={value!r} must be a finite number > 0")


def _context(cfg: ModelConfig, context: int, name: str = "context") -> None:
    check_count(name, context)
    if context > cfg.max_seq_len:
        raise ValueError(f"{name}={context} must be <= max_seq_len={cfg.max_seq_len} of {cfg.name!r}")


def _mfu(mfu: float) -> None:
    if isinstance(mfu, bool) or not isinstance(mfu, int | float) or not 0 < mfu <= 1:
        raise ValueError(f"mfu={mfu!r} must be in (0, 1]")


def kv_bytes_per_token(model: ModelConfig | str, kv_bytes: float = 2) -> float:
    """Bytes of KV cache one token adds: a key and a value per KV head and layer, 2·L·K·H·bytes (GQA/MHA);
    MLA stores one compressed latent plus the shared RoPE key instead, L·(kv_lora_rank + qk_rope_head_dim)·bytes
    (DeepSeek-V2 §2.1.4)."""
    cfg = _model(model)
    _positive("kv_bytes", kv_bytes)
    if cfg.attention == "mla":
        per_layer = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    else:
        per_layer = 2 * cfg.n_kv_heads * cfg.head_dim
    return cfg.n_layers * per_layer * kv_bytes


def kv_bytes_per_sequence(model: ModelConfig | str, context: int, kv_bytes: float = 2) -> float:
    """The KV cache of one sequence of `context` tokens."""
    cfg = _model(model)
    _context(cfg, context)
    return context * kv_bytes_per_token(cfg, kv_bytes)


def weight_bytes_read(model: ModelConfig | str, batch: int, weight_bytes: float = 2) -> float:
    """Weight bytes one decode step reads, all chips together: every weight of a dense model. An MoE layer reads
    only the experts some token of the batch routes to, E·(1 - (1 - k/E)^B) of them on average under uniform
    routing: k at batch 1 (the active parameters), all E once B·k is well above E."""
    cfg = _model(model)
    check_count("batch", batch)
    _positive("weight_bytes", weight_bytes)
    parts = param_breakdown(cfg)
    touched = 1 - (1 - cfg.top_k / cfg.n_experts) ** batch if cfg.is_moe else 1.0
    return (parts["total"] - parts["experts"] * (1 - touched)) * weight_bytes


def kv_sharding(model: ModelConfig | str, tp: int) -> tuple[int, int]:
    """(ways over KV heads, ways over the batch) in which tp chips split the KV cache: heads first, up to
    n_kv_heads ways, then sequences (MLA: the batch only)."""
    cfg = _model(model)
    ParallelConfig(tp=tp).check_model(cfg)
    heads = 1 if cfg.attention == "mla" else min(tp, cfg.n_kv_heads)
    return heads, tp // heads


def forward_flops_per_token(model: ModelConfig | str, context: int) -> tuple[float, float]:
    """(weight matmuls, attention core) forward FLOPs of one token attending over `context` keys: a third of
    lab.calc.flops' "6N" training count, 2 per active parameter plus 4·d_model·context per layer."""
    cfg = _model(model)
    _context(cfg, context)
    linear = 2.0 * param_breakdown(cfg)["active"]
    return linear, training_flops(cfg, context, counting="6N").model_flops_per_token / 3 - linear


@dataclass(frozen=True)
class DecodeStep:
    """One decode step of `batch` sequences, seen from one of `chips` chips: what it reads and computes, and
    the least time each takes."""

    batch: int
    chips: int
    weight_bytes: float  # read per step, per chip
    kv_bytes: float  # read per step, per chip
    linear_flops: float  # the weight matmuls, per chip
    attention_flops: float  # q·kᵀ and p·v, per chip
    weights_s: float
    kv_s: float
    linear_s: float
    attention_s: float
    comms_s: float  # TP's all-reduces (0 unless asked for)

    @property
    def latency_bound_s(self) -> float:
        """Everything read once from HBM: the step can be no faster (ch. 7's T_step,min)."""
        return self.weights_s + self.kv_s

    @property
    def compute_s(self) -> float:
        return self.linear_s + self.attention_s

    @property
    def time_s(self) -> float:
        """The general step: attention on the KV cache, then the weight matmuls, each at its roof."""
        return max(self.kv_s, self.attention_s) + max(self.weights_s, self.linear_s) + self.comms_s

    @property
    def bound(self) -> str:
        """Where the weight matmuls sit: compute-bound past the critical batch (attention never is)."""
        return "compute" if self.linear_s > self.weights_s else "memory"

    @property
    def intensity(self) -> float:
        return (self.linear_flops + self.attention_flops) / (self.weight_bytes + self.kv_bytes)

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.time_s

    @property
    def tokens_per_s_per_chip(self) -> float:
        return self.tokens_per_s / self.chips

    def as_dict(self) -> dict:
        return {**asdict(self), "latency_bound_s": self.latency_bound_s, "compute_s": self.compute_s,
                "time_s": self.time_s, "bound": self.bound, "intensity": self.intensity,
                "tokens_per_s": self.tokens_per_s, "tokens_per_s_per_chip": self.tokens_per_s_per_chip}


def step_time(batch: int, weight_bytes: float, kv_bytes: float, linear_flops: float, hardware: str | Accelerator,
              *, attention_flops: float = 0.0, chips: int = 1, precision: str = "bf16",
              comms_s: float = 0.0, attention_precision: str = "bf16") -> DecodeStep:
    """A decode step from one chip's share: the weight and KV bytes it reads, the FLOPs it does (`precision`:
    the weight matmuls' compute dtype, whose peak prices `linear_flops`; `attention_precision` the same for
    `attention_flops`)."""
    check_count("batch", batch)
    check_count("chips", chips)
    for name, value in (("weight_bytes", weight_bytes), ("linear_flops", linear_flops)):
        _positive(name, value)
    for name, value in (("kv_bytes", kv_bytes), ("attention_flops", attention_flops), ("comms_s", comms_s)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
            raise ValueError(f"{name}={value!r} must be a finite number >= 0")
    chip = _chip(hardware)
    peak, bandwidth = peak_flops(chip, precision), chip.hbm_bandwidth
    attention_peak = peak_flops(chip, attention_precision)
    return DecodeStep(batch, chips, weight_bytes, kv_bytes, linear_flops, attention_flops, weight_bytes / bandwidth,
                      kv_bytes / bandwidth, linear_flops / peak, attention_flops / attention_peak, comms_s)


def tp_comms_s(model: ModelConfig | str, batch: int, tp: int, hardware: str) -> float:
    """TP's all-reduces in one decode step: two per layer (after attention, after the MLP) of batch x d_model
    bf16 activations over the tp GPUs' NVLink, the faster of a ring and a tree (`lab.calc.comms`); small
    messages, so mostly latency."""
    cfg = _model(model)
    check_count("batch", batch)
    check_count("tp", tp)
    if tp == 1:
        return 0.0
    if not isinstance(hardware, str) or hardware not in SYSTEMS:
        raise ValueError(f"hardware={getattr(hardware, 'name', hardware)!r} has no interconnect model for the "
                         f"comms term; valid: {', '.join(h for h in SYSTEMS if h != 'cpu')}")
    nbytes = batch * cfg.d_model * ACTIVATION_BYTES
    one = min(collective_time("all_reduce", nbytes, tp, system=hardware, algorithm=a).time_s for a in ("ring", "tree"))
    return 2 * cfg.n_layers * one


def decode_step(model: ModelConfig | str, hardware: str | Accelerator, batch: int, context: int, tp: int = 1,
                kv_bytes: float = 2, weight_bytes: float = 2, precision: str = "bf16",
                comms: bool = False) -> DecodeStep:
    """One decode step of `batch` sequences at `context` tokens each, on tp chips (see the module docstring):
    `weight_bytes` / `kv_bytes` per stored element; `precision` the weight matmuls' compute dtype ("bf16":
    weight-only quantisation, "fp8": W8A8 at the FP8 peak)."""
    cfg = _model(model)
    check_count("batch", batch)
    heads, batch_ways = kv_sharding(cfg, tp)
    kv = math.ceil(batch / batch_ways) * kv_bytes_per_sequence(cfg, context, kv_bytes) / heads
    linear, attention = forward_flops_per_token(cfg, context)
    return step_time(batch, weight_bytes_read(cfg, batch, weight_bytes) / tp, kv, batch * linear / tp, hardware,
                     attention_flops=batch * attention / tp, chips=tp, precision=precision,
                     comms_s=tp_comms_s(cfg, batch, tp, hardware) if comms else 0.0)


@dataclass(frozen=True)
class Prefill:
    tokens: int
    chips: int
    linear_flops: float  # all chips
    attention_flops: float  # all chips
    mfu: float
    time_s: float


def prefill_time(model: ModelConfig | str, hardware: str | Accelerator, tokens: int, tp: int = 1,
                 precision: str = "bf16", mfu: float = 0.4) -> Prefill:
    """One prompt of `tokens` tokens through the model on tp chips at `mfu` of their peak: compute-bound, its
    time is the FLOPs (2·N per token plus attention over the prompt) over tp·peak·mfu — the weight matmuls at
    `precision`'s peak, attention at bf16's. This is the time to the first token, queueing aside."""
    cfg = _model(model)
    _context(cfg, tokens, "tokens")
    ParallelConfig(tp=tp).check_model(cfg)
    _mfu(mfu)
    linear, attention = forward_flops_per_token(cfg, tokens)
    chip = _chip(hardware)
    time_s = tokens * (linear / peak_flops(chip, precision) + attention / peak_flops(chip, "bf16")) / (tp * mfu)
    return Prefill(tokens, tp, tokens * linear, tokens * attention, mfu, time_s)


def critical_batch(hardware: str | Accelerator, weight_bytes: float = 2, precision: str = "bf16",
                   model: ModelConfig | str | None = None) -> float:
    """The decode batch (tokens in flight) above which the weight matmuls are compute-bound: 2·B FLOPs per
    weight against `weight_bytes` per weight read, so B > ridge x weight_bytes / 2 (ch. 7: 240 on a TPU v5e in
    bf16, 120 for int8 weights with bf16 compute). In an MoE layer each expert sees only k/E of the tokens while
    all E are read, so B > ridge x weight_bytes / 2 x E/k (ch. 4 Q8)."""
    _positive("weight_bytes", weight_bytes)
    batch = ridge_point(_chip(hardware), precision) * weight_bytes / 2
    cfg = None if model is None else _model(model)
    return batch * cfg.n_experts / cfg.top_k if cfg is not None and cfg.is_moe else batch


def max_sequences(model: ModelConfig | str, hardware: str | Accelerator, context: int, tp: int = 1,
                  kv_bytes: float = 2, weight_bytes: float = 2, hbm_bytes: float | None = None) -> int:
    """How many sequences of `context` tokens fit beside the weights in tp chips' HBM (`hbm_bytes` per chip,
    default the chip's): each chip's free memory over its share of one sequence's KV, times the batch ways.
    Activations and the runtime's own memory are left out (a real server keeps ~10-20 % for them)."""
    cfg = _model(model)
    _positive("weight_bytes", weight_bytes)
    memory = _chip(hardware).memory_bytes if hbm_bytes is None else hbm_bytes
    _positive("hbm_bytes", memory)
    heads, batch_ways = kv_sharding(cfg, tp)
    free = memory - param_breakdown(cfg)["total"] * weight_bytes / tp
    if free <= 0:
        return 0
    return batch_ways * math.floor(free / (kv_bytes_per_sequence(cfg, context, kv_bytes) / heads))


def throughput_latency(model: ModelConfig | str, hardware: str | Accelerator, context: int, batches: list[int],
                       tp: int = 1, kv_bytes: float = 2, weight_bytes: float = 2, precision: str = "bf16",
                       hbm_bytes: float | None = None, comms: bool = False) -> list[dict]:
    """The book's throughput-latency curve as rows, one per batch: KV and total bytes (all chips), whether they
    fit, ms per step (the per-token latency), tokens/s in all and per chip, and what bounds the weight matmuls."""
    if not batches:
        raise ValueError("batches=[] must list at least one batch size")
    cfg = _model(model)
    fit = max_sequences(cfg, hardware, context, tp, kv_bytes, weight_bytes, hbm_bytes)
    weights = param_breakdown(cfg)["total"] * weight_bytes
    rows = []
    for batch in batches:
        step = decode_step(cfg, hardware, batch, context, tp, kv_bytes, weight_bytes, precision, comms)
        kv = batch * kv_bytes_per_sequence(cfg, context, kv_bytes)
        rows.append({"batch": batch, "kv_bytes": kv, "memory_bytes": weights + kv, "fits": batch <= fit,
                     "step_ms": step.time_s * 1e3, "latency_bound_ms": step.latency_bound_s * 1e3,
                     "tokens_per_s": step.tokens_per_s, "tokens_per_s_per_chip": step.tokens_per_s_per_chip,
                     "bound": step.bound})
    return rows


def inference_roofline(model: ModelConfig | str, hardware: str | Accelerator, batch: int, context: int,
                       tp: int = 1, kv_bytes: float = 2, weight_bytes: float = 2) -> dict:
    """A decode step on the chip's roofline, for the chapter's widget (bf16 compute; see the module docstring)."""
    step = decode_step(model, hardware, batch, context, tp, kv_bytes, weight_bytes)
    return {"intensity": step.intensity, "ridge": ridge_point(_chip(hardware)),
            "latency_bound_s": step.latency_bound_s, "compute_s": step.compute_s, "step_s": step.time_s,
            "bound": step.bound, "tokens_per_s": step.tokens_per_s,
            "tokens_per_s_per_chip": step.tokens_per_s_per_chip,
            "critical_batch": critical_batch(hardware, weight_bytes, model=model)}


def serving_plan(model: ModelConfig | str = "llama3-70b", hardware: str | Accelerator = "h100", tp: int = 8,
                 context: int = 8192, batch: int | None = None, kv_bytes: float = 2, weight_bytes: float = 2,
                 precision: str = "bf16", mfu: float = 0.4, hbm_bytes: float | None = None,
                 comms: bool = False) -> dict:
    """Ch. 8's "serving LLaMA-3 70B" in numbers, for any model and chip: the weights and how many chips they need,
    the KV per token and per sequence, how many sequences fit, the decode step at `batch` (default: as many as
    fit, ch. 8's "latency at maximum batch") and its tokens/s, one prompt's prefill, and the critical batch.
    `precision` is the weight matmuls' compute dtype: "bf16" prices fp8 or int4 weights as weight-only quantisation
    (dequantised to bf16, at the bf16 peak), "fp8" as W8A8 (at the FP8 peak)."""
    cfg = _model(model)
    chip = _chip(hardware)
    memory = chip.memory_bytes if hbm_bytes is None else hbm_bytes
    fit = max_sequences(cfg, chip, context, tp, kv_bytes, weight_bytes, memory)
    if batch is None:
        if fit == 0:
            raise ValueError(f"batch=None asks for as many sequences as fit, and no sequence of context={context} "
                             f"fits on tp={tp} x {chip.name}: give a batch, more chips or smaller weights")
        batch = fit
    step = decode_step(cfg, hardware, batch, context, tp, kv_bytes, weight_bytes, precision, comms)
    weights = param_breakdown(cfg)["total"] * weight_bytes
    return {"model": cfg.name, "hardware": chip.name, "tp": tp, "context": context, "batch": batch,
            "weight_bytes": weights, "weight_bytes_per_chip": weights / tp, "min_chips_for_weights": weights / memory,
            "kv_bytes_per_token": kv_bytes_per_token(cfg, kv_bytes),
            "kv_bytes_per_sequence": kv_bytes_per_sequence(cfg, context, kv_bytes),
            "max_sequences": fit, "fits": batch <= fit, "step": step.as_dict(),
            "prefill_s": prefill_time(cfg, chip, context, tp, precision, mfu).time_s, "mfu": mfu,
            "critical_batch": critical_batch(chip, weight_bytes, precision, cfg),
            "tokens_per_s": step.tokens_per_s, "tokens_per_s_per_chip": step.tokens_per_s_per_chip}


@dataclass(frozen=True)
class EPDecode:
    """The all-to-alls of one expert-parallel decode step: a dispatch and a combine per MoE layer (one layer's
    each), the whole step's, its latency floor, and the tokens/s they allow."""

    ep: int
    batch: int  # sequences per GPU
    moe_layers: int
    dispatch: CommCost
    combine: CommCost
    floor_per_layer_s: float  # dispatch and combine of zero bytes: the α of every hop

    @property
    def step_s(self) -> float:
        return self.moe_layers * (self.dispatch.time_s + self.combine.time_s)

    @property
    def latency_floor_s(self) -> float:
        return self.moe_layers * self.floor_per_layer_s

    @property
    def latency_share(self) -> float:
        """How much of the all-to-all time is latency: near 1 at small batch, where batching is free."""
        return self.latency_floor_s / self.step_s

    @property
    def tokens_per_s(self) -> float:
        """The group's tokens per second if the all-to-alls were all a step did: a bound, ep × batch per step."""
        return self.ep * self.batch / self.step_s

    @property
    def tokens_per_s_per_sequence(self) -> float:
        return 1 / self.step_s

    def as_dict(self) -> dict:
        return {"ep": self.ep, "batch": self.batch, "moe_layers": self.moe_layers,
                "dispatch": self.dispatch.as_dict(), "combine": self.combine.as_dict(),
                "step_s": self.step_s, "latency_floor_s": self.latency_floor_s, "latency_share": self.latency_share,
                "tokens_per_s": self.tokens_per_s, "tokens_per_s_per_sequence": self.tokens_per_s_per_sequence}


def ep_decode(model: ModelConfig | str, batch: int, ep: int, hardware: str = "h100", dispatch_bytes: float = 2,
              combine_bytes: float = 2) -> EPDecode:
    """The two all-to-alls per MoE layer of a decode step on ep GPUs (`hardware`: a system of `lab.calc.network`,
    nodes of 8 GPUs: NVLink inside, the NICs between), each GPU with `batch` sequences (see the module docstring).
    `dispatch_bytes` / `combine_bytes`: bytes per hidden value sent (DeepSeek-V3 dispatches in FP8, 1, and combines
    in BF16, 2: its report's §3.3, on low-precision communication). The all-to-all is `lab.calc.comms`' pairwise
    schedule, ep − 1 messages one after the other: kernels that post every message at once over RDMA (DeepEP's
    low-latency mode) pay fewer α."""
    cfg = _model(model)
    check_count("batch", batch)
    check_count("ep", ep)
    ParallelConfig(dp=ep, ep=ep).check_model(cfg)  # a mixture of experts, ep dividing n_experts
    _positive("dispatch_bytes", dispatch_bytes)
    _positive("combine_bytes", combine_bytes)
    if hardware not in SYSTEMS:
        raise ValueError(f"hardware={hardware!r} must be one of {', '.join(SYSTEMS)}")
    values = batch * cfg.top_k * cfg.d_model  # hidden values each GPU sends out, and gets back, per MoE layer

    def all_to_all(nbytes: float) -> CommCost:
        return collective_time("all_to_all", nbytes, ep, system=hardware)

    return EPDecode(ep, batch, sum(map(cfg.is_moe_layer, range(cfg.n_layers))), all_to_all(values * dispatch_bytes),
                    all_to_all(values * combine_bytes), 2 * all_to_all(0).time_s)


COUNT_BYTES = 8  # an int64 count of rows per expert


def ep_counts_exchange(model: ModelConfig | str, ep: int, hardware: str = "h100") -> CommCost:
    """The all-to-all of routing counts that comes before each MoE layer's dispatch in an implementation sizing its
    receive buffers exactly (`lab.parallel.ep`: n_experts int64 counts a GPU): a third all-to-all per MoE layer,
    almost all latency, that `ep_decode` leaves out — DeepEP's low-latency kernels send into buffers sized for the
    worst case instead and skip it."""
    cfg = _model(model)
    check_count("ep", ep)
    ParallelConfig(dp=ep, ep=ep).check_model(cfg)
    if hardware not in SYSTEMS:
        raise ValueError(f"hardware={hardware!r} must be one of {', '.join(SYSTEMS)}")
    return collective_time("all_to_all", cfg.n_experts * COUNT_BYTES, ep, system=hardware)
