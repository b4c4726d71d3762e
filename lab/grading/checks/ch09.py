"""Chapter 09, GPU kernels. Four Triton kernels written by the student, run in Triton's interpreter on CPU tensors,
and the launch floor's arithmetic.

Each exercise cell holds a kernel (`@triton.jit`), its launcher and a driver (`run_softmax`, ...) that draws the
inputs from a seed in float64, rounds them to the kernel's dtype, launches the kernel and returns flat lists.
The checks draw the same inputs here and judge the answer by the error-ratio rule of `lab.kernels.accuracy`: the
kernel's largest error against a float64 reference must be at most `RATIO` times torch's own error in the same
dtype (its floor: 16 ulps at the reference's scale). Shapes are random and chosen to expose the classic
mistakes — widths that are not a power of two (a masked tail), one row, K and sequence lengths that are not a
multiple of the block, several key blocks (a running output that must be rescaled), strided inputs, several
programs adding up one reduction. Each check isolates one mistake, so that its hint is the one that helps: the
checks of overflow, strides and rescaling use whole blocks, leaving the tail's mistakes to the tail's checks; a
kernel that writes outside its tensor crashes the interpreter, and is told about masks (`lab.grading.runner`).

The sandbox runs kernels in the interpreter (`TRITON_INTERPRET=1` wherever triton is allowed, see
`lab.grading.sandbox`), whose cost is per program instance and per block operation: the shapes are tiny and the
launchers' blocks large, so that each check takes well under a second or two.

`09.launch_bound` is plain arithmetic, checked against `reference_op_time` (`lab.measure.launch.op_time`'s rule, kept
here so that grading imports no torch) on random machines whose terms never nearly tie.

torch and `lab.kernels` are imported inside the functions: `lab.check` of other chapters loads this module
too, and importing `lab.kernels` decides how this process runs Triton.
"""

from __future__ import annotations

import random

from lab.grading.checks import CheckFailed, exercise, expect_close, explain
from lab.grading.sandbox import CallError

KERNELS = {"modules": ("lab.kernels.runtime",), "packages": ("numpy", "torch", "triton"), "memory_mb": 2048}
RATIO = 4.0
"""The error-ratio rule's allowance for graded kernels: 4x torch's own error, not the library tests' 2x. A check's
inputs change with the class secret, and a correct kernel that sums in another order than torch lands above 2x on
a few draws in a hundred (flash attention over a handful of keys: up to 2.8x in 340 draws), while every mistake the
checks look for is 10^3x or more: grading must never fail a right answer."""


def _drawn(g, shape: tuple[int, ...], dtype):
    import torch

    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def expect_accurate(got, baseline, reference, what: str, hint: str | None = None) -> None:
    """`got` (a flat list from a driver) must hold `reference.numel()` numbers whose largest error against
    `reference` (float64) is at most RATIO times that of torch's `baseline` (the kernel's dtype)."""
    import torch

    from lab.kernels.accuracy import error_ratio, max_error

    shape, dtype = tuple(reference.shape), baseline.dtype
    if not (isinstance(got, list) and len(got) == reference.numel()
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in got)):
        size = f"{len(got)} values" if isinstance(got, list) else repr(got)[:80]
        raise CheckFailed(f"{what} returned {size}, expected {reference.numel()} numbers (shape {shape})", hint)
    result = torch.tensor(got, dtype=torch.float64).view(shape).to(dtype)
    ratio = error_ratio(result, baseline, reference)
    if ratio <= RATIO:
        return
    diff = (result.double() - reference.double()).abs().nan_to_num(nan=float("inf"))
    diff[(result.double() == reference.double())] = 0
    index = tuple(int(i) for i in torch.unravel_index(diff.flatten().argmax(), shape))
    where = f"[{', '.join(map(str, index))}]"
    raise CheckFailed(f"{what} returned {float(result[index]):.6g} at {where} where the float64 reference is "
                      f"{float(reference[index]):.6g}: an error of {max_error(result, reference):.3g}, {ratio:.3g}x "
                      f"torch's own {max_error(baseline, reference):.3g} in {str(dtype).removeprefix('torch.')}; "
                      f"expected at most {RATIO:g}x", hint)


def ask(fn, call: str, expected: str, *args):
    """`fn(*args)`, a function of the student's cell: a call that raised fails the check, saying what was due."""
    try:
        return fn(*args)
    except CallError as error:
        raise explain(error, call, expected) from None


