"""How this process runs Triton kernels: compiled for a GPU, or in Triton's interpreter on the CPU.

`triton.jit` reads `TRITON_INTERPRET` when a kernel is *decorated* (it returns an interpreted function when the
variable is 1 and a GPU-compiled one otherwise), so the choice is made here, once, when `lab.kernels` is first
imported — before any kernel module of the package is loaded. Without a GPU the variable is set to 1: every
kernel of the course then runs on CPU tensors, slowly but with the same masks, tiles and reductions.

The interpreter has no GPU to ask: a launcher must not query device properties, call `triton.autotune` or
`triton.testing.do_bench` there (they fail with "0 active drivers"); it uses one pinned launch configuration.
Its cost is per program instance and per block operation, so interpreted launchers use few, large blocks.
It has no bf16 (bf16 arithmetic is silently wrong: triton-lang/triton#11584): bf16 runs only on a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch


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


def _configure() -> str:
    if importlib.util.find_spec("triton") is None:
        return "unavailable"
    if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available():
        return "compiled"
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton.language" in sys.modules:
        _interpret_triton_language()
    return "interpreter"


MODE: str = _configure()
"""'compiled' (a GPU), 'interpreter' (Triton's interpreter on CPU tensors) or 'unavailable' (no triton)."""

DEVICE: str = "cuda" if MODE == "compiled" else "cpu"
"""Where this process's kernel inputs live."""


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
