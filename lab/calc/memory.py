"""Per-GPU memory of a training step: parameters, gradients, optimizer states and activations.

Static memory is bytes per parameter times the parameters a rank holds. Tensor parallelism splits every
matrix outside the MoE layers (norms and MoE layers stay replicated, as `lab.parallel.tp` leaves them),
pipeline parallelism gives each stage its layers (the first stage also holds the embedding, the last the
final norm and output layer), expert parallelism splits the experts,
and ZeRO shards over the ranks that hold the same weights: stage 1 the optimizer states, stage 2 also the
gradients, stage 3 also the parameters (ZeRO's 2Ψ + 2Ψ + KΨ with K = 12 for mixed-precision Adam).
Dense weights are replicated on dp·cp ranks, expert weights on dp·cp/ep (TorchTitan's layout).

Activations have two models:

* "korthikanti": Korthikanti et al. 2022 (arXiv 2205.05198) for a GPT layer (MHA, 4h GeLU MLP, dropout)
  with 16-bit activations and 1-byte dropout masks, s·b·h·(34 + 5·a·s/h) bytes, applied as published
  whatever the architecture and `precision` (the playbook plots it next to fp32 weights too). The 5·a·s/h
  term is three s x s tensors per head: the softmax output (2 bytes), the dropout mask (1) and the dropout
  output (2), which multiplies V; the pre-softmax scores are not kept (softmax's backward needs its output
  only). Selective recompute and flash attention drop that term; full recompute keeps the 2·s·b·h layer input;
  tensor parallelism leaves 10·s·b·h replicated (s·b·h·(10 + 24/t + 5·a·s/(h·t))) unless sequence
  parallelism splits it too (everything /t); context parallelism gives each rank s/cp queries, which still
  see all s keys (everything /cp). Outside the layers: the embedding's dropout mask s·b·h, and
  4·s·b·h + 4·s·b·v for the final norm, the output layer's input and fp32 logits (the chunked loss keeps
  w·(s·b·h + v·h) instead of the logits, the hidden states' and the output weight's gradients, w bytes each).
* "exact": what autograd really keeps for `lab.model` in fp32 (derived in `_exact_layer`); it matches
  saved-tensor hooks byte for byte on the grid of tests/test_measure.py, which holds it to 2%.

With pipeline parallelism a stage keeps the activations of every micro-batch it has run forward but not yet
backward: m for AFAB, min(m, pp - stage) for 1F1B, so the first stage holds pp x (L/pp) layers' worth, as
much as without pipelining (Korthikanti §4.2.3). The counts are replayed from the schedule that
`lab.parallel.pp` executes, per chunk too: the last stage keeps the logits of m micro-batches under AFAB and
of one under 1F1B; interleaving keeps more embeddings on the first stage than min(m, pp). Stages hold the layers
`lab.layout.stage_layers` gives them (equal, Llama 3's lighter first and last, or counts per stage).

The loss needs more than what it keeps. On whole logits (`loss="whole"`, and always under tensor parallelism) at
its backward the fp32 gradients of the (B, T, vocab) log-probabilities sit beside them, two more copies of the
fp32 logits (`loss_bytes`). lab.train at tp = 1 takes the chunked cross-entropy (`loss="chunked"`, the default:
`lab.loss.chunked_cross_entropy`), which keeps the hidden states' and the output weight's gradients instead of
the logits and works on one chunk of tokens' logits at a time (`chunked_loss_bytes`). That working set is the
`loss` entry, on the last stage; with it calc.memory's total is the step's peak on a GPU, not only what lasts from
forward to backward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from lab.calc.params import count_params
from lab.calc.schedules import B, F, W, make_schedule, rank_layers
from lab.config import ModelConfig, ParallelConfig
from lab.layout import CHUNK_TOKENS, check_sequence, experts_per_rank, kv_heads_per_rank, stage_layers

# Bytes per parameter: (weights, gradients, optimizer states).
PRECISIONS = {
    "fp32": (4, 4, 8),  # fp32 weights and gradients, Adam's m and v
    "mixed": (2, 2, 12),  # bf16 weights and gradients + fp32 master weights, m and v (ZeRO's K = 12)
    "bf16": (2, 2, 8),  # bf16 weights and gradients, fp32 m and v, no master copy: the playbook's 5D plots
    # bf16 weights, gradients kept in fp32 only (each bf16 gradient moved into an fp32 sum as autograd makes it:
    # Megatron's main_grad), fp32 master weights, m and v: what `lab.train --precision bf16|fp16|fp8-*` keeps
    "mixed-fp32-grads": (2, 4, 12),
}
FP32_GRAD_ACCUM_BYTES = 4  # an fp32 gradient buffer next to the bf16 one: 16 -> 20 bytes per parameter


def training_precision(precision: str, reduce_dtype: str = "fp32") -> tuple[str, bool]:
    """The scheme of PRECISIONS, and whether to add fp32 gradient accumulation, that a `lab.train --precision`
    run keeps between steps. FP8 changes no static byte: the FP8 copies of weights and activations are made in
    each forward and live as activations, the weights stay bf16 with fp32 masters (torchao, DeepSeek-V3 §3.3).
    Gradients summed in the 16-bit compute dtype (`reduce_dtype`) stay in autograd's .grad, and the fp32
    masters take an fp32 copy of them: 2 + 4 bytes, the playbook's "fp32 gradient accumulation" layout."""
    if precision == "fp32":
        return "fp32", False
    return ("mixed-fp32-grads", False) if reduce_dtype == "fp32" else ("mixed", True)
