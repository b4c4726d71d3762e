"""How this process runs Triton kernels: compiled for a GPU, or in Triton's interpreter on the CPU.

`triton.jit` reads `TRITON_INTERPRET` when a kernel is *decorated* (it returns an interpreted function when the
variable is 1 and a GPU-compiled one otherwise), so the choice is made here, once, when `lab.kernels` is first
imported — before any kernel module of the package is loaded. Without a GPU the variable is set to 1: every
kernel of the course then runs on CPU tensors, slowly but with the same masks, tiles and reductions.

The interpreter has no GPU to ask: a launcher must not query device properties, call `triton.autotune` or
`triton.testing.do_bench` there (they fail with "0 active drivers"); it uses one pinned launch configuration.
Its cost is per program instance and per block operation, so interpreted launchers use few, large blocks.
It has no bf16 (bf16 arithmetic is silently wrong: triton-lang/triton#11584): bf16 runs only on a GPU.

A third mode compiles without running: with `LAB_KERNELS_COMPILE_FOR=sm_90a` (or sm_80) set before the import,
TRITON_INTERPRET stays unset, kernels are GPU-compiled for that target through a driver that answers for the
absent GPU, and a launch is refused in one line. `lab.kernels.cross_compile` drives the real launchers in such a
process, on CPU stand-in tensors whose data no kernel ever reads, to find what fails only on a GPU (a tl.dot
under 16 wide, shared memory over budget, register spills) before any GPU time is spent.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch

COMPILE_FOR = "LAB_KERNELS_COMPILE_FOR"
"""The environment variable that makes a process compile-only, for the GPU architecture it names (a key of
`TARGETS`). It must be set before lab.kernels is first imported."""


@dataclass(frozen=True)
class Target:
    """What a compile-only process pretends its GPU is: what the compiler and the launchers ask of a device."""

    capability: int  # 90 is compiled as sm_90a by Triton (wgmma, TMA), 80 as sm_80
    sms: int  # multiprocessors: the programs of a persistent launch
    max_shared: int  # bytes of shared memory one program may use (Triton refuses more at launch)
    gpu: str


TARGETS = {"sm_90a": Target(90, 132, 227 * 1024, "H100 SXM"), "sm_80": Target(80, 108, 163 * 1024, "A100")}
"""The targets a compile-only process can compile for, with the numbers of the GPUs the course benchmarks."""

compiling = False
"""True while `lab.kernels.cross_compile` drives the launchers: only then does a compile-only launch pass."""


def _compile_only(arch: str) -> Target:
    """Make Triton compile for `arch` with no GPU present: an active driver that reports the target, and whose
    "launch" does nothing while `compiling` is set and refuses otherwise. torch's device queries (capability, SM
    count), which launchers use to pick a path, answer for the target too. Triton compiles for
    `driver.active.get_current_target()`, so nothing else changes: the same launchers, configs and compiler."""
    if arch not in TARGETS:
        raise ValueError(f"{COMPILE_FOR}={arch!r} is not a known target: choose one of {', '.join(TARGETS)}")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError(f"{COMPILE_FOR} and TRITON_INTERPRET=1 are both set: a process either compiles for a GPU "
                           "or interprets, unset one")
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    target = TARGETS[arch]

    class NoLaunch:
        def __init__(self, src, metadata) -> None:
            pass

        def __call__(self, *args) -> None:
            if not compiling:
                raise RuntimeError(f"this process only compiles kernels for {arch} ({COMPILE_FOR} is set): unset it "
                                   "to run them")

    class Utils:
        def get_device_properties(self, device) -> dict:
            return {"max_shared_mem": target.max_shared, "multiprocessor_count": target.sms, "warpSize": 32}

        def load_binary(self, name, kernel, shared, device) -> tuple:
            return name, name, 0, 0, 1024  # module, function, registers, spills, max threads: nothing is loaded

    class CompileOnlyDriver:  # duck-typed, not a DriverBase: its abstract methods differ between Triton versions
        launcher_cls = NoLaunch
        utils = Utils()

        def get_current_target(self):
            return GPUTarget("cuda", target.capability, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device=None) -> int:
            return 0

        def get_benchmarker(self):
            def run_once(kernel_call, quantiles=None, **kwargs):  # the autotuner "times" a config by compiling it
                kernel_call()
                return [1.0] * len(quantiles) if quantiles else 1.0
            return run_once

    driver.set_active(CompileOnlyDriver())
    properties = SimpleNamespace(name=f"{target.gpu} (compile-only)", multi_processor_count=target.sms,
                                 major=target.capability // 10, minor=target.capability % 10)
    torch.cuda.get_device_capability = lambda device=None: (properties.major, properties.minor)
    torch.cuda.get_device_properties = lambda device=None: properties
    return target


def _interpret_triton_language() -> None:
    """Triton's own helpers (`tl.sum`, `tl.max`, `tl.cdiv`, ...) are @triton.jit functions too, decorated when
    `triton.language` is first imported. If that happened before TRITON_INTERPRET=1 was set (triton imported
    before lab.kernels, by the learner or by torch), they are GPU functions that an interpreted kernel may not
    call ("Cannot call @triton.jit'd outside of the scope of a kernel"): rebuild them as interpreted ones."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for name, module in list(sys.modules.items()):
        if name == "triton.language" or name.startswith("triton.language."):
            for attr, value in list(vars(module).items()):
                if isinstance(value, JITFunction):
                    setattr(module, attr, InterpretedFunction(value.fn))


