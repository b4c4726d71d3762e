"""Flash attention (forward and backward) and the paged decode kernel against torch, by the error-ratio rule.

Each case runs the kernel, torch's own op in the same dtype, and a float64 reference; the kernel's error on the
output and on dq, dk, dv must be at most 2x torch's. The shape zoo: one row (T=1), head dims that are not powers
of two (24, 40), lengths that are not a multiple of the 64-row tile (37, 65, 70, 90, 100: several key blocks, so
the online rescale runs), grouped-query heads (H=4, Hkv=2 and H=2, Hkv=1), Dv != D (MLA), causal and not.
Both backwards (single pass with atomic dQ, the default; two kernels, the deterministic one) are held to the same
rule, and which one runs, with how many block matmuls, is observed by counting launches and tl.dot calls.
The paged decode kernel: shuffled blocks, a one-token sequence, a last block cut short, a block size that is not
a power of two; its baseline is torch's SDPA on the gathered cache.
Kernels run in Triton's interpreter here (fp32 and fp16; bf16 only on a GPU).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from lab.kernels import DEVICE  # before triton: lab.kernels decides the interpreter before triton is imported

pytest.importorskip("triton")

from lab.config import ModelConfig  # noqa: E402
from lab.kernels.accuracy import assert_error_ratio, dot_product_ratio  # noqa: E402
from lab.kernels.flash_attention import attention_reference, flash_attention  # noqa: E402
from lab.kernels.paged_attention import gather_kv, paged_attention_decode, paged_attention_reference  # noqa: E402
from lab.model import Attention, LatentAttention, rope_angles  # noqa: E402

#        B  H  Hkv  T    S    D   Dv  causal
ZOO = [(1, 1, 1, 1, 1, 24, 24, True),       # one row, D not a power of two
       (1, 2, 2, 37, 37, 24, 24, True),     # one partial tile
       (1, 4, 2, 100, 100, 16, 16, True),   # GQA, two tiles with a tail: rescale and causal skip run
       (1, 2, 1, 70, 90, 24, 40, False),    # non-causal, T != S, Dv != D, one kv head for two
       (2, 2, 2, 65, 65, 12, 20, True)]     # MLA-like Dv != D, batch stride, one-row tail tile
DTYPES = [torch.float32, torch.float16]


def _torch_attention(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


def _run(fn, q, k, v, do):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", ZOO, ids=lambda s: "B{}H{}Hkv{}T{}S{}D{}Dv{}{}".format(*s[:7], "c" * s[7]))
def test_flash_attention_matches_torch(shape, dtype):
    B, H, Hkv, T, S, D, Dv, causal = shape
    gen = torch.Generator().manual_seed(T * 131 + D)
    q, k, v, do = (torch.randn(*s, generator=gen).to(dtype=dtype, device=DEVICE)
                   for s in ((B, H, T, D), (B, Hkv, S, D), (B, Hkv, S, Dv), (B, H, T, Dv)))
    got = _run(lambda *a: flash_attention(*a, causal=causal), q, k, v, do)
    base = _run(lambda *a: _torch_attention(*a, causal), q, k, v, do)
    ref = _run(lambda *a: attention_reference(*a, causal=causal), q.double(), k.double(), v.double(), do.double())
    # One roundoff scale for the four tensors (unit-normal inputs): with a single key the softmax is 1 and dq, dk
    # cancel to exactly 0 (dP - rowsum(dO * O) = 0), so their own scale would leave no room for any roundoff.
    scale = max(float(r.abs().max()) for r in ref)
    for name, g, b, r in zip(("out", "dq", "dk", "dv"), got, base, ref, strict=True):
        assert g.dtype == dtype and g.shape == r.shape
        assert_error_ratio(f"flash_attention {name}", g, b, r, dot_product_ratio(g.dtype), scale)


class EveryBackwardConfig:
    """Stands in for the autotuned single-pass backward when a test pretends to compile (the interpreter cannot
    time configs): it runs every config `prune_backward` keeps, grid from the config and dQ zeroed before each, as
    the autotuner does, and keeps each trial's (config, dq, dk, dv); the last trial's results are the call's."""

    def __init__(self, fa):
        self.fa, self.trials = fa, []

    def __call__(self):
        return self

    def __getitem__(self, grid):
        def launch(*args, **meta):
            kernel = self.fa._bwd_dkdv_kernel
            named = dict(zip(kernel.arg_names, args, strict=False))
            for cfg in self.fa.prune_backward(self.fa.BACKWARD_ATOMIC_CONFIGS, named, **meta):
                named["DQ"].zero_()
                kernel[grid(cfg.kwargs)](*args, **meta, **cfg.kwargs)
                self.trials.append((cfg.kwargs, *(named[n].clone() for n in ("DQ", "DK", "DV_"))))
        return launch


