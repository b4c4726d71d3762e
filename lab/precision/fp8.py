"""FP8 scaling and the block-scaled FP8 GEMM, emulated on CPU.

An FP8 number has 3 (e4m3) or 2 (e5m2) mantissa bits and a narrow range (±448, ±57344), so a tensor is
multiplied by a *scale* before the cast, chosen so that its largest magnitude (its amax) lands on the top of
the format: `x_fp8 = clamp(x * scale, ±fp8_max)`, `x ≈ x_fp8 / scale`. One API, two orthogonal knobs:

* granularity — how many elements share one scale: the whole `tensor`; a `row` (one scale per row, the
  reduction axis being the last one, which is the GEMM's contraction axis K); a 1×128 `tile` of a row
  (DeepSeek-V3's activations and gradients); a 128×128 `block` (DeepSeek-V3's weights). Finer groups follow
  outliers: one large value only coarsens the grid of its own group.
* timing — `current` scales come from this tensor's amax (torchao, DeepSeek-V3); `delayed` scales come from a
  rolling window of past amaxes (`AmaxHistory`, Transformer Engine's `DelayedScaling`), which saves a pass over
  the tensor on a GPU but lags one step behind a change of magnitude.

Operands are stored with the contraction axis last ("NT" layout, as DeepGEMM's `fp8_gemm_nt`): `fp8_matmul`
computes `a @ b.T` for `a` (M, K) and `b` (N, K), so "row" and "tile" scales always run along K.

On CPU, float8 tensors can be cast and `torch._scaled_mm` accepts tensorwise and rowwise scales, but nothing
else computes in float8 (torch 2.13's CPU backend): amax, scaling and the blockwise GEMM run in float32 on
dequantised values, whose products float32 rounds at 2^-24 (FP8 itself rounds at 2^-4 or 2^-3), and the one
thing float32 does better than the hardware — accumulation — is degraded on purpose (see `fp8_matmul`).

An inf or nan in a tensor makes its amax non-finite, and no scale brings it into FP8. That is recorded on the
device, never read while quantising (`NonFiniteFlags`), and read once per training step by `raise_if_nonfinite`,
which names the tensor in one line — the same on CPU and on a GPU.
"""

from __future__ import annotations

import functools
import itertools
import math
import weakref
from dataclasses import dataclass

import torch

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
GRANULARITIES = ("tensor", "row", "tile", "block")
TIMINGS = ("current", "delayed")

# Limited-precision accumulation (DeepSeek-V3 §3.3.2): Hopper's FP8 tensor cores keep "around 14 bits" of the
# running sum (SageAttention2 measured an FP22 accumulator: 1 sign, 8 exponent, 13 mantissa bits), dropping the
# bits shifted out when addends are aligned. We model that as truncation to ACCUM_BITS significant bits after
# every MMA_K-deep tensor-core instruction (a WGMMA consumes K=32 FP8 elements).
ACCUM_BITS = 14
MMA_K = 32


def fp8_max(fmt: str) -> float:
    """Largest finite value of an FP8 format: 448 for e4m3(fn), 57344 for e5m2."""
    if fmt not in FP8_DTYPES:
        raise ValueError(f"fmt={fmt!r}: expected one of {sorted(FP8_DTYPES)}")
    return float(torch.finfo(FP8_DTYPES[fmt]).max)