def answer(what: str, fn, *args):
    """`fn(*args)`, a driver of the exercise cell: a kernel that raised (a shape that does not broadcast, an index
    out of range) fails the check with the call and what was due."""
    return ask(fn, what, "the kernel's result (flat lists)", *args)


def _whole(rng: random.Random, low: int, high: int) -> int:
    """A power of two in [low, high]: a launcher's BLOCK that covers it exactly leaves no tail to mask, so a check
    meant for another mistake (overflow, strides) does not also fail on a tail bug and show the wrong hint."""
    return rng.choice([n for n in (2 ** i for i in range(high.bit_length())) if low <= n <= high])


def _ragged(rng: random.Random, low: int, high: int) -> int:
    """A size in [low, high] that is not a power of two."""
    while True:
        n = rng.randrange(low, high + 1)
        if n & (n - 1):
            return n


def _dtype(name: str):
    import torch

    return getattr(torch, name)


# --- 09.fused_softmax ------------------------------------------------------------------------------------

SOFTMAX = exercise("09.fused_softmax", entry=("run_softmax",), **KERNELS)


def _expect_softmax(student, rows: int, cols: int, seed: int, scale: float = 1.0, pad: int = 0,
                    dtype: str = "float32") -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols + pad, generator=g, dtype=torch.float64) * scale).to(_dtype(dtype))[:, :cols]
    what = f"run_softmax(rows={rows}, cols={cols}, seed={seed}, scale={scale:g}, pad={pad}, dtype={dtype!r})"
    expect_accurate(answer(what, student.run_softmax, rows, cols, seed, scale, pad, dtype), torch.softmax(x, dim=-1),
                    torch.softmax(x.double(), dim=-1), what)


@SOFTMAX.check(points=2, hint="the tail's padded lanes must neither read past the row nor win the row's max or add to "
                              "its sum: what value does a masked load put in those lanes, and what does its "
                              "exponential add to the denominator?")
def softmax_ragged_rows(student, rng):
    """widths that are not a power of two (a masked tail), one row among them; fp32 and fp16"""
    _expect_softmax(student, rng.randrange(2, 40), _ragged(rng, 33, 300), rng.randrange(10**6))
    _expect_softmax(student, 1, _ragged(rng, 3, 31), rng.randrange(10**6))
    _expect_softmax(student, rng.randrange(2, 20), _ragged(rng, 65, 200), rng.randrange(10**6), dtype="float16")


@SOFTMAX.check(points=1, hint="e^x overflows float32 above x ≈ 88 and these logits are in the hundreds: softmax does "
                              "not change when a whole row moves by one constant — which constant keeps every exponent "
                              "from being positive?")
def softmax_large_logits(student, rng):
    """logits in the hundreds: no overflow"""
    _expect_softmax(student, rng.randrange(2, 20), _whole(rng, 32, 128), rng.randrange(10**6),
                    scale=rng.uniform(150.0, 400.0))


@SOFTMAX.check(points=1, hint="the input here is a slice of a wider tensor: its rows lie further apart than n_cols "
                              "elements, so where does each row start?")
def softmax_strided_rows(student, rng):
    """a slice of a wider tensor: rows in_stride elements apart"""
    _expect_softmax(student, rng.randrange(2, 30), _whole(rng, 32, 128), rng.randrange(10**6),
                    pad=rng.randrange(1, 40))


# --- 09.matmul_tiles -------------------------------------------------------------------------------------

MATMUL = exercise("09.matmul_tiles", entry=("run_matmul_tiles",), **KERNELS)
TILE = 32  # the launcher's BLOCK_M = BLOCK_N = BLOCK_K


def _expect_matmul(student, m: int, n: int, k: int, seed: int, dtype: str = "float32",
                   transpose_b: bool = False) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g, dtype=torch.float64)
    b = torch.randn(n, k, generator=g, dtype=torch.float64).T if transpose_b else \
        torch.randn(k, n, generator=g, dtype=torch.float64)
    a, b = a.to(_dtype(dtype)), b.to(_dtype(dtype))
    what = f"run_matmul_tiles(m={m}, n={n}, k={k}, seed={seed}, dtype={dtype!r}, transpose_b={transpose_b})"
    expect_accurate(answer(what, student.run_matmul_tiles, m, n, k, seed, dtype, transpose_b), a @ b,
                    a.double() @ b.double(), what)


def _off_tile(rng: random.Random, low: int, high: int) -> int:
    """A size in [low, high] that is not a multiple of the tile."""
    while True:
        n = rng.randrange(low, high + 1)
        if n % TILE:
            return n


