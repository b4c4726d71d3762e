"""FP8 scaling, the block-scaled GEMM and the FP8 linear (lab.precision.fp8, lab.precision.fp8_linear).

Thresholds: cast SQNR >= 25 dB, FP8 linear output >= 18 dB and gradients >= 17 dB are torchao's
(test/float8/test_base.py); the block-scaled GEMM's relative difference < 1e-3 is DeepGEMM's bar for FP8
(tests: calc_diff < 1e-3). Tiny shapes, float32 on CPU.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import lab.precision.fp8_linear as fp8_linear
from lab.model import Linear
from lab.precision.fp8 import (
    FP8_DTYPES,
    STANDALONE,
    AmaxHistory,
    NonFiniteAmax,
    Scaling,
    _scaled_mm_works,
    amax,
    dequantize,
    fp8_matmul,
    fp8_max,
    nonfinite_sites,
    quantize,
    raise_if_nonfinite,
    scale_from_amax,
    scaled_mm_supported,
    sqnr,
)
from lab.precision.fp8_linear import RECIPES, FP8Matmul, FP8Recipe, double_quantization_error, retile

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rel(reference: torch.Tensor, approx: torch.Tensor) -> float:
    return float((reference.double() - approx.double()).norm() / reference.double().norm())


def test_fp8_max_and_dtypes() -> None:
    assert fp8_max("e4m3") == 448.0 and fp8_max("e5m2") == 57344.0
    assert FP8_DTYPES == {"e4m3": E4M3, "e5m2": E5M2}


@pytest.mark.parametrize("kwargs, bad", [
    (dict(fmt="e3m4"), "e3m4"), (dict(granularity="col"), "col"), (dict(tile=0), "tile=0"),
    (dict(timing="late"), "late"), (dict(history=0), "history=0"),
    (dict(timing="delayed", granularity="row"), "'row'"),
])
def test_scaling_rejects_bad_values_in_one_line(kwargs: dict, bad: str) -> None:
    with pytest.raises(ValueError, match=bad) as err:
        Scaling(**kwargs)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("granularity", ["tensor", "row", "tile", "block"])
def test_cast_sqnr_at_least_25db(granularity: str) -> None:
    # torchao test_base.py: e4m3 tensorwise/axiswise casts of randn reach SQNR >= 25 dB.
    x = _randn(64, 256)
    s = Scaling("e4m3", granularity)
    q, scale = quantize(x, s)
    assert q.dtype == E4M3
    assert sqnr(x, dequantize(q, scale, s)) >= 25


def test_amax_per_group_on_the_right_axis() -> None:
    # Ragged shapes (7×10 with 4-wide tiles) so that a transposed or misaligned reduction cannot coincide.
    x = _randn(7, 10, seed=1) * torch.arange(1, 71, dtype=torch.float32).reshape(7, 10)
    a = x.abs()
    assert torch.equal(amax(x, Scaling(granularity="tensor")), a.max())
    assert torch.equal(amax(x, Scaling(granularity="row")), a.amax(dim=1, keepdim=True))
    tiles = torch.stack([torch.stack([a[r, c:c + 4].max() for c in range(0, 10, 4)]) for r in range(7)])
    assert torch.equal(amax(x, Scaling(granularity="tile", tile=4)), tiles)
    blocks = torch.stack([torch.stack([a[r:r + 4, c:c + 4].max() for c in range(0, 10, 4)])
                          for r in range(0, 7, 4)])
    assert torch.equal(amax(x, Scaling(granularity="block", tile=4)), blocks)


@pytest.mark.parametrize("granularity", ["tensor", "row", "tile", "block"])
def test_each_group_max_lands_on_fp8_max(granularity: str) -> None:
    # scale = fp8_max / amax: the largest value of every group quantises to ±448 (an inverted scale, or a
    # scale from another group's amax, misses it).
    s = Scaling("e4m3", granularity, tile=4)
    x = _randn(8, 12, seed=2) * torch.logspace(-3, 3, 12)
    q, scale = quantize(x, s)
    assert torch.allclose(scale, fp8_max("e4m3") / amax(x, s))
    assert torch.equal(amax(q.float(), s), torch.full_like(scale, 448.0))


def test_amax_zero_gives_scale_one() -> None:
    assert scale_from_amax(torch.tensor(0.0), "e4m3") == 1.0
    s = Scaling("e4m3", "tile", tile=4)
    x = torch.zeros(2, 8)
    x[1, 4:] = torch.tensor([1.0, -2.0, 3.0, 0.5])                      # one non-zero tile among zero ones
    q, scale = quantize(x, s)
    assert torch.equal(scale, torch.tensor([[1.0, 1.0], [1.0, 448 / 3]]))
    assert torch.equal(dequantize(q, scale, s)[0], torch.zeros(8))
    tiny = scale_from_amax(torch.tensor(1e-45), "e4m3")                  # subnormal amax: scale stays finite
    assert math.isfinite(tiny.item())


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_inf_or_nan_input_raises_one_line_naming_the_tensor_when_the_flags_are_read(bad: float) -> None:
    # Nothing is read while quantising (the flag is set on the device); raise_if_nonfinite reads the flags once,
    # names the tensor, and clears them: the next clean check passes (a flag never cleared would fail it).
    nonfinite_sites([STANDALONE])                                        # whatever an earlier test left
    x = _randn(4, 8)
    x[2, 3] = bad
    quantize(x, Scaling(granularity="row"))
    with pytest.raises(NonFiniteAmax, match=r"^amax of quantize's input is not finite: .*lower the learning rate, "
                       r"use current scaling .*check the data") as err:
        raise_if_nonfinite()
    assert "\n" not in str(err.value)
    raise_if_nonfinite()                                                 # cleared by the read
    AmaxHistory(4).update(torch.tensor(bad))
    with pytest.raises(NonFiniteAmax, match="amax of AmaxHistory's amax is not finite"):
        raise_if_nonfinite([STANDALONE])


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_non_finite_operand_of_an_fp8_linear_is_named_by_layer_and_operand(recipe: str) -> None:
    # The forward's input and, separately, the backward's output gradient; in every recipe (the delayed one
    # records through its amax history). Each read clears, so the second case names only its own tensor.
    mm = FP8Matmul(retile(RECIPES[recipe], 4), name="layers.3.attn.wq")
    x, w = _randn(4, 8).requires_grad_(), _randn(6, 8, seed=1).requires_grad_()
    mm(x, w).sum().backward()
    raise_if_nonfinite([mm.nonfinite])                                  # clean: nothing set
    bad = x.detach().clone()
    bad[1, 2] = math.inf
    mm(bad, w)
    with pytest.raises(NonFiniteAmax, match=r"^step 7: amax of layers\.3\.attn\.wq's input is not finite: "
                       r".*stopped before its update"):
        raise_if_nonfinite([mm.nonfinite], step=7)
    dy = torch.ones(4, 6)
    dy[0, 0] = math.nan
    mm(x, w).backward(dy)
    with pytest.raises(NonFiniteAmax, match=r"^amax of layers\.3\.attn\.wq's output gradient is not finite"):
        raise_if_nonfinite([mm.nonfinite])                               # (and its transpose, re-quantised)
    raise_if_nonfinite([mm.nonfinite])


def test_the_first_tensor_named_is_the_first_a_step_met() -> None:
    # Two linears in a row, a nan in the gradient reaching the second: the backward meets the second one first,
    # and the nan then spreads into the first's gradients; listing by module order would name the first layer.
    first, second = FP8Matmul("tensorwise", name="layers.0.w"), FP8Matmul("tensorwise", name="layers.1.w")
    x, w0, w1 = _randn(4, 8), _randn(8, 8, seed=1).requires_grad_(), _randn(8, 8, seed=2).requires_grad_()
    dy = torch.ones(4, 8)
    dy[2, 2] = math.nan
    second(first(x, w0), w1).backward(dy)
    with pytest.raises(NonFiniteAmax, match=r"^amax of layers\.1\.w's output gradient is not finite \(and 1 more\)"):
        raise_if_nonfinite([first.nonfinite, second.nonfinite])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_saturation_clamps_to_fp8_max_not_inf(fmt: str) -> None:
    # A scale too large for the tensor (delayed scaling after a spike): values beyond the range become
    # ±fp8_max. torch's e5m2 cast alone overflows to inf (e4m3fn's saturates since torch 2.12).
    s = Scaling(fmt)
    x = torch.tensor([1e6, -1e6, 1.0, 0.0])
    q, _ = quantize(x, s, scale=torch.tensor(1.0))
    top = fp8_max(fmt)
    assert torch.equal(q.float(), torch.tensor([top, -top, 1.0, 0.0]))


def test_power_of_2_scales() -> None:
    s = Scaling("e4m3", "row", power_of_2=True)
    x = _randn(16, 32, seed=3) * torch.logspace(-4, 4, 16).unsqueeze(1)
    q, scale = quantize(x, s)
    mantissa, _ = torch.frexp(scale)
    assert torch.all(mantissa == 0.5)                                   # exact powers of two
    exact = fp8_max("e4m3") / amax(x, s)
    assert torch.all((scale <= exact) & (scale > exact / 2))            # rounded down, by less than 2x
    assert q.float().abs().max() <= 448
    # Scaling by a power of two only shifts exponents: an FP8-representable input survives exactly.
    grid = q.float() / scale
    q2, scale2 = quantize(grid, s)
    assert torch.equal(dequantize(q2, scale2, s), grid)


def test_amax_history_scale_is_max_of_window_and_lags_one_step() -> None:
    h = AmaxHistory(length=2)
    with pytest.raises(ValueError, match="empty"):
        h.scale("e4m3")
    scales = []
    for a in [1.0, 10.0, 2.0, 3.0]:
        h.update(torch.tensor(a))
        scales.append(h.scale("e4m3").item())
    # After 10: max(1, 10); after 2: max(10, 2) (10 still in the window); after 3: max(2, 3) (10 dropped).
    assert scales == pytest.approx([448 / 1, 448 / 10, 448 / 10, 448 / 3])


def test_delayed_recipe_uses_last_steps_amax() -> None:
    w = _randn(64, 256, seed=4) / 16
    x = _randn(8, 256, seed=5)
    delayed, current = FP8Matmul("delayed"), FP8Matmul("tensorwise")
    with torch.no_grad():
        errs = {name: [sqnr(F.linear(xi, w), mm(xi, w)) for xi in (x, 10 * x, 10 * x)]
                for name, mm in (("delayed", delayed), ("current", current))}
    assert errs["delayed"][0] >= 18                                    # step 1 bootstraps from its own amax
    assert errs["delayed"][1] < 10                                     # step 2 scaled for amax(x): saturates
    assert errs["delayed"][2] >= 18                                    # step 3 sees 10·amax in the history
    assert min(errs["current"]) >= 18                                  # current scaling never lags
    window = delayed.histories["output.x"].window
    assert window[:3].tolist() == pytest.approx([10 * x.abs().max().item()] * 2 + [x.abs().max().item()])


def _representable(rows: int, k: int, scaling: Scaling, seed: int) -> torch.Tensor:
    """e4m3 grid values times a power of two per scaling group (exponents -12..12): with power-of-2 scales
    the quantisation is then exact, so a GEMM of these inputs measures the scaled GEMM's own error only."""
    g = torch.Generator().manual_seed(seed)
    grid = (torch.randn(rows, k, generator=g) * 64).to(E4M3).float()
    exps = torch.randint(-12, 13, amax(grid, scaling).shape, generator=g).float()
    t = scaling.tile
    spread = exps.repeat_interleave(t, dim=-1)
    if scaling.granularity == "block":
        spread = spread.repeat_interleave(t, dim=0)
    return grid * torch.exp2(spread[:rows, :k])


