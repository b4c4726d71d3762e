"""Compile every kernel of lab.kernels for a GPU on a machine without one, through the real launchers.

What belongs here: the list of launches (`cases`: each launcher, for representative shapes and fp16, bf16, fp32),
the compile-time record of each kernel they compile (registers, spill bytes, shared memory, or the first error
line), and the CLI that prints them. The compile-only mode itself (a driver that reports the target GPU) is
`lab.kernels.runtime`'s.

Why. The interpreter runs a kernel's arithmetic on numpy arrays, so it accepts what a GPU compile refuses: a
`tl.dot` on a tile under 16 wide, shared memory over the 227 KiB an H100 program may have, a layout the TMA or
wgmma lowering cannot take. And it says nothing about registers: a kernel that spills to local memory runs, slowly.
GPU time is scarce, so these are found here first: `python -m lab.kernels.cross_compile --arch sm_90a` compiles,
with Triton's own compiler and the ptxas it bundles, exactly what the launchers would launch on an H100 — their
block sizes, num_warps and num_stages, and every config the matmul's autotuner would try for the dtype (its
"benchmark" of a config is a compilation here) — and reads each cubin's resource usage with the bundled
`cuobjdump --dump-resource-usage`. A launch compiles and returns: the stand-in CPU tensors are never read.

What it cannot see: anything at run time (wrong results, races, speed, TMA descriptors' alignment of real device
pointers). Rows are unique kernel configurations: a config compiled once in a process is listed under the first
case that compiled it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
import triton.compiler

from lab.kernels import runtime

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class Row:
    """One compiled kernel configuration, or one failure. `stack_bytes` is the local memory a thread needs:
    registers ptxas spilled, or values it could not keep in registers at all (then `registers` can be low, 32,
    beside kilobytes of stack); either way loads and stores to memory the kernel was not written to make, so
    it is the warning column. `shared_bytes` is the dynamic shared memory Triton allocates."""

    case: str
    kernel: str
    config: str
    dtype: str
    registers: int | None = None
    stack_bytes: int | None = None
    shared_bytes: int | None = None
    status: str = "ok"
    warning: str = ""


@dataclass(frozen=True)
class Case:
    """One call of a launcher: `run()` makes the stand-in tensors and calls it (forward and backward)."""

    name: str
    dtype: str
    run: Callable[[], object]


# --- stand-ins and launches ---------------------------------------------------------------------------------------

def _empty(*shape: int, dtype: torch.dtype, grad: bool = False) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, requires_grad=grad)


def _backward(out: torch.Tensor, *inputs: torch.Tensor) -> None:
    torch.autograd.grad(out, inputs, torch.empty_like(out))


def _add(dtype: torch.dtype, n: int) -> None:
    from lab.kernels.add import add

    x = _empty(n, dtype=dtype)
    add(x, x)


def _softmax(dtype: torch.dtype, rows: int, cols: int, online: bool | None) -> None:
    from lab.kernels.softmax import softmax

    x = _empty(rows, cols, dtype=dtype, grad=True)
    _backward(softmax(x, online=online), x)


def _rms_norm(dtype: torch.dtype, rows: int, cols: int) -> None:
    from lab.kernels.rmsnorm import rms_norm

    x, w = _empty(rows, cols, dtype=dtype, grad=True), _empty(cols, dtype=dtype, grad=True)
    _backward(rms_norm(x, w, 1e-5), x, w)


def _swiglu(dtype: torch.dtype, n: int) -> None:
    from lab.kernels.swiglu import swiglu

    gate, up = _empty(n, dtype=dtype, grad=True), _empty(n, dtype=dtype, grad=True)
    _backward(swiglu(gate, up), gate, up)


def _cross_entropy(dtype: torch.dtype, rows: int, vocab: int) -> None:
    from lab.kernels.cross_entropy import cross_entropy

    logits, targets = _empty(rows, vocab, dtype=dtype, grad=True), torch.zeros(rows, dtype=torch.int64)
    _backward(cross_entropy(logits, targets), logits)  # the training launch: loss and gradient
    with torch.no_grad():
        cross_entropy(logits, targets)  # the evaluation launch: pass 1 only


def _matmul(dtype: torch.dtype, size: int, tf32: bool = False) -> None:
    from lab.kernels.matmul import matmul

    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        matmul(_empty(size, size, dtype=dtype), _empty(size, size, dtype=dtype))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def _matmul_persistent(dtype: torch.dtype, size: int, tma: bool) -> None:
    from lab.kernels.matmul import matmul_persistent

    matmul_persistent(_empty(size, size, dtype=dtype), _empty(size, size, dtype=dtype), tma=tma)


def _flash(dtype: torch.dtype, seq: int, d: int, dv: int, causal: bool, deterministic: bool) -> None:
    from lab.kernels.flash_attention import flash_attention

    q = _empty(1, 4, seq, d, dtype=dtype, grad=True)
    k, v = _empty(1, 2, seq, d, dtype=dtype, grad=True), _empty(1, 2, seq, dv, dtype=dtype, grad=True)
    _backward(flash_attention(q, k, v, causal=causal, deterministic=deterministic), q, k, v)


def _paged(dtype: torch.dtype, block_size: int, d: int) -> None:
    from lab.kernels.paged_attention import paged_attention_decode

    batch, heads, kv_heads, max_blocks = 2, 8, 2, 4
    cache = _empty(batch * max_blocks, block_size, kv_heads, d, dtype=dtype)
    table = torch.arange(batch * max_blocks, dtype=torch.int32).view(batch, max_blocks)
    lens = torch.full((batch,), max_blocks * block_size - 3, dtype=torch.int32)
    paged_attention_decode(_empty(batch, heads, d, dtype=dtype), cache, cache, table, lens)


def cases(arch: str = "sm_90a") -> list[Case]:
    """Every launch the GPU lanes make, per dtype: the shapes pick each branch of the launchers' config choices
    (rows packed or not, one block or online, chunked vocabulary, head dims up to and past 128 bytes a row, causal
    or not, both backwards, TMA or pointers where the target has a TMA unit)."""
    out = []
    for name, dtype in DTYPES.items():
        def case(label: str, fn: Callable, *args, **kwargs) -> None:
            out.append(Case(label, name, functools.partial(fn, dtype, *args, **kwargs)))  # noqa: B023

        case("add n=2^20", _add, 1 << 20)
        case("softmax 64x1000 (one block, 2 rows a program)", _softmax, 64, 1000, None)
        case("softmax 16x8192 (one block)", _softmax, 16, 8192, None)
        case("softmax 16x32768 (online)", _softmax, 16, 32768, None)
        case("softmax 4x65536 online=False (the widest one block)", _softmax, 4, 65536, False)
        case("rms_norm 64x1024", _rms_norm, 64, 1024)
        case("rms_norm 16x8192", _rms_norm, 16, 8192)
        case("swiglu n=2^20", _swiglu, 1 << 20)
        case("cross_entropy 64x1000", _cross_entropy, 64, 1000)
        case("cross_entropy 16x32000 (chunked)", _cross_entropy, 16, 32000)
        case("matmul 512^3 (every autotune config)", _matmul, 512)
        if dtype == torch.float32:
            case("matmul 512^3 tf32", _matmul, 512, tf32=True)
        case("matmul_persistent 512^3 pointers", _matmul_persistent, 512, tma=False)
        if runtime.TARGETS[arch].capability >= 90:
            case("matmul_persistent 512^3 TMA", _matmul_persistent, 512, tma=True)
        for d, dv in ((64, 64), (128, 128), (192, 128)):
            for deterministic in (False, True):
                backward = "two-kernel" if deterministic else "single-pass"
                case(f"flash_attention D={d} Dv={dv} causal, {backward} backward", _flash, 256, d, dv, True,
                     deterministic)
        case("flash_attention D=128 not causal", _flash, 256, 128, 128, False, False)
        case("paged_attention_decode block 16, D=128", _paged, 16, 128)
    return out


# --- recording what the compiler produced -------------------------------------------------------------------------

_current: tuple[str, str] = ("", "")  # (case, dtype) being run
_rows: list[Row] = []


def _config(src, options: dict) -> str:
    """The kernel's constexprs by name, then num_warps and num_stages."""
    fn = src.fn
    names = {i for i in fn.constexprs}
    parts = []
    for key, value in src.constants.items():
        index = key[0] if isinstance(key, tuple) else fn.arg_names.index(key)
        if index in names:
            parts.append(f"{fn.arg_names[index]}={value}")
    parts += [f"warps={options.get('num_warps')}", f"stages={options.get('num_stages')}"]
    return " ".join(parts)