ACTIVATION_MODELS = ("korthikanti", "exact")
LOSSES = ("chunked", "whole")  # lab.train's loss at tp = 1 (`lab.loss.chunked_cross_entropy`), or F.cross_entropy
PARAM_CONVENTIONS = ("exact", "playbook")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one GPU (the pipeline stage `stage`, by default the fullest one)."""

    num_params: int  # the whole model
    per_gpu: dict[str, int]  # params, grads, optimizer, activations, loss (its working set, `loss_bytes`), total
    activations_breakdown: dict[str, int]  # layers, embedding, logits
    stage: int
    params_on_gpu: int  # parameters this rank holds before ZeRO sharding

    def as_dict(self) -> dict:
        return {"num_params": self.num_params, "per_gpu_bytes": dict(self.per_gpu),
                "activations_breakdown": dict(self.activations_breakdown)}

    def headroom(self, capacity_bytes: int) -> int:
        """Bytes left on a device of `capacity_bytes`, negative when the layout needs that much more: the one
        "does it fit" rule that the CLI's verdict and the memory widget share."""
        return capacity_bytes - self.per_gpu["total"]


def static_bytes(num_params: float | Sequence[int], precision: str = "mixed", *, zero: int = 0, dp: int = 1,
                 fp32_grad_accum: bool = False, zero_rank: int = 0) -> dict[str, int]:
    """ZeRO's ladder for `num_params` weights replicated on `dp` ranks: the elements of the tensors a rank keeps.

    `num_params` may also be the sizes of ZeRO's units (lab.parallel.zero shards each transformer block, and a
    root of the rest, as one flat buffer, like FSDP): each unit is padded to a multiple of dp and cut into
    shards of ceil(unit / dp), so the padding lies on the group's last ranks, which hold fewer real elements.
    Padding is not counted (at most dp - 1 elements a unit); `zero_rank` is the rank's place in the group, by
    default 0, whose shards are all real: the fullest."""
    units = list(num_params) if isinstance(num_params, Sequence) else [num_params]
    p, g, o = PRECISIONS[precision]
    g += FP32_GRAD_ACCUM_BYTES if fp32_grad_accum else 0
    whole = sum(units)
    shard = sum(min(max(u - zero_rank * math.ceil(u / dp), 0), math.ceil(u / dp)) for u in units)
    return {"params": p * (shard if zero >= 3 else whole), "grads": g * (shard if zero >= 2 else whole),
            "optimizer": o * (shard if zero >= 1 else whole)}