@MATMUL.check(points=2, hint="every slab of K counts, the last partial one too (its lanes past K adding nothing to the "
                             "dot), and every slab's product must add to one fp32 running sum that lives across the "
                             "whole loop")
def matmul_ragged_tiles(student, rng):
    """M, N and K that are not multiples of the 32-wide tiles, several slabs of K"""
    for _ in range(2):
        _expect_matmul(student, _off_tile(rng, 33, 80), _off_tile(rng, 33, 80), _off_tile(rng, 70, 140),
                       rng.randrange(10**6))


@MATMUL.check(points=1, hint="a K shorter than one slab is all tail: the loop must still run once, masked")
def matmul_one_row_short_k(student, rng):
    """one row of A (M = 1), K shorter than one slab"""
    _expect_matmul(student, 1, _off_tile(rng, 20, 60), rng.randrange(3, TILE), rng.randrange(10**6))


@MATMUL.check(points=1, hint="B here is a transposed view: its elements are not laid out row after row, so addresses "
                             "computed from the shape read the wrong ones — the launcher passes each matrix's strides")
def matmul_fp16_transposed(student, rng):
    """fp16 inputs and a transposed (non-contiguous) B"""
    _expect_matmul(student, _off_tile(rng, 33, 70), _off_tile(rng, 33, 70), TILE,  # one whole slab: no K tail
                   rng.randrange(10**6), dtype="float16", transpose_b=True)


# --- 09.flash_attention_loop ----------------------------------------------------------------------------

FLASH = exercise("09.flash_attention_loop", entry=("run_flash_attention",), **KERNELS)
KEY_BLOCK = 32  # the launcher's BLOCK_N (and BLOCK_M)


def _expect_flash(student, heads: int, seq_len: int, head_dim: int, seed: int, causal: bool) -> None:
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(heads, seq_len, head_dim, generator=g, dtype=torch.float64) for _ in range(3))
    q, k, v = (t.float() for t in (2 * q, k, v))
    what = f"run_flash_attention(heads={heads}, seq_len={seq_len}, head_dim={head_dim}, seed={seed}, " \
           f"causal={causal})"
    expect_accurate(answer(what, student.run_flash_attention, heads, seq_len, head_dim, seed, causal),
                    F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                    F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal), what)


@FLASH.check(points=2, hint="when a block raises a row's running max, the running sum and the output accumulated so "
                            "far are still weighted against the old max: both must be brought to the new one before "
                            "the block's terms join them")
def flash_several_key_blocks(student, rng):
    """sequences of several whole key blocks, no mask"""
    for head_dim in (16, 32):  # whole blocks: no tail keys, whose mistake flash_short_sequences isolates
        _expect_flash(student, rng.randrange(1, 3), KEY_BLOCK * rng.randrange(2, 5), head_dim, rng.randrange(10**6),
                      causal=False)


def _off_key_block(rng: random.Random, low: int, high: int) -> int:
    while True:
        n = rng.randrange(low, high + 1)
        if n % KEY_BLOCK:
            return n


@FLASH.check(points=1, hint="the keys past seq_len are padding, yet a zero-filled key still scores 0 and takes a share "
                            "of the softmax: a key that must not be seen has to add exactly nothing to the max, the "
                            "sum and the output")
def flash_short_sequences(student, rng):
    """one token, and a sequence shorter than one key block"""
    _expect_flash(student, 1, 1, 16, rng.randrange(10**6), causal=False)
    _expect_flash(student, rng.randrange(1, 4), rng.randrange(2, KEY_BLOCK), 32, rng.randrange(10**6), causal=False)


@FLASH.check(points=2, hint="causal: a query sees the keys at or before its own position in the sequence — positions, "
                            "not lanes within a block (a rule on lanes is right in the first block only); and, as "
                            "without a mask, the running sum and output must follow the running max")
def flash_causal(student, rng):
    """causal mask, sequences of several blocks"""
    _expect_flash(student, rng.randrange(1, 3), _off_key_block(rng, KEY_BLOCK + 1, 3 * KEY_BLOCK), 16,
                  rng.randrange(10**6), causal=True)


# --- 09.rmsnorm_backward ---------------------------------------------------------------------------------

RMSNORM = exercise("09.rmsnorm_backward", entry=("run_rmsnorm_backward",), **KERNELS)
ROWS_PER_PROGRAM = 16  # the launcher's BLOCK_ROWS


