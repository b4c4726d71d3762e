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

The time model of one step (all ranks do the same work; the slowest pipeline stage sets the pace):

* **Compute.** The FLOPs lab.model really runs (`training_flops(counting="exact")`, recomputation
  included) at `efficiency` x the accelerator's dense bf16 peak; 0.6 by default: large bf16 GEMMs reach
  60-75 % of an H100's dense peak, and the best end-to-end MFUs published (the playbook's 44 %, TorchTitan's
  40-50 %) sit below that once communication and bubbles are added. Tensor and context parallelism divide
  a micro-batch's work by tp·cp. Layers are spread evenly over the pipeline stages; the last stage also runs
  the output layer, so it is the slowest one (the first stage's embedding is a lookup, no FLOPs). MFU counts
  the model's FLOPs as lab.model runs them, without recomputation (`counting="exact"`: the embedding lookup
  is no matmul, so an untied model's MFU is not inflated by 6 FLOPs per embedding weight as "6N" would).
* **Where a group lives.** Ranks are numbered TP fastest, then CP, PP, DP (Llama 3's order), in nodes of
  `gpus_per_node`: a group whose members share a node talks over NVLink, one that spans nodes over the
  NICs, multi-rail (`lab.calc.comms.collective_time` with the group's members per node). TP's degree
  divides the node size, so its group never leaves the node (the playbook's rule, "Tensor Parallelism": TP's collectives
  sit on the critical path after every matmul).
* **Tensor parallelism** (exposed: its collectives sit between the matmuls that need them). Per layer and
  micro-batch, forward: an all-gather and a reduce-scatter around attention and around the MLP (SP; an
  all-reduce each without SP, same bytes), of mbs·seq/cp·d bf16 values; backward the same again; full
  recomputation repeats the forward's. Async TP, which overlaps them with the matmuls, is left out by default;
  `tp_overlap` is the share of that time it hides (0 to 1).
* **Context parallelism** (ring attention, zig-zag). Per layer, the K/V blocks travel cp-1 hops forward and
  again with their gradients backward; each hop hides behind one block of attention: exposed =
  max(0, ring time - attention time), or at least `cp_exposed` x the ring time (0 by default: a perfect
  overlap; real ring attention loses some to the hops' launch and to the load it shares with the kernel).
* **Expert parallelism.** Four all-to-alls per MoE layer and micro-batch (`lab.calc.moe.all_to_all_seconds`:
  dispatch, combine and their gradients; six with full recomputation), exposed.
* **Pipeline.** The bubble is the closed form of `lab.calc.bubble.closed_form` for the schedule with
  t_f : t_b : t_w = 1 : 2 : 1 of the slowest stage's micro-batch time ((p-1)/v stage times for 1F1B and
  interleaved, a third of 1F1B's for ZB-H1). The activations' point-to-point sends overlap compute in the
  steady state (their time over a stage's compute is far below 1); the fill and the drain cross 2(p·v - 1)
  boundaries on the critical path, and those sends are exposed.
* **Data parallelism and ZeRO** (the overlap rules of the playbook's appendix "Math for Compute/Communication
  Overlap"). The gradients of the slowest stage's parameters (bf16) are reduced over the dp·cp ranks that share
  them (experts over dp·cp/ep) in buckets of `bucket_mb` (25 MiB, DDP's default; each bucket pays the latency of a
  collective over all those ranks again; the faster of NCCL's flat ring and the hierarchical all-reduce). ZeRO-0
  all-reduces them during the last micro-batch's backward: exposed = max(0, all-reduce - backward). ZeRO-1/2
  reduce-scatter them the same way, then all-gather the updated parameters after the optimizer step, exposed (so
  ZeRO-2 costs what ZeRO-1 costs and saves memory: the playbook's "prefer ZeRO-2"). ZeRO-3 gathers each layer's
  parameters before its forward and again before its backward and reduce-scatters its gradients after it, for
  every micro-batch; layer i+1's gather hides behind layer i's compute (`comms.zero3_overlap_ratio` is the
  bandwidth-only form of the ratio), so the exposed time is the first layer's gather plus, per layer, max(0,
  gather - forward) and max(0, gather + reduce-scatter - backward).

Left out: kernel-level overheads (launches, memory-bound norms and element-wise ops) and the kernels' different
efficiencies (one `efficiency` for every matmul, whatever its shape after TP or CP splits it), the
vocabulary-parallel loss's small collectives, stragglers and switch congestion. The ranking is a model to
shortlist layouts that are then measured, as the playbook's step 4 says, not a measurement.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

from lab.calc.bubble import closed_form
from lab.calc.comms import collective_time
from lab.calc.flops import FlopsEstimate, mfu, training_flops
from lab.calc.hardware import Accelerator, get_accelerator
from lab.calc.memory import MemoryEstimate, estimate_memory, stage_params
from lab.calc.moe import all_to_all_seconds
from lab.calc.network import SYSTEMS, Link
from lab.config import (
    PP_SCHEDULES,
    RECOMPUTE_MODES,
    Config,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    check_supported,
)
from lab.layout import INTERLEAVED_CHUNKS, pp_chunks, strides

COMPUTE_EFFICIENCY = 0.6  # achievable fraction of the dense bf16 peak for the model's matmuls (see above)
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
            parts.append(f"pp{p.pp} {p.pp_schedule}" + (f" x{p.pp_virtual_stages}" if p.pp_virtual_stages > 1 else ""))
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
                "tokens_per_s": self.tokens_per_s, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu}


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

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq

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
                "tokens_per_step": self.tokens_per_step, "efficiency": self.efficiency,
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

def _per_node(gpus_per_node: int, dims: tuple[tuple[int, int], ...]) -> int:
    """Members of rank 0's group on rank 0's node, the group spanning `dims` = ((stride, size), ...)."""
    members = [0]
    for stride, size in dims:
        members = [m + i * stride for m in members for i in range(size)]
    return sum(m < gpus_per_node for m in members)


@dataclass(frozen=True)
class _Network:
    system: str
    gpus_per_node: int

    @lru_cache(maxsize=4096)  # noqa: B019 - a few hundred distinct messages per search; the object lives as long
    def collective(self, op: str, nbytes: float, ranks: int, per_node: int) -> float:
        """Seconds of one collective on a group of `ranks` with `per_node` members per node (all of them when
        it stays inside one); all-reduce takes the faster of the flat ring and the hierarchical algorithm."""
        if ranks == 1 or nbytes == 0:
            return 0.0
        g = ranks if per_node == ranks else per_node
        algorithms = ("ring", "hierarchical") if op == "all_reduce" and per_node < ranks else ("ring",)
        return min(collective_time(op, nbytes, ranks, system=self.system, algorithm=a, gpus_per_node=g).time_s
                   for a in algorithms)

    def bucketed(self, op: str, nbytes: float, ranks: int, per_node: int, bucket: float) -> float:
        """`nbytes` of gradients in equal buckets of at most `bucket` bytes, one collective each: every bucket
        pays the collective's latency again, which is what makes many ranks costly for small models."""
        n = math.ceil(nbytes / bucket)
        return n * self.collective(op, nbytes / n, ranks, per_node) if n else 0.0

    def neighbour_link(self, per_node: int, ranks: int) -> Link:
        """The link a ring or chain of neighbours waits on: NVLink inside a node, else each GPU's own NIC."""
        spec = SYSTEMS[self.system]
        return spec.intra if per_node == ranks else spec.nic

    def send(self, nbytes: float, per_node: int, ranks: int) -> float:
        return collective_time("send", nbytes, 2, link=self.neighbour_link(per_node, ranks)).time_s


@dataclass(frozen=True)
class _Work:
    """Per-token FLOPs of the model at this sequence length, split as the time model needs them."""

    layer: dict[str, float]  # one layer, forward + backward (+ recomputation), by recompute mode
    layer_forward: float
    head: float  # the output layer, forward + backward
    attention: float  # the attention core of one layer, forward + backward
    moe_layers: int

    @classmethod
    def of(cls, cfg: ModelConfig, seq: int) -> _Work:
        L = cfg.n_layers
        head_forward = 2 * cfg.vocab_size * cfg.d_model
        exact = {r: training_flops(cfg, seq, recompute=r, counting="exact") for r in RECOMPUTE_MODES}
        layer = {r: (e.hardware_flops_per_token - 3 * head_forward) / L for r, e in exact.items()}
        # the attention core is the part that grows with seq: f(s) = a + b·s, so b·s = 2·(f(s) - f(s/2))
        half = training_flops(cfg, max(seq // 2, 1), counting="exact").model_flops_per_token
        attention = 2 * (exact["none"].model_flops_per_token - half) / L if seq > 1 else 0.0
        return cls(layer, layer["none"] / 3, 3 * head_forward, attention,
                   sum(cfg.is_moe_layer(i) for i in range(L)))


def _step_time(cfg: ModelConfig, seq: int, p: ParallelConfig, mbs: int, work: _Work, net: _Network,
               flops_per_s: float, tp_overlap: float = 0.0, cp_exposed: float = 0.0) -> StepTime:
    """The model of the module docstring for one layout."""
    g, m = net.gpus_per_node, p.grad_accum
    tokens = mbs * seq // p.cp  # of one micro-batch on one rank
    layers = cfg.n_layers // p.pp  # on every stage; the last one also runs the output layer
    moe_layers = work.moe_layers / p.pp

    def seconds(flops: float) -> float:
        return flops / flops_per_s

    # compute of one micro-batch on the last (slowest) stage
    compute = seconds((layers * work.layer[p.recompute] + work.head) * mbs * seq / (p.tp * p.cp))
    forward = seconds((layers * work.layer_forward + work.head / 3) * mbs * seq / (p.tp * p.cp))
    backward = compute - forward

    # groups along the mesh's axes (lab.layout: TP innermost); EP inside dp x cp
    stride = strides(p.dp, p.pp, p.cp, p.tp)
    tp_node = _per_node(g, ((stride["tp"], p.tp),))
    cp_node = _per_node(g, ((stride["cp"], p.cp),))
    pp_node = _per_node(g, ((stride["pp"], p.pp),))
    dpcp = ((stride["cp"], p.cp), (stride["dp"], p.dp))
    dpcp_node = _per_node(g, dpcp)
    ep_node = _per_node(g, ((stride["cp"], min(p.cp, p.ep)), (stride["dp"], max(p.ep // p.cp, 1))))

    forward_passes = 2 if p.recompute == "full" else 1
    activation = tokens * cfg.d_model * WIRE_BYTES
    tp_layer = 0.0
    if p.tp > 1:  # 2 AG + 2 RS (sp) or 2 AR per forward, the same per backward
        ops = ("all_gather", "reduce_scatter") if p.sp else ("all_reduce",)
        per_forward = 2 * sum(net.collective(op, activation, p.tp, tp_node) for op in ops)
        tp_layer = per_forward * (forward_passes + 1) * (1 - tp_overlap)
    cp_layer = 0.0
    if p.cp > 1:  # K and V of the local tokens, cp-1 hops; 2x again backward (K, V and their gradients)
        width = (cfg.n_heads // p.tp * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
                 if cfg.attention == "mla" else 2 * max(cfg.n_kv_heads // p.tp, 1) * cfg.head_dim)
        ring = (p.cp - 1) * net.send(tokens * width * WIRE_BYTES, cp_node, p.cp) * (forward_passes + 2)
        attention = seconds(work.attention * mbs * seq / (p.tp * p.cp))
        cp_layer = max(ring - attention, cp_exposed * ring, 0.0)
    ep_mb = 0.0
    if p.ep > 1:
        ep_mb = all_to_all_seconds(tokens, cfg.top_k, cfg.d_model, p.ep, net.system,
                                   gpus_per_node=ep_node) * (1 + forward_passes) / 2 * moe_layers

    # ZeRO-3: per micro-batch, gather before forward and backward, reduce-scatter after backward, per layer
    dense, expert = stage_params(cfg, p, p.pp - 1)
    z3_mb = 0.0
    if p.zero == 3:
        layer_bytes = (dense + expert) * WIRE_BYTES / layers
        gather = net.collective("all_gather", layer_bytes, p.dp * p.cp, dpcp_node)
        scatter = net.collective("reduce_scatter", layer_bytes, p.dp * p.cp, dpcp_node)
        z3_mb = gather + max(0.0, layers * gather - forward) + max(0.0, layers * (gather + scatter) - backward)

    stage = compute + layers * (tp_layer + cp_layer) + ep_mb + z3_mb  # one micro-batch through the last stage

    # data parallelism: once per step, during the last micro-batch's backward
    dp_exposed = 0.0
    if p.dp * p.cp > 1 and p.zero < 3:
        ep_dp, ep_dp_node = p.dp * p.cp // p.ep, max(dpcp_node // ep_node, 1)
        grads = ((dense * WIRE_BYTES, p.dp * p.cp, dpcp_node), (expert * WIRE_BYTES, ep_dp, ep_dp_node))
        bucket = p.bucket_mb * 2**20

        def bucketed(op: str) -> float:
            return sum(net.bucketed(op, b, n, k, bucket) for b, n, k in grads)

        if p.zero == 0:
            dp_exposed = max(0.0, bucketed("all_reduce") - backward)
        else:
            dp_exposed = max(0.0, bucketed("reduce_scatter") - backward) + bucketed("all_gather")

    bubble = pp_exposed = 0.0
    if p.pp > 1:
        t = stage / 3
        bubble = closed_form(p.pp_schedule, p.pp, m, p.pp_virtual_stages, tf=t, tb=2 * t, tw=t)["idle"]
        boundary = activation // (p.tp if p.sp else 1)
        pp_exposed = 2 * (p.pp * p.pp_virtual_stages - 1) * net.send(boundary, pp_node, p.pp)

    return StepTime(compute=m * compute, tp=m * layers * tp_layer, cp=m * layers * cp_layer, ep=m * ep_mb,
                    pp=pp_exposed, dp=dp_exposed + m * z3_mb, bubble=bubble)


# --- steps 1 and 2: enumerate, validate, fit ---------------------------------------------------------------

def _check_inputs(cfg: ModelConfig, gpus: int, gpus_per_node: int, hardware: str, system: str, seq: int,
                  global_batch_tokens: int, efficiency: float, tp_overlap: float = 0.0,
                  cp_exposed: float = 0.0) -> None:
    def require(ok: bool, message: str) -> None:
        if not ok:
            raise ValueError(message)

    for name, value in (("gpus", gpus), ("gpus_per_node", gpus_per_node), ("seq", seq),
                        ("global_batch_tokens", global_batch_tokens)):
        require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                f"{name}={value!r} must be an integer >= 1")
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


PINNABLE = ("dp", "tp", "pp", "cp", "ep", "zero", "pp_schedule", "pp_virtual_stages", "recompute", "mbs",
            "grad_accum")


def _check_fixed(fixed: dict) -> None:
    for key, value in fixed.items():
        if key not in PINNABLE:
            raise ValueError(f"fixed[{key!r}] is not a setting the search can pin; valid: {', '.join(PINNABLE)}")
        if key in ("pp_schedule", "recompute"):
            allowed = PP_SCHEDULES if key == "pp_schedule" else RECOMPUTE_MODES
            if value not in allowed:
                raise ValueError(f"{key}={value!r} must be one of {', '.join(map(repr, allowed))}")
        elif key == "zero":
            if value not in (0, 1, 2, 3):
                raise ValueError(f"zero={value!r} must be one of 0, 1, 2, 3")
        elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key}={value!r} must be an integer >= 1")


def _options(cfg: ModelConfig, dp: int, pp: int, fixed: dict) -> list[tuple[int, str, int, str]]:
    """(zero, schedule, chunks, recompute) settings of one family: schedules from 1F1B (the least memory),
    ZeRO stages from the most frugal, no recomputation before full; those `fixed` pins, only."""
    zeros = [3, 2, 1, 0] if dp > 1 else [0]
    schedules = [s for s in SCHEDULES if cfg.n_layers % (pp * s[1]) == 0] if pp > 1 else [("1f1b", 1)]
    if "pp_schedule" in fixed or "pp_virtual_stages" in fixed:
        name = fixed.get("pp_schedule", "interleaved" if fixed.get("pp_virtual_stages", 1) > 1 else "1f1b")
        schedules = [(name, pp_chunks(name, fixed.get("pp_virtual_stages", 0)))]
    recomputes = [fixed["recompute"]] if "recompute" in fixed else RECOMPUTE_SEARCHED
    return [(z, s, v, r) for s, v in schedules for z in zeros if fixed.get("zero", z) == z for r in recomputes]


@dataclass(frozen=True)
class _Context:
    """What every layout of one search shares."""

    cfg: ModelConfig
    seq: int
    batch: int  # sequences
    gpus: int
    capacity: int  # bytes per GPU
    peak: float  # dense bf16 FLOP/s
    flops_per_s: float  # what the matmuls achieve
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
           cp_exposed: float = 0.0) -> SearchResult:
    """Every layout of `model` on `gpus` GPUs (nodes of `gpus_per_node`) that fits and that lab.train runs,
    ranked by modelled tokens/s, for sequences of `seq` tokens and a global batch of about
    `global_batch_tokens` tokens (rounded to whole sequences). `hardware` is an accelerator of
    `lab.calc.hardware` (or one given as an `Accelerator`: its bf16 peak and memory); `system` the network of
    `lab.calc.network` (default: the one named like the hardware). `fixed` pins settings, e.g. {"cp": 1,
    "tp": 8} (the keys of `PINNABLE`: the fields of ParallelConfig the search varies, mbs and grad_accum),
    to search what a published recipe left free. `tp_overlap` (share of TP's collectives that async TP hides)
    and `cp_exposed` (share of CP's ring that stays exposed however long the attention) move the two
    overlaps the default model takes as 0 and perfect. Invalid input raises a one-line ValueError."""
    started = time.perf_counter()
    cfg = ModelConfig.from_preset(model) if isinstance(model, str) else model
    accelerator = hardware if isinstance(hardware, Accelerator) else get_accelerator(hardware)
    name = hardware if isinstance(hardware, str) else accelerator.name
    system = system or name
    _check_inputs(cfg, gpus, gpus_per_node, name, system, seq, global_batch_tokens, efficiency, tp_overlap, cp_exposed)
    fixed = dict(fixed or {})
    _check_fixed(fixed)
    peak = accelerator.peak_flops("bf16")
    batch = round(global_batch_tokens / seq)
    ctx = _Context(cfg, seq, batch, gpus, accelerator.memory_bytes, peak,
                   efficiency * peak, _Work.of(cfg, seq), _Network(system, gpus_per_node),
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
                    base = ParallelConfig(dp=dp, tp=tp, cp=cp, pp=pp, ep=ep, sp=tp > 1 and not cfg.is_moe)
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
                        time.perf_counter() - started, efficiency)


def fullest_stage(cfg: ModelConfig, seq: int, mbs: int, parallel: ParallelConfig) -> MemoryEstimate:
    """`estimate_memory` of the fullest GPU, looking only at the first and the last pipeline stage: stages
    hold equal layers, the first also the embedding and the most micro-batches in flight (1F1B, interleaved
    and ZB-H1 hold fewer further down), the last the output layer and the logits. The same answer as
    `estimate_memory(stage=None)`, which walks every stage (tests/test_calc_search.py checks it), at a cost
    that does not grow with pp."""
    estimates = [estimate_memory(cfg, seq, mbs, parallel, precision=PRECISION, flash=True, stage=k)
                 for k in sorted({0, parallel.pp - 1})]
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
    for zero, schedule, chunks, recompute in options:
        if any(z >= zero for z in too_big):
            why.add("memory", f"needs at least {min(too_big.values()) / 2**30:.1f} GiB per GPU > {gib}")
            continue
        layout = dataclasses.replace(base, zero=zero, pp_schedule=schedule, pp_virtual_stages=chunks,
                                     recompute=recompute, grad_accum=per_dp)
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
            memory = fullest_stage(ctx.cfg, ctx.seq, mbs, parallel)
            if memory.headroom(ctx.capacity) < 0:
                smallest = smallest or memory.per_gpu["total"]
                break
            if recompute == "none":
                fits_without_recompute.add((zero, schedule, chunks, mbs))
            step = _step_time(ctx.cfg, ctx.seq, parallel, mbs, ctx.work, ctx.net, ctx.flops_per_s, ctx.tp_overlap,
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
