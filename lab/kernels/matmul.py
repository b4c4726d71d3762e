"""Tiled matmul C = A B with a K loop, an fp32 accumulator and grouped ("super-grouped") program order; its
autotuned configurations; and a persistent variant that loads its tiles by pointers or by TMA descriptors.

Why tiles. Each program computes one BLOCK_M × BLOCK_N tile of C. It walks K in steps of BLOCK_K, loading a
BLOCK_M × BLOCK_K tile of A and a BLOCK_K × BLOCK_N tile of B into SRAM and multiplying them on the tensor cores
(`tl.dot`), so every element loaded is reused BLOCK_N (for A) or BLOCK_M (for B) times. Bytes moved from memory
fall from 2·M·N·K elements (one A and one B element per multiply-add) to about M·N·K·(1/BLOCK_N + 1/BLOCK_M),
and the arithmetic intensity grows with the tile: with 128×128 tiles in fp16, each unit of K costs 2·128·128
FLOPs for 2·(128+128) bytes loaded, 64 FLOP/byte (the roofline ridge of an H100 is ~300 FLOP/byte: L2 reuse
across programs, which the grouped order below improves, supplies the rest).

Why grouped order. Programs run roughly in the order of their id. Numbered row by row, consecutive programs
share one row of A tiles but each needs a different column of B tiles: N/BLOCK_N columns of B pass through L2
for every row of C. Numbered in groups of GROUP_M tile rows (down a group's column first, then the next column),
a wave of programs touches GROUP_M rows of A and a few columns of B, and both stay in L2 while they are reused.
The result is the same; only the L2 hit rate (and so HBM traffic) changes.

Why autotune. The best tile depends on the shape and the dtype: 128×256 tiles reuse each loaded byte most, but a
2048² C has only 128 of them for 132 SMs, and a skinny matrix wastes most of a big tile on masked rows. On a GPU
`matmul` is `triton.autotune`d over `CONFIGS` (Triton's python/tutorials/03-matrix-multiplication.py lists
similar ones), timing each on the first call of every (M, N, K, dtype) and keeping the fastest. `prune_configs`
drops, before any compilation, the configs whose pipeline would not fit in shared memory (`smem_bytes`) and those
whose K step is not one 128-byte row of the dtype (BLOCK_K 64 for 16-bit inputs, 32 for fp32): 128 bytes is the
widest shared-memory swizzle (the layout that keeps tensor-core reads free of bank conflicts): narrower K rows get a
narrower swizzle, wider ones double the bytes of every pipeline stage and so cost stages.
The interpreter cannot autotune (it has no GPU to time): it runs one pinned configuration of few, large tiles.

Why persistent (`matmul_persistent`, Triton's python/tutorials/09-persistent-matmul.py). The tiled kernel
launches one program per tile; a 4096³ fp16 matmul with 128×256 tiles is 512 programs in about 4 waves over 132
SMs, and every program pays its prologue (index math, the first pipeline stages' loads) before its first
`tl.dot`. A persistent kernel launches one program per SM, and each loops over tiles `start, start + NUM_SMS,
...` in the same grouped order: no per-tile launch or prologue, the compiler can overlap one tile's epilogue
(convert and store C) with the next tile's first loads (`tl.range(..., flatten=True)` lets it pipeline across
the tile loop), and because the programs resident at any moment are consecutive tiles, the grouped order's L2
reuse holds for the whole run instead of being reshuffled wave by wave. It wins most where tiles are few per SM
or K is short (the prologue is then a large share of a tile); on long K the two are close.

Why TMA (Hopper, capability >= 9). A pointer load makes every thread compute BLOCK×BLOCK addresses and masks in
registers and issue its own loads. A tensor descriptor (`tl.make_tensor_descriptor`: base, shape, strides, block
shape) hands a whole tile to the Tensor Memory Accelerator, a copy engine that generates the addresses, clips at
the tensor's shape (loads past the edge read zeros, stores past it are dropped: the descriptor's shape *is* the
mask) and writes shared memory asynchronously. That frees the registers and the warps' issue slots for the
`tl.dot`s, and bigger tiles or more stages fit. TMA needs a unit last stride and 16-byte-aligned rows and base.
Device-side descriptors are written to a global scratch buffer by the kernel, which `triton.set_allocator`
provides on a GPU; the interpreter emulates descriptors on CPU tensors and needs none.

The accumulator is fp32 whatever the input dtype, as torch's own matmul does. Comparisons against CPU use
`input_precision="ieee"` (true fp32 products); on a GPU, fp32 inputs use TF32 only when torch itself would
(`torch.backends.cuda.matmul.allow_tf32`). Tails: M, N and K need not be multiples of the blocks — every pointer
load and store is masked, and masked-off A/B elements load as 0 so they add nothing to the dot product.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# Importing this module runs lab/kernels/__init__.py first, which imports lab.kernels.runtime: the interpreter is
# chosen before the @triton.jit below is decorated.
from lab.kernels.runtime import TARGETS, check_input, interpreted

INTERPRETED = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=4)
"""The interpreter's one configuration: its cost is per program and per block op, so few, large tiles."""