def squeezed_index(patch_lang_tensor: Callable) -> Callable:
    """Triton's interpreter patches `tl.tensor` for each launch; among the patches, `__index__` turns a scalar value
    (a kernel argument, held as a 1-element array) into a Python int, as `range(0, n_cols, BLOCK)` needs. Triton 3.6
    spells it `int(data)`, which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars":
    every loop over a runtime bound fails); Triton 3.9 spells it `int(data.squeeze())`. This wraps the interpreter's
    patch so that 3.9's spelling wins in either version (set in the same scope, so undone after the launch too)."""

    @functools.wraps(patch_lang_tensor)
    def patch(tensor, scope) -> None:
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    return patch


def _index_scalars_under_any_numpy() -> None:
    """Install `squeezed_index` around the interpreter's tensor patch (a Triton without that private function is
    left as it is)."""
    from triton.runtime import interpreter

    if hasattr(interpreter, "_patch_lang_tensor"):
        interpreter._patch_lang_tensor = squeezed_index(interpreter._patch_lang_tensor)


def _configure() -> str:
    if importlib.util.find_spec("triton") is None:
        return "unavailable"
    if os.environ.get(COMPILE_FOR):
        _compile_only(os.environ[COMPILE_FOR])
        return "compile-only"
    if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available():
        return "compiled"
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton.language" in sys.modules:
        _interpret_triton_language()
    _index_scalars_under_any_numpy()
    return "interpreter"


MODE: str = _configure()
"""'compiled' (a GPU), 'interpreter' (Triton's interpreter on CPU tensors), 'compile-only' (compiled for
`TARGETS[os.environ[COMPILE_FOR]]`, never run) or 'unavailable' (no triton)."""

DEVICE: str = "cuda" if MODE == "compiled" else "cpu"
"""Where this process's kernel inputs live (CPU stand-ins in a compile-only process)."""


def interpreted() -> bool:
    """True when kernels run in Triton's interpreter: launchers pin one configuration of few, large blocks."""
    return MODE == "interpreter"


def require_triton() -> None:
    """Raise one clear line when triton is not installed (it is the `triton` extra)."""
    if MODE == "unavailable":
        raise ImportError("lab.kernels needs triton: pip install -e '.[triton]' (or use --kernels eager)")


def supported_dtypes() -> tuple[torch.dtype, ...]:
    """What the kernels compute correctly here: fp32 and fp16 in the interpreter (its bf16 is silently wrong),
    also bf16 on a GPU."""
    return (torch.float32, torch.float16) if interpreted() else (torch.float32, torch.float16, torch.bfloat16)


def check_input(tensor: torch.Tensor, name: str = "input") -> None:
    """Refuse what a kernel cannot compute correctly here, in one line: a tensor on another device than this
    process's kernels (DEVICE), or a dtype other than fp32 and fp16 in the interpreter (its bf16 is silently
    wrong) or fp32/fp16/bf16 on a GPU."""
    if tensor.device.type != DEVICE:
        where = "the GPU (cuda)" if DEVICE == "cuda" else "the CPU (Triton's interpreter)"
        raise ValueError(f"{name} is on {tensor.device}: this process runs Triton kernels on {where}")
    allowed = supported_dtypes()
    if tensor.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        where = "in Triton's interpreter (CPU)" if interpreted() else "on this GPU"
        raise ValueError(f"{name} dtype {str(tensor.dtype).removeprefix('torch.')} is not supported {where}: "
                         f"use one of {names}")


# --- Launch rules: one pinned configuration per lane, never a device query -------------------------------------

INTERPRETED_ELEMENTS = 1 << 16
"""Elements per program in the interpreter: few programs, each a large numpy operation."""

GPU_ELEMENTS = 2048
"""Elements per program of a row-wise kernel on a GPU, for rows narrower than this: enough work to hide latency."""

MAX_ROW = 1 << 16
"""The widest row a single-block kernel (RMSNorm, softmax's one-block kernel) takes; wider rows need a loop over
chunks, as `lab.kernels.cross_entropy` and softmax's online kernel do."""


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (>= 1): `tl.arange` takes only power-of-two lengths."""
    return 1 << max(0, n - 1).bit_length()


def flat_block(n: int) -> int:
    """Elements per program of an element-wise kernel over n elements: 1024 on a GPU (4 warps of 32 threads, 8
    elements each), up to 65536 in the interpreter."""
    return min(next_power_of_2(n), INTERPRETED_ELEMENTS) if interpreted() else 1024


def row_launch(n_rows: int, block_cols: int) -> tuple[int, int]:
    """(BLOCK_ROWS, num_warps) for a kernel whose programs each own BLOCK_ROWS rows of `block_cols` columns.
    The interpreter packs rows up to 65536 elements per program, a GPU up to 2048."""
    budget = INTERPRETED_ELEMENTS if interpreted() else GPU_ELEMENTS
    block_rows = max(1, min(next_power_of_2(n_rows), budget // block_cols))
    elements = block_rows * block_cols
    num_warps = 4 if elements <= 2048 else 8 if elements <= 8192 else 16
    return block_rows, num_warps


def check_row(width: int, name: str = "last dim") -> None:
    """Refuse a row a single-block kernel cannot hold (or an empty one)."""
    if not 1 <= width <= MAX_ROW:
        raise ValueError(f"{name} {width} is out of range: a row-wise kernel takes 1 to {MAX_ROW} columns")