def rmsnorm_backward_reference(dy, x, weight, rstd):
    """(dx, dweight) of y = x * rstd * weight, in the inputs' dtype: dx = rstd (w dy - x̂ mean(x̂ w dy)) with
    x̂ = x * rstd and the mean over each row's features, dweight = the sum over rows of dy x̂."""
    x_hat = x * rstd[:, None]
    w_dy = weight * dy
    dx = rstd[:, None] * (w_dy - x_hat * (x_hat * w_dy).mean(dim=-1, keepdim=True))
    return dx, (dy * x_hat).sum(dim=0)


def _rmsnorm(student, rows: int, cols: int, seed: int, eps: float = 1e-6) -> tuple:
    """The driver's answer, torch's (float32) and the reference (float64), and the call's spelling."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x, dy = (torch.randn(rows, cols, generator=g, dtype=torch.float64) for _ in range(2))
    weight = 1 + torch.randn(cols, generator=g, dtype=torch.float64) / 2
    rstd = torch.rsqrt(x.pow(2).mean(-1) + eps)
    inputs = [t.float() for t in (dy, x, weight, rstd)]
    what = f"run_rmsnorm_backward(rows={rows}, cols={cols}, seed={seed})"
    got = answer(what, student.run_rmsnorm_backward, rows, cols, seed)
    if not isinstance(got, dict):
        raise CheckFailed(f"{what} returned {got!r:.120}, expected the driver's dict of dx and dweight")
    return (got, rmsnorm_backward_reference(*inputs), rmsnorm_backward_reference(*(t.double() for t in inputs)),
            what)


def _rmsnorm_shapes(rng: random.Random) -> list[tuple[int, int]]:
    """One row; then rows spread over several programs, widths not a power of two (and above 16)."""
    return [(1, _ragged(rng, 17, 100)), (rng.randrange(2 * ROWS_PER_PROGRAM + 1, 6 * ROWS_PER_PROGRAM),
                                         _ragged(rng, 17, 100))]


@RMSNORM.check(points=2, hint="dx's mean is per row, over that row's real features: check which axis of the [rows, "
                              "features] tile the reduction runs along, and what it is divided by (padded lanes are "
                              "not features)")
def rmsnorm_dx(student, rng):
    """dx: one row, and rows over several programs; widths not a power of two"""
    for rows, cols in _rmsnorm_shapes(rng):
        got, (dx, _), (dx_ref, _), what = _rmsnorm(student, rows, cols, rng.randrange(10**6))
        expect_accurate(got.get("dx"), dx, dx_ref, f"{what}: dx")


@RMSNORM.check(points=2, hint="dweight is per feature, a sum over the rows — the other axis from dx's mean; and each "
                              "program's partial sum needs a place of its own in dw_partial, or the programs overwrite "
                              "each other")
def rmsnorm_dweight(student, rng):
    """dweight: the sum over every row, rows spread over several programs"""
    for rows, cols in _rmsnorm_shapes(rng):
        got, (_, dweight), (_, dweight_ref), what = _rmsnorm(student, rows, cols, rng.randrange(10**6))
        expect_accurate(got.get("dweight"), dweight, dweight_ref, f"{what}: dweight")


# --- 09.launch_bound ------------------------------------------------------------------------------------------------

LAUNCH = exercise("09.launch_bound", entry=("op_time", "fusion_saving"))


def reference_op_time(nbytes: float, flops: float, launch_s: float, bandwidth: float,
                      peak_flops: float) -> tuple[float, str]:
    """`lab.measure.launch.op_time`'s rule, kept here so that grading imports no torch (a test holds the two equal):
    the largest of the launch floor, the memory time and the compute time, and its name."""
    times = {"launch": launch_s, "memory": nbytes / bandwidth, "compute": flops / peak_flops}
    bound = max(times, key=times.__getitem__)
    return times[bound], bound


def reference_fusion_saving(chain: list[tuple[float, float]], fused: tuple[float, float], launch_s: float,
                            bandwidth: float, peak_flops: float) -> float:
    machine = (launch_s, bandwidth, peak_flops)
    return (sum(reference_op_time(nbytes, flops, *machine)[0] for nbytes, flops in chain)
            - reference_op_time(*fused, *machine)[0])


def _machine(rng: random.Random) -> tuple[float, float, float]:
    """(launch floor, bytes/s, FLOP/s) spanning a laptop core to a datacenter GPU: 2-20 µs, 10^10.5-10^12.7 B/s,
    10^11-10^15.3 FLOP/s, log-uniform."""
    return 10 ** rng.uniform(-5.7, -4.7), 10 ** rng.uniform(10.5, 12.7), 10 ** rng.uniform(11, 15.3)


def _op(rng: random.Random, bound: str, machine: tuple[float, float, float]) -> tuple[float, float]:
    """(bytes, flops) of an op whose `bound` term is 3-1000x the floor (or, for "launch", whose other two terms are
    2-100x under it) and whose other terms are 2-100x smaller: no near-tie for an answer to fall on either side of."""
    launch_s, bandwidth, peak = machine
    top = launch_s * (10 ** rng.uniform(0.5, 3) if bound != "launch" else 1)
    memory_s, compute_s = (top / 10 ** rng.uniform(0.3, 2) for _ in range(2))
    memory_s, compute_s = {"memory": (top, compute_s), "compute": (memory_s, top)}.get(bound, (memory_s, compute_s))
    return memory_s * bandwidth, compute_s * peak


def _expect_op_time(student, nbytes: float, flops: float, machine: tuple[float, float, float]) -> None:
    call = f"op_time({nbytes:.6g}, {flops:.6g}, {machine[0]:.6g}, {machine[1]:.6g}, {machine[2]:.6g})"
    seconds, bound = reference_op_time(nbytes, flops, *machine)
    got = ask(student.op_time, call, f"({seconds:.6g}, {bound!r})", nbytes, flops, *machine)
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        raise CheckFailed(f"{call} returned {got!r:.200}, expected a pair (seconds, bound): ({seconds:.6g}, {bound!r})")
    expect_close(got[0], seconds, f"{call}[0] (seconds)", rel=1e-9)
    if got[1] != bound:
        raise CheckFailed(f"{call}[1] (bound) returned {got[1]!r:.80}, expected {bound!r}")


@LAUNCH.check(points=1, hint="the launch, the memory traffic and the arithmetic overlap (the GPU launches the next "
                             "kernel while this one runs, and moves bytes while it computes): an op takes the longest "
                             "of the three, not their sum, and that one names its bound")
def each_term_can_bound(student, rng):
    """a block's ops on random machines: some launch-, some memory-, some compute-bound"""
    for _ in range(3):
        machine = _machine(rng)
        bounds = ["launch", "memory", "compute"] * 2
        rng.shuffle(bounds)
        for bound in bounds:
            _expect_op_time(student, *_op(rng, bound, machine), machine)