def _pretend_to_compile(monkeypatch) -> EveryBackwardConfig:
    import lab.kernels.flash_attention as fa

    monkeypatch.setattr(fa, "interpreted", lambda: False)
    tuner = EveryBackwardConfig(fa)
    monkeypatch.setattr(fa, "_autotuned_backward", tuner)
    return tuner


@pytest.mark.parametrize("dtype, D, causal", [(torch.float16, 24, True), (torch.float32, 24, False),
                                               (torch.float32, 80, True)], ids=["fp16-D24-c", "fp32-D24", "fp32-D80-c"])
def test_flash_attention_gpu_tiles_in_interpreter(monkeypatch, dtype, D, causal):
    """The tiles a GPU launch picks (forward 128×64 and 64×32; every single-pass backward config the prune keeps,
    BLOCK_M != BLOCK_N among them) give the same answer: the kernels assume no particular tile shape. Run through
    the interpreter by pretending to compile; each backward config is checked, not only the one a GPU would time
    fastest. A head past 256 bytes a row (fp32, D 80 padded to 128) tries only the 64-key tiles."""
    import lab.kernels.flash_attention as fa

    tuner = _pretend_to_compile(monkeypatch)
    fwd = fa._config(D, D, dtype)
    assert fwd["BLOCK_M"] != fwd["BLOCK_N"]
    gen = torch.Generator().manual_seed(D)
    B, H, Hkv, T = 1, 2, 1, 150
    q, k, v, do = (torch.randn(*s, generator=gen).to(dtype=dtype, device=DEVICE)
                   for s in ((B, H, T, D), (B, Hkv, T, D), (B, Hkv, T, D), (B, H, T, D)))
    got = _run(lambda *a: flash_attention(*a, causal=causal), q, k, v, do)
    base = _run(lambda *a: _torch_attention(*a, causal), q, k, v, do)
    ref = _run(lambda *a: attention_reference(*a, causal=causal), q.double(), k.double(), v.double(), do.double())
    for name, g, b, r in zip(("out", "dq", "dk", "dv"), got, base, ref, strict=True):
        assert_error_ratio(f"flash_attention (GPU tiles) {name}", g, b, r, dot_product_ratio(g.dtype))
    wide = D > 64 and dtype == torch.float32
    expected = [c.kwargs for c in fa.BACKWARD_ATOMIC_CONFIGS if not wide or c.kwargs["BLOCK_N"] <= 64]
    assert [kw for kw, *_ in tuner.trials] == expected
    for kw, *grads in tuner.trials:
        for name, g, b, r in zip(("dq", "dk", "dv"), grads, base[1:], ref[1:], strict=True):
            assert_error_ratio(f"flash_attention backward {kw} {name}", g.to(dtype), b, r, dot_product_ratio(dtype))


def test_the_backward_autotuner_zeroes_dq_before_every_trial():
    """On a GPU the autotuner runs the single pass once per config before the real run, each adding into dQ: unless
    it zeroes dQ before each trial and the real run, the first backward at a shape returns dQ times the number of
    configs tried plus one. Built here, never run (the interpreter cannot time)."""
    import lab.kernels.flash_attention as fa

    tuner = fa._autotuned_backward.__wrapped__()
    assert tuner.reset_to_zero == ["DQ"]
    assert tuner.configs == fa.BACKWARD_ATOMIC_CONFIGS and tuner.fn is fa._bwd_dkdv_kernel
    assert {"T", "S", "D", "DV", "GROUP", "CAUSAL"} <= set(tuner.keys)