def bytes_per_param(precision: str = "mixed", *, zero: int = 0, dp: int = 1, fp32_grad_accum: bool = False) -> float:
    """Model-state bytes per parameter on one rank: ZeRO-1 divides the optimizer states by dp, ZeRO-2 the
    gradients too, ZeRO-3 the weights too (`static_bytes` for a large model, padding aside)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} must be one of {', '.join(map(repr, PRECISIONS))}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero={zero!r} must be 0, 1, 2 or 3")
    if not (isinstance(dp, int) and dp >= 1):
        raise ValueError(f"dp={dp!r} must be an integer >= 1")
    p, g, o = PRECISIONS[precision]
    g += FP32_GRAD_ACCUM_BYTES if fp32_grad_accum else 0
    return p / (dp if zero >= 3 else 1) + g / (dp if zero >= 2 else 1) + o / (dp if zero >= 1 else 1)


def grad_accum_steps(global_batch_tokens: int, seq: int, micro_batch: int, dp: int) -> int:
    """Micro-batches each data-parallel rank runs before the optimizer steps: global batch / (seq · mbs · dp)."""
    per_step = seq * micro_batch * dp
    for name, value in (("global_batch_tokens", global_batch_tokens), ("seq", seq), ("micro_batch", micro_batch),
                        ("dp", dp)):
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{name}={value!r} must be an integer >= 1")
    if global_batch_tokens % per_step:
        raise ValueError(f"global_batch_tokens={global_batch_tokens} must be a multiple of seq·micro_batch·dp = "
                         f"{per_step}")
    return global_batch_tokens // per_step


def playbook_num_params(cfg: ModelConfig, seq: int) -> int:
    """The playbook's GPT-2-style count N = h·(v+s) + L·(12h² + 13h) + 2h (learned positions, 4h MLP, biases)."""
    h, L = cfg.d_model, cfg.n_layers
    return h * (cfg.vocab_size + seq) + L * (12 * h * h + 13 * h) + 2 * h


def _attention_on_rank(cfg: ModelConfig, tp: int) -> int:
    """Attention weights of one layer on one tensor-parallel rank: heads split, KV heads replicated beyond
    n_kv_heads ranks, MLA's latent down-projections (and their norms) replicated."""
    d, h = cfg.d_model, cfg.n_heads
    if cfg.attention == "gqa":
        return 2 * d * h * cfg.head_dim // tp + 2 * d * kv_heads_per_rank(cfg.n_kv_heads, tp) * cfg.head_dim
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q = (d * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * h * qk // tp) if cfg.q_lora_rank \
        else d * h * qk // tp
    kv = d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
    kv += cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim) // tp
    return q + kv + h * cfg.v_head_dim * d // tp


def zero_units(cfg: ModelConfig, parallel: ParallelConfig, stage: int) -> list[tuple[int, int]]:
    """(dense, expert) parameters of each ZeRO unit on one rank of pipeline stage `stage`: the root (embedding,
    final norm, output layer: what lies outside the blocks), then each of the rank's blocks. Experts are split
    by ep only: as in `lab.parallel.tp`, an MoE layer (router, routed and shared experts) stays whole on every
    TP rank (Megatron would also split each expert by tp, its default expert-tensor-parallel size). With tied
    embeddings and pp > 1 the last stage keeps its own copy of the embedding matrix for the output layer."""
    d, tp = cfg.d_model, parallel.tp
    vocab_shard = cfg.vocab_size * d // tp
    root = vocab_shard if stage == 0 else 0
    if stage == parallel.pp - 1:
        root += d + (0 if cfg.tie_embeddings and parallel.pp == 1 else vocab_shard)
    units = [(root, 0)]
    for layer in rank_layers(cfg.n_layers, parallel.pp, parallel.pp_virtual_stages, parallel.pp_layers)[stage]:
        dense, expert = _attention_on_rank(cfg, tp) + 2 * d, 0
        if cfg.is_moe_layer(layer):
            dense += d * cfg.n_experts + cfg.n_shared_experts * 3 * d * cfg.d_ff_expert
            expert = experts_per_rank(cfg.n_experts, parallel.ep) * 3 * d * cfg.d_ff_expert
        else:
            dense += 3 * d * cfg.d_ff // tp
        units.append((dense, expert))
    return units


