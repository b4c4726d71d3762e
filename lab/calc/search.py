"""The config search: the playbook's three-step procedure ("Finding the best training configuration") as code.
Torch-free.

1. **Fit in memory.** Enumerate every layout of `gpus` GPUs — data parallelism with ZeRO 0-3, tensor
   parallelism (with sequence parallelism), pipeline parallelism with its schedule and chunks, context
   parallelism, expert parallelism for MoE models, activation recomputation — and keep those that
   `ParallelConfig`/`Config` accept, that `lab.config.check_supported` says `lab.train` runs, and whose
   fullest GPU fits the accelerator's memory (`lab.calc.memory.estimate_memory`, mixed precision, flash
   attention). Every rejection is counted under its layout family (the degrees dp·tp·pp·cp·ep) and reason
   (`REASONS`). Not enumerated at all, as never worth a row: TP wider than a node, pipelines deeper than
   n_layers/2 or with fewer micro-batches than stages, CP ranks with fewer than 1024 tokens, AFAB (1F1B's
   bubble, more memory), selective recomputation (with flash attention it saves nothing), and full
   recomputation at a micro-batch size that fits without it (the same layout with more FLOPs).
2. **Hit the global batch.** The target in tokens is rounded to the nearest whole number of sequences B;
   a layout keeps only the splits B = dp × mbs × grad_accum that are exact (no layout gets a different
   batch than the others, so their tokens/s compare). Every micro-batch size that divides B/dp and fits is
   a candidate.
3. **Rank by throughput.** Each candidate's step time is modelled below and the list is sorted by tokens/s,
   ties going to the simpler layout (fewer dimensions besides dp, lower ZeRO stage, lighter recomputation),
   then to the smaller memory footprint, then to the layout's name, so that the order is deterministic.

The time model of one step (all ranks do the same work; the slowest pipeline stage sets the pace). Every constant
it uses is in `lab.calc.calibration`, with its source; `stack` names the software that runs the step ("eager",
"compiled", "compiled-fp8" or "lab"), `hardware` the chip (its bf16 peak and HBM bandwidth):

* **Matmuls.** The FLOPs lab.model really runs (`training_flops(counting="exact")`, recomputation included),
  GEMM by GEMM (seven a layer and pass, three for the output layer), each costing FLOPs / (`efficiency` x peak)
  plus a fixed `gemm_overhead_s`: an efficiency that saturates with the GEMM's size, so that TP, which makes
  every GEMM tp times smaller, pays for it when the GEMMs get small. `efficiency` is the plateau large bf16
  GEMMs reach on an H100 (74.5 %). With fp8 linears (stack "compiled-fp8") the layers' GEMMs run
  `fp8_gemm_speedup` faster and their inputs and output gradients are cast (`fp8_cast_bytes` per element).
* **Attention core** (flash, causal: half of the s x s products flops.py counts) at the forward and backward
  rates of torch's SDPA kernels, recorded on lab's H100 (scaled by the chip's peak). A stack without a flash
  kernel (Megatron-LM 2021) multiplies the whole s x s scores at the GEMM rate and moves them through HBM for
  the softmax and dropout (`unfused_softmax_bytes`).
* **Element-wise work.** Norms, residual adds, RoPE and SwiGLU move 10·d + 2·(q + kv) + 3·d_ff bf16 values a
  token and layer when fused (one read, one write), at `hbm_efficiency` of the chip's HBM bandwidth; an eager
  stack moves `eager_traffic` times that. Backward moves twice the forward's, full recomputation the forward's
  again; SP splits the d-wide part by tp, TP the rest. The loss costs `loss_s_per_logit` per logit on the last
  stage, AdamW `adam_bytes` per local parameter once a step. Kernel time is `compute` in `StepTime`.
* **Where a group lives.** Ranks are numbered TP fastest, then CP, PP, DP (Llama 3's order), in nodes of
  `gpus_per_node`: a group whose members share a node talks over NVLink, one that spans nodes over the
  NICs, multi-rail (`lab.calc.comms.collective_time` with the group's members per node), at the bus bandwidth
  the playbook measured for that op and node count (`calibration.collective_efficiency`: 55 % of NVLink for an
  all-gather in a node, a seventh of the NICs' at 64 nodes). A system with a `Fabric` of pods (Llama 3's,
  `llama3-roce`) keeps the playbook's 2-node share at any scale and prices the pods a group spans instead
  (`comms.pod_share`; GPUs numbered pod by pod).
* **Tensor parallelism.** Per layer and micro-batch, forward: an all-gather and a reduce-scatter around
  attention and around the MLP (SP; an all-reduce each without SP, same bytes), of mbs·seq/cp·d bf16 values;
  backward the same again; full recomputation repeats the forward's; under fp8 linears the forward's
  all-gathers move fp8 values (torchao's float8 TP casts before gathering). Exposed, but for `tp_overlap`, the share
  async TP hides (0 by default: lab.train runs none; TorchTitan's async TP hides `async_tp_overlap`).
* **Context parallelism** (ring attention, zig-zag). Each pass sends K/V cp-1 hops (backward also their
  gradients), hop i hidden behind block i of attention: exposed = (cp-1)·max(0, hop - block), plus the hop the
  backward's dK/dV make back to their owner (`cp_exposed_hops`), and at least `cp_exposed` x the ring.
* **Expert parallelism.** Four all-to-alls per MoE layer and micro-batch (`lab.calc.moe.all_to_all_seconds`:
  dispatch, combine and their gradients; six with full recomputation), exposed.
* **Pipeline.** Layers are split by `ParallelConfig.pp_layers` (`lab.layout.stage_layers`: "even", or "llama3",
  the first and the last stage one layer lighter, which the search tries where "even" does not divide), and
  each stage's micro-batch time is its own layers' (the last stage adds the output layer and the loss). The
  steady state runs m micro-batches at the slowest stage's pace; the bubble is `lab.calc.bubble.closed_form`
  for the schedule (t_f : t_b : t_w = 1 : 2 : 1) of the other stages' mean time, which the fill and the drain
  pass through ((p-1)/v stage times for 1F1B and interleaved, a third of 1F1B's for ZB-H1). The activations'
  sends overlap compute in the steady state; the fill and the drain cross 2(p·v - 1) boundaries, exposed.
* **Data parallelism and ZeRO** (the overlap rules of the playbook's appendix "Math for Compute/Communication
  Overlap"). The gradients of the slowest stage's parameters (bf16) are reduced over the dp·cp ranks that share
  them (experts over dp·cp/ep) in buckets of `bucket_mb` (25 MiB, DDP's default; each bucket pays the latency of a
  collective over all those ranks again; the faster of NCCL's flat ring and the hierarchical all-reduce). ZeRO-0
  all-reduces them during the last micro-batch's backward: exposed = max(0, all-reduce - backward), and with v
  interleaved chunks chunk by chunk, each once its last backward has run (`drain_exposed`: the cooldown leaves
  p micro-batches' backward between one chunk's last and the next's, so only the last chunk's share can show). ZeRO-1/2
  reduce-scatter them the same way, then all-gather the updated parameters after the optimizer step, exposed (so
  ZeRO-2 costs what ZeRO-1 costs and saves memory: the playbook's "prefer ZeRO-2"); a stack that reduces
  after the backward (Megatron-LM 2021, `overlap_grad_reduce` False) hides none of it. ZeRO-3 gathers each layer's
  parameters before its forward and again before its backward and reduce-scatters its gradients after it, for
  every micro-batch, prefetching `zero3_prefetch_layers` (FSDP2's one): layer i+1's gather hides behind layer
  i's compute (`comms.zero3_overlap_ratio` is the bandwidth-only form of the ratio), so the exposed time is the
  first layer's gather of each pass plus, per layer, max(0, gather - forward) and max(0, gather +
  reduce-scatter - backward).

Uncertainty: each layout's tokens/s comes with a range, its step's parts widened by `calibration.SPREAD`
(compute +-10 %, exposed communication +-30 %, bubble +-5 %) and added in quadrature; the layouts whose range
reaches the best one's are its ties (`SearchResult.ties`). The validation table (`calibration.RUNS`,
`predict_run`) and chapter 08 show how close the model comes to what clusters measured, and where it does not.

Left out: the vocabulary-parallel loss's small collectives, NCCL's kernels slowing the compute they overlap,
stragglers and switch congestion, and the power limits that lower a chip's clock. The ranking is a model to
shortlist layouts that are then measured, as the playbook's step 4 says, not a measurement.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

from lab.calc import calibration
from lab.calc.bubble import closed_form
from lab.calc.calibration import CONSTANTS, SPREAD, STACKS, Run, Stack
from lab.calc.comms import collective_time
from lab.calc.flops import FlopsEstimate, mfu, training_flops
from lab.calc.hardware import Accelerator, get_accelerator
from lab.calc.memory import (
    MemoryEstimate,
    estimate_memory,
    fsdp_unsharded_bytes,
    korthikanti_layer_bytes,
    op_sac_layer_bytes,
    stage_params,
    static_bytes,
    zero_units,
)
from lab.calc.moe import all_to_all_seconds
from lab.calc.network import PLAYBOOK_BUSBW, SYSTEMS, Link
from lab.calc.schedules import rank_layers
from lab.config import (
    PP_SCHEDULES,
    RECOMPUTE_MODES,
    Config,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    check_supported,
)
from lab.layout import INTERLEAVED_CHUNKS, check_count, pp_chunks, stage_layers, strides

COMPUTE_EFFICIENCY = CONSTANTS["matmul_efficiency"].value  # the plateau of large bf16 GEMMs (calibration)
PRECISION = "mixed"  # bf16 weights and gradients, fp32 master weights and Adam states: 16 bytes per parameter
WIRE_BYTES = 2  # bf16 activations, gradients and parameters on the wire
SCHEDULES = (("1f1b", 1), ("interleaved", INTERLEAVED_CHUNKS), ("zb-h1", 1))  # AFAB: 1F1B's bubble, more memory
# Selective recomputation drops the s x s attention scores, which flash attention never keeps: with flash it
# saves no memory and costs FLOPs, so it can never win and is not enumerated.
RECOMPUTE_SEARCHED = ("none", "full")
DIMENSIONS = ("dp", "tp", "pp", "cp", "ep")
REASONS = ("memory", "batch", "unsupported", "shape")  # why a layout is rejected, the closest to running first
# Pipelines deeper than n_layers / 2 are not enumerated: a one-layer stage (Megatron's 1T model ran 128 layers
# on 64 stages, two each) does little but wait for its neighbours, and replaying such schedules is slow.
MIN_STAGE_LAYERS = 2
# Nor context parallelism that leaves a rank fewer than 1024 tokens of a sequence (Llama 3 ran CP16 on 128k
# tokens, 8k each): its attention blocks would be too small to hide the ring's hops behind.
MIN_CP_TOKENS = 1024


@dataclass(frozen=True)
class StepTime:
    """Seconds of one training step, split as the playbook plots it: compute, exposed communication (by
    parallelism), pipeline bubble."""

    compute: float
    tp: float
    cp: float
    ep: float
    pp: float
    dp: float
    bubble: float

    @property
    def comms(self) -> float:
        return self.tp + self.cp + self.ep + self.pp + self.dp

    @property
    def total(self) -> float:
        return self.compute + self.comms + self.bubble

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "comms": self.comms, "total": self.total}

    @property
    def spread(self) -> float:
        """Relative uncertainty of `total`: each part widened by `calibration.SPREAD`, in quadrature."""
        parts = (SPREAD["compute"] * self.compute, SPREAD["comms"] * self.comms, SPREAD["bubble"] * self.bubble)
        return math.hypot(*parts) / self.total


@dataclass(frozen=True)
class Candidate:
    """One layout that fits, with its modelled step."""

    parallel: ParallelConfig
    mbs: int
    memory: MemoryEstimate
    time: StepTime
    tokens_per_step: int
    gpus: int
    mfu: float

    @property
    def grad_accum(self) -> int:
        return self.parallel.grad_accum

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.time.total

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / self.gpus

    @property
    def tokens_per_s_range(self) -> tuple[float, float]:
        """(low, high) tokens/s from the calibration's spread of the step time (`StepTime.spread`)."""
        u = self.time.spread
        return self.tokens_per_s / (1 + u), self.tokens_per_s / max(1 - u, 1e-9)

    @property
    def family(self) -> str:
        return family_name(self.parallel)

    @property
    def layout(self) -> str:
        """e.g. 'dp32 zero3 · tp8 sp · pp8 interleaved x2 · recompute full'."""
        p = self.parallel
        parts = [f"dp{p.dp}" + (f" zero{p.zero}" if p.zero else "")]
        if p.tp > 1:
            parts.append(f"tp{p.tp}" + (" sp" if p.sp else ""))
        if p.pp > 1:
            parts.append(f"pp{p.pp} {p.pp_schedule}" + (f" x{p.pp_virtual_stages}" if p.pp_virtual_stages > 1 else "")
                         + (f" {p.pp_layers}" if p.pp_layers != "even" else ""))
        parts += [f"{name}{getattr(p, name)}" for name in ("cp", "ep") if getattr(p, name) > 1]
        if p.recompute != "none":
            parts.append(f"recompute {p.recompute}")
        return " · ".join(parts)

    def config(self, model: ModelConfig, seq: int) -> Config:
        """The run config `python -m lab.train` would take (global batch in sequences)."""
        return Config(model, self.parallel, TrainConfig(global_batch=self.tokens_per_step // seq, seq_len=seq))

    def as_dict(self) -> dict:
        return {"layout": self.layout, "family": self.family, "parallel": dataclasses.asdict(self.parallel),
                "mbs": self.mbs, "grad_accum": self.grad_accum, "memory_bytes": self.memory.per_gpu["total"],
                "memory": self.memory.as_dict(), "time_s": self.time.as_dict(), "mfu": self.mfu,
                "tokens_per_s": self.tokens_per_s, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "tokens_per_s_range": list(self.tokens_per_s_range)}


@dataclass
class Rejections:
    """Why the layouts of one family (its degrees dp·tp·pp·cp·ep) were turned down: a count per reason and
    the first message met for each. A layout is a family with a ZeRO stage, a schedule and a recompute mode."""

    counts: Counter = field(default_factory=Counter)
    messages: dict[str, Counter] = field(default_factory=dict)  # reason -> its messages, counted

    def add(self, reason: str, message: str, count: int = 1) -> None:
        self.counts[reason] += count
        self.messages.setdefault(reason, Counter())[message] += count

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def main_reason(self) -> tuple[str, str]:
        """The reason that stops the layouts closest to running: memory (lab.train runs them, they do not
        fit), then the batch split, then what lab.train does not run, then the model's shape."""
        reason = min(self.counts, key=REASONS.index)
        return reason, self.messages[reason].most_common(1)[0][0]


@dataclass
class SearchResult:
    model: ModelConfig
    gpus: int
    gpus_per_node: int
    hardware: str
    seq: int
    global_batch: int  # sequences
    candidates: list[Candidate]  # ranked, best first
    rejected: dict[str, Rejections]  # family -> why its layouts were turned down
    families: set[str]  # every family enumerated
    elapsed_s: float
    efficiency: float
    stack: str = "eager"

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq

    @property
    def ties(self) -> int:
        """How many layouts, best first, the model cannot tell from the best: those whose tokens/s range
        (`Candidate.tokens_per_s_range`) reaches the best one's low end. 0 when nothing fits."""
        if not self.candidates:
            return 0
        low = self.candidates[0].tokens_per_s_range[0]
        return sum(c.tokens_per_s_range[1] >= low for c in self.candidates)

    def top(self, k: int = 10) -> list[Candidate]:
        return self.candidates[:k]

    def rejected_families(self) -> dict[str, Rejections]:
        """The families none of whose layouts survived, with their reasons."""
        alive = {c.family for c in self.candidates}
        return {f: r for f, r in self.rejected.items() if f not in alive}

    def rejected_by_reason(self) -> Counter:
        total: Counter = Counter()
        for r in self.rejected.values():
            total.update(r.counts)
        return total

    def as_dict(self, top: int | None = None) -> dict:
        return {"model": self.model.name, "gpus": self.gpus, "gpus_per_node": self.gpus_per_node,
                "hardware": self.hardware, "seq": self.seq, "global_batch": self.global_batch,
                "tokens_per_step": self.tokens_per_step, "efficiency": self.efficiency, "stack": self.stack,
                "ties": self.ties,
                "elapsed_s": self.elapsed_s, "layouts_kept": len(self.candidates),
                "candidates": [c.as_dict() for c in self.candidates[:top]],
                "rejected_families": {f: {"count": r.total, "reason": r.main_reason()[0],
                                          "message": r.main_reason()[1], "counts": dict(r.counts)}
                                      for f, r in sorted(self.rejected_families().items())},
                "rejected_by_reason": dict(self.rejected_by_reason())}


def family_name(parallel: ParallelConfig) -> str:
    """The degrees of a layout, e.g. 'dp32·tp8' (dp always, the others when > 1)."""
    return "·".join(f"{n}{getattr(parallel, n)}" for n in DIMENSIONS if n == "dp" or getattr(parallel, n) > 1)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# --- step 3's pieces: where groups live, what each parallelism costs -------------------------------------

def _members(dims: tuple[tuple[int, int], ...]) -> list[int]:
    """The ranks of rank 0's group, the group spanning `dims` = ((stride, size), ...)."""
    members = [0]
    for stride, size in dims:
        members = [m + i * stride for m in members for i in range(size)]
    return members


def _per_node(gpus_per_node: int, dims: tuple[tuple[int, int], ...]) -> int:
    """Members of rank 0's group on rank 0's node."""
    return sum(m < gpus_per_node for m in _members(dims))


def _pods(pod_gpus: int | None, dims: tuple[tuple[int, int], ...]) -> int:
    """Pods of `pod_gpus` GPUs (ranks numbered pod by pod) that rank 0's group reaches; 1 without pods."""
    return len({m // pod_gpus for m in _members(dims)}) if pod_gpus else 1


@dataclass(frozen=True)
class _Network:
    system: str
    gpus_per_node: int

    @property
    def pod_gpus(self) -> int | None:
        """GPUs of one pod of the system's `Fabric`; None where the network is one non-blocking fabric."""
        fabric = SYSTEMS[self.system].fabric
        return fabric.pod_gpus if fabric else None

    @lru_cache(maxsize=4096)  # noqa: B019 - a few hundred distinct messages per search; the object lives as long
    def collective(self, op: str, nbytes: float, ranks: int, per_node: int, pods: int = 1) -> float:
        """Seconds of one collective on a group of `ranks` with `per_node` members per node (all of them when
        it stays inside one), spanning `pods` pods of the system's fabric; all-reduce takes the faster of the
        flat ring and the hierarchical algorithm."""
        if ranks == 1 or nbytes == 0:
            return 0.0
        g = ranks if per_node == ranks else per_node
        algorithms = ("ring", "hierarchical") if op == "all_reduce" and per_node < ranks else ("ring",)
        modelled = min(collective_time(op, nbytes, ranks, system=self.system, algorithm=a, gpus_per_node=g,
                                       pods=pods if per_node < ranks else 1).time_s for a in algorithms)
        return modelled / self.efficiency(op, math.ceil(ranks / g))

    @lru_cache(maxsize=64)  # noqa: B019 - one per op and node count
    def efficiency(self, op: str, nodes: int) -> float:
        """The share of the modelled bus bandwidth NCCL delivers (`calibration.collective_efficiency`), the
        model's own busbw computed here at the playbook's message size and node counts, 8 GPUs a node. A system
        with a `Fabric` of its own (pods of full bisection bandwidth) keeps, at any node count, what NCCL
        delivered on `calibration.CONSTANTS["fabric_busbw_nodes"]` nodes of the playbook's H100 cluster: its
        pods' crossings are priced by `comms.pod_share`, not by the playbook's cluster's fall-off."""
        if SYSTEMS[self.system].fabric is not None:
            return _Network("h100", 8).efficiency(op, min(nodes, int(CONSTANTS["fabric_busbw_nodes"].value)))
        if op not in ("all_reduce", "all_gather", "reduce_scatter") or self.system not in ("h100", "h200", "a100",
                                                                                           "b200"):
            return 1.0
        size = PLAYBOOK_BUSBW["message_bytes"]
        factor = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0}
        model = {o: tuple(size * factor[o] * (8 * n - 1) / (8 * n) / 1e9
                          / collective_time(o, size, 8 * n, system=self.system, gpus_per_node=8).time_s
                          for n in PLAYBOOK_BUSBW["nodes"]) for o in factor}
        return calibration.collective_efficiency(op, nodes, model)

    def bucketed(self, op: str, nbytes: float, ranks: int, per_node: int, bucket: float, pods: int = 1) -> float:
        """`nbytes` of gradients in equal buckets of at most `bucket` bytes, one collective each: every bucket
        pays the collective's latency again, which is what makes many ranks costly for small models."""
        n = math.ceil(nbytes / bucket)
        return n * self.collective(op, nbytes / n, ranks, per_node, pods) if n else 0.0

    def neighbour_link(self, per_node: int, ranks: int) -> Link:
        """The link a ring or chain of neighbours waits on: NVLink inside a node, else each GPU's own NIC."""
        spec = SYSTEMS[self.system]
        return spec.intra if per_node == ranks else spec.nic

    def send(self, nbytes: float, per_node: int, ranks: int) -> float:
        return collective_time("send", nbytes, 2, link=self.neighbour_link(per_node, ranks)).time_s


@dataclass(frozen=True)
class _Work:
    """Per-token work of one layer and of the output layer, split as the time model prices it."""

    matmul: dict[str, float]  # FLOPs of one layer's GEMMs, forward + backward (+ recomputation), by recompute mode
    matmul_forward: float
    gemms: int  # GEMMs of one layer's forward
    attention: float  # the attention core's forward FLOPs as flops.py counts them (the full s x s)
    elementwise: tuple[float, float]  # values a token and layer's forward reads and writes: d-wide, tp-split
    cast: float  # values of one layer's linear inputs and output gradients (fp8 casts)
    head: float  # the output layer's forward FLOPs
    moe_layers: int

    @classmethod
    def of(cls, cfg: ModelConfig, seq: int) -> _Work:
        L, d = cfg.n_layers, cfg.d_model
        head_forward = 2 * cfg.vocab_size * d
        exact = {r: training_flops(cfg, seq, recompute=r, counting="exact") for r in RECOMPUTE_MODES}
        layer = {r: (e.hardware_flops_per_token - 3 * head_forward) / L for r, e in exact.items()}
        # the attention core is the part that grows with seq: f(s) = a + b·s, so b·s = 2·(f(s) - f(s/2))
        half = training_flops(cfg, max(seq // 2, 1), counting="exact").model_flops_per_token
        attention = 2 * (exact["none"].model_flops_per_token - half) / L / 3 if seq > 1 else 0.0
        redone = {"none": 0.0, "selective": attention / 2, "full": attention}  # selective: q·k again
        matmul = {r: layer[r] - 3 * attention - redone[r] for r in RECOMPUTE_MODES}
        q = cfg.n_heads * cfg.head_dim if cfg.attention == "gqa" else d
        kv = cfg.n_kv_heads * cfg.head_dim if cfg.attention == "gqa" else d
        ff = cfg.d_ff_expert * (cfg.top_k + cfg.n_shared_experts) if cfg.is_moe else cfg.d_ff
        gemms = 4 + 3 * (cfg.top_k + cfg.n_shared_experts if cfg.is_moe else 1)
        return cls(matmul, matmul["none"] / 3, gemms, attention, (10 * d, 2 * (q + kv) + 3 * ff),
                   6 * d + 2 * kv + 3 * ff, head_forward, sum(cfg.is_moe_layer(i) for i in range(L)))


@dataclass(frozen=True)
class _Chip:
    """What a step's kernels achieve on one accelerator, for one software stack."""

    matmul_flops: float  # the GEMM plateau, FLOP/s
    peak: float  # dense bf16 FLOP/s
    hbm: float  # bytes/s the element-wise kernels achieve
    stack: Stack

    def gemms(self, flops: float, count: float, fp8: bool = False) -> float:
        """Seconds of `count` GEMMs doing `flops` in all: FLOPs at the plateau plus a fixed cost each."""
        speedup = CONSTANTS["fp8_gemm_speedup"].value if fp8 else 1.0
        return flops / (self.matmul_flops * speedup) + count * CONSTANTS["gemm_overhead_s"].value

    def attention(self, forward_flops: float, scores: float = 0.0) -> tuple[float, float]:
        """(forward, backward) seconds of flash attention, causal: half the products flops.py counts (the
        backward counted as twice the forward, as flops.py and the recording count it). Without a flash kernel
        (the stack's `flash_attention`), every product of the s x s `scores` (elements) as two batched GEMMs
        a pass at the matmul rate, and the scores' softmax and dropout through HBM (`unfused_softmax_bytes`, 9
        of its 20 bytes an element in the forward)."""
        if not self.stack.flash_attention:
            moved = CONSTANTS["unfused_softmax_bytes"].value * scores
            return (self.gemms(forward_flops, 2) + self.moved(0.45 * moved),
                    self.gemms(2 * forward_flops, 4) + self.moved(0.55 * moved))
        scale = self.peak / calibration.H100_PEAK
        forward = 0.5 * forward_flops / (CONSTANTS["attention_forward_flops"].value * scale)
        return forward, 0.5 * 2 * forward_flops / (CONSTANTS["attention_backward_flops"].value * scale)

    def moved(self, nbytes: float) -> float:
        return nbytes / self.hbm


def _stage_compute(cfg: ModelConfig, seq: int, p: ParallelConfig, mbs: int, work: _Work, chip: _Chip,
                   layers: int, last: bool) -> tuple[float, float]:
    """(forward + backward, forward) kernel seconds of one micro-batch through `layers` layers on one rank,
    plus the output layer and the loss on the last stage."""
    tokens = mbs * seq / p.cp  # on this rank, before TP
    fp8 = chip.stack.fp8_linears
    passes = 2 if p.recompute == "full" else 1  # forwards of each layer
    matmul = chip.gemms(layers * work.matmul[p.recompute] * tokens / p.tp, layers * work.gemms * (2 + passes), fp8)
    matmul_fwd = chip.gemms(layers * work.matmul_forward * tokens / p.tp, layers * work.gemms, fp8)
    scores = tokens * seq * cfg.n_heads / p.tp  # elements of the s x s scores (only without a flash kernel)
    attention_fwd, attention_bwd = (layers * t for t in chip.attention(work.attention * tokens / p.tp, scores))
    attention = passes * attention_fwd + attention_bwd
    wide, split = work.elementwise
    values = tokens * (wide / (p.tp if p.sp else 1) + split / p.tp)  # one layer's forward
    traffic = 2 * values * chip.stack.elementwise_traffic + (5 * tokens * work.cast / p.tp if fp8 else 0.0)
    elementwise = layers * chip.moved(traffic * (2 + passes))
    elementwise_fwd = layers * chip.moved(traffic)
    compute = matmul + attention + elementwise
    forward = matmul_fwd + attention_fwd + elementwise_fwd
    if last:
        logits = tokens * cfg.vocab_size / p.tp
        loss = logits * chip.stack.loss_s_per_logit * calibration.H100_HBM / chip.hbm
        head = chip.gemms(3 * work.head * tokens / p.tp, 3)
        compute += head + loss
        forward += head / 3 + loss / 3
    return compute, forward


def _step_time(cfg: ModelConfig, seq: int, p: ParallelConfig, mbs: int, work: _Work, net: _Network,
               chip: _Chip, tp_overlap: float = 0.0, cp_exposed: float = 0.0) -> StepTime:
    """The model of the module docstring for one layout."""
    g, m = net.gpus_per_node, p.grad_accum
    tokens = mbs * seq // p.cp  # of one micro-batch on one rank
    counts = [len(layers) for layers in rank_layers(cfg.n_layers, p.pp, p.pp_virtual_stages, p.pp_layers)]
    kinds = {(n, s == p.pp - 1) for s, n in enumerate(counts)}  # at most three: first, middle, last
    kernels = {kind: _stage_compute(cfg, seq, p, mbs, work, chip, *kind) for kind in kinds}
    times = [kernels[n, s == p.pp - 1][0] for s, n in enumerate(counts)]
    slowest = max(range(p.pp), key=lambda s: (times[s], s))
    layers = counts[slowest]
    moe_layers = work.moe_layers * layers / cfg.n_layers

    compute, forward = kernels[layers, slowest == p.pp - 1]
    backward = compute - forward
    layer_forward = forward / layers

    # groups along the mesh's axes (lab.layout: TP innermost); EP inside dp x cp
    stride = strides(p.dp, p.pp, p.cp, p.tp)
    tp_node = _per_node(g, ((stride["tp"], p.tp),))
    cp_node = _per_node(g, ((stride["cp"], p.cp),))
    pp_node = _per_node(g, ((stride["pp"], p.pp),))
    dpcp = ((stride["cp"], p.cp), (stride["dp"], p.dp))
    dpcp_node, dpcp_pods = _per_node(g, dpcp), _pods(net.pod_gpus, dpcp)
    ep_node = _per_node(g, ((stride["cp"], min(p.cp, p.ep)), (stride["dp"], max(p.ep // p.cp, 1))))

    forward_passes = 2 if p.recompute == "full" else 1
    activation = tokens * cfg.d_model * WIRE_BYTES
    tp_layer = 0.0
    if p.tp > 1:  # 2 AG + 2 RS (sp) or 2 AR per forward, the same per backward
        ops = ("all_gather", "reduce_scatter") if p.sp else ("all_reduce",)
        per_backward = 2 * sum(net.collective(op, activation, p.tp, tp_node) for op in ops)
        # fp8 linears cast their input before SP's all-gather, which then moves 1-byte values (torchao's
        # PrepareFloat8ModuleInput and Float8ColwiseParallel, TorchTitan's TP under Float8)
        cast = 0.5 if chip.stack.fp8_linears else 1.0
        per_forward = 2 * sum(net.collective(op, activation * (cast if op == "all_gather" else 1.0), p.tp, tp_node)
                              for op in ops)
        tp_layer = (per_forward * forward_passes + per_backward) * (1 - tp_overlap)
    cp_layer = 0.0
    if p.cp > 1:  # K and V of the local tokens, cp-1 hops a pass; backward also their gradients
        width = (cfg.n_heads // p.tp * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
                 if cfg.attention == "mla" else 2 * max(cfg.n_kv_heads // p.tp, 1) * cfg.head_dim)
        hop = net.send(tokens * width * WIRE_BYTES, cp_node, p.cp)
        block_forward, block_backward = (t / p.cp for t in chip.attention(work.attention * tokens / p.tp,
                                                                           tokens * seq * cfg.n_heads / p.tp))
        exposed = (forward_passes * (p.cp - 1) * max(0.0, hop - block_forward)
                   + (p.cp - 1) * max(0.0, 2 * hop - block_backward) + CONSTANTS["cp_exposed_hops"].value * 2 * hop)
        ring = (p.cp - 1) * hop * (forward_passes + 2)
        cp_layer = max(exposed, cp_exposed * ring)
    ep_mb = 0.0
    if p.ep > 1:
        ep_mb = all_to_all_seconds(tokens, cfg.top_k, cfg.d_model, p.ep, net.system,
                                   gpus_per_node=ep_node) * (1 + forward_passes) / 2 * moe_layers

    # ZeRO-3: per micro-batch, gather before forward and backward, reduce-scatter after backward, per layer;
    # the first `zero3_prefetch_layers` gathers of each pass wait, the others hide behind the layer before
    dense, expert = stage_params(cfg, p, slowest)
    z3_mb = 0.0
    if p.zero == 3:
        layer_bytes = (dense + expert) * WIRE_BYTES / layers
        gather = net.collective("all_gather", layer_bytes, p.dp * p.cp, dpcp_node, dpcp_pods)
        scatter = net.collective("reduce_scatter", layer_bytes, p.dp * p.cp, dpcp_node, dpcp_pods)
        first = 2 * CONSTANTS["zero3_prefetch_layers"].value * gather
        z3_mb = (first + layers * max(0.0, gather - layer_forward)
                 + layers * max(0.0, gather + scatter - backward / layers))

    stage = compute + layers * (tp_layer + cp_layer) + ep_mb + z3_mb  # one micro-batch through the slowest stage

    # data parallelism: once per step, during the last micro-batch's backward
    dp_exposed = 0.0
    if p.dp * p.cp > 1 and p.zero < 3:
        ep_dp, ep_dp_node = p.dp * p.cp // p.ep, max(dpcp_node // ep_node, 1)
        grads = ((dense * WIRE_BYTES, p.dp * p.cp, dpcp_node, dpcp_pods),
                 (expert * WIRE_BYTES, ep_dp, ep_dp_node, min(dpcp_pods, max(ep_dp // ep_dp_node, 1))))
        bucket = p.bucket_mb * 2**20

        def bucketed(op: str) -> float:
            return sum(net.bucketed(op, b, n, k, bucket, pods) for b, n, k, pods in grads)

        reduce = bucketed("all_reduce" if p.zero == 0 else "reduce_scatter")
        if chip.stack.overlap_grad_reduce:
            v = p.pp_virtual_stages
            dp_exposed = drain_exposed(reduce, v, min(m, p.pp) * backward / v, backward / v)
        else:
            dp_exposed = reduce
        if p.zero:
            dp_exposed += bucketed("all_gather")  # the updated weights, after the optimizer step
    sharded = p.zero >= 1  # AdamW over this rank's shard of its stage's parameters, once a step
    local = dense / (p.dp * p.cp if sharded else 1) + expert / (max(p.dp * p.cp // p.ep, 1) if sharded else 1)
    optimizer = chip.moved(local * chip.stack.adam_bytes)

    bubble = pp_exposed = 0.0
    if p.pp > 1:  # the fill and the drain run through the other stages: their mean time, scaled by their kernels'
        others = [s for s in range(p.pp) if s != slowest]
        t = sum(stage * times[s] / compute for s in others) / len(others) / 3
        bubble = closed_form(p.pp_schedule, p.pp, m, p.pp_virtual_stages, tf=t, tb=2 * t, tw=t)["idle"]
        boundary = activation // (p.tp if p.sp else 1)
        pp_exposed = 2 * (p.pp * p.pp_virtual_stages - 1) * net.send(boundary, pp_node, p.pp)

    return StepTime(compute=m * compute + optimizer, tp=m * layers * tp_layer, cp=m * layers * cp_layer,
                    ep=m * ep_mb, pp=pp_exposed, dp=dp_exposed + m * z3_mb, bubble=bubble)


def drain_exposed(reduce_s: float, chunks: int, gap: float, own: float) -> float:
    """Seconds a step's gradient reduction of `reduce_s` outlasts the last backward. It is split over the `chunks`
    model chunks a rank holds, each reduced once its gradients are complete and overlapping its own last
    backward (`own`); with interleaving the cooldown runs the last micro-batches chunk by chunk, deepest first
    (Narayanan et al. 2021, §2.2.2 and Fig. 4: p micro-batches a chunk), so chunk j completes j x `gap` before
    chunk 0 and its reduction hides behind the backward that follows. One chunk: max(0, reduce - own)."""
    done = -math.inf
    for j in reversed(range(chunks)):
        done = max(done, -j * gap - own) + reduce_s / chunks
    return max(0.0, done)


# --- steps 1 and 2: enumerate, validate, fit ---------------------------------------------------------------

def _check_inputs(cfg: ModelConfig, gpus: int, gpus_per_node: int, hardware: str, system: str, seq: int,
                  global_batch_tokens: int, efficiency: float, tp_overlap: float = 0.0,
                  cp_exposed: float = 0.0, stack: str = "eager") -> None:
    def require(ok: bool, message: str) -> None:
        if not ok:
            raise ValueError(message)

    for name, value in (("gpus", gpus), ("gpus_per_node", gpus_per_node), ("seq", seq),
                        ("global_batch_tokens", global_batch_tokens)):
        check_count(name, value)
    require(gpus <= gpus_per_node or gpus % gpus_per_node == 0,
            f"gpus={gpus} must be a multiple of gpus_per_node={gpus_per_node} (whole nodes) or fit in one node")
    require(system in SYSTEMS, f"system={system!r} must be one of {', '.join(SYSTEMS)} (the network; "
                               f"hardware={hardware!r} names none)")
    require(seq <= cfg.max_seq_len, f"seq={seq} must be <= max_seq_len={cfg.max_seq_len} of {cfg.name}")
    require(round(global_batch_tokens / seq) >= 1,
            f"global_batch_tokens={global_batch_tokens} must be at least one sequence of seq={seq} tokens")
    require(isinstance(efficiency, int | float) and 0 < efficiency <= 1, f"efficiency={efficiency!r} must be in (0, 1]")
    for name, value in (("tp_overlap", tp_overlap), ("cp_exposed", cp_exposed)):
        require(isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= 1,
                f"{name}={value!r} must be in [0, 1]")
    require(stack in STACKS, f"stack={stack!r} must be one of {', '.join(STACKS)}")


PINNABLE = ("dp", "tp", "pp", "cp", "ep", "zero", "pp_schedule", "pp_virtual_stages", "pp_layers", "recompute",
            "mbs", "grad_accum")


def _check_fixed(fixed: dict) -> None:
    for key, value in fixed.items():
        if key not in PINNABLE:
            raise ValueError(f"fixed[{key!r}] is not a setting the search can pin; valid: {', '.join(PINNABLE)}")
        if key == "pp_layers":
            if not isinstance(value, str):
                raise ValueError(f"pp_layers={value!r} must be 'even', 'llama3' or counts like '7,8,8,7'")
        elif key in ("pp_schedule", "recompute"):
            allowed = PP_SCHEDULES if key == "pp_schedule" else RECOMPUTE_MODES
            if value not in allowed:
                raise ValueError(f"{key}={value!r} must be one of {', '.join(map(repr, allowed))}")
        elif key == "zero":
            if value not in (0, 1, 2, 3):
                raise ValueError(f"zero={value!r} must be one of 0, 1, 2, 3")
        else:
            check_count(key, value)


def _split(n_layers: int, virtual_stages: int, fixed: dict) -> str | None:
    """How the layers split over the virtual stages: as pinned, else "even" where it divides, else Llama 3's
    rule (first and last stage one layer fewer), else None (no split of this depth)."""
    if "pp_layers" in fixed:
        return fixed["pp_layers"]
    for split in ("even", "llama3"):
        try:
            stage_layers(n_layers, virtual_stages, split)
            return split
        except ValueError:
            continue
    return None


def _options(cfg: ModelConfig, dp: int, pp: int, fixed: dict) -> list[tuple[int, str, int, str, str]]:
    """(zero, schedule, chunks, layer split, recompute) settings of one family: schedules from 1F1B (the least
    memory), ZeRO stages from the most frugal, no recomputation before full; those `fixed` pins, only."""
    zeros = [3, 2, 1, 0] if dp > 1 else [0]
    schedules = list(SCHEDULES) if pp > 1 else [("1f1b", 1)]
    if "pp_schedule" in fixed or "pp_virtual_stages" in fixed:
        name = fixed.get("pp_schedule", "interleaved" if fixed.get("pp_virtual_stages", 1) > 1 else "1f1b")
        schedules = [(name, pp_chunks(name, fixed.get("pp_virtual_stages", 0)))]
    splits = {v: _split(cfg.n_layers, pp * v, fixed) if pp > 1 else "even" for _, v in schedules}
    recomputes = [fixed["recompute"]] if "recompute" in fixed else RECOMPUTE_SEARCHED
    return [(z, s, v, splits[v], r) for s, v in schedules if splits[v] for z in zeros if fixed.get("zero", z) == z
            for r in recomputes]


@dataclass(frozen=True)
class _Context:
    """What every layout of one search shares."""

    cfg: ModelConfig
    seq: int
    batch: int  # sequences
    gpus: int
    capacity: int  # bytes per GPU
    peak: float  # dense bf16 FLOP/s
    chip: _Chip
    work: _Work
    net: _Network
    model_flops: FlopsEstimate  # of one step, for MFU
    tp_overlap: float = 0.0  # share of TP's collectives hidden (async TP)
    cp_exposed: float = 0.0  # share of CP's ring exposed at least

    def train(self) -> TrainConfig:
        return TrainConfig(global_batch=self.batch, seq_len=self.seq)


def search(model: ModelConfig | str, gpus: int, gpus_per_node: int = 8, hardware: str | Accelerator = "h100",
           seq: int = 4096, global_batch_tokens: int = 2**20, *, system: str | None = None,
           efficiency: float = COMPUTE_EFFICIENCY, fixed: dict | None = None, tp_overlap: float = 0.0,
           cp_exposed: float = 0.0, stack: str = "eager", enforce_memory: bool = True) -> SearchResult:
    """Every layout of `model` on `gpus` GPUs (nodes of `gpus_per_node`) that fits and that lab.train runs,
    ranked by modelled tokens/s, for sequences of `seq` tokens and a global batch of about
    `global_batch_tokens` tokens (rounded to whole sequences). `hardware` is an accelerator of
    `lab.calc.hardware` (or one given as an `Accelerator`: its bf16 peak and memory); `system` the network of
    `lab.calc.network` (default: the one named like the hardware). `fixed` pins settings, e.g. {"cp": 1,
    "tp": 8} (the keys of `PINNABLE`: the fields of ParallelConfig the search varies, mbs and grad_accum),
    to search what a published recipe left free. `tp_overlap` (share of TP's collectives that async TP hides)
    and `cp_exposed` (the least share of CP's ring that stays exposed) move the two overlaps; `efficiency` is
    the plateau of large GEMMs (a share of the bf16 peak); `stack` the software that runs the step
    (`calibration.STACKS`). `enforce_memory=False` keeps layouts whatever `calc.memory` says they need (for runs
    that were measured, so fit their framework). Invalid input raises a one-line ValueError."""
    started = time.perf_counter()
    cfg = ModelConfig.from_preset(model) if isinstance(model, str) else model
    accelerator = hardware if isinstance(hardware, Accelerator) else get_accelerator(hardware)
    name = hardware if isinstance(hardware, str) else accelerator.name
    system = system or name
    _check_inputs(cfg, gpus, gpus_per_node, name, system, seq, global_batch_tokens, efficiency, tp_overlap, cp_exposed,
                  stack)
    fixed = dict(fixed or {})
    _check_fixed(fixed)
    peak = accelerator.peak_flops("bf16")
    batch = round(global_batch_tokens / seq)
    chip = _Chip(efficiency * peak, peak, accelerator.hbm_bandwidth * CONSTANTS["hbm_efficiency"].value,
                 STACKS[stack])
    ctx = _Context(cfg, seq, batch, gpus, accelerator.memory_bytes if enforce_memory else 2**62, peak,
                   chip, _Work.of(cfg, seq), _Network(system, gpus_per_node),
                   training_flops(cfg, seq, batch * seq, counting="exact"), tp_overlap, cp_exposed)
    candidates: list[Candidate] = []
    rejected: dict[str, Rejections] = {}
    families: set[str] = set()
    for pp in _divisors(gpus):  # pp outermost: estimate_memory caches a pipeline's schedule replay per pp
        if pp > 1 and cfg.n_layers < MIN_STAGE_LAYERS * pp:
            continue
        for tp in (t for t in _divisors(gpus // pp) if gpus_per_node % t == 0):  # TP inside a node
            for cp in (c for c in _divisors(gpus // (pp * tp)) if seq // c >= MIN_CP_TOKENS or c == 1):
                dp = gpus // (tp * cp * pp)
                eps = [e for e in _divisors(dp * cp) if cfg.n_experts % e == 0] if cfg.is_moe else [1]
                for ep in eps:
                    if any(fixed.get(n, v) != v for n, v in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp),
                                                              ("ep", ep))):
                        continue
                    base = ParallelConfig(dp=dp, tp=tp, cp=cp, pp=pp, ep=ep, sp=tp > 1 and not cfg.is_moe,
                                          pp_layers=_split(cfg.n_layers, pp, fixed) or "even" if pp > 1 else "even")
                    family = family_name(base)
                    families.add(family)
                    why = rejected.setdefault(family, Rejections())
                    options = _options(cfg, dp, pp, fixed)
                    if ctx.batch % dp:
                        why.add("batch", f"the global batch of {ctx.batch} sequences is not a multiple of dp={dp}",
                                len(options))
                        continue
                    try:  # the family's shape: heads, layers, experts, sequence chunks
                        Config(cfg, base, ctx.train()).validate()
                    except ValueError as err:
                        why.add("shape", str(err), len(options))
                        continue
                    candidates += _fit(ctx, base, options, why, fixed)
    candidates.sort(key=_rank)
    rejected = {f: r for f, r in rejected.items() if r.total}
    return SearchResult(cfg, gpus, gpus_per_node, name, seq, ctx.batch, candidates, rejected, families,
                        time.perf_counter() - started, efficiency, stack)


def fullest_stage(cfg: ModelConfig, seq: int, mbs: int, parallel: ParallelConfig, loss: str = "chunked"
                  ) -> MemoryEstimate:
    """`estimate_memory` of the fullest GPU, looking only at the first and the last pipeline stage when the
    stages hold equal layers: the first also holds the embedding and the most micro-batches in flight (1F1B,
    interleaved and ZB-H1 hold fewer further down), the last the output layer and the logits. The same answer
    as `estimate_memory(stage=None)`, which walks every stage (tests/test_calc_search.py checks it), at a cost
    that does not grow with pp. Llama 3's split also looks at stage 1, the first with a whole stage of
    layers; a split given as counts walks every stage. `loss` as `estimate_memory`'s: the stack's."""
    stages = {0, parallel.pp - 1} | ({1} if parallel.pp_layers == "llama3" and parallel.pp > 2 else set())
    if parallel.pp_layers not in ("even", "llama3"):
        stages = set(range(parallel.pp))
    estimates = [estimate_memory(cfg, seq, mbs, parallel, precision=PRECISION, flash=True, stage=k, loss=loss)
                 for k in sorted(stages)]
    return max(estimates, key=lambda e: (e.per_gpu["total"], e.stage))


def _rank(c: Candidate) -> tuple:
    """Best first: tokens/s (to 9 significant digits, so that equal models tie), then the simpler layout
    (fewer dimensions besides dp, lower ZeRO stage, lighter recomputation), then less memory, then the name."""
    p = c.parallel
    return (-float(f"{c.tokens_per_s:.9g}"), sum(getattr(p, n) > 1 for n in DIMENSIONS[1:]), p.zero,
            RECOMPUTE_MODES.index(p.recompute), c.memory.per_gpu["total"], c.layout, c.mbs)


def _fit(ctx: _Context, base: ParallelConfig, options: list, why: Rejections, fixed: dict) -> list[Candidate]:
    """The candidates of one family: for each setting, every micro-batch size that validates and fits.

    Two shortcuts keep this fast without losing an answer. Memory falls with the ZeRO stage and with
    recomputation and rises with mbs (and with interleaving and ZB-H1, which hold more micro-batches than
    1F1B): so a ZeRO stage whose 1F1B, full-recompute, mbs = 1 setting does not fit rules out every setting
    of that stage and the lower ones, and the mbs sweep stops at the first size that does not fit. And full
    recomputation at a micro-batch size that fits without it is the same layout with more FLOPs: it is
    skipped as dominated, not counted as rejected."""
    kept = []
    per_dp = ctx.batch // base.dp
    too_big: dict[int, int] = {}  # zero stage -> bytes its most frugal setting needs, when that is too many
    fits_without_recompute: set[tuple] = set()
    gib = f"{ctx.capacity / 2**30:.0f} GiB"
    for zero, schedule, chunks, split, recompute in options:
        if any(z >= zero for z in too_big):
            why.add("memory", f"needs at least {min(too_big.values()) / 2**30:.1f} GiB per GPU > {gib}")
            continue
        layout = dataclasses.replace(base, zero=zero, pp_schedule=schedule, pp_virtual_stages=chunks,
                                     pp_layers=split, recompute=recompute, grad_accum=per_dp)
        try:
            check_supported(Config(ctx.cfg, layout, ctx.train()))
        except ValueError as err:
            why.add("unsupported", str(err))
            continue
        fitted, dominated, smallest, invalid = 0, 0, None, None
        for mbs in _divisors(per_dp):
            if per_dp // mbs < base.pp:  # and larger mbs leave fewer micro-batches still
                invalid = invalid or (f"grad_accum={per_dp // mbs} micro-batches < pp={base.pp}: the pipeline "
                                      f"would idle for most of the step (the playbook: keep m >> p - 1)")
                break
            if fixed.get("mbs", mbs) != mbs or fixed.get("grad_accum", per_dp // mbs) != per_dp // mbs:
                continue
            if recompute == "full" and (zero, schedule, chunks, mbs) in fits_without_recompute:
                dominated += 1
                continue
            parallel = dataclasses.replace(layout, grad_accum=per_dp // mbs)
            try:
                Config(ctx.cfg, parallel, ctx.train()).validate()
            except ValueError as err:
                invalid = invalid or str(err)
                continue
            memory = fullest_stage(ctx.cfg, ctx.seq, mbs, parallel, ctx.chip.stack.loss)
            if memory.headroom(ctx.capacity) < 0:
                smallest = smallest or memory.per_gpu["total"]
                break
            if recompute == "none":
                fits_without_recompute.add((zero, schedule, chunks, mbs))
            step = _step_time(ctx.cfg, ctx.seq, parallel, mbs, ctx.work, ctx.net, ctx.chip, ctx.tp_overlap,
                              ctx.cp_exposed)
            kept.append(Candidate(parallel, mbs, memory, step, ctx.batch * ctx.seq, ctx.gpus,
                                  mfu(ctx.model_flops, step.total, ctx.gpus, ctx.peak)))
            fitted += 1
        if fitted or dominated:
            continue
        if smallest is not None:
            why.add("memory", f"needs at least {smallest / 2**30:.1f} GiB per GPU > {gib}")
            if recompute == "full" and schedule == "1f1b":
                too_big[zero] = smallest
        else:
            why.add("batch", invalid or "no micro-batch size splits the batch")
    return kept


# --- the model against measurements: calibration.RUNS ------------------------------------------------------

def run_model(run: Run) -> ModelConfig:
    """The ModelConfig of a measured run: a preset (with its overrides), or one of Megatron's GPT models as
    lab.model's nearest (SwiGLU of the GELU MLP's weights, multi-head attention, untied for the pipeline)."""
    if run.model in calibration.MEGATRON:
        d, layers, heads = calibration.MEGATRON[run.model]
        return ModelConfig(name=run.model, vocab_size=calibration.MEGATRON_VOCAB, d_model=d, n_layers=layers,
                           n_heads=heads, n_kv_heads=heads, d_ff=8 * d // 3 // 64 * 64, max_seq_len=run.seq)
    return ModelConfig.from_preset(run.model, **run.overrides)


def predict_run(run: Run) -> Candidate:
    """The search pinned to a measured run's layout, on its hardware and software stack: the best candidate
    (what the pins leave free, the search chooses). A layout that ran fitted its framework: where `calc.memory`
    says lab.train's would not (Llama 3 ran 8K tokens without recomputation after trimming what its pipeline
    kept, §3.3.2), it is priced all the same, and its memory is what lab.train would need. Raises ValueError when
    nothing runs."""
    hardware = calibration.TITAN_H100 if run.hardware == "titan" else run.hardware
    system = run.system or ("h100" if run.hardware == "titan" else run.hardware)
    result = search(run_model(run), run.gpus, 8, hardware, run.seq, run.global_batch * run.seq, system=system,
                    fixed=run.pins, tp_overlap=run.tp_overlap, stack=run.stack)
    if not result.candidates:
        result = search(run_model(run), run.gpus, 8, hardware, run.seq, run.global_batch * run.seq, system=system,
                        fixed=run.pins, tp_overlap=run.tp_overlap, stack=run.stack, enforce_memory=False)
    if not result.candidates:
        reasons = "; ".join(f"{f}: {r.main_reason()[1]}" for f, r in result.rejected_families().items())
        raise ValueError(f"{run.name}: no layout fits the pins {run.pins}: {reasons}")
    return result.candidates[0]


def reported_memory(run: Run, candidate: Candidate) -> dict[str, int]:
    """Bytes per GPU of `candidate` (predict_run's) as the run's own measurement reports them, by part: the
    search counts what lab.train would hold; a run measured elsewhere held what its framework holds.

    * states: TorchTitan shards everything with FSDP2 (fp32 weights, gradients, m, v: 16 bytes a parameter over
      dp·cp, under PP too) and holds gathered copies beside them (`memory.fsdp_unsharded_bytes`: reshard after
      forward without PP, not under PP); lab.train --precision bf16 keeps bf16 weights, fp32 gradients and fp32
      masters, m, v ("mixed-fp32-grads").
    * activations: the search's full recomputation keeps each layer's input; TorchTitan's "op" policy keeps what
      `memory.op_sac_layer_bytes` counts, for the same layers in flight.
    * reserved: TorchTitan logs the allocator's reserved peak, `allocator_reserved_over_allocated` of the
      allocated one; lab logs the allocated peak.

    Of the first and the last pipeline stage, the fuller (TorchTitan reports the most over its GPUs)."""
    stages = sorted({0, candidate.parallel.pp - 1})
    return max((_reported_memory(run, candidate, k) for k in stages), key=lambda parts: parts["total"])


def _reported_memory(run: Run, candidate: Candidate, k: int) -> dict[str, int]:
    cfg, p, seq, mbs = run_model(run), candidate.parallel, run.seq // candidate.parallel.cp, candidate.mbs
    mem = estimate_memory(cfg, run.seq, mbs, p, precision=PRECISION, flash=True, stage=k, loss=STACKS[run.stack].loss)
    units = [dense + expert for dense, expert in zero_units(cfg, p, k)]
    if run.framework == "torchtitan":
        states = sum(static_bytes(units, "mixed", zero=3, dp=p.dp * p.cp).values())
        gathered = fsdp_unsharded_bytes(cfg, p, k, reshard_after_forward=p.pp == 1)
    else:
        states, gathered = sum(static_bytes(units, "mixed-fp32-grads", zero=p.zero, dp=p.dp * p.cp).values()), 0
    layers = mem.activations_breakdown["layers"]
    if run.ac == "op" and p.recompute == "full":
        full = korthikanti_layer_bytes(seq, mbs, cfg.d_model, cfg.n_heads, tp=p.tp, sp=p.sp, recompute="full")
        layers = round(layers * op_sac_layer_bytes(cfg, seq, mbs, tp=p.tp, sp=p.sp) / full)
    parts = {"states": states, "gathered": gathered,
             "activations": layers + mem.activations_breakdown["embedding"] + mem.activations_breakdown["logits"],
             "loss": mem.per_gpu["loss"]}
    allocated = sum(parts.values())
    reserved = CONSTANTS["allocator_reserved_over_allocated"].value if run.memory_reported == "reserved" else 1.0
    return {**parts, "allocator": round(allocated * (reserved - 1)), "total": round(allocated * reserved)}


def predicted_over_measured(run: Run, candidate: Candidate) -> tuple[float, float | None]:
    """(throughput, memory) predicted / measured: tokens/s per GPU, or MFU where the run published that;
    memory (`reported_memory`) None where it published none."""
    throughput = (candidate.tokens_per_s_per_gpu / run.tokens_per_s_per_gpu if run.tokens_per_s_per_gpu
                  else candidate.mfu / run.mfu)
    memory = reported_memory(run, candidate)["total"] / 2**30 / run.memory_gib if run.memory_gib else None
    return throughput, memory


def recipe_rank(result: SearchResult, match: dict) -> tuple[int, float, bool]:
    """(rank from 1, tokens/s over the best's, whether it ties with the best) of the fastest candidate whose
    ParallelConfig has the fields of `match`, e.g. {"dp": 32, "tp": 8, "zero": 3}."""
    rank, candidate = next((i, c) for i, c in enumerate(result.candidates)
                           if all(getattr(c.parallel, k) == v for k, v in match.items()))
    return rank + 1, candidate.tokens_per_s / result.candidates[0].tokens_per_s, rank < result.ties