INTERPRETED_PROGRAMS = 3
"""Programs of a persistent launch in the interpreter (a GPU launches one per SM): few enough that each loops
over several tiles, so a slip in the tile loop shows on a small matrix."""

SMEM_LIMIT = TARGETS["sm_90a"].max_shared
"""Shared memory one program may use on an H100/H200 (228 KiB per SM, of which 1 KiB is reserved)."""


def _config(block_m: int, block_n: int, block_k: int, num_stages: int, num_warps: int) -> triton.Config:
    return triton.Config(dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8),
                         num_stages=num_stages, num_warps=num_warps)


CONFIGS = [
    # 16-bit inputs: K steps of 64 (128 bytes). Big tiles first: most reuse per byte, 3 stages to fit.
    _config(128, 256, 64, 3, 8), _config(256, 128, 64, 3, 8), _config(128, 128, 64, 4, 8),
    # narrower tiles for skinny or small C (more programs to fill 132 SMs), one more stage to hide latency
    _config(128, 64, 64, 4, 4), _config(64, 128, 64, 4, 4), _config(64, 64, 64, 5, 4),
    # fp32 inputs: K steps of 32 (128 bytes again); twice the bytes per element, so no 256-wide tiles
    _config(128, 128, 32, 3, 8), _config(128, 64, 32, 4, 4), _config(64, 128, 32, 4, 4), _config(64, 64, 32, 4, 4),
]
"""What `matmul` tries on a GPU; `prune_configs` keeps those that suit the dtype."""

PERSISTENT_CONFIGS = [
    _config(128, 256, 64, 3, 8), _config(128, 128, 64, 4, 8),  # 16-bit
    _config(128, 128, 32, 3, 8), _config(128, 64, 32, 4, 4),   # fp32
]
"""What `matmul_persistent` tries on a GPU: big tiles only, since it pays no per-tile launch to amortise."""


def smem_bytes(config: triton.Config, element_size: int) -> int:
    """Shared memory a config needs, estimated: num_stages buffers of an A tile and a B tile (the software
    pipeline keeps that many K steps in flight) plus one C tile for the epilogue's layout change or TMA store."""
    m, n, k = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"]
    return (config.num_stages * (m * k + k * n) + m * n) * element_size