def stage_params(cfg: ModelConfig, parallel: ParallelConfig, stage: int) -> tuple[int, int]:
    """(dense, expert) parameters on one rank of pipeline stage `stage` (`zero_units` added up)."""
    units = zero_units(cfg, parallel, stage)
    return sum(dense for dense, _ in units), sum(expert for _, expert in units)


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, *, tp: int = 1, sp: bool = False,
                            recompute: str = "none", flash: bool = False, s_kv: int | None = None) -> float:
    """Activation bytes of one transformer layer for one micro-batch (Korthikanti et al., eqs. 1-6).
    `s` is the local sequence (seq/cp); `s_kv` the keys each query sees (the full sequence, default s)."""
    split = tp if sp else 1
    if recompute == "full":
        return 2 * s * b * h / split
    linear = 34 * s * b * h / tp if sp else s * b * h * (10 + 24 / tp)
    # softmax output, dropout mask and dropout output of the a s x s matrices (TP splits the heads)
    square = 0 if recompute == "selective" or flash else 5 * a * s * (s_kv or s) * b / tp
    return linear + square


def op_sac_layer_bytes(cfg: ModelConfig, s: int, b: int, *, tp: int = 1, sp: bool = False) -> float:
    """Activation bytes of one layer and micro-batch under TorchTitan's selective *op* activation checkpointing
    (torchtitan/models/llama3/parallelize_llama.py, `_save_list` and `_custom_policy`, the `selective_ac_option
    = 'op'` of its llama3_8b.toml): inside each checkpointed block it keeps the outputs of the ops on its list —
    SDPA (output and its fp32 log-sum-exp) and every other matmul, counted from the block's start (wq, wv, w1,
    w2; wk, wo and w3 are recomputed) — plus the block's input, all bf16. What it saves over full checkpointing
    (the input only) is most of a layer's bytes at a third of the recomputation. `s` is the local sequence
    (seq/cp); TP splits heads and the FFN, SP the block input; w2's output is the matmul's (s, d) before its
    reduce-scatter."""
    q = cfg.n_heads // tp * cfg.head_dim
    kv = kv_heads_per_rank(cfg.n_kv_heads, tp) * cfg.head_dim
    local = s // tp if sp else s
    per_token = 2 * (q + kv + q + cfg.d_ff // tp + cfg.d_model) + 4 * cfg.n_heads // tp
    return b * (per_token * s + 2 * cfg.d_model * local)


def fsdp_unsharded_bytes(cfg: ModelConfig, parallel: ParallelConfig, stage: int, *,
                         reshard_after_forward: bool = True) -> int:
    """Bytes FSDP2 (`torch.distributed.fsdp.fully_shard`, bf16 compute, fp32 reduction) holds unsharded on one
    rank at the step's peak, beyond the sharded fp32 states `static_bytes(zero=3)` counts:

    * resharding after forward (TorchTitan without PP): the root unit (embedding, final norm, output layer),
      gathered for the loss and the output layer's backward, two blocks' bf16 weights (the one computing and the
      one prefetched) and one block's gradients cast to fp32 for the reduce-scatter;
    * without resharding (TorchTitan under PP, `reshard_after_forward=False`, so that micro-batches do not
      gather again): every weight of the stage in bf16, and its gradients accumulated unsharded in fp32 until
      the last micro-batch's backward syncs them (torch.distributed.pipelining turns gradient sync off before)."""
    units = [dense + expert for dense, expert in zero_units(cfg, parallel, stage)]
    if not reshard_after_forward:
        return (2 + 4) * sum(units)
    root, blocks = units[0], units[1:]
    block = max(blocks, default=0)
    return 2 * root + 2 * 2 * block + 4 * block


def _exact_layer(cfg: ModelConfig, s: int, b: int, recompute: str, flash: bool, tp: int = 1, sp: bool = False) -> int:
    """Bytes lab.model's Block saves in fp32 (elements per token, x4 bytes), as autograd keeps them:

    * each RMSNorm: its input, the 1/rms per token, the normalised x and x·weight (the next matmul's input);
    * SwiGLU: w1·x and w3·x (inputs of silu and of the product), silu(w1·x), and the product (w2's input);
    * attention, flash kernel: q and k after RoPE, v, the output and its log-sum-exp per head, and the
      output re-laid out as (B, T, heads·head_dim) for wo — K/V stay at n_kv_heads;
    * attention, math kernel: q and k scaled by sqrt(scale) and v, all expanded to n_heads (GQA repeats K/V),
      the softmax probabilities (a·s per token: the whole s x s matrix, causal or not), and wo's input;
    * selective: the checkpoint keeps only its inputs q, k, v (plus wo's input outside it);
    * full: the checkpoint keeps only the block's input.

    Tensor parallelism (`lab.parallel.tp`) splits heads, KV heads (one per rank once tp > n_kv_heads) and
    the FFN width by tp; the norms stay whole. With sequence parallelism the norms and the block input hold
    s/tp tokens, but the all-gathered input of each column-parallel group (attention, FFN) is what its matmul
    saves: d per token over the whole sequence, twice per layer. Megatron-LM gathers it again in backward
    instead, which is how Korthikanti et al. reach "everything / tp"; lab keeps it, for clarity.
    """
    d, hd = cfg.d_model, cfg.head_dim
    a, ff = cfg.n_heads // tp, cfg.d_ff // tp
    kv = kv_heads_per_rank(cfg.n_kv_heads, tp)
    local = s // tp if sp else s  # tokens of the residual stream on this rank
    if recompute == "full":
        return 4 * d * local * b
    if recompute == "selective":
        attention = 2 * a * hd + 2 * kv * hd
    elif flash:  # with one head per rank, wo's input is a view of the kernel's output, not a copy
        attention = (3 if a > 1 else 2) * a * hd + 2 * kv * hd + a
    else:
        attention = 4 * a * hd + a * s
    norms_local, norms_full = (2 * (2 * d + 1), 2 * d) if sp else (0, 2 * (3 * d + 1))
    return 4 * b * (norms_local * local + (norms_full + attention + 4 * ff) * s)


@lru_cache(maxsize=64)
def _held(schedule: str, pp: int, m: int, v: int, n_layers: int, split: str
          ) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
    """Per rank, at the moment it holds the most layers' activations: those layers (a held (micro-batch, chunk)
    counts its chunk's layers, `lab.layout.stage_layers` of `split`) and the (micro-batch, chunk) pairs; then the
    most micro-batches each of its chunks holds. Replayed from the schedule `lab.parallel.pp` executes: a forward
    stores a micro-batch's activations, its backward frees them — or its W, when the schedule defers weight
    gradients (ZB-H1): until then lab's executor keeps what W needs, each weighted module's input and output and
    the gradient at that output, the output layer's logits included. (Counted here as the whole micro-batch's
    activations.)"""
    plan = make_schedule(schedule, pp, m, v)
    counts = stage_layers(n_layers, plan.virtual_stages, split)
    frees = W if plan.split_backward else B
    result = []
    for rank, ops in enumerate(plan.ops):
        layers = [counts[plan.virtual_stage(rank, chunk)] for chunk in range(v)]
        held, peak = [0] * v, [0] * v  # micro-batches each chunk holds now, and at most
        most = (0, 0)  # (layers, chunks) held at the fullest moment
        for op in ops:
            if op.kind in (F, frees):
                held[op.chunk] += 1 if op.kind == F else -1
                peak[op.chunk] = max(peak[op.chunk], held[op.chunk])
                most = max(most, (sum(h * n for h, n in zip(held, layers, strict=True)), sum(held)))
        result.append((*most, tuple(peak)))
    return tuple(result)


def _in_flight(cfg: ModelConfig, parallel: ParallelConfig, stage: int) -> tuple[int, int, int, int]:
    """At a pipeline stage's peak: the layers' activations of one micro-batch it holds (AFAB m x its layers, 1F1B
    min(m, p - stage) x them, interleaved Megatron's (p - stage - 1)·2 + (v - 1)·p + 1 chunks), the (micro-batch,
    chunk) pairs behind them, and the micro-batches whose embedding (chunk 0 of stage 0) and whose logits (the
    last chunk of the last stage) it holds."""
    p, m, v = parallel.pp, parallel.grad_accum, parallel.pp_virtual_stages
    if p == 1:
        return cfg.n_layers, 1, 1, 1  # gradient accumulation runs micro-batches one after the other
    layers, chunks, per_chunk = _held(parallel.pp_schedule, p, m, v, cfg.n_layers, parallel.pp_layers)[stage]
    return layers, chunks, per_chunk[0], per_chunk[-1]


def loss_bytes(tokens: int, vocab: int, tp: int = 1, logits_bytes: int = 4) -> int:
    """Bytes the loss of one micro-batch holds at its peak beyond what the activations count for it (the fp32
    log-probabilities or softmax it keeps for backward, the `logits` term), with N = tokens x vocab/tp elements:

    * whole logits, `lab.loss.cross_entropy` (F.cross_entropy: log-softmax then NLL): at the log-softmax's
      backward, the gradient it receives and the one it returns, both fp32 (B, T, vocab), sit beside its kept
      output: 2 x 4·N. Its forward holds less (the logits, their fp32 copy under 16-bit precision, the output).
    * vocabulary-parallel logits (`lab.parallel.tp.vocab_parallel_cross_entropy`, tp > 1): its forward holds the
      incoming logits (`logits_bytes` each), their fp32 copy when those are 16-bit (`lab.parallel.parallelize`
      casts them first), the shifted logits and their exponentials beside the softmax it keeps: (c + 4 + 8)·N
      with c = 2, or (4 + 8)·N in fp32 — more than its backward's 8·N.

    It lives once (only one micro-batch's loss runs at a time), on the stage that computes the loss, the last,
    while every activation of that micro-batch is still held: a step's peak, what `torch.cuda.max_memory_allocated`
    reports. tests/test_calc_memory.py measures it on the CPU. At tp = 1 lab.train's loss is the chunked one
    (`chunked_loss_bytes`)."""
    n = tokens * vocab // tp
    if tp == 1:
        return 8 * n
    return (logits_bytes + (4 if logits_bytes < 4 else 0) + 8) * n


def chunked_loss_bytes(tokens: int, vocab: int, d_model: int, weight_bytes: int = 4,
                       chunk_tokens: int = CHUNK_TOKENS) -> int:
    """Bytes `lab.loss.chunked_cross_entropy` holds at its peak (the last chunk of its forward) beyond what the
    activations count for it (the hidden states' gradient, tokens·d·w, and the output weight's, vocab·d·w, kept
    for backward: the `logits` term), with c = min(chunk_tokens, tokens) and w = `weight_bytes`:

    * one chunk's logits: c·vocab·w in the weight's dtype, and their fp32 copy, which the log-sum-exp and the
      gradient (softmax - one-hot) overwrite in place: c·vocab·(4 + w), or c·vocab·4 in fp32 (one tensor);
    * the weight's gradient summed in fp32 (vocab·d·4; in fp32 it is the kept one, and the chunk's share of it,
      vocab·d·w, sits beside it then) and the chunk's share: vocab·d·4 beyond the kept gradient either way;
    * the chunk's hidden-state gradient before it is copied into its rows: c·d·w.

    For llama3-1b (vocab 128,256, d 2048) in bf16 with 8192 tokens: 1.9 GB (0.8 of it the chunk's logits),
    instead of whole logits' 8.4 GB (`loss_bytes`). tests/test_calc_memory_loss.py measures it on the CPU."""
    c = min(chunk_tokens, tokens)
    logits = c * vocab * (4 + (weight_bytes if weight_bytes < 4 else 0))
    return logits + 4 * vocab * d_model + c * d_model * weight_bytes


def _check(cfg: ModelConfig, seq: int, mbs: int, parallel: ParallelConfig, precision: str,
           fp32_grad_accum: bool, activation_model: str, param_convention: str, stage: int | None, loss: str) -> None:
    def require(ok: bool, message: str) -> None:
        if not ok:
            raise ValueError(message)

    for name, value in (("seq", seq), ("mbs", mbs)):
        require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                f"{name}={value!r} must be an integer >= 1")
    for name, value, allowed in (("precision", precision, tuple(PRECISIONS)),
                                 ("activation_model", activation_model, ACTIVATION_MODELS),
                                 ("param_convention", param_convention, PARAM_CONVENTIONS),
                                 ("loss", loss, LOSSES)):
        require(value in allowed, f"{name}={value!r} must be one of {', '.join(map(repr, allowed))}")
    require(not fp32_grad_accum or precision == "mixed",
            f"fp32_grad_accum=True needs precision='mixed' (got precision={precision!r})")
    cfg.validate()
    parallel.validate()
    parallel.check_model(cfg)
    check_sequence(seq, parallel.cp, parallel.cp_impl, parallel.tp, parallel.sp, name="seq")
    require(stage is None or (isinstance(stage, int) and 0 <= stage < parallel.pp),
            f"stage={stage!r} must be None (the fullest stage) or in 0..{parallel.pp - 1}")
    if activation_model == "exact":
        require(not cfg.is_moe and cfg.attention == "gqa",
                f"activation_model='exact' covers dense GQA models; {cfg.name} is not (use 'korthikanti')")
        require(precision == "fp32", f"activation_model='exact' counts lab.model in fp32; precision={precision!r}"
                                     " must be 'fp32'")