def test_block_scaled_gemm_matches_fp32_on_representable_inputs() -> None:
    # DeepSeek-V3's layout: a 1×128 tiles, b 128×128 blocks, promotion every 128, power-of-2 scales. Inputs
    # are chosen exactly representable after scaling (see _representable) so that quantisation adds nothing:
    # the difference from fp32 is the scaled GEMM's own (the limited-precision accumulation), held to DeepGEMM's
    # 1e-3. The same inputs with one scale per tensor lose the small tiles to underflow.
    sa, sb = Scaling("e4m3", "tile", power_of_2=True), Scaling("e4m3", "block", power_of_2=True)
    a, b = _representable(32, 384, sa, seed=6), _representable(160, 384, sb, seed=7)
    qa, ska = quantize(a, sa)
    qb, skb = quantize(b, sb)
    assert torch.equal(dequantize(qa, ska, sa), a) and torch.equal(dequantize(qb, skb, sb), b)
    ref = a.double() @ b.double().T
    out = fp8_matmul(qa, ska, qb, skb, sa, sb)
    assert out.dtype == torch.float32 and out.shape == (32, 160)
    assert _rel(ref, out) < 1e-3
    row_rel = ((ref - out.double()).norm(dim=1) / ref.norm(dim=1)).max()
    assert row_rel < 1e-3                                               # small rows too, not just the norm
    st = Scaling("e4m3", "tensor", power_of_2=True)
    qa_t, ska_t = quantize(a, st)
    qb_t, skb_t = quantize(b, st)
    tensorwise = fp8_matmul(qa_t, ska_t, qb_t, skb_t, st, st, backend="emulate")
    assert ((ref - tensorwise.double()).norm(dim=1) / ref.norm(dim=1)).max() > 0.1