#               B  H  Hkv  T    S   D   Dv  causal  dtype          GPU tiles
BACKWARD_CASES = [(1, 4, 2, 100, 100, 16, 16, True, torch.float16, False),  # GQA, two query blocks, causal skip
                  (1, 2, 1, 70, 90, 24, 40, False, torch.float32, True)]    # T != S, Dv != D, 32×128 / 64×64


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "two-kernel"])
@pytest.mark.parametrize("case", BACKWARD_CASES, ids=["fp16-gqa-c", "fp32-dv40-gpu-tiles"])
def test_flash_attention_backward_paths(monkeypatch, case, deterministic):
    """Each backward path, asked for by name, against the float64 reference: q, k, v gradients within 2x torch's
    error. The second case runs the launch configs a GPU picks (through the interpreter, pretending to compile)."""

    B, H, Hkv, T, S, D, Dv, causal, dtype, gpu_tiles = case
    if gpu_tiles:
        _pretend_to_compile(monkeypatch)
    gen = torch.Generator().manual_seed(T + D)
    q, k, v, do = (torch.randn(*s, generator=gen).to(dtype=dtype, device=DEVICE)
                   for s in ((B, H, T, D), (B, Hkv, S, D), (B, Hkv, S, Dv), (B, H, T, Dv)))
    got = _run(lambda *a: flash_attention(*a, causal=causal, deterministic=deterministic), q, k, v, do)
    base = _run(lambda *a: _torch_attention(*a, causal), q, k, v, do)
    ref = _run(lambda *a: attention_reference(*a, causal=causal), q.double(), k.double(), v.double(), do.double())
    for name, g, b, r in zip(("dq", "dk", "dv"), got[1:], base[1:], ref[1:], strict=True):
        assert g.dtype == dtype
        assert_error_ratio(f"flash_attention {name} (deterministic={deterministic})", g, b, r,
                           dot_product_ratio(g.dtype))