def _activations(cfg: ModelConfig, seq: int, mbs: int, parallel: ParallelConfig, stage: int, flash: bool,
                 activation_model: str, chunked: bool = False, weight_bytes: int = 4) -> dict[str, int]:
    tp, sp, cp, recompute = parallel.tp, parallel.sp, parallel.cp, parallel.recompute
    # the chunked loss keeps the gradients of the hidden states and of the output weight (in the weight's dtype),
    # not the output layer's input and the logits: at tp = 1, where it runs (`chunked`)
    kept_by_chunked = weight_bytes * (seq // cp * mbs * cfg.d_model + cfg.vocab_size * cfg.d_model)
    s, b, h = seq // cp, mbs, cfg.d_model
    layers_held, chunks_held, embedding_micro_batches, logits_micro_batches = _in_flight(cfg, parallel, stage)
    first, last = stage == 0, stage == parallel.pp - 1
    if activation_model == "exact":
        rope = 4 * s * cfg.head_dim  # cos and sin, (s, head_dim/2) each, shared by all layers
        # Context parallelism runs ring attention (lab.parallel.ring_attention), which keeps what a flash
        # kernel keeps — q, k, v, the output and its log-sum-exp — for this rank's s = seq/cp queries.
        layer = _exact_layer(cfg, s, b, recompute, flash or cp > 1, tp, sp)
        # each chunk's forward computes its own angles: one rope per (micro-batch, chunk) held
        layers = layers_held * layer + chunks_held * rope
        # the int64 token ids the embedding's backward indexes with (TP: and the mask of ids outside its shard)
        embedding = 8 * s * b + (s * b if tp > 1 else 0)
        d, vocab = cfg.d_model, cfg.vocab_size // tp
        norm = 4 * s * b * ((2 * d + 1) / tp + d if sp else 3 * d + 1)  # the final norm (sp: and the gather)
        if chunked:  # the norm's input, output and rstd (its output: the hidden states' gradient's size)
            logits = norm + kept_by_chunked - 4 * s * b * d
        elif tp == 1:  # log-softmax, targets, and a scalar of F.cross_entropy
            logits = norm + 4 * s * b * vocab + 8 * s * b + 4
        else:  # vocab_parallel_cross_entropy: the local softmax, local targets (int64) and a bool mask
            logits = norm + 4 * s * b * vocab + 9 * s * b
    else:
        split = tp if sp else 1
        per_layer = korthikanti_layer_bytes(s, b, h, cfg.n_heads, tp=tp, sp=sp, recompute=recompute, flash=flash,
                                            s_kv=seq)
        layers = layers_held * per_layer
        embedding = s * b * h / split  # dropout mask of the embedding output
        logits = 4 * s * b * h / split + (kept_by_chunked if chunked else 4 * s * b * cfg.vocab_size / tp)
    return {"layers": round(layers), "embedding": round(embedding * embedding_micro_batches) if first else 0,
            "logits": round(logits * logits_micro_batches) if last else 0}


def estimate_memory(cfg: ModelConfig, seq: int, mbs: int = 1, parallel: ParallelConfig | None = None, *,
                    precision: str = "mixed", fp32_grad_accum: bool = False, flash: bool = False,
                    activation_model: str = "korthikanti", param_convention: str = "exact",
                    stage: int | None = None, zero_rank: int = 0, loss: str = "chunked") -> MemoryEstimate:
    """Per-GPU bytes of training `cfg` on micro-batches of `mbs` sequences of `seq` tokens with `parallel`
    (dp, zero, tp, sp, pp, cp, ep, recompute, grad_accum, pp schedule). Invalid input raises ValueError.

    `param_convention="playbook"` counts N with the playbook's GPT-2 formula (split evenly over tp·pp): with
    precision="fp32" and recompute it reproduces the plots of its sections "Activations memory" and "Activation
    recomputation"; the parallelism chapters' plots use the exact count, precision="bf16" and
    recompute="selective". With ZeRO, `zero_rank` is the rank's place in
    its dp x cp group: the last places hold fewer elements when padding falls on them (`static_bytes`); the
    default, 0, is the fullest. `loss` is "chunked" (lab.train's at tp = 1: `chunked_loss_bytes`, and the
    gradients it keeps instead of the logits) or "whole" (fp32 logits of the micro-batch: `loss_bytes`); tensor
    parallelism's vocabulary-parallel loss is always on whole (split) logits.
    """
    parallel = parallel or ParallelConfig()
    _check(cfg, seq, mbs, parallel, precision, fp32_grad_accum, activation_model, param_convention, stage, loss)
    chunked, weight_bytes = loss == "chunked" and parallel.tp == 1, 4 if precision == "fp32" else 2
    replicas = parallel.dp * parallel.cp
    if not (isinstance(zero_rank, int) and not isinstance(zero_rank, bool) and 0 <= zero_rank < replicas):
        raise ValueError(f"zero_rank={zero_rank!r} must be in 0..{replicas - 1} (a place among dp*cp = {replicas})")
    estimates = []
    for k in range(parallel.pp) if stage is None else [stage]:
        if param_convention == "playbook":
            units = [(math.ceil(playbook_num_params(cfg, seq) / (parallel.tp * parallel.pp)), 0)]
        else:
            units = zero_units(cfg, parallel, k)
        dense, expert = sum(u for u, _ in units), sum(e for _, e in units)
        kw = {"precision": precision, "zero": parallel.zero, "fp32_grad_accum": fp32_grad_accum,
              "zero_rank": zero_rank}
        if parallel.ep == 1:  # a block's experts are in its unit, sharded with it over dp x cp
            static = static_bytes([u + e for u, e in units], dp=replicas, **kw)
        else:  # experts are held by dp x cp / ep ranks: their shards are cut over those
            static = static_bytes([u for u, _ in units], dp=replicas, **kw)
            kw["zero_rank"] = zero_rank // parallel.ep  # its place among the ranks holding the same experts
            for key, value in static_bytes([e for _, e in units], dp=replicas // parallel.ep, **kw).items():
                static[key] += value
        acts = _activations(cfg, seq, mbs, parallel, k, flash, activation_model, chunked, weight_bytes)
        last = k == parallel.pp - 1
        tokens = seq // parallel.cp * mbs
        working = chunked_loss_bytes(tokens, cfg.vocab_size, cfg.d_model, weight_bytes) if chunked else \
            loss_bytes(tokens, cfg.vocab_size, parallel.tp, weight_bytes)
        per_gpu = {**static, "activations": sum(acts.values()), "loss": working if last else 0}
        per_gpu["total"] = sum(per_gpu.values())
        estimates.append((per_gpu["total"], k, per_gpu, acts, dense + expert))
    _, k, per_gpu, acts, on_gpu = max(estimates, key=lambda e: (e[0], e[1]))
    total = playbook_num_params(cfg, seq) if param_convention == "playbook" else count_params(cfg)
    return MemoryEstimate(total, per_gpu, acts, k, on_gpu)
