"""The constants of the config search's step-time model, each with where it comes from, and the published runs
the model is checked against. Torch-free.

What belongs here: every number `lab.calc.search` needs that is neither a chip's or a network's datasheet value
(`lab.calc.hardware`, `lab.calc.network`) nor a count of the model (`lab.calc.flops`, `lab.calc.memory`): how
close real kernels come to those peaks, how much of a collective hides, which software stack runs the step, what a
memory reading holds beyond the tensors (the allocator's reserve). And `RUNS`, the measurements the model must
reproduce, each with what its framework ran (`Run.framework`, `Run.ac`: `lab.calc.search.reported_memory` counts
its memory as that framework holds it). Sources are given as a learner can open them: a paper's
table, a repository file, or lab's own recording in benchmarks/results/ (the GPU lane's JSON documents).

Fitted or read off? Most constants are read off one measurement each (`fitted_on` empty). Three are fitted, and
say so: `titan_clock` (the unknown peak of TorchTitan's 500 W H100s) on one TorchTitan run, 8B on 128 GPUs
compiled; `async_tp_overlap` on the ratio of TorchTitan's two Table 4 rows; the `lab` stack's element-wise
traffic on lab's own 1B recording (the only one there is). Every other row of `RUNS` only tests. The
`spread` of a constant is the range its sources span (relative, +-); `SPREAD` turns them into the range of a
step time, which the search reports per layout and uses to call layouts ties.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lab.calc.hardware import Accelerator, GiB
from lab.calc.network import PLAYBOOK_BUSBW

LAB_H100 = "benchmarks/results/2026-11-26-h100-80gb-hbm3-bench-scripts.json"
LAB_MFU = "benchmarks/results/2026-11-26-h100-80gb-hbm3-bench.json"
LAB_SNAPSHOT = "benchmarks/results/2026-11-26-h100-80gb-hbm3-memory-snapshot.pickle.gz"
TITAN = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
H100_PEAK, H100_HBM = 989.4e12, 3.35e12  # what the recordings' chip had (lab.calc.hardware "h100")


@dataclass(frozen=True)
class Constant:
    value: float
    spread: float  # relative range of its sources, +-
    source: str
    fitted_on: str = ""  # the validation rows it was fitted to; empty when read off a measurement


CONSTANTS: dict[str, Constant] = {
    # --- matmuls: time = FLOPs / (matmul_efficiency x peak) + gemm_overhead_s, i.e. an efficiency that
    # saturates with the GEMM's size, F / (F + F_half) x matmul_efficiency, F_half = matmul_efficiency x peak x
    # overhead (4.3 GFLOP on an H100: a 1024^3 GEMM reaches 27 %, 2048^3 60 %, 4096^3 and up the plateau)
    "matmul_efficiency": Constant(
        0.745, 0.06, f"{LAB_H100}, part fp8, bf16 GEMMs of the eight shapes >= 4096 (square 4096-16384 and the "
                     "Llama 3 1B/8B/70B MLP GEMMs): 681-784 TFLOP/s, 69-79 % of 989"),
    "gemm_overhead_s": Constant(
        5.8e-6, 0.25, f"{LAB_H100}, part fp8, bf16 square 1024 and 2048 (10.0 and 27.8 us, 21 % and 62 %): "
                      "the time above FLOPs / plateau, 7.1 and 4.5 us (launch, tile waves that do not fill 132 SMs)"),
    # --- the attention core (flash, causal: half the s x s products that lab.calc.flops counts)
    "attention_forward_flops": Constant(
        317e12, 0.15, f"{LAB_H100}, part kernels, flash_attention fwd, torch SDPA (B4 H32 S4096 D128, causal "
                      "FLOPs): 317 TFLOP/s; FlashAttention-3's paper reaches 500-600 at D128, so +-15 %"),
    "attention_backward_flops": Constant(
        266e12, 0.15, f"{LAB_H100}, part kernels, flash_attention bwd, torch SDPA, same shape: 266 TFLOP/s"),
    # --- element-wise work (norms, RoPE, SwiGLU, residual adds): bytes moved / (hbm x hbm_efficiency)
    "hbm_efficiency": Constant(
        0.85, 0.08, f"{LAB_H100}, part kernels: fused kernels reach 90 % (add, SwiGLU), 88 % (RMSNorm forward), "
                    "68-72 % (RMSNorm backward) of 3.35 TB/s"),
    "eager_traffic": Constant(
        1.84, 0.2, f"{LAB_H100}, part kernels: torch eager over torch.compile time, RMSNorm forward 1.52, "
                   "backward 1.95, SwiGLU 1.67, cross-entropy 2.21 (mean 1.84): eager kernels read and write "
                   "every intermediate"),
    "loss_s_per_logit_eager": Constant(
        6.22e-3 / (8192 * 128256), 0.1, f"{LAB_H100}, part kernels, cross_entropy fwd+bwd torch eager, 8192 x "
                                        "128256 logits: 6.22 ms"),
    "loss_s_per_logit_compiled": Constant(
        2.81e-3 / (8192 * 128256), 0.1, f"{LAB_H100}, part kernels, cross_entropy fwd+bwd torch.compile: 2.81 ms"),
    "unfused_softmax_bytes": Constant(
        20.0, 0.2, "attention without a flash kernel (Megatron-LM 2021: megatron/model/fused_softmax.py's "
                   "scale-mask-softmax, then dropout), bytes per element of the s x s scores in 16 bits, forward "
                   "and backward: the forward reads the scores and writes the probabilities (2 + 2), dropout reads "
                   "them and writes its mask and output (2 + 1 + 2); the backward reads the gradient and the mask "
                   "and writes (2 + 1 + 2), then reads the gradient and the probabilities and writes (2 + 2 + 2): the "
                   "tensors Korthikanti et al. 2022, §4.1, count as 5 bytes an element of activations"),
    "fp8_cast_bytes": Constant(
        5.0, 0.2, "torchao float8 tensorwise scaling: per element of each linear's input and output gradient, "
                  "read bf16 for the amax, read bf16 and write fp8 for the cast (2 + 2 + 1 bytes)"),
    "fp8_gemm_speedup": Constant(
        1.73, 0.1, f"{LAB_H100}, part fp8: tensorwise fp8 over bf16 GEMM time at the Llama 3 1B/8B/70B MLP "
                   "shapes, 1.61-1.99 (mean 1.73)"),
    # --- AdamW: bytes per local parameter of one step (fp32 master, m, v read and written; bf16 grad, param)
    "adam_bytes_fused": Constant(
        28.0, 0.2, "torch.optim.AdamW(fused=True): 3 x 4 bytes read and written, 2 read, 2 written"),
    "adam_bytes_lab": Constant(
        98.0, 0.1, f"{LAB_MFU}, part mfu, where_the_time_goes: optimizer 36.2 ms per step for 1.24 B "
                   "parameters at 3.35 TB/s (torch's foreach AdamW and lab's fp32 master copies)"),
    # --- communication
    "async_tp_overlap": Constant(
        0.19, 0.3, f"{TITAN}, Table 4: 2D 829 -> 2D + AsyncTP 876 tokens/s/GPU (+5.7 %); the share of TP's "
                   "collectives that hides to give that gain in this model", fitted_on="titan-70b-2d-asynctp"),
    "titan_clock": Constant(
        0.748, 0.08, f"{TITAN}, Hardware: \"96GB HBM2e\" H100s at a 500 W power limit, whose peak \"we don't know\" "
                     "(footnote 2): the share of the SXM's 989 TFLOP/s their matmuls and attention run at, here",
        fitted_on="titan-8b-128gpu-compile"),
    "zero3_prefetch_layers": Constant(
        1, 0.0, "torch.distributed.fsdp.fully_shard (FSDP2): the next unit's all-gather is issued while the "
                "current one computes (forward and backward prefetch of 1); the first unit of each pass waits"),
    # --- memory as a run reports it
    "allocator_reserved_over_allocated": Constant(
        1.08, 0.05, f"{LAB_SNAPSHOT}: the CUDA caching allocator's history of two training steps, replayed: at the "
                    "step's peak 14.15 GiB allocated in 15.29 GiB of segments (1.08). TorchTitan logs "
                    "torch.cuda.max_memory_reserved (torchtitan/components/metrics.py, `max_reserved_gib`); lab "
                    "logs max_memory_allocated (lab/trainer.py)"),
    "fabric_busbw_nodes": Constant(
        2, 0.3, "an assumption, not a measurement: on a system with a fabric of its own (lab.calc.network's "
                "llama3-roce: pods of 3,072 GPUs with full bisection bandwidth, NCCLX's 16 flows a pair balanced by "
                "E-ECMP, The Llama 3 Herd of Models §3.3.1, Network), NCCL keeps at any scale the share of the "
                "modelled bus bandwidth it reached on 2 nodes of the playbook's H100 cluster (PLAYBOOK_BUSBW: all-"
                "reduce 0.90 of it, reduce-scatter and all-gather 0.51), before that cluster's fabric made it fall "
                "(a seventh at 64 nodes); the paper gives no achieved bandwidth. Spread: the playbook's 4-node share "
                "is 30 % lower"),
    "cp_exposed_hops": Constant(
        1, 0.0, "ring attention (Liu et al. 2023, Fig. 2): each pass starts on local K/V and hides hop i behind "
                "block i; the backward's dK/dV travel one hop more, back to their owner, with nothing to hide it"),
}

# the share of the bus bandwidth the alpha-beta model promises that NCCL delivers, by op and node count
# (the playbook's measured busbw over the model's, both for 256 MB; see `collective_efficiency`)
BUSBW_SOURCE = PLAYBOOK_BUSBW["source"]


@dataclass(frozen=True)
class Stack:
    """The software that runs a step: how its element-wise kernels, loss and optimizer move bytes, whether its
    linears run in fp8."""

    name: str
    elementwise_traffic: float  # bytes moved over a fused kernel's
    loss_s_per_logit: float  # on an H100 (3.35 TB/s); scaled by HBM bandwidth
    adam_bytes: float
    fp8_linears: bool
    source: str
    flash_attention: bool = True  # else the s x s scores go through HBM (`unfused_softmax_bytes`)
    overlap_grad_reduce: bool = True  # the gradients' reduction overlaps the last micro-batch's backward
    # the loss's memory (`lab.calc.memory.estimate_memory`'s `loss`): every stack here computed it on the whole
    # micro-batch's fp32 logits (TorchTitan's and Megatron's, and lab's 1B run before `lab.train` took the chunked
    # cross-entropy), so their measured peaks are priced so
    loss: str = "whole"


STACKS: dict[str, Stack] = {
    "eager": Stack("eager", CONSTANTS["eager_traffic"].value, CONSTANTS["loss_s_per_logit_eager"].value,
                   CONSTANTS["adam_bytes_fused"].value, False, "PyTorch eager, bf16 (TorchTitan without compile)"),
    "compiled": Stack("compiled", 1.0, CONSTANTS["loss_s_per_logit_compiled"].value,
                      CONSTANTS["adam_bytes_fused"].value, False,
                      "torch.compile per block: element-wise work fused into one read and one write"),
    "compiled-fp8": Stack("compiled-fp8", 1.0, CONSTANTS["loss_s_per_logit_compiled"].value,
                          CONSTANTS["adam_bytes_fused"].value, True,
                          "torch.compile and torchao float8 linears (the output layer stays bf16)"),
    # Megatron-LM 2021 (Narayanan et al., §4.2: fused kernels for bias + GeLU and scale-mask-softmax; its code uses
    # apex's fused Adam) predates FlashAttention (2022): its attention multiplies the whole s x s scores, causal mask
    # and all, and moves them through HBM
    "megatron-2021": Stack("megatron-2021", 1.0, CONSTANTS["loss_s_per_logit_compiled"].value,
                           CONSTANTS["adam_bytes_fused"].value, False,
                           "Megatron-LM 2021: fused element-wise kernels, no flash attention; the gradients "
                           "all-reduced after the backward (megatron/training.py, train_step: allreduce_gradients() "
                           "once forward_backward_func returns; the overlap came with Megatron-Core's "
                           "--overlap-grad-reduce)", flash_attention=False, overlap_grad_reduce=False),
    # lab.model's eager step moves far more: fp32 RMSNorm and RoPE statistics, fp32 logits, bf16 casts of fp32
    # weights per micro-batch (the recording counts 860 copy and 850 cast kernels a step); its traffic is the
    # one fit on lab's own run.
    "lab": Stack("lab", 8.5, CONSTANTS["loss_s_per_logit_eager"].value * 2, CONSTANTS["adam_bytes_lab"].value,
                 False, f"lab.model eager; element-wise traffic fitted on {LAB_MFU} (lab-1b-h100)"),
}

# TorchTitan's hosts: "H100 GPUs with 96GB HBM2e, 2.4 TB/sec, 500W power limit"; its footnote 2: their peak lies
# between the SXM's (989) and the NVL's (835), value unknown. Fitted on one run (`titan_clock`): 75 % of the SXM's,
# below the NVL's, which a 500 W limit on a 700 W part explains only in part; the rest is what the model leaves
# out of every TorchTitan run alike (NCCL kernels sharing the SMs, the allocator, the Python dispatch).
_CLOCK = CONSTANTS["titan_clock"].value
TITAN_H100 = Accelerator("H100 96GB HBM2e at 500 W (TorchTitan's Grand Teton hosts)", _CLOCK * H100_PEAK,
                         2 * _CLOCK * H100_PEAK, 2 * _CLOCK * H100_PEAK, 96 * GiB, 2.4e12,
                         f"{TITAN}, Hardware and footnote 2; the clock fitted (CONSTANTS['titan_clock'])")

# Relative range of a step's parts: compute from the matmul plateau, the attention kernels and HBM (their
# spreads in quadrature); exposed communication from the busbw measurements' scatter between node counts and
# clusters (the playbook's 4-node all-gather runs at half its 2-node value); the bubble is arithmetic.
SPREAD = {"compute": math.hypot(0.06, 0.08), "comms": 0.3, "bubble": 0.05}


def collective_efficiency(op: str, nodes: int, model_busbw: dict[str, tuple[float, ...]]) -> float:
    """Measured over modelled bus bandwidth for `op` on `nodes` nodes, log-interpolated between the playbook's
    node counts (1 to 64). `model_busbw` holds the alpha-beta model's busbw at those counts, which the caller
    computes (lab.calc.search), so that this table stays a table. Capped at 1: where the model is already
    slower than the measurement, it is kept."""
    if op not in ("all_reduce", "all_gather", "reduce_scatter"):
        return 1.0
    counts = PLAYBOOK_BUSBW["nodes"]
    ratios = [min(1.0, m / p) for m, p in zip(PLAYBOOK_BUSBW[op], model_busbw[op], strict=True)]
    x = math.log2(min(max(nodes, counts[0]), counts[-1]))
    for (n0, r0), (n1, r1) in zip(zip(counts, ratios, strict=True), zip(counts[1:], ratios[1:], strict=True),
                                  strict=False):
        if x <= math.log2(n1):
            t = (x - math.log2(n0)) / (math.log2(n1) - math.log2(n0))
            return r0 + t * (r1 - r0)
    return ratios[-1]


# --- the published runs and lab's own, each with what was measured --------------------------------------------

@dataclass(frozen=True)
class Run:
    """One measured training run, and the layout to pin the search to. `tokens_per_s_per_gpu` or `mfu` is the
    measured throughput; `memory_gib` the peak per GPU where published. `goal_error` is None when the run must
    be predicted within the goal (throughput +-15 %, memory +-10 %); else the run is outside the goal and
    `why` says why, and the test holds the model to the documented error."""

    name: str
    model: str  # a preset of lab.config, or "megatron-<size>" (built in lab.calc.search.run_model)
    gpus: int
    seq: int
    global_batch: int  # sequences
    pins: dict
    stack: str
    source: str
    tokens_per_s_per_gpu: float | None = None
    mfu: float | None = None
    memory_gib: float | None = None
    hardware: str = "titan"  # "titan" (TITAN_H100), or a name of lab.calc.hardware
    system: str = ""  # the network of lab.calc.network; "" for the one named like the hardware (TorchTitan's: h100)
    tp_overlap: float = 0.0
    goal_error: float | None = None  # the documented |predicted/measured - 1| of throughput, outside the goal
    memory_error: float | None = None  # the same for memory
    why: str = ""
    overrides: dict = field(default_factory=dict)  # ModelConfig fields (e.g. untied embeddings for pp)
    # what the measured memory is: the framework that ran (its sharding and precision: "torchtitan" runs FSDP2 with
    # fp32 sharded states, lab.train its `lab.calc.memory` layout), the activation checkpointing the recipe ran
    # ("op": TorchTitan's selective op policy, "full", "none"), and whether the number is the allocator's
    # reserved peak (TorchTitan) or its allocated peak (lab)
    framework: str = "torchtitan"
    ac: str = "full"
    memory_reported: str = "reserved"


# Megatron's GPT models (Table 1): d_model, layers, heads; MLP 4d (a SwiGLU of d_ff = 8d/3 has its weights and
# FLOPs), multi-head attention, vocabulary 51,200, sequences of 2,048.
MEGATRON = {"megatron-18b": (6144, 40, 48), "megatron-146b": (12288, 80, 96), "megatron-1t": (25600, 128, 160)}
MEGATRON_VOCAB = 51200


def megatron_tokens_per_s(flops_per_s: float, name: str, seq: int = 2048) -> float:
    """Tokens/s per GPU behind a TFLOP/s of Megatron's Table 1, with the paper's own count (§5.1, eq. 3):
    96·l·h²·(1 + s/6h + V/16lh) FLOPs per token, recomputation included."""
    h, layers, _ = MEGATRON[name]
    return flops_per_s / (96 * layers * h**2 * (1 + seq / (6 * h) + MEGATRON_VOCAB / (16 * layers * h)))


ASYNC_TP = CONSTANTS["async_tp_overlap"].value
_T1 = f"{TITAN}, Table 1 (8B, 8 GPUs, FSDP, local batch 2, selective AC)"
_T3 = f"{TITAN}, Table 3 (8B, 128 GPUs, FSDP, local batch 2, selective AC)"
_T4 = f"{TITAN}, Table 4 (70B, 256 GPUs, FSDP 32 x TP 8, local batch 16, full AC, compile, Float8)"
_T5 = f"{TITAN}, Table 5 (405B, 512 GPUs, FSDP 8 x TP 8 x PP 8, local batch 32, full AC, compile, Float8, AsyncTP)"
_L3 = "Llama Team, \"The Llama 3 Herd of Models\" (2024), §3.3.2, Table 4 (BF16 MFU)"
_MEG = ("Narayanan et al., \"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM\" "
        "(2021), Table 1")
# TorchTitan's selective AC (op level) recomputes about half the forward's matmuls and its element-wise ops;
# lab has no op-level recomputation, and without any the 8-GPU runs do not fit: full recomputation is the nearest
_8B_FSDP = {"dp": 8, "zero": 3, "mbs": 2, "recompute": "full"}
_8B_FSDP128 = {"dp": 128, "zero": 3, "mbs": 2, "recompute": "full"}
_70B = {"dp": 32, "tp": 8, "cp": 1, "pp": 1, "zero": 3, "mbs": 16, "recompute": "full"}
# TorchTitan (Dec 2024) splits a PP rank's local batch into `experimental.pipeline_parallel_microbatches`, which
# "defaults to the number of pipeline stages" (torchtitan/config_manager.py): 8 micro-batches of 4 sequences
_405B = {"dp": 8, "tp": 8, "cp": 1, "pp": 8, "zero": 1, "mbs": 4, "recompute": "full"}
# Llama 3 §3.3.2: FSDP that "shards optimizer states and gradients" but keeps the weights gathered from forward to
# backward (ZeRO-2; lab runs ZeRO-1 under PP, which the model prices alike), and at 8K tokens "without activation
# checkpointing" (at 128K with CP16 a rank holds the same 8,192 tokens, and calc.memory the same bytes)
_L3_PINS = {"dp": 64, "tp": 8, "pp": 16, "cp": 1, "pp_schedule": "interleaved", "pp_virtual_stages": 4, "zero": 1,
            "recompute": "none"}

_TITAN_PP = ("memory: FSDP under PP holds every weight of a stage gathered and its gradients unsharded in fp32 "
             "(search.reported_memory counts both), yet 1F1B measured 10 GiB more than interleaved, which holds "
             "more micro-batches in flight: what fills it, the model does not know")
_MEG_WHY = ("throughput: the three rows come out 18-23 % fast alike, a factor they share and the model does not "
            "explain: lab has no A100 recording, so the GEMM plateau (74.5 %) and the attention and element-wise rates "
            "are the H100's scaled by peak, and Table 1 gives no micro-batch sizes (the search chooses them)")

RUNS: tuple[Run, ...] = (
    Run("titan-8b-8gpu-eager", "llama3-8b", 8, 8192, 16, _8B_FSDP, "eager", _T1, 5762, ac="op", memory_gib=82.4),
    Run("titan-8b-8gpu-compile", "llama3-8b", 8, 8192, 16, _8B_FSDP, "compiled", _T1, 6667, ac="op", memory_gib=77.0),
    Run("titan-8b-8gpu-fp8", "llama3-8b", 8, 8192, 16, _8B_FSDP, "compiled-fp8", _T1, 8532, ac="op", memory_gib=76.8),
    Run("titan-8b-128gpu-eager", "llama3-8b", 128, 8192, 256, _8B_FSDP128, "eager", _T3, 5605, ac="op",
        memory_gib=67.0),
    Run("titan-8b-128gpu-compile", "llama3-8b", 128, 8192, 256, _8B_FSDP128, "compiled", _T3, 6514, ac="op",
        memory_gib=62.0),
    Run("titan-8b-128gpu-fp8", "llama3-8b", 128, 8192, 256, _8B_FSDP128, "compiled-fp8", _T3, 8380, ac="op",
        memory_gib=61.8),
    Run("titan-70b-2d", "llama3-70b", 256, 8192, 512, _70B, "compiled-fp8", _T4, 829, memory_gib=71.9),
    Run("titan-70b-2d-asynctp", "llama3-70b", 256, 8192, 512, _70B, "compiled-fp8", _T4, 876, memory_gib=67.6,
        tp_overlap=ASYNC_TP),
    Run("titan-405b-3d-1f1b", "llama3-405b", 512, 8192, 256, {**_405B, "pp_schedule": "1f1b"}, "compiled-fp8",
        _T5, 100, memory_gib=82.5, tp_overlap=ASYNC_TP, overrides={"n_layers": 128}, memory_error=0.15,
        why=_TITAN_PP),
    Run("titan-405b-3d-interleaved", "llama3-405b", 512, 8192, 256, {**_405B, "pp_schedule": "interleaved"},
        "compiled-fp8", _T5, 128, memory_gib=72.7, tp_overlap=ASYNC_TP, overrides={"n_layers": 128},),
    # Table 4 gives no schedule depth: 4 chunks a rank, the deepest Llama 3's split allows (2 layers a chunk)
    # on the cluster they ran on (lab.calc.network's llama3-roce, from the paper's §3.3.1), not the playbook's
    Run("llama3-405b-8k-gpus", "llama3-405b", 8192, 8192, 2048, _L3_PINS, "compiled", _L3, mfu=0.43,
        hardware="h100", system="llama3-roce", framework="llama3"),
    Run("llama3-405b-16k-gpus", "llama3-405b", 16384, 8192, 2048, {**_L3_PINS, "dp": 128}, "compiled", _L3,
        mfu=0.41, hardware="h100", system="llama3-roce", framework="llama3"),
    Run("llama3-405b-16k-gpus-128k", "llama3-405b", 16384, 131072, 128, {**_L3_PINS, "dp": 8, "cp": 16},
        "compiled", _L3, mfu=0.38, hardware="h100", system="llama3-roce", framework="llama3"),
    Run("megatron-18b", "megatron-18b", 256, 2048, 1024, {"dp": 32, "tp": 8, "pp": 1, "zero": 0, "recompute": "full"},
        "megatron-2021", f"{_MEG}: 135 TFLOP/s per GPU", megatron_tokens_per_s(135e12, "megatron-18b"),
        hardware="a100", framework="megatron", goal_error=0.20, why=_MEG_WHY),
    Run("megatron-146b", "megatron-146b", 1536, 2048, 2304,
        {"dp": 24, "tp": 8, "pp": 8, "zero": 0, "recompute": "full"},
        "megatron-2021", f"{_MEG}: 148 TFLOP/s per GPU", megatron_tokens_per_s(148e12, "megatron-146b"),
        hardware="a100", framework="megatron", goal_error=0.25, why=_MEG_WHY),
    Run("megatron-1t", "megatron-1t", 3072, 2048, 3072, {"dp": 6, "tp": 8, "pp": 64, "zero": 0, "recompute": "full"},
        "megatron-2021", f"{_MEG}: 163 TFLOP/s per GPU", megatron_tokens_per_s(163e12, "megatron-1t"),
        hardware="a100", framework="megatron", goal_error=0.23, why=_MEG_WHY),
    Run("lab-1b-h100", "llama3-1b", 1, 2048, 16, {"dp": 1, "mbs": 4, "recompute": "none"}, "lab",
        f"{LAB_MFU}, part mfu (34,236 tokens/s, MFU 28.4 %, peak 52.05 GB)", 34236, memory_gib=48.5,
        hardware="h100", framework="lab", ac="none", memory_reported="allocated",
        memory_error=0.16, why="memory: lab.model's eager step keeps more than the Korthikanti count of bf16 "
        "activations it is priced with: fp32 RMSNorm and RoPE statistics and the copies and casts its 1,700 "
        "copy and cast kernels a step make (the lab stack's element-wise traffic, fitted on this run)"),
)
