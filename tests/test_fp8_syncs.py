"""FP8 scales are computed on the device: no value of a tensor is read on the host during an FP8 linear.

Every `.item()`, `float(t)`, `bool(t)` or `if t > 0:` on a CUDA tensor makes the CPU wait until the GPU has
finished all queued work (a host synchronisation), and a CUDA graph cannot capture it. On CPU there is no such
wait, but the same reads go through the same ATen ops, so a TorchDispatchMode that records them counts, on CPU,
the synchronisations the code would make on a GPU: `_local_scalar_dense` (what `.item()`, `float()`, `bool()`
dispatch to), `equal`, `is_nonzero`, every op whose output shape depends on values (`nonzero`, `masked_select`,
a tensor-count `repeat_interleave`: torch tags them `dynamic_output_shape`), and `tolist`/`numpy`, which on CPU
read memory without an ATen op and so are caught at the Tensor method.
`torch._assert_async` is not one: on CUDA it asserts on the device without waiting (but a failed assert kills the
process without naming anything, so lab records a non-finite amax in device-side flags instead, read once a step).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lab.precision.fp8 import AmaxHistory, NonFiniteAmax, fp8_max, nonfinite_sites, raise_if_nonfinite, scale_from_amax
from lab.precision.fp8_linear import RECIPES, FP8Matmul, retile

_READS = {torch.ops.aten._local_scalar_dense, torch.ops.aten.equal, torch.ops.aten.is_nonzero,
          torch.ops.aten.nonzero}
_TAGS = {torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape}


class HostReads(TorchDispatchMode):
    """Records every ATen op that brings a value to the host or sizes its output from values, and the two
    Tensor methods that copy the data out without an ATen op on CPU (`tolist`, `numpy`)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.methods = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def __enter__(self) -> HostReads:
        for name, method in self.methods.items():
            setattr(torch.Tensor, name, self._recording(name, method))
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for name, method in self.methods.items():
            setattr(torch.Tensor, name, method)

    def _recording(self, name: str, method):  # noqa: ANN001, ANN202 — wraps a Tensor method
        def read(tensor: torch.Tensor, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.ops.append(f"Tensor.{name}")
            return method(tensor, *args, **kwargs)
        return read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN201 — torch's protocol
        if func.overloadpacket in _READS or _TAGS & set(func.tags):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _linear_step(mm: FP8Matmul, device: str = "cpu") -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 32, generator=g).to(device).requires_grad_()
    w = torch.randn(48, 32, generator=g).to(device).requires_grad_()
    mm(x, w).square().sum().backward()


def test_the_counter_sees_each_kind_of_host_read() -> None:
    # The instrument itself: each way of reading a value that the FP8 code must not use is recorded.
    t = torch.tensor([0.5, 2.0])
    for read in (lambda: t.max().item(), lambda: float(t[0]), lambda: bool(t[0] > 1), lambda: t.nonzero(),
                 lambda: torch.equal(t, t), lambda: t[t > 1], lambda: t.repeat_interleave(torch.tensor([1, 2])),
                 lambda: t.tolist(), lambda: t.numpy()):
        with HostReads() as reads:
            read()
        assert reads.ops, "a host read went unrecorded"
    with HostReads() as reads:
        torch._assert_async(torch.isfinite(t).all(), "finite")
        torch.exp2(torch.floor(torch.log2(t))).repeat_interleave(3, dim=-1)
    assert reads.ops == []


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_fp8_linear_forward_and_backward_read_nothing_on_the_host(recipe: str) -> None:
    # tensorwise and rowwise (torchao's), tilewise (DeepSeek-V3's 1x128 / 128x128) and delayed (TE's history):
    # every scale, amax and history update stays a tensor. The first call is outside the count: it probes once
    # whether torch._scaled_mm runs on this device (cached), which is a host read by design.
    mm = FP8Matmul(retile(RECIPES[recipe], 16))
    _linear_step(mm)
    with HostReads() as reads:
        _linear_step(mm)
    assert reads.ops == [], f"{recipe}: host reads {reads.ops}"


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("power_of_2", [False, True])
def test_scale_on_the_device_equals_the_formula(fmt: str, power_of_2: bool) -> None:
    # The same numbers as the straightforward formula computed in Python on each amax: fp8_max / amax in
    # float64, 1 for a zero amax, capped at float32's max, rounded down to a power of two if asked.
    amaxes = [0.0, 1e-45, 1e-30, 3e-5, 0.1, 1.0, 3.0, 447.9, 448.0, 1e4, 57344.0, 3e38]
    f32_max = torch.finfo(torch.float32).max

    def reference(a: float) -> float:
        scale = min(fp8_max(fmt) / a, f32_max) if a > 0 else 1.0
        return 2.0 ** math.floor(math.log2(scale)) if power_of_2 else scale

    amax = torch.tensor(amaxes)                                          # float32, as `fp8.amax` returns
    expected = torch.tensor([reference(a) for a in amax.tolist()], dtype=torch.float64).float()
    assert torch.equal(scale_from_amax(amax, fmt, power_of_2), expected)