def test_block_scaled_gemm_calc_diff_on_randn() -> None:
    # DeepGEMM's test: calc_diff = 1 - 2Σxy / Σ(x² + y²) < 1e-3 between the FP8 GEMM of randn inputs (cast with
    # per_token / per_block scales) and the high-precision product, quantisation error included.
    a, b = _randn(64, 256, seed=8), _randn(128, 256, seed=9)
    recipe = RECIPES["tilewise"]
    sa, sb = recipe.output
    out = fp8_matmul(*quantize(a, sa), *quantize(b, sb), sa, sb).double()
    ref = a.double() @ b.double().T
    calc_diff = 1 - 2 * (out * ref).sum() / (out * out + ref * ref).sum()
    assert calc_diff < 1e-3


def test_promotion_every_128_bounds_accumulation_error() -> None:
    # DeepSeek-V3 §3.3.2: accumulating all of K at tensor-core precision loses accuracy as K grows; promoting
    # partial sums to fp32 every 128 elements keeps it small. Reference: the same FP8 operands summed in fp32.
    s = Scaling("e4m3", "tensor")

    def errors(k: int) -> tuple[float, float]:
        qa, sa = quantize(_randn(16, k, seed=10), s)
        qb, sb = quantize(_randn(16, k, seed=11), s)
        exact = fp8_matmul(qa, sa, qb, sb, s, s, accum_bits=None, backend="emulate")
        return tuple(_rel(exact, fp8_matmul(qa, sa, qb, sb, s, s, promote, backend="emulate"))
                     for promote in (128, None))

    promoted_short, never_short = errors(256)
    promoted_long, never_long = errors(2048)
    assert promoted_long < 1e-3 and promoted_short < 1e-3
    assert never_long > 5 * promoted_long
    assert never_long > 2 * never_short                                 # the unpromoted error grows with K


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_scaled_mm_and_emulation_agree(granularity: str) -> None:
    s = Scaling("e4m3", granularity)
    qa, sa = quantize(_randn(16, 256, seed=12), s)
    qb, sb = quantize(_randn(32, 256, seed=13), s)
    if not scaled_mm_supported(qa, qb, s, s):
        pytest.skip(f"torch._scaled_mm does not take {granularity}wise scales on this device")
    hardware = fp8_matmul(qa, sa, qb, sb, s, s, backend="scaled_mm")
    exact = fp8_matmul(qa, sa, qb, sb, s, s, accum_bits=None, backend="emulate")
    assert torch.allclose(hardware, exact, rtol=1e-5, atol=1e-5)
    assert _rel(hardware, fp8_matmul(qa, sa, qb, sb, s, s, backend="emulate")) < 1e-3