def prune_configs(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """The autotuner's early prune: configs whose K row is 128 bytes of this dtype and whose pipeline fits in
    shared memory. Dropping them here costs nothing; letting them fail costs a compilation each."""
    size = named_args["A"].element_size()
    return [c for c in configs if c.kwargs["BLOCK_K"] * size == 128 and smem_bytes(c, size) <= SMEM_LIMIT]


@triton.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped order: tile ids run down GROUP_M tile rows before moving to the next tile column
    (`grouped_order` is the same mapping in Python)."""
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (tile // num_pid_in_group) * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)  # the last group may be shorter
    pid_m = first_pid_m + (tile % num_pid_in_group) % group_size_m
    pid_n = (tile % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _tile_product(A, B, rows, cols, M, N, K, sam, sak, sbk, sbn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """One C tile (rows × cols) by pointer loads, any strides: the K loop with masked tails, fp32 accumulator."""
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    a_ptrs = A + rows[:, None] * sam + offs_k[None, :] * sak  # the first k step's tiles; moved by BLOCK_K below
    b_ptrs = B + offs_k[:, None] * sbk + cols[None, :] * sbn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = k + offs_k < K
        a = tl.load(a_ptrs + k * sak, mask=(rows[:, None] < M) & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs + k * sbk, mask=k_ok[:, None] & (cols[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _matmul_kernel(A, B, C, M, N, K, sam, sak, sbk, sbn, scm, scn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   PRECISION: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # int64 offsets: no int32 overflow on large matrices
    pid_m, pid_n = _tile_coords(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    acc = _tile_product(A, B, rows, cols, M, N, K, sam, sak, sbk, sbn, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    tl.store(C + rows[:, None] * scm + cols[None, :] * scn, acc.to(C.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _matmul_persistent_kernel(A, B, C, VISITS, M, N, K, sam, sak, sbk, sbn, scm, scn,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              GROUP_M: tl.constexpr, PRECISION: tl.constexpr, NUM_SMS: tl.constexpr,
                              TMA: tl.constexpr, COUNT_VISITS: tl.constexpr):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    if TMA:  # one descriptor per operand for the whole run; its shape is what clips the tails
        a_desc = tl.make_tensor_descriptor(A, shape=[M, K], strides=[sam, 1], block_shape=[BLOCK_M, BLOCK_K])
        b_desc = tl.make_tensor_descriptor(B, shape=[K, N], strides=[sbk, 1], block_shape=[BLOCK_K, BLOCK_N])
        c_desc = tl.make_tensor_descriptor(C, shape=[M, N], strides=[scm, 1], block_shape=[BLOCK_M, BLOCK_N])
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        if COUNT_VISITS:
            tl.atomic_add(VISITS + tile, 1)
        if TMA:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k in range(0, K, BLOCK_K):
                a = a_desc.load([pid_m * BLOCK_M, k])
                b = b_desc.load([k, pid_n * BLOCK_N])
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(C.dtype.element_ty))
        else:
            rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = _tile_product(A, B, rows, cols, M, N, K, sam, sak, sbk, sbn, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
            tl.store(C + rows[:, None] * scm + cols[None, :] * scn, acc.to(C.dtype.element_ty),
                     mask=(rows[:, None] < M) & (cols[None, :] < N))


@functools.cache
def _autotuned(persistent: bool):
    """The autotuned kernel, built on first use on a GPU (the interpreter has no autotune). The key adds
    PRECISION (and TMA) to the shape; Triton's autotuner adds every tensor argument's dtype itself."""
    if persistent:
        return triton.autotune(PERSISTENT_CONFIGS, key=["M", "N", "K", "PRECISION", "TMA"],
                               prune_configs_by={"early_config_prune": prune_configs})(_matmul_persistent_kernel)
    return triton.autotune(CONFIGS, key=["M", "N", "K", "PRECISION"],
                           prune_configs_by={"early_config_prune": prune_configs})(_matmul_kernel)


def _launch(persistent: bool, grid, *args, **meta) -> None:
    """Interpreter: the raw kernel with the pinned `INTERPRETED` config. GPU: the autotuned kernel, whose grid
    depends on the config it tries (so `grid` takes the config's dict)."""
    if interpreted():
        kernel = _matmul_persistent_kernel if persistent else _matmul_kernel
        kernel[grid(INTERPRETED)](*args, **INTERPRETED, **meta)
    else:
        _autotuned(persistent)[grid](*args, **meta)


def _precision(dtype: torch.dtype) -> str:
    tf32 = not interpreted() and dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    return "tf32" if tf32 else "ieee"


def _check_operands(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"{name} takes 2-D a (M, K) and b (K, N), got shapes {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"inner dims differ: a is {tuple(a.shape)}, b is {tuple(b.shape)} (need a.K == b.K)")
    if a.dtype != b.dtype:
        raise ValueError(f"a and b dtypes differ: {a.dtype} and {b.dtype}")
    check_input(a, "a")


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (M, K) @ b (K, N) -> (M, N) in a's dtype, accumulated in fp32. Any strides; any M, N, K (K = 0 gives zeros).
    One program per C tile; on a GPU the tile shape is autotuned over `CONFIGS`."""
    _check_operands("matmul", a, b)
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty(M, N, dtype=a.dtype, device=a.device)
    if M == 0 or N == 0:
        return c

    def grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _launch(False, grid, a, b, c, M, N, K, *a.stride(), *b.stride(), *c.stride(), PRECISION=_precision(a.dtype))
    return c


def _sm_count(device: torch.device) -> int:
    """Programs of a persistent launch: one per SM on a GPU, `INTERPRETED_PROGRAMS` in the interpreter."""
    return INTERPRETED_PROGRAMS if interpreted() else torch.cuda.get_device_properties(device).multi_processor_count


def _tma_hardware(device: torch.device) -> bool:
    """Whether this device has a TMA unit (Hopper, capability 9.0, or newer); the interpreter emulates one."""
    return interpreted() or torch.cuda.get_device_capability(device)[0] >= 9


def tma_layout_problem(*tensors: tuple[str, torch.Tensor]) -> str | None:
    """Why a TMA descriptor cannot take one of these named 2-D tensors (None when all can): its last stride
    must be 1, and its base and its row stride multiples of 16 bytes."""
    for name, t in tensors:
        size = t.element_size()
        if t.stride(1) != 1 or (t.stride(0) * size) % 16 or t.data_ptr() % 16:
            return (f"{name} has strides {tuple(t.stride())} in {str(t.dtype).removeprefix('torch.')} (TMA needs a "
                    f"last stride of 1 and rows and base on 16-byte boundaries)")
    return None


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory where a kernel writes its device-side tensor descriptors (`triton.set_allocator`)."""
    return torch.empty(size, device="cuda", dtype=torch.int8)


def matmul_persistent(a: torch.Tensor, b: torch.Tensor, *, tma: bool | None = None,
                      tile_visits: torch.Tensor | None = None) -> torch.Tensor:
    """a (M, K) @ b (K, N) -> (M, N) like `matmul`, by a persistent kernel: one program per SM (3 in the
    interpreter), each looping over C tiles in grouped order (see the module docstring for why it wins).

    tma: load and store tiles by TMA descriptors (True), by pointers with any strides (False), or TMA where the
    device (Hopper or newer), the dtype (16-bit) and the layout (unit last strides, 16-byte rows) allow it (None).
    fp32 stays on pointers under None: compiled for an H100 by Triton 3.9, its TMA tiles hold 32 registers and ~5.5 KB
    of stack a thread, where the pointer path spills nothing (Triton 3.6 keeps them in 168-174 registers). In the
    interpreter None means pointers, and True runs Triton's emulation of descriptors.
    tile_visits: interpreter only, an int32 tensor of one counter per C tile (cdiv(M, 64) · cdiv(N, 64)) that
    each program increments for every tile it computes; all ones afterwards means each tile was computed exactly
    once. (On a GPU the autotuner's trial runs would count too.)"""
    _check_operands("matmul_persistent", a, b)
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty(M, N, dtype=a.dtype, device=a.device)
    problem = tma_layout_problem(("a", a), ("b", b), ("the output (M, N)", c))
    if tma and not _tma_hardware(a.device):
        raise ValueError(f"tma=True needs a GPU of compute capability 9.0 or newer (Hopper); this one is "
                         f"{'.'.join(map(str, torch.cuda.get_device_capability(a.device)))}")
    if tma and problem:
        raise ValueError(f"tma=True cannot take this layout: {problem}; use tma=False or None")
    if tma is None:  # 16-bit only: fp32's TMA tiles spill ~5.5 KB a thread (python -m lab.kernels.cross_compile)
        use_tma = a.element_size() == 2 and not problem and not interpreted() and _tma_hardware(a.device)
    else:
        use_tma = tma
    if tile_visits is not None:
        tiles = triton.cdiv(M, INTERPRETED["BLOCK_M"]) * triton.cdiv(N, INTERPRETED["BLOCK_N"])
        if not interpreted():
            raise ValueError("tile_visits is for the interpreter: on a GPU the autotuner's trial runs count too")
        if tile_visits.dtype != torch.int32 or tile_visits.shape != (tiles,):
            raise ValueError(f"tile_visits must be int32 of shape ({tiles},) (one per 64×64 tile of C), got "
                             f"{str(tile_visits.dtype).removeprefix('torch.')} {tuple(tile_visits.shape)}")
    if M == 0 or N == 0:
        return c
    if use_tma and not interpreted():
        triton.set_allocator(_scratch)
    num_sms = _sm_count(a.device)

    def grid(meta: dict) -> tuple[int]:
        return (min(num_sms, triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])),)

    _launch(True, grid, a, b, c, tile_visits, M, N, K, *a.stride(), *b.stride(), *c.stride(),
            PRECISION=_precision(a.dtype), NUM_SMS=num_sms, TMA=use_tma, COUNT_VISITS=tile_visits is not None)
    return c


def grouped_order(num_pid_m: int, num_pid_n: int, group_m: int) -> list[tuple[int, int]]:
    """The (tile row, tile column) each program id computes, in id order: the kernel's mapping in plain Python,
    for printing and for checking that it visits every tile once."""
    order = []
    for pid in range(num_pid_m * num_pid_n):
        in_group = group_m * num_pid_n
        first_m = (pid // in_group) * group_m
        size_m = min(num_pid_m - first_m, group_m)
        order.append((first_m + (pid % in_group) % size_m, (pid % in_group) // size_m))
    return order


def matmul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The definition: (a @ b) computed in float64, returned in float64."""
    return a.double() @ b.double()