def _cuobjdump() -> Path | None:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return tool if tool.exists() else None


def resource_usage(cubin: bytes) -> tuple[int, int] | None:
    """(registers per thread, stack bytes per thread) of a cubin, by the cuobjdump bundled with Triton (None
    when it is absent)."""
    tool = _cuobjdump()
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+)", text)
    return (int(match[1]), int(match[2])) if match else None


def _recording_compile(compile_fn: Callable, gpu: runtime.Target) -> Callable:
    """triton.compile, recording a row for every kernel it builds or fails to build."""

    @functools.wraps(compile_fn)
    def compile_and_record(src, target=None, options=None, **kwargs):
        case, dtype = _current
        row = Row(case, getattr(src, "name", "?"), _config(src, options or {}), dtype)
        _rows.append(row)
        try:
            kernel = compile_fn(src, target=target, options=options, **kwargs)
        except Exception as error:
            row.status = f"FAILED: {_first_line(error)}"
            raise
        row.shared_bytes = kernel.metadata.shared
        usage = resource_usage(kernel.asm["cubin"]) if "cubin" in kernel.asm else None
        if usage:
            row.registers, row.stack_bytes = usage
            if row.stack_bytes:
                row.warning = f"local memory: {row.stack_bytes} stack bytes a thread"
        if row.shared_bytes > gpu.max_shared:
            row.status = f"FAILED: shared memory {row.shared_bytes} bytes > {gpu.max_shared} on {gpu.gpu}"
        return kernel

    return compile_and_record


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    # a CompilationError starts with the source location; its message is the last line
    text = lines[-1] if type(error).__name__ == "CompilationError" and lines else (lines[0] if lines else "")
    return f"{type(error).__name__}: {text}"[:200]