@dataclass(frozen=True)
class Scaling:
    """How one GEMM operand is scaled into FP8.

    fmt: "e4m3" (more precision, range ±448: weights and activations) or "e5m2" (range ±57344: gradients,
    whose magnitudes spread wider). granularity: "tensor" | "row" | "tile" (1×`tile` along the last axis) |
    "block" (`tile`×`tile` over the last two axes). timing: "current" | "delayed" (scale from the max of the
    last `history` amaxes; per tensor only, as Transformer Engine's DelayedScaling: the rows of an activation
    are different tokens every step, so a per-row history would have nothing to remember). power_of_2: round
    each scale down to a power of two, so scaling and unscaling are exact (torchao's rowwise recipe, TE's block
    recipes, MX's e8m0 scales).
    """

    fmt: str = "e4m3"
    granularity: str = "tensor"
    tile: int = 128
    timing: str = "current"
    history: int = 16
    power_of_2: bool = False

    def __post_init__(self) -> None:
        if self.fmt not in FP8_DTYPES:
            raise ValueError(f"Scaling fmt={self.fmt!r}: expected one of {sorted(FP8_DTYPES)}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"Scaling granularity={self.granularity!r}: expected one of {GRANULARITIES}")
        if not isinstance(self.tile, int) or self.tile < 1:
            raise ValueError(f"Scaling tile={self.tile!r}: expected an int >= 1")
        if self.timing not in TIMINGS:
            raise ValueError(f"Scaling timing={self.timing!r}: expected one of {TIMINGS}")
        if not isinstance(self.history, int) or self.history < 1:
            raise ValueError(f"Scaling history={self.history!r}: expected an int >= 1")
        if self.timing == "delayed" and self.granularity != "tensor":
            raise ValueError(f"Scaling timing='delayed' with granularity={self.granularity!r}: "
                             "delayed scaling is per tensor only (granularity='tensor')")

    @property
    def dtype(self) -> torch.dtype:
        """The torch float8 dtype of `fmt`."""
        return FP8_DTYPES[self.fmt]


def _groups(x: torch.Tensor, scaling: Scaling) -> torch.Tensor:
    """|x| in float32, zero-padded to whole groups and viewed as (..., groups, group elements) per axis."""
    t = scaling.tile
    a = x.detach().float().abs()
    if scaling.granularity == "tile":
        a = torch.nn.functional.pad(a, (0, -a.shape[-1] % t))
        return a.unflatten(-1, (-1, t))                                      # (..., K/t, t)
    if a.dim() < 2:
        raise ValueError(f"block scaling needs a tensor of >= 2 dims, got shape {tuple(x.shape)}")
    a = torch.nn.functional.pad(a, (0, -a.shape[-1] % t, 0, -a.shape[-2] % t))
    return a.unflatten(-1, (-1, t)).unflatten(-3, (-1, t))                   # (..., R/t, t, K/t, t)


def amax(x: torch.Tensor, scaling: Scaling) -> torch.Tensor:
    """Largest |x| of each scaling group, float32: shape () for tensor, (..., 1) for row, (..., ceil(K/tile))
    for tile, (..., ceil(R/tile), ceil(K/tile)) for block. Padding a ragged last group with zeros leaves its
    amax unchanged."""
    if scaling.granularity == "tensor":
        return x.detach().float().abs().amax()
    if scaling.granularity == "row":
        return x.detach().float().abs().amax(dim=-1, keepdim=True)
    if scaling.granularity == "tile":
        return _groups(x, scaling).amax(dim=-1)
    return _groups(x, scaling).amax(dim=(-3, -1))


def scale_from_amax(amax: torch.Tensor, fmt: str, power_of_2: bool = False) -> torch.Tensor:
    """scale = fp8_max / amax, so each group's largest value lands on the top of the format.

    Computed in float64 (torchao does the same so that eager and compiled code agree to the bit), then kept
    inside float32's range: a subnormal amax would otherwise give an infinite scale. amax == 0 (an all-zero
    group) gets scale 1 rather than inf: any scale quantises zeros exactly. A non-finite amax (the tensor already
    holds inf or nan, which no scale can bring into FP8) gives a scale of 0 or nan here, and is caught where the
    amax is measured: `quantize` and `AmaxHistory.update` record it in a `NonFiniteFlags`, which the trainer
    reads before the step's update. `power_of_2` rounds the scale *down* to a power of two, so the scaled amax
    still fits under fp8_max and multiplying by the scale changes only the exponent. There is no epsilon floor
    under amax (torchao 1e-12, DeepGEMM 1e-4): only an exact zero needs care, and a floor would push the values
    of a legitimately tiny group (a small gradient tile) down into the subnormals.

    Everything here is a tensor op, with no value brought back to Python (no `.item()`, no `if` on a tensor):
    on a GPU, reading a value waits for the device to finish all queued work, once per quantised operand,
    three to six times per linear per step, and a CUDA graph cannot capture it. `tests/test_fp8_syncs.py`
    counts those reads during an FP8 linear's forward and backward: zero.
    """
    a = amax.detach().double()
    scale = torch.where(a > 0, fp8_max(fmt) / a, torch.ones_like(a))
    scale = scale.clamp(max=torch.finfo(torch.float32).max)
    if power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale.float()


class NonFiniteAmax(RuntimeError):
    """An amax was inf or nan: the tensor it was measured on cannot be represented in FP8 at any scale."""


ADVICE = ("lower the learning rate, use current scaling (a delayed scale lags a spike), or check the data for "
          "inf/nan")


_LIVE: weakref.WeakValueDictionary[int, NonFiniteFlags] = weakref.WeakValueDictionary()  # by creation
_COUNTER = itertools.count()


class NonFiniteFlags:
    """Which amaxes held inf or nan, recorded on the device and read on the host only when asked.

    Raising at once would need the amax's value on the host: a synchronisation per quantised operand (what
    `scale_from_amax` avoids), and `torch._assert_async`, the device-side alternative, kills a CUDA process with
    an opaque "device-side assert triggered" that names nothing. Instead each measured amax ORs
    `~isfinite(amax)` into its own slot of a small bool tensor on the amax's device (a few tensor ops, no read);
    the names of the slots (`sites`, e.g. "layers.3.attn.wq's input") live on the host, so one read of the
    tensor, once per step, says which ones went bad: `raise_if_nonfinite`. `backward` names the sites recorded
    during a backward pass, so that the report can list them in the order a step meets them.

    The tensor of a device is made by `on(device)`: for `devices` at once, for any other at its first use. Make it
    before `torch.compile` traces code that records into it: a compiled graph then only updates it in place,
    whereas a tensor made inside the traced forward and updated in the traced backward fails to compile (torch
    2.13's partitioner: "Node select_scatter was invalid, but is output").
    """

    def __init__(self, sites: tuple[str, ...], devices: tuple[torch.device | str, ...] = (),
                 backward: frozenset[str] = frozenset()) -> None:
        if not sites or len(set(sites)) != len(sites) or not backward <= set(sites):
            raise ValueError(f"NonFiniteFlags sites={sites!r}, backward={sorted(backward)}: expected distinct "
                             "names, at least one, and backward sites among them")
        self.sites, self.backward = sites, backward
        self.flags: dict[torch.device, torch.Tensor] = {}
        for device in map(torch.device, devices):
            if device.type == "cuda" and device.index is None:  # "cuda": the device tensors will report
                device = torch.device("cuda", torch.cuda.current_device())
            self.on(device)
        _LIVE[next(_COUNTER)] = self

    def on(self, device: torch.device) -> torch.Tensor:
        """The flags of `device`, all clear when first made."""
        if device not in self.flags:
            self.flags[device] = torch.zeros(len(self.sites), dtype=torch.bool, device=device)
        return self.flags[device]

    def record(self, site: str, amax: torch.Tensor) -> None:
        """Set `site`'s flag if any element of `amax` is inf or nan (a tensor op: nothing is read)."""
        flags = self.on(amax.device)
        i = self.sites.index(site)
        flags[i] |= ~torch.isfinite(amax).all()


# Where `quantize` and `AmaxHistory.update` record when no caller passes flags of its own (a learner calling them
# in a notebook); `FP8Matmul` records in its own, named after its layer.
STANDALONE = NonFiniteFlags(("quantize's input", "AmaxHistory's amax"), ("cpu",))


def nonfinite_sites(flag_sets: list[NonFiniteFlags]) -> list[str]:
    """The sites whose flag is set, and those flags cleared: one host read per device (the flags of all the sets
    are concatenated first), which waits for the device's queued work like any read.

    Listed in the order a step meets them when `flag_sets` are in the order of the forward (a model's modules):
    forward sites set by set, then backward sites with the sets reversed. An inf spreads to every tensor computed
    after it, so the first site listed is the closest to where it appeared."""
    tensors: dict[torch.device, list[tuple[int, NonFiniteFlags, torch.Tensor]]] = {}
    for n, flag_set in enumerate(flag_sets):
        for device, flags in flag_set.flags.items():
            if device.type != "meta":  # a model built for a dry run computes nothing
                tensors.setdefault(device, []).append((n, flag_set, flags))
    bad: list[tuple[bool, int, int, str]] = []
    for triples in tensors.values():
        hits = torch.cat([flags for _, _, flags in triples]).tolist()          # the one read
        if not any(hits):
            continue
        for n, flag_set, flags in triples:
            hit, hits = hits[: len(flags)], hits[len(flags):]
            for i, (site, h) in enumerate(zip(flag_set.sites, hit, strict=True)):
                if h:
                    backward = site in flag_set.backward
                    bad.append((backward, -n if backward else n, i, site))
            flags.zero_()
    return [site for *_, site in sorted(bad)]


def raise_if_nonfinite(flag_sets: list[NonFiniteFlags] | None = None, step: int | None = None) -> None:
    """Raise `NonFiniteAmax`, one line naming the first bad amax (and how many more), if any flag is set; the
    flags are cleared either way. `flag_sets` None: every `NonFiniteFlags` alive in this process, in the order
    they were made (each FP8 linear's, and `STANDALONE`'s for `quantize` called on its own).

    `lab.trainer.train_worker` reads its model's flags (`fp8_linear.nonfinite_flags`) once per optimizer step,
    after the backward and the gradient clipping, before the update, just ahead of `non_finite(loss.item(),
    norm.item())`: that read of the logged loss waits for the device to finish the step's work anyway (clipping
    itself reads nothing), so this read takes the wait that one would have taken and the step waits no longer;
    it adds a concatenation kernel and a copy of a few bytes per linear. A learner calling an FP8 linear directly
    calls this after the backward: `raise_if_nonfinite()`."""
    error = nonfinite_amax_error(nonfinite_sites(list(_LIVE.values()) if flag_sets is None else flag_sets), step)
    if error is not None:
        raise error


def nonfinite_amax_error(sites: list[str], step: int | None = None, rank: int | None = None) -> NonFiniteAmax | None:
    """The error for `sites` (`nonfinite_sites`' list; None when empty): one line naming the first, how many
    more, and the step and the rank when given (a rank of a group, where they differ: another stage's layers,
    another replica's data)."""
    if not sites:
        return None
    more = f" (and {len(sites) - 1} more)" if len(sites) > 1 else ""
    at, stopped = (f"step {step}: ", "stopped before its update: ") if step is not None else ("", "")
    on = f" on rank {rank}" if rank is not None else ""
    return NonFiniteAmax(f"{at}amax of {sites[0]}{on} is not finite{more}: the tensor holds inf or nan, which no "
                         f"FP8 scale can represent; {stopped}{ADVICE}")


def _expand(scale: torch.Tensor, scaling: Scaling, shape: torch.Size) -> torch.Tensor:
    """One scale per element: each group's scale broadcast over the group, cropped to the tensor's shape."""
    if scaling.granularity in ("tensor", "row"):
        return scale
    t = scaling.tile
    s = scale.repeat_interleave(t, dim=-1)[..., : shape[-1]]
    if scaling.granularity == "block":
        s = s.repeat_interleave(t, dim=-2)[..., : shape[-2], :]
    return s


def quantize(x: torch.Tensor, scaling: Scaling, scale: torch.Tensor | None = None,
             flags: NonFiniteFlags = STANDALONE, site: str = "quantize's input") -> tuple[torch.Tensor, torch.Tensor]:
    """Scale, saturate and cast x to FP8; returns (x_fp8, scale), x ≈ x_fp8 / scale.

    Without `scale`, it is computed now from x's amax (current scaling); a caller doing delayed scaling passes
    the history's scale instead. The clamp to ±fp8_max is what makes the cast *saturating*: a value above the
    range (a delayed scale that lags a spike; float32 rounding of fp8_max/amax) becomes fp8_max instead of inf
    (e5m2 casts in torch 2.13 overflow to inf; e4m3fn casts saturate only since torch 2.12). The amax measured
    here is recorded as `site` in `flags` (see `NonFiniteFlags`); a given scale was checked where it was made.
    """
    if scale is None:
        a = amax(x, scaling)
        flags.record(site, a)
        scale = scale_from_amax(a, scaling.fmt, scaling.power_of_2)
    top = fp8_max(scaling.fmt)
    x_scaled = x.detach().float() * _expand(scale, scaling, x.shape)
    return x_scaled.clamp(-top, top).to(scaling.dtype).contiguous(), scale


def dequantize(x_fp8: torch.Tensor, scale: torch.Tensor, scaling: Scaling,
               shape: torch.Size | tuple[int, ...] | None = None) -> torch.Tensor:
    """float32 x_fp8 / scale, each group divided by its own scale; reshaped to `shape` if given (e.g. an
    activation flattened to (M, K) for the GEMM, back to (..., K))."""
    x = x_fp8.float() / _expand(scale, scaling, x_fp8.shape)
    return x if shape is None else x.reshape(shape)


class AmaxHistory:
    """Delayed scaling's memory: the last `length` amaxes of one tensor (Transformer Engine's amax_history).

    The scale for this step comes from the max over the window *before* this step's amax is added (TE's
    default `amax_compute_algo="max"`), so a sudden jump in magnitude is seen one step late and saturates
    for that step. The window starts empty; the first step bootstraps from its own amax, as torchao's delayed
    scaling did (TE starts at scale 1, which flushes small e5m2 gradients to zero on step one).
    """

    def __init__(self, length: int = 16) -> None:
        if not isinstance(length, int) or length < 1:
            raise ValueError(f"AmaxHistory length={length!r}: expected an int >= 1")
        self.window = torch.zeros(length, dtype=torch.float64)
        self.seen = 0

    def __len__(self) -> int:
        return min(self.seen, len(self.window))

    def scale(self, fmt: str, power_of_2: bool = False) -> torch.Tensor:
        """The scale for the next use: from the max amax in the window (an empty window is an error)."""
        if self.seen == 0:
            raise ValueError("AmaxHistory is empty: update it with a first amax before asking for a scale")
        return scale_from_amax(self.window.max(), fmt, power_of_2)

    def update(self, amax: torch.Tensor, flags: NonFiniteFlags = STANDALONE, site: str = "AmaxHistory's amax") -> None:
        """Push one per-tensor amax (after the tensor it came from was quantised), dropping the oldest; a
        non-finite one is recorded as `site` in `flags` (the step that made it must not be applied)."""
        if amax.numel() != 1:
            raise ValueError(f"AmaxHistory takes one amax per tensor, got shape {tuple(amax.shape)}")
        flags.record(site, amax)
        window = self.window.to(amax.device)                  # kept where the amaxes are: a copy, never a read
        self.window = torch.roll(window, 1)
        self.window[0] = amax.detach().reshape(())
        self.seen += 1


def _truncate(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Keep `bits` significant bits of each float32 value, dropping the rest (round toward zero): clearing the
    low 24 - bits bits of the significand is one integer AND, where frexp/ldexp would be ten times slower."""
    mask = -(1 << (24 - bits))                               # ...111000: sign, exponent, top bits - 1 of mantissa
    return (x.float().view(torch.int32) & mask).view(torch.float32)


def _accumulate(a: torch.Tensor, b: torch.Tensor, promote_every: int | None, accum_bits: int | None
                ) -> torch.Tensor:
    """a @ b.T with the K-sum done as a tensor core does it: limited precision within a chunk of
    `promote_every` elements, exact float32 across chunks (DeepSeek-V3's promotion to CUDA cores)."""
    if accum_bits is None:
        return a @ b.T
    k = a.shape[-1]
    chunk = k if promote_every is None else promote_every
    out = a.new_zeros(a.shape[0], b.shape[0])
    for c0 in range(0, k, chunk):
        c1 = min(c0 + chunk, k)
        partial = a.new_zeros(out.shape)
        for s0 in range(c0, c1, MMA_K):
            s1 = min(s0 + MMA_K, c1)
            partial = _truncate(partial + a[:, s0:s1] @ b[:, s0:s1].T, accum_bits)
        out += partial
    return out


@functools.cache
@torch.compiler.assume_constant_result  # torch.compile runs the probe once while tracing, as a constant
def _scaled_mm_works(device: str, granularity: str, a_dtype: torch.dtype, b_dtype: torch.dtype,
                     out_dtype: torch.dtype = torch.float32) -> bool:
    """Probe once per (device, granularity, dtypes) whether torch._scaled_mm runs and is right, instead of
    assuming: its support differs by device, torch version, dtype pair (e5m2×e5m2 is refused on CUDA) and output
    dtype (CUDA's rowwise kernel has written bf16 only)."""
    if granularity not in ("tensor", "row") or not hasattr(torch, "_scaled_mm"):
        return False
    m, k, n = 16, 32, 16
    a = torch.ones(m, k, device=device).to(a_dtype)
    b = torch.ones(n, k, device=device).to(b_dtype)
    sa, sb = (torch.ones((), device=device),) * 2 if granularity == "tensor" else \
        (torch.full((m, 1), 2.0, device=device), torch.full((1, n), 0.5, device=device))
    try:
        out = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    except (RuntimeError, NotImplementedError, ValueError):          # CUDA refuses e5m2×e5m2 with ValueError
        return False
    return bool(torch.equal(out.cpu(), torch.full((m, n), float(k), dtype=out_dtype)))


def scaled_mm_supported(a_fp8: torch.Tensor, b_fp8: torch.Tensor, a_scaling: Scaling, b_scaling: Scaling,
                        out_dtype: torch.dtype = torch.float32) -> bool:
    """Whether `fp8_matmul` can hand this GEMM to torch._scaled_mm: both operands tensorwise or both rowwise,
    the probe passes on this device, and on CUDA the dims are multiples of 16 (cuBLASLt's FP8 rule)."""
    if a_scaling.granularity != b_scaling.granularity:
        return False
    if a_fp8.device.type == "cuda" and any(d % 16 for d in (*a_fp8.shape, b_fp8.shape[0])):
        return False
    return _scaled_mm_works(a_fp8.device.type, a_scaling.granularity, a_fp8.dtype, b_fp8.dtype, out_dtype)


def fp8_matmul(a_fp8: torch.Tensor, a_scale: torch.Tensor, b_fp8: torch.Tensor, b_scale: torch.Tensor,
               a_scaling: Scaling, b_scaling: Scaling, promote_every: int | None = 128, *,
               accum_bits: int | None = ACCUM_BITS, backend: str = "auto",
               out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """a @ b.T for FP8 operands a (M, K) and b (N, K), each with its own groups of scales, accumulated in float32
    and returned in `out_dtype` (bf16 for a bf16 model: torch._scaled_mm rounds in its epilogue, where a float32
    result would cost a cast kernel and twice the bytes; on CPU both give the same bits).

    backend "emulate": dequantise each operand (every group divided by its scale: exact products in float32),
    then sum over K in chunks of `promote_every`, each chunk accumulated with `accum_bits` significant bits
    (truncated after every MMA_K slab) and then added to an exact float32 total — DeepSeek-V3's recipe for
    H800 tensor cores, whose limited accumulation alone gave up to ~2% relative error at K=4096 without it.
    `promote_every=None` never promotes (the whole K at limited precision, the unpromoted baseline);
    `accum_bits=None` accumulates exactly in float32 (what torch._scaled_mm does on CPU).
    backend "scaled_mm": torch._scaled_mm (tensorwise or rowwise pairs only; takes the inverse scales); the
    accumulation is then the hardware's own. "auto": scaled_mm where `scaled_mm_supported`, else emulate.

    Measured on an H100 (torch 2.11, M=N=256, relative Frobenius error against the float64 sum of the same FP8
    operands): cuBLAS's default FP8 GEMM 1.27e-4 at K = 512, 4096 and 16384, this emulation with promotion
    every 128 1.28e-4; cuBLAS with use_fast_accum=True 3.4e-4, 1.3e-3, 2.1e-3, this emulation never promoting
    4.3e-4, 3.3e-3, 1.3e-2 (an upper bound: the fast path's accumulation is not documented).
    """
    if a_fp8.dim() != 2 or b_fp8.dim() != 2 or a_fp8.shape[1] != b_fp8.shape[1]:
        raise ValueError(f"fp8_matmul takes a (M, K) and b (N, K), got {tuple(a_fp8.shape)} and "
                         f"{tuple(b_fp8.shape)}")
    if promote_every is not None and (not isinstance(promote_every, int) or promote_every < 1):
        raise ValueError(f"promote_every={promote_every!r}: expected an int >= 1 or None (never promote)")
    if backend not in ("auto", "emulate", "scaled_mm"):
        raise ValueError(f"backend={backend!r}: expected 'auto', 'emulate' or 'scaled_mm'")
    pair = (a_scaling.granularity, b_scaling.granularity)
    if backend == "scaled_mm" and pair not in (("tensor", "tensor"), ("row", "row")):
        raise ValueError(f"backend='scaled_mm' takes tensorwise or rowwise pairs, got {pair}: use 'emulate'")
    use_scaled_mm = backend == "scaled_mm" or (
        backend == "auto" and scaled_mm_supported(a_fp8, b_fp8, a_scaling, b_scaling, out_dtype))
    if use_scaled_mm:
        sa, sb = a_scale.float().reciprocal(), b_scale.float().reciprocal()
        if a_scaling.granularity == "row":
            sa, sb = sa.reshape(-1, 1).contiguous(), sb.reshape(1, -1).contiguous()
        return torch._scaled_mm(a_fp8, b_fp8.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    a = dequantize(a_fp8, a_scale, a_scaling)
    b = dequantize(b_fp8, b_scale, b_scaling)
    return _accumulate(a, b, promote_every, accum_bits).to(out_dtype)


def sqnr(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio in dB, 20·log10(‖ref‖ / ‖ref − approx‖) (torchao's compute_error):
    +6 dB per bit kept; inf when equal."""
    ref = reference.detach().double()
    noise = torch.linalg.vector_norm(ref - approx.detach().double())
    if noise == 0:
        return math.inf
    return float(20 * torch.log10(torch.linalg.vector_norm(ref) / noise))