@LAUNCH.check(points=1, hint="an op cannot take less than its launch floor, however few bytes it moves: "
                             "time = max(launch_s, bytes / bandwidth, flops / peak_flops)")
def tiny_ops_sit_on_the_floor(student, rng):
    """the elementwise ops of a tiny model (a few KB each): every one on the launch floor"""
    machine = _machine(rng)
    for _ in range(4):
        elements = rng.randrange(64, 4096)
        _expect_op_time(student, 8.0 * elements, rng.uniform(1, 5) * elements, machine)


def _chain(rng: random.Random, machine: tuple[float, float, float], bound: str) -> tuple[list, tuple]:
    """An elementwise chain of 3-7 ops, each `bound`, and its fused kernel: the chain's first input read and its
    last output written once (half to one and a half of one op's bytes), the chain's FLOPs."""
    chain = [_op(rng, bound, machine) for _ in range(rng.randrange(3, 8))]
    return chain, (chain[0][0] * rng.uniform(0.5, 1.5), sum(flops for _, flops in chain))


@LAUNCH.check(points=1, hint="price both sides with op_time: the eager chain is the sum of its ops' times, each "
                             "paying its own launch; the fused kernel is one op_time over the fused bytes and FLOPs; "
                             "the saving is the difference")
def fusion_saves_launches_and_bytes(student, rng):
    """fusing a chain into one kernel: launch-bound chains save launches, memory-bound ones bytes"""
    for bound in ("launch", "memory", "launch", "memory"):
        machine = _machine(rng)
        chain, fused = _chain(rng, machine, bound)
        call = (f"fusion_saving(<{len(chain)} {bound}-bound ops>, ({fused[0]:.6g}, {fused[1]:.6g}), "
                f"{machine[0]:.6g}, {machine[1]:.6g}, {machine[2]:.6g})")
        expected = reference_fusion_saving(chain, fused, *machine)
        got = ask(student.fusion_saving, call, f"{expected:.6g}", chain, fused, *machine)
        expect_close(got, expected, call, rel=1e-9)