@contextlib.contextmanager
def _recording(target: runtime.Target) -> Iterator[None]:
    original = triton.compiler.compile
    triton.compiler.compile = _recording_compile(original, target)
    runtime.compiling = True
    try:
        yield
    finally:
        triton.compiler.compile = original
        runtime.compiling = False


def compile_cases(selected: list[Case]) -> list[Row]:
    """Run each case's launches in this compile-only process and return one row per kernel configuration
    compiled (or failed), plus one row for a case whose launcher itself failed."""
    global _current
    if runtime.MODE != "compile-only":
        raise RuntimeError(f"compile_cases needs a compile-only process: set {runtime.COMPILE_FOR}=sm_90a before "
                           "lab.kernels is imported (python -m lab.kernels.cross_compile does)")
    target = runtime.TARGETS[os.environ[runtime.COMPILE_FOR]]
    _rows.clear()
    with _recording(target):
        for case in selected:
            _current = (case.name, case.dtype)
            before = len(_rows)
            try:
                case.run()
            except Exception as error:
                if not any(r.status.startswith("FAILED") for r in _rows[before:]):
                    _rows.append(Row(case.name, "-", "-", case.dtype, status=f"FAILED: {_first_line(error)}"))
    return list(_rows)


# --- output --------------------------------------------------------------------------------------------------------

def table(rows: list[Row]) -> str:
    """The rows as aligned text: kernel, config, dtype, registers, stack bytes, shared bytes, status, warning."""
    header = ("kernel", "config", "dtype", "regs", "stack B", "shared B", "status", "case")
    lines = [header] + [(r.kernel, r.config, r.dtype, _cell(r.registers), _cell(r.stack_bytes),
                         _cell(r.shared_bytes), r.status + (f" ({r.warning})" if r.warning else ""), r.case)
                        for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=False)) + "  " + line[-1]
                     for line in lines)


def _cell(value: int | None) -> str:
    return "?" if value is None else str(value)


def main(argv: list[str] | None = None, extra: list[Case] | None = None) -> int:
    """The CLI. Re-executes itself in a compile-only process when this one is not (lab.kernels decides its
    mode once, at import). Exit status 1 when any kernel failed to compile."""
    parser = argparse.ArgumentParser(prog="python -m lab.kernels.cross_compile", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default=os.environ.get(runtime.COMPILE_FOR) or "sm_90a", choices=runtime.TARGETS)
    parser.add_argument("--only", default="", help="only the cases whose name contains this text")
    parser.add_argument("--dtype", choices=DTYPES, help="only this dtype's cases (default: fp16, bf16, fp32)")
    parser.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    if runtime.MODE != "compile-only" or os.environ.get(runtime.COMPILE_FOR) != args.arch:
        if extra:
            raise RuntimeError(f"extra cases need a process started with {runtime.COMPILE_FOR}={args.arch}")
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {runtime.COMPILE_FOR: args.arch}
        argv = sys.argv[1:] if argv is None else argv
        return subprocess.run([sys.executable, "-m", "lab.kernels.cross_compile", *argv], env=env).returncode
    selected = [c for c in cases(args.arch) + (extra or [])
                if args.only in c.name and args.dtype in (None, c.dtype)]
    if not selected:
        parser.error(f"--only {args.only!r} --dtype {args.dtype} match no case")
    rows = compile_cases(selected)
    print(table(rows))
    failed = [r for r in rows if r.status.startswith("FAILED")]
    spilled = [r for r in rows if r.warning]
    print(f"{len(rows)} kernel configurations compiled for {args.arch} ({runtime.TARGETS[args.arch].gpu}): "
          f"{len(failed)} failed, {len(spilled)} use local memory (spills)")
    if args.json:
        args.json.write_text(json.dumps({"arch": args.arch, "triton": triton.__version__,
                                         "rows": [asdict(r) for r in rows]}, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    sys.exit(main())