def test_flash_attention_atomic_dq_sums_in_fp32():
    """The single pass's dQ equals the two-kernel dQ (one fp32 sum per element, rounded once) to 2 ulps of each
    element, plus 1/64 ulp of the largest for elements that cancel: the fp32 sums differ only in order (bit-equal
    in the interpreter). Summed in fp16, four key blocks' partials each round: 3.5x past that bound (measured),
    where the error-ratio rule cannot see it (both paths measured 0.03x the error of torch's CPU fp16 attention)."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn(*s, generator=gen).to(dtype=torch.float16, device=DEVICE)
                   for s in ((1, 2, 16, 16), (1, 1, 256, 16), (1, 1, 256, 16), (1, 2, 16, 16)))
    atomic, two = (_run(lambda *a, d=d: flash_attention(*a, causal=False, deterministic=d), q, k, v, do)[1].float()
                   for d in (False, True))
    eps = torch.finfo(torch.float16).eps
    excess = float(((atomic - two).abs() / (2 * eps * two.abs() + eps * two.abs().max() / 64)).max())
    assert excess <= 1, f"single-pass dq differs from the two-kernel dq by {excess:.2g}x the 2-ulp bound"


def test_flash_attention_backward_path_choice(monkeypatch):
    """The single pass is the default; deterministic=True or torch's global flag
    (torch.use_deterministic_algorithms(True), read by torch.are_deterministic_algorithms_enabled: patched here,
    as setting it for real imports inductor's config, 2 s) take the two kernels; an explicit deterministic=False
    wins over the flag. Observed by logging each kernel launch, and in the interpreter by counting tl.dot calls
    on one (query block, key block) pair: 5 (S, dV, dP, dK, dQ) against 7 (S and dP again in the dQ kernel)."""
    import lab.kernels.flash_attention as fa

    launches, dots = [], []

    class Logged:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launches.append(self.name)
            return self.kernel[grid]

    for name in ("_bwd_preprocess", "_bwd_dkdv_kernel", "_bwd_dq_kernel"):
        monkeypatch.setattr(fa, name, Logged(name, getattr(fa, name)))
    if DEVICE == "cpu":
        from triton.runtime.interpreter import InterpreterBuilder

        create_dot = InterpreterBuilder.create_dot
        monkeypatch.setattr(InterpreterBuilder, "create_dot", lambda self, *a: dots.append(1) or create_dot(self, *a))
    q, k, v = (torch.randn(1, 1, 16, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    single, two = ["_bwd_preprocess", "_bwd_dkdv_kernel"], ["_bwd_preprocess", "_bwd_dkdv_kernel", "_bwd_dq_kernel"]
    for flag, kwargs, want_launches, want_dots in ((False, {}, single, 5), (False, dict(deterministic=True), two, 7),
                                                   (True, {}, two, 7), (True, dict(deterministic=False), single, 5)):
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda flag=flag: flag)
        out = flash_attention(q, k, v, causal=False, **kwargs)
        launches.clear(), dots.clear()
        out.backward(torch.ones_like(out))
        assert launches == want_launches, (flag, kwargs, launches)
        assert DEVICE != "cpu" or len(dots) == want_dots, (flag, kwargs, len(dots))
    # fp32 heads wider than 128: the single pass's tiles would not fit an A100's shared memory, so two kernels
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: False)
    q, k = (torch.randn(1, 1, 16, 192, device=DEVICE, requires_grad=True) for _ in range(2))
    out = flash_attention(q, k, v[..., :8].detach().clone().requires_grad_(), causal=False, deterministic=False)
    launches.clear()
    out.backward(torch.ones_like(out))
    assert launches == two and not fa.single_pass_fits(192, 8, torch.float32) and fa.single_pass_fits(
        192, 8, torch.bfloat16) and fa.single_pass_fits(128, 128, torch.float32)


def _check_core(module, cfg, wants_scale):
    """The module with flash_attention as its core against the same module with the eager core (fp32 baseline)
    and in float64 (reference): output and every weight gradient."""
    torch.manual_seed(0)
    x = torch.randn(2, 33, cfg.d_model)
    rope_dim = cfg.qk_rope_head_dim if cfg.attention == "mla" else cfg.head_dim
    cos, sin = rope_angles(torch.arange(x.shape[1]), rope_dim, cfg.rope_theta)
    eager = module(cfg)
    for p in eager.parameters():
        torch.nn.init.normal_(p, std=0.2)
    calls = []

    def core(*args):
        calls.append(len(args))
        return flash_attention(*args)

    results = []
    for dtype, kernel in ((torch.float32, True), (torch.float32, False), (torch.float64, False)):
        m = copy.deepcopy(eager).to(dtype=dtype, device=DEVICE)
        if kernel:
            m.core = core
        out = m(*(t.to(dtype=dtype, device=DEVICE) for t in (x, cos, sin)))
        out.square().sum().backward()
        results.append([out.detach()] + [p.grad for p in m.parameters()])
    assert calls == [4 if wants_scale else 3]
    for i, (g, b, r) in enumerate(zip(*results, strict=True)):
        assert_error_ratio(f"{module.__name__} with flash core, tensor {i}", g, b, r, dot_product_ratio(g.dtype))


def test_drop_in_attention_core():
    """Attention.core(q, k, v) on transposed (non-contiguous) views, GQA 4:2, head_dim 16."""
    _check_core(Attention, ModelConfig.from_preset("tiny"), wants_scale=False)


def test_drop_in_latent_attention_core():
    """LatentAttention.core(q, k, v, scale): qk head dim 12 = 8 + 4 (not a power of two), v head dim 20."""
    cfg = dataclasses.replace(ModelConfig.from_preset("tiny"), attention="mla", kv_lora_rank=16,
                              qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=20)
    _check_core(LatentAttention, cfg, wants_scale=True)


@pytest.mark.parametrize("q_shape, k_shape, v_shape, dtype, causal, match", [
    ((1, 4, 8, 16), (1, 3, 8, 16), (1, 3, 8, 16), torch.float32, True, "kv heads 3 must divide query heads 4"),
    ((1, 2, 8, 16), (1, 2, 8, 8), (1, 2, 8, 16), torch.float32, True, "k head_dim 8 must equal q's 16"),
    ((1, 2, 8, 16), (1, 2, 8, 16), (1, 2, 9, 16), torch.float32, False, r"v \(heads, seq\)"),
    ((1, 2, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16), torch.float32, False, "batch sizes differ"),
    ((2, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16), torch.float32, False, "q must be 4-D"),
    ((1, 2, 8, 16), (1, 2, 9, 16), (1, 2, 9, 16), torch.float32, True, "S=9, T=8"),
    ((1, 2, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16), torch.float64, True, "q dtype float64 is not supported"),
])
def test_flash_attention_rejects_bad_input(q_shape, k_shape, v_shape, dtype, causal, match):
    q, k, v = (torch.zeros(s, dtype=dtype, device=DEVICE) for s in (q_shape, k_shape, v_shape))
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, v, causal=causal)


def _paged_case(dtype, block_size, seq_lens, H=4, Hkv=2, D=24, Dv=40):
    """A cache of shuffled blocks: sequence b owns the blocks of row b of the table, in no particular order."""
    gen = torch.Generator().manual_seed(block_size)
    max_blocks = -(-max(seq_lens) // block_size)
    num_blocks = len(seq_lens) * max_blocks + 3
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype=dtype, device=DEVICE)
    v_cache = torch.randn(num_blocks, block_size, Hkv, Dv, generator=gen).to(dtype=dtype, device=DEVICE)
    table = torch.randperm(num_blocks, generator=gen)[:len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks)
    q = torch.randn(len(seq_lens), H, D, generator=gen).to(dtype=dtype, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, table.to(dtype=torch.int32, device=DEVICE), lens


def _torch_paged(q, k_cache, v_cache, table, lens):
    """torch's SDPA on each sequence's gathered cache, in the inputs' dtype: the baseline of the error ratio."""
    rows = []
    for row, n in enumerate(lens.tolist()):
        k, v = gather_kv(k_cache, table, n, row), gather_kv(v_cache, table, n, row)
        rows.append(F.scaled_dot_product_attention(q[row, :, None, :][None], k[None], v[None],
                                                   enable_gqa=True)[0, :, 0])
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("block_size, seq_lens", [(16, [1, 16, 37]), (5, [23, 4])],
                         ids=["bs16-lens1,16,37", "bs5-lens23,4"])
def test_paged_attention_decode_matches_torch(block_size, seq_lens, dtype):
    q, k_cache, v_cache, table, lens = _paged_case(dtype, block_size, seq_lens)
    got = paged_attention_decode(q, k_cache, v_cache, table, lens)
    base = _torch_paged(q, k_cache, v_cache, table, lens)
    ref = paged_attention_reference(q.double(), k_cache.double(), v_cache.double(), table, lens)
    assert got.dtype == dtype
    assert_error_ratio("paged_attention_decode", got, base, ref)


def test_paged_attention_is_flash_attention_on_the_gathered_cache():
    """A decode step equals the last row of full (non-causal over the cache) attention on the gathered K, V."""
    q, k_cache, v_cache, table, lens = _paged_case(torch.float32, 16, [37])
    k, v = gather_kv(k_cache, table, 37, 0), gather_kv(v_cache, table, 37, 0)
    full = flash_attention(q[:, :, None, :], k[None], v[None], causal=False)[:, :, 0]
    assert_error_ratio("paged vs flash", paged_attention_decode(q, k_cache, v_cache, table, lens), full,
                       paged_attention_reference(q.double(), k_cache.double(), v_cache.double(), table, lens))


@pytest.mark.parametrize("change, match", [
    (dict(lens=[0]), r"seq_lens \[0\] must lie in \[1, max_blocks\*block_size = 48\]"),
    (dict(lens=[49]), "must lie in"),
    (dict(table_value=99), r"block ids in use must lie in \[0, 5\]"),
    (dict(table_dtype=torch.int64), "block_table must be int32"),
    (dict(q_heads=3), "kv heads 2 must divide query heads 3"),
])
def test_paged_attention_rejects_bad_input(change, match):
    q, k_cache, v_cache, table, lens = _paged_case(torch.float32, 16, [37])
    if "lens" in change:
        lens = torch.tensor(change["lens"], dtype=torch.int32, device=DEVICE)
    if "table_value" in change:
        table[0, 0] = change["table_value"]
    if "table_dtype" in change:
        table = table.to(change["table_dtype"])
    if "q_heads" in change:
        q = q[:, :change["q_heads"]]
    with pytest.raises(ValueError, match=match):
        paged_attention_decode(q, k_cache, v_cache, table, lens)
