"""The roofline: how fast an op can run on a chip, given the FLOPs it does and the bytes it moves to and from HBM.

An op doing F FLOPs over B bytes of HBM traffic needs at least F / peak seconds of compute and B / bandwidth of
memory time; the two overlap, so its time is at least the larger (How to Scale Your Model, ch. 1). Its
*arithmetic intensity* F / B decides which: below the chip's *ridge point* peak / bandwidth (~295 FLOPs/byte
for bf16 on an H100) the op is memory-bound and reaches only intensity x bandwidth FLOP/s; above it, the peak.

`llama_block_ops` lists the ops of one Llama block's forward pass (lab.model's `Block`) as kernels that each read
their inputs from HBM and write their output back — what eager PyTorch launches, op by op. Matmuls over
thousands of tokens sit above the ridge; norms, activations, residual adds and a materialised softmax sit far
below it at any size, which is why they are fused (`Fusion`: bytes moved before and after) and why
FlashAttention never writes the T x T scores. Counting conventions: a matmul (m, k) x (k, n) does 2mkn FLOPs; an
elementwise op one FLOP per arithmetic operation (exp included); attention counts the full T x T matrix, causal
or not, as `lab.calc.flops` does. The roof of every op is the dtype's tensor-core peak: elementwise work really
runs on the slower vector units, but it is memory-bound long before either roof matters.
"""

from __future__ import annotations

from dataclasses import dataclass

from lab.calc.hardware import Accelerator, get_accelerator
from lab.config import ModelConfig
from lab.layout import check_count

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
ATTENTION_CORES = ("naive", "flash")


def dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r} must be one of {', '.join(map(repr, DTYPE_BYTES))}")
    return DTYPE_BYTES[dtype]


def _device(device: str | Accelerator) -> Accelerator:
    return device if isinstance(device, Accelerator) else get_accelerator(device)


def peak_flops(device: str | Accelerator, dtype: str = "bf16") -> float:
    """Dense FLOP/s of the matmul units in `dtype`. NVIDIA's tensor cores run fp16 at the bf16 rate (same
    datasheet line); `calc.hardware` has no fp32 peak (it would be the far lower non-tensor-core rate)."""
    chip = _device(device)
    dtype_bytes(dtype)
    peak = _peak(chip, dtype)
    if peak is None:
        valid = [d for d in DTYPE_BYTES if _peak(chip, d) is not None]
        raise ValueError(f"dtype={dtype!r} has no peak on {chip.name}; valid: {', '.join(valid)}")
    return peak


def _peak(chip: Accelerator, dtype: str) -> float | None:
    if dtype == "fp16" and chip.name.startswith("NVIDIA"):
        dtype = "bf16"
    return {"bf16": chip.bf16_flops, "fp8": chip.fp8_flops, "int8": chip.int8_ops}.get(dtype)


def intensity(flops: float, bytes_moved: float) -> float:
    """Arithmetic intensity: FLOPs per byte moved to or from HBM."""
    if not flops >= 0:
        raise ValueError(f"flops={flops!r} must be >= 0")
    if not bytes_moved > 0:
        raise ValueError(f"bytes_moved={bytes_moved!r} must be > 0")
    return flops / bytes_moved


def ridge_point(device: str | Accelerator, dtype: str = "bf16") -> float:
    """The intensity (FLOPs/byte) where the roofline bends: peak FLOP/s / HBM bytes/s."""
    return peak_flops(device, dtype) / _device(device).hbm_bandwidth


def attainable_flops(op_intensity: float, device: str | Accelerator, dtype: str = "bf16") -> float:
    """The roofline itself: min(peak, intensity x bandwidth) FLOP/s."""
    if not op_intensity >= 0:
        raise ValueError(f"intensity={op_intensity!r} must be >= 0 FLOPs/byte")
    return min(peak_flops(device, dtype), op_intensity * _device(device).hbm_bandwidth)


@dataclass(frozen=True)
class Op:
    """One kernel: the FLOPs it does and the bytes it reads plus writes in HBM."""

    name: str
    flops: float
    bytes_moved: float
    kind: str  # "matmul" (tensor cores) or "elementwise" (includes row reductions such as softmax, norms)

    @property
    def intensity(self) -> float:
        return intensity(self.flops, self.bytes_moved)