@pytest.mark.parametrize("error", [ValueError, RuntimeError, NotImplementedError])
def test_scaled_mm_probe_treats_any_refusal_as_unsupported(error: type[Exception],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # CUDA refuses e5m2×e5m2 with a ValueError (seen on an H100, torch 2.11), CPU with a RuntimeError: the probe
    # must answer False for either, so that fp8_matmul falls back to emulation instead of failing.
    def refuse(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise error("Multiplication of two Float8_e5m2 matrices is not supported")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    _scaled_mm_works.cache_clear()
    try:
        assert not _scaled_mm_works("cpu", "tensor", E5M2, E5M2)
    finally:
        _scaled_mm_works.cache_clear()


def test_fp8_matmul_rejects_bad_arguments() -> None:
    s = Scaling()
    qa, sa = quantize(_randn(4, 8), s)
    with pytest.raises(ValueError, match="promote_every=0"):
        fp8_matmul(qa, sa, qa, sa, s, s, 0)
    with pytest.raises(ValueError, match="backend='gpu'"):
        fp8_matmul(qa, sa, qa, sa, s, s, backend="gpu")
    with pytest.raises(ValueError, match=r"\(4, 8\) and \(8, 4\)"):
        fp8_matmul(qa, sa, qa.t(), sa, s, s)
    with pytest.raises(ValueError, match=r"got \('tile', 'block'\)"):
        fp8_matmul(qa, sa, qa, sa, Scaling(granularity="tile"), Scaling(granularity="block"), backend="scaled_mm")
    with pytest.raises(ValueError, match="recipe 'fp4'"):
        FP8Matmul("fp4")


@pytest.fixture(scope="module")
def linear_case() -> dict[str, torch.Tensor]:
    """One fp32 linear, forward and backward: x (2, 32, 256) → y (2, 32, 192)."""
    x = _randn(2, 32, 256, seed=14).requires_grad_()
    w = (_randn(192, 256, seed=15) / 16).requires_grad_()
    dy = _randn(2, 32, 192, seed=16)
    y = F.linear(x, w)
    y.backward(dy)
    return dict(x=x.detach(), w=w.detach(), dy=dy, y=y.detach(), dx=x.grad, dw=w.grad)


def _run(mm: FP8Matmul, case: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    x, w = case["x"].clone().requires_grad_(), case["w"].clone().requires_grad_()
    y = mm(x, w)
    y.backward(case["dy"])
    return y, x.grad, w.grad


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_fp8_linear_sqnr(recipe: str, linear_case: dict[str, torch.Tensor]) -> None:
    # torchao (test_base.py, Float8Linear vs nn.Linear): output SQNR >= 18 dB, gradients >= 17 dB.
    y, dx, dw = _run(FP8Matmul(recipe), linear_case)
    assert y.shape == linear_case["y"].shape and y.dtype == torch.float32
    assert sqnr(linear_case["y"], y) >= 18
    assert sqnr(linear_case["dx"], dx) >= 17
    assert sqnr(linear_case["dw"], dw) >= 17


def test_fp8_linear_without_weight_grad(linear_case: dict[str, torch.Tensor]) -> None:
    x = linear_case["x"].clone().requires_grad_()
    FP8Matmul("tilewise")(x, linear_case["w"]).backward(linear_case["dy"])
    assert sqnr(linear_case["dx"], x.grad) >= 17


def test_fp8_linear_is_a_linear_kernel_in_bf16_too() -> None:
    # The seam's contract (lab.model.Linear.kernel): F.linear without bias, any leading dims, the input's dtype.
    layer = Linear(64, 48)
    layer.kernel = FP8Matmul("tilewise")
    x = _randn(2, 5, 64, seed=22).bfloat16().requires_grad_()
    layer.bfloat16()
    y = layer(x)
    assert y.shape == (2, 5, 48) and y.dtype == torch.bfloat16
    y.float().square().sum().backward()
    assert x.grad.dtype == layer.weight.grad.dtype == torch.bfloat16
    assert sqnr(F.linear(x.float(), layer.weight.float()), y.float()) >= 18


def test_each_gemm_gets_its_own_formats(monkeypatch: pytest.MonkeyPatch,
                                        linear_case: dict[str, torch.Tensor]) -> None:
    seen: list[tuple[torch.dtype, torch.dtype]] = []

    def spy(a, sa, b, sb, *args, **kwargs):  # noqa: ANN001, ANN202
        seen.append((a.dtype, b.dtype))
        return fp8_matmul(a, sa, b, sb, *args, **kwargs)

    monkeypatch.setattr(fp8_linear, "fp8_matmul", spy)
    expected = {"tensorwise": [(E4M3, E4M3), (E5M2, E4M3), (E5M2, E4M3)],     # torchao: e5m2 grad_output
                "delayed": [(E4M3, E4M3), (E5M2, E4M3), (E5M2, E4M3)],        # TE HYBRID
                "rowwise": [(E4M3, E4M3)] * 3, "tilewise": [(E4M3, E4M3)] * 3}  # torchao rowwise, DeepSeek-V3
    for name, dtypes in expected.items():
        seen.clear()
        _run(FP8Matmul(name), linear_case)
        assert seen == dtypes, name                                    # output, grad_input, grad_weight
    e4, e5 = Scaling("e4m3"), Scaling("e5m2")
    mixed = FP8Recipe(output=(e4, e4), grad_input=(e5, e4), grad_weight=(e4, e5))
    seen.clear()
    _run(FP8Matmul(mixed), linear_case)
    assert seen == [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]


def test_e5m2_keeps_small_gradients_that_e4m3_flushes() -> None:
    # Why gradients default to e5m2 with one scale per tensor: a gradient 1e-6 times its largest element is
    # below e4m3's smallest subnormal after scaling (2^-9 ≈ 2e-3 vs 448e-6) but a normal e5m2 number.
    x, w = _randn(4, 64, seed=17), _randn(32, 64, seed=18)
    dy = _randn(4, 32, seed=19) * torch.tensor([1.0, 1e-6, 1e-6, 1e-6]).unsqueeze(1)
    ref = dy @ w
    e4, e5 = Scaling("e4m3"), Scaling("e5m2")
    small = {}
    for name, grad in (("e5m2", e5), ("e4m3", e4)):
        xr = x.clone().requires_grad_()
        FP8Matmul(FP8Recipe(output=(e4, e4), grad_input=(grad, e4), grad_weight=(grad, e4)))(xr, w).backward(dy)
        small[name] = sqnr(ref[1:], xr.grad[1:])
    assert small["e5m2"] >= 15 and small["e4m3"] < 1


@pytest.mark.parametrize("granularity, doubled", [("tensor", False), ("block", False), ("row", True),
                                                  ("tile", True)])
def test_double_quantisation_error(granularity: str, doubled: bool) -> None:
    # grad_weight needs xᵀ scaled along tokens. Tensor and 128×128 block groups are transpose-invariant, so the
    # FP8 copy can be reused; row and 1×128 tile groups are not, and re-quantising the FP8 copy rounds twice.
    x = _randn(128, 256, seed=20) * torch.rand(128, 1, generator=torch.Generator().manual_seed(21)) * 10
    single, double = double_quantization_error(x, Scaling("e4m3", granularity))
    assert single >= 25
    if doubled:
        assert double < single - 1
    else:
        assert double == single
    # Power-of-2 scales share one mantissa grid across groups: re-quantising is exact (DeepSeek-V3 §3.3.3).
    single, double = double_quantization_error(x, Scaling("e4m3", granularity, power_of_2=True))
    assert double == pytest.approx(single, abs=1e-6)


def test_retile_keeps_the_recipe_shape(linear_case: dict[str, torch.Tensor]) -> None:
    small = retile(RECIPES["tilewise"], 32)
    assert {s.tile for pair in (small.output, small.grad_input, small.grad_weight) for s in pair} == {32}
    assert [s.granularity for s in small.output] == ["tile", "block"]
    y, _, _ = _run(FP8Matmul(small), linear_case)
    assert sqnr(linear_case["y"], y) >= 18


def test_recipes_cite_their_layouts() -> None:
    tile = RECIPES["tilewise"]
    assert [s.granularity for s in (*tile.output, *tile.grad_input, *tile.grad_weight)] == \
        ["tile", "block", "tile", "block", "tile", "tile"]
    assert all(s.power_of_2 for s in RECIPES["rowwise"].output)
    assert {s.timing for s in RECIPES["delayed"].output} == {"delayed"}
    assert RECIPES["delayed"].output[0].history == 1024