def test_amax_history_stays_on_the_amaxes_device() -> None:
    # Delayed scaling's window is updated by a tensor copy, not float(amax): same values as before.
    history = AmaxHistory(3)
    with HostReads() as reads:
        for a in (2.0, 7.0, 5.0, 1.0):
            history.update(torch.tensor(a))
        scale = history.scale("e4m3")
    assert reads.ops == []
    assert torch.equal(history.window, torch.tensor([1.0, 5.0, 7.0], dtype=torch.float64))
    assert scale.item() == pytest.approx(448 / 7.0, rel=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.set_sync_debug_mode")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_linear_on_cuda_makes_no_host_synchronisation(recipe: str) -> None:
    # On a GPU, torch itself raises on any synchronising call while the debug mode is "error".
    mm = FP8Matmul(recipe)
    _linear_step(mm, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _linear_step(mm, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_nan_on_cuda_is_one_line_and_the_process_goes_on() -> None:
    # What torch._assert_async could not do: a failed device-side assert ends the CUDA context. The flags are
    # set without a synchronisation, read once, and the GPU is usable afterwards.
    mm = FP8Matmul("rowwise", name="layers.0.ffn.w1", device="cuda")
    x = torch.randn(32, 64, device="cuda")
    w = torch.randn(48, 64, device="cuda", requires_grad=True)
    mm(x, w).sum().backward()                                  # the first call probes torch._scaled_mm (a read)
    raise_if_nonfinite([mm.nonfinite])
    x[5, 7] = math.nan
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mm(x, w).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(NonFiniteAmax, match=r"^amax of layers\.0\.ffn\.w1's input is not finite"):
        raise_if_nonfinite([mm.nonfinite])
    assert list(mm.nonfinite.flags) == [torch.device("cuda", torch.cuda.current_device())]  # "cuda" made as cuda:N
    assert (torch.ones(4, device="cuda") * 2).sum().item() == 8.0


class ScaledMMs(TorchDispatchMode):
    """Records the output dtype of every torch._scaled_mm."""

    def __init__(self) -> None:
        super().__init__()
        self.out_dtypes: list[torch.dtype] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN201 — torch's protocol
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten._scaled_mm:
            self.out_dtypes.append(out.dtype)
        return out


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_bf16_fp8_linear_gets_bf16_from_each_gemm_not_float32_then_a_cast(recipe: str) -> None:
    # The GEMM rounds to bf16 in its epilogue: a float32 result cast afterwards costs a kernel and 5x the bytes
    # (4 written, 4 read, 2 written per element, against 2).
    mm = FP8Matmul(recipe)
    x = torch.randn(32, 64).bfloat16().requires_grad_()
    w = torch.randn(48, 64).bfloat16().requires_grad_()
    mm(x, w).float().square().sum().backward()                           # the first call probes _scaled_mm
    with ScaledMMs() as gemms:
        mm(x, w).float().square().sum().backward()
    assert gemms.out_dtypes == [torch.bfloat16] * 3


def test_torch_compile_traces_an_fp8_linear_as_one_graph() -> None:
    # What compile fuses must first be one graph: a host read, or the once-only probe of torch._scaled_mm traced
    # instead of taken as a constant, would split it (a graph break) and leave the casts around it unfused.
    # Rowwise: its scales are also rounded to powers of two (one tracing costs seconds: one recipe).
    import torch._dynamo

    mm = FP8Matmul("rowwise")
    x = torch.randn(32, 64).bfloat16().requires_grad_()
    w = torch.randn(48, 64).bfloat16().requires_grad_()
    explained = torch._dynamo.explain(lambda x, w: mm(x, w))(x, w)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_the_non_finite_flags_of_many_linears_are_read_in_one_host_read() -> None:
    # The trainer's step reads the flags of every FP8 linear of the model: one copy to the host for all of them
    # (a read per linear would be one wait per layer on a GPU).
    linears = [FP8Matmul("tensorwise", name=f"layers.{i}.ffn.w1") for i in range(3)]
    for mm in linears:
        _linear_step(mm)
    with HostReads() as reads:
        assert nonfinite_sites([mm.nonfinite for mm in linears]) == []
    assert reads.ops == ["Tensor.tolist"]


def test_a_compiled_fp8_linear_still_records_a_non_finite_amax() -> None:
    # Under torch.compile the flag is an in-place update of a tensor the graph takes as an input (made with the
    # linear, before tracing): the graph must keep that mutation, forward and backward (aot_eager: the same
    # functionalised graphs inductor gets, without its C++ build).
    mm = FP8Matmul("tensorwise", name="layers.0.attn.wo")
    compiled = torch.compile(lambda x, w: mm(x, w), backend="aot_eager", fullgraph=True)
    x, w = torch.randn(8, 16), torch.randn(4, 16, requires_grad=True)
    compiled(x, w).sum().backward()
    raise_if_nonfinite([mm.nonfinite])
    x[3, 5] = math.nan
    compiled(x, w).sum().backward()
    with pytest.raises(NonFiniteAmax, match=r"^amax of layers\.0\.attn\.wo's input is not finite"):
        raise_if_nonfinite([mm.nonfinite])