@dataclass(frozen=True)
class Placement:
    """Where an op sits on a chip's roofline and the least time it can take there."""

    op: Op
    attainable: float  # FLOP/s
    compute_s: float  # flops / peak
    memory_s: float  # bytes / bandwidth

    @property
    def bound(self) -> str:
        return "memory" if self.memory_s > self.compute_s else "compute"

    @property
    def time_s(self) -> float:
        """Lower bound: compute and memory traffic fully overlapped."""
        return max(self.compute_s, self.memory_s)


def place(op: Op, device: str | Accelerator, dtype: str = "bf16") -> Placement:
    chip = _device(device)
    peak = peak_flops(chip, dtype)
    return Placement(op, attainable_flops(op.intensity, chip, dtype), op.flops / peak,
                     op.bytes_moved / chip.hbm_bandwidth)


def matmul(name: str, m: int, k: int, n: int, dtype: str = "bf16", batch: int = 1) -> Op:
    """`batch` independent (m, k) x (k, n) products, each reading both operands and writing the result once:
    2mkn FLOPs over (mk + kn + mn) elements (scaling book ch. 1: 2BDF / (2BD + 2DF + 2BF) in bf16)."""
    for label, value in (("m", m), ("k", k), ("n", n), ("batch", batch)):
        check_count(label, value)
    return Op(name, 2.0 * batch * m * k * n, float(dtype_bytes(dtype) * batch * (m * k + k * n + m * n)), "matmul")


def elementwise(name: str, flops_per_element: float, elements: int, read: int, written: int,
                dtype: str = "bf16") -> Op:
    """An op over `elements` outputs that reads `read` and writes `written` elements of `dtype`."""
    return Op(name, float(flops_per_element * elements), float(dtype_bytes(dtype) * (read + written)), "elementwise")


def llama_block_ops(cfg: ModelConfig, batch: int, seq: int, dtype: str = "bf16",
                    attention: str = "naive") -> list[Op]:
    """The forward ops of one dense Llama block on `batch` sequences of `seq` tokens, in order, each a kernel
    that reads its inputs from and writes its output to HBM. q, k and v come from one matmul over the
    concatenated weights (lab.model runs three: same FLOPs, x read three times), w1 and w3 likewise.
    `attention="naive"` writes the (B, H, T, T) scores, softmaxes them into probabilities and multiplies those
    by v, three kernels; `"flash"` is one kernel that reads q, k, v once and writes the output (its minimum
    traffic: a real kernel re-reads K/V once per query tile, mostly from L2)."""
    check_count("batch", batch)
    check_count("seq", seq)
    if attention not in ATTENTION_CORES:
        raise ValueError(f"attention={attention!r} must be one of {', '.join(map(repr, ATTENTION_CORES))}")
    if cfg.attention != "gqa" or cfg.is_moe:
        raise ValueError(f"model {cfg.name!r} must be a dense GQA model (attention='gqa', n_experts=0): the block "
                         f"ops cover Llama blocks only")
    b = dtype_bytes(dtype)
    N, d, F, hd = batch * seq, cfg.d_model, cfg.d_ff, cfg.head_dim
    q_dim, kv_dim = cfg.n_heads * hd, cfg.n_kv_heads * hd
    scores = batch * cfg.n_heads * seq * seq  # elements of the T x T matrices of all heads
    q_elems, kv_elems = N * q_dim, N * kv_dim

    def norm(name: str) -> Op:  # x · rsqrt(mean(x²) + eps) · w: square, add, scale, weight ~ 4 FLOPs an element
        return elementwise(name, 4, N * d, N * d + d, N * d, dtype)

    def residual(name: str) -> Op:
        return elementwise(name, 1, N * d, 2 * N * d, N * d, dtype)

    ops = [norm("attn_norm"), matmul("qkv_proj", N, d, q_dim + 2 * kv_dim, dtype),
           # rotate q and k: x1·cos − x2·sin per element, the (T, hd/2) cos and sin tables read once
           elementwise("rope", 3, q_elems + kv_elems, q_elems + kv_elems + seq * hd, q_elems + kv_elems, dtype)]
    if attention == "naive":
        # q·kᵀ per query head: reads q and k (each KV head once, shared under GQA), writes the scores
        ops += [Op("scores", 2.0 * scores * hd, float(b * (q_elems + kv_elems + scores)),
                   "matmul"),
                elementwise("softmax", 5, scores, scores, scores, dtype),  # max, subtract, exp, sum, divide
                Op("probs_v", 2.0 * scores * hd, float(b * (scores + kv_elems + q_elems)),
                   "matmul")]
    else:
        ops.append(Op("flash_attention", 4.0 * scores * hd + 5.0 * scores,
                      float(b * (2 * q_elems + 2 * kv_elems)), "matmul"))
    ops += [matmul("o_proj", N, q_dim, d, dtype), residual("attn_residual"), norm("ffn_norm"),
            matmul("gate_up_proj", N, d, 2 * F, dtype),
            # silu(g)·u = g / (1 + exp(−g)) · u: negate, exp, add, divide, multiply
            elementwise("swiglu", 5, N * F, 2 * N * F, N * F, dtype),
            matmul("down_proj", N, F, d, dtype), residual("ffn_residual")]
    return ops


@dataclass(frozen=True)
class Fusion:
    """A chain of elementwise kernels, each a (name, bytes read, bytes written) launch, against one fused kernel
    that reads the chain's inputs once and writes its final output once."""

    name: str
    kernels: tuple[tuple[str, int, int], ...]
    fused_read: int
    fused_written: int

    @property
    def unfused_bytes(self) -> int:
        return sum(read + written for _, read, written in self.kernels)

    @property
    def fused_bytes(self) -> int:
        return self.fused_read + self.fused_written

    @property
    def saving(self) -> float:
        """How many times fewer bytes the fused kernel moves: its speed-up when memory-bound."""
        return self.unfused_bytes / self.fused_bytes


def rms_norm_fusion(tokens: int, d_model: int, dtype: str = "bf16") -> Fusion:
    """RMSNorm as eager PyTorch runs `x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w`: six
    kernels, the two full-size temporaries (x², x·r) written and read back, against reading x and w and
    writing y once."""
    check_count("tokens", tokens)
    check_count("d_model", d_model)
    b, n, rows = dtype_bytes(dtype), tokens * d_model, tokens
    kernels = (("pow", n, n), ("mean", n, rows), ("add_eps", rows, rows), ("rsqrt", rows, rows),
               ("mul_rsqrt", n + rows, n), ("mul_weight", n + d_model, n))
    return Fusion("rms_norm", tuple((k, b * r, b * w) for k, r, w in kernels), b * (n + d_model), b * n)


def softmax_fusion(rows: int, cols: int, dtype: str = "bf16") -> Fusion:
    """Row softmax as five kernels (max, x − max, exp, sum, divide) against one that reads x and writes y."""
    check_count("rows", rows)
    check_count("cols", cols)
    b, n = dtype_bytes(dtype), rows * cols
    kernels = (("max", n, rows), ("subtract", n + rows, n), ("exp", n, n), ("sum", n, rows), ("divide", n + rows, n))
    return Fusion("softmax", tuple((k, b * r, b * w) for k, r, w in kernels), b * n, b * n)


def swiglu_fusion(tokens: int, d_ff: int, dtype: str = "bf16") -> Fusion:
    """silu(gate) · up as two kernels (silu, multiply) against one that reads gate and up and writes the product."""
    check_count("tokens", tokens)
    check_count("d_ff", d_ff)
    b, n = dtype_bytes(dtype), tokens * d_ff
    return Fusion("swiglu", (("silu", b * n, b * n), ("mul", 2 * b * n, b * n)), 2 * b * n, b * n)


def tp_mlp_matmuls(tokens: int, d_model: int, d_ff: int, tp: int, dtype: str = "bf16") -> tuple[Op, Op]:
    """The two matmuls one GPU runs for an MLP under tensor parallelism: x[T, D] · W1[D, F/tp] (column) and
    h[T, F/tp] · W2[F/tp, D] (row). TP divides the FLOPs by tp but not the T·D activation each reads or writes, so
    the per-GPU matmuls get thinner and their arithmetic intensity falls: at large tp they slide down the roofline
    as well as waiting on the all-reduce."""
    check_count("tp", tp)
    if d_ff % tp:
        raise ValueError(f"tp={tp} must divide d_ff={d_ff}")
    local = d_ff // tp
    return matmul("column", tokens, d_model, local, dtype), matmul("row", tokens, local, d_model, dtype)
