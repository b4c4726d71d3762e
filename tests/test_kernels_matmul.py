"""The tiled and the persistent matmul against torch by the error-ratio rule, on shapes that are not multiples
of their tiles; the autotuner's configurations; the GPU launch path traced in the interpreter.

The kernels run in Triton's interpreter here (64×64 tiles, K steps of 32, groups of 4 tile rows, 3 persistent
programs), fp32 with input_precision="ieee" and fp16 with an fp32 accumulator; torch's own matmul in the same
dtype is the baseline and a float64 product the reference.
"""

from __future__ import annotations

import pytest
import torch

from lab.kernels import DEVICE  # before triton: lab.kernels decides the interpreter before triton is imported

pytest.importorskip("triton")

import lab.kernels.matmul as mm  # noqa: E402
from lab.kernels.accuracy import assert_error_ratio, dot_product_ratio  # noqa: E402
from lab.kernels.matmul import grouped_order, matmul, matmul_persistent, matmul_reference  # noqa: E402

INTERPRETED = mm.interpreted()

#        M    K    N
ZOO = [(1, 1, 1),       # one element
       (1, 37, 5),      # one row, K below one step
       (64, 64, 64),    # exact tiles
       (150, 100, 70),  # 3 tile rows (a short last group of GROUP_M=4), 2 tile columns, K tail of 4
       (5, 129, 130)]   # K one past a multiple of the step, N two past a tile
DTYPES = [torch.float32, torch.float16]
DTYPE_IDS = {"ids": lambda d: str(d).removeprefix("torch.")}


def _inputs(M: int, K: int, N: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(M * 7 + K * 3 + N)
    return (torch.randn(M, K, generator=gen).to(dtype=dtype, device=DEVICE),
            torch.randn(K, N, generator=gen).to(dtype=dtype, device=DEVICE))


def _check(name: str, got: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    assert got.dtype == a.dtype
    assert_error_ratio(name, got, a @ b, matmul_reference(a, b), dot_product_ratio(a.dtype))


@pytest.mark.parametrize("dtype", DTYPES, **DTYPE_IDS)
@pytest.mark.parametrize("shape", ZOO, ids=lambda s: "M{}K{}N{}".format(*s))
def test_matmul_matches_torch(shape, dtype):
    a, b = _inputs(*shape, dtype)
    _check("matmul", matmul(a, b), a, b)


# Persistent shapes, all TMA-able in fp16 and fp32 (K and N multiples of 8: rows of 16-byte multiples).
#               M    K    N    tiles
PERSISTENT = [(250, 104, 120, 8),  # 4 × 2 tiles over 3 programs (3, 3, 2 each), K tail of 8, M and N tails
              (5, 40, 24, 1)]      # one tile smaller than a block: 1 program, 2 idle


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("dtype", DTYPES, **DTYPE_IDS)
@pytest.mark.parametrize("shape", PERSISTENT, ids=lambda s: "M{}K{}N{}".format(*s))
def test_persistent_matches_torch_and_computes_each_tile_once(shape, dtype, tma):
    """Each tile counted once by the program that computes it (tile_visits: interpreter only, where the counts
    are of this launch alone; on a GPU the autotuner's trial runs would add theirs)."""
    *mkn, tiles = shape
    a, b = _inputs(*mkn, dtype)
    visits = torch.zeros(tiles, dtype=torch.int32) if INTERPRETED else None
    _check(f"matmul_persistent tma={tma}", matmul_persistent(a, b, tma=tma, tile_visits=visits), a, b)
    if INTERPRETED:
        assert visits.tolist() == [1] * tiles, "each C tile must be computed by exactly one program, once"


def test_persistent_pointer_path_takes_strides():
    """Transposed views (no TMA: their last stride is not 1) go through the pointer path's strides; K of 37."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(37, 150, generator=gen).to(DEVICE).t()  # (150, 37), column-major
    b = torch.randn(70, 37, generator=gen).to(DEVICE).t()   # (37, 70)
    _check("matmul_persistent strided", matmul_persistent(a, b), a, b)


@pytest.mark.skipif(not INTERPRETED, reason="on a GPU the other tests run this path for real")
@pytest.mark.parametrize("dtype", DTYPES, **DTYPE_IDS)
def test_gpu_launch_path_in_interpreter(monkeypatch, dtype):
    """The GPU branch of both launchers, run through the interpreter by pretending to compile: the autotuner is
    replaced by one trial launch per config that `prune_configs` keeps (grid from the config, as the autotuner
    does), each checked; the persistent kernel's TMA path is picked by tma=None on a "Hopper" of 3 SMs in 16 bits,
    its pointer path in fp32."""
    trials = []

    class EveryConfig:
        def __init__(self, persistent):
            self.kernel = mm._matmul_persistent_kernel if persistent else mm._matmul_kernel
            self.configs = mm.PERSISTENT_CONFIGS if persistent else mm.CONFIGS

        def __getitem__(self, grid):
            def launch(*args, **meta):
                for cfg in mm.prune_configs(self.configs, dict(zip(self.kernel.arg_names, args, strict=False))):
                    self.kernel[grid(cfg.kwargs)](*args, **meta, **cfg.kwargs)
                    trials.append((cfg.kwargs, meta.get("TMA"), args[2].clone()))
            return launch

    monkeypatch.setattr(mm, "interpreted", lambda: False)
    monkeypatch.setattr(mm, "_autotuned", EveryConfig)
    monkeypatch.setattr(mm, "_sm_count", lambda device: 3)
    monkeypatch.setattr(mm, "_tma_hardware", lambda device: True)
    allocators = []
    monkeypatch.setattr(mm.triton, "set_allocator", allocators.append)
    a, b = _inputs(140, 72, 136, dtype)  # 2 × 2 tiles of 128×128 on 3 programs, K tails of 8 (TMA-able rows)
    matmul(a, b)
    matmul_persistent(a, b)
    size = a.element_size()
    sixteen_bit = size == 2  # fp32 stays on pointers under tma=None (its TMA tiles spill, compiled for sm_90a)
    assert allocators == ([mm._scratch] if sixteen_bit else []), "descriptors need triton.set_allocator on a GPU"
    expected = [c.kwargs for c in mm.CONFIGS + mm.PERSISTENT_CONFIGS if c.kwargs["BLOCK_K"] * size == 128]
    assert [kw for kw, _, _ in trials] == expected
    assert {tma for _, tma, _ in trials} == {None, sixteen_bit}  # matmul has no TMA; the persistent one took it
    for kw, tma, got in trials:
        _check(f"GPU config {kw} tma={tma}", got, a, b)


def test_configs_are_valid_and_used():
    """Every autotune config: tile dims powers of two >= 16 (tl.dot's minimum), and kept by the prune for
    16-bit or fp32 inputs within the H100's shared memory (none is dead weight); every dtype keeps some."""
    for cfg in mm.CONFIGS + mm.PERSISTENT_CONFIGS:
        dims = [cfg.kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")]
        assert all(d >= 16 and d & (d - 1) == 0 for d in dims), f"tile {dims} of {cfg}"
        size = 128 // cfg.kwargs["BLOCK_K"]
        assert size in (2, 4) and mm.smem_bytes(cfg, size) <= mm.SMEM_LIMIT < 228 * 1024, f"{cfg} never runs"
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for configs in (mm.CONFIGS, mm.PERSISTENT_CONFIGS):
            assert mm.prune_configs(configs, {"A": torch.empty(0, dtype=dtype)}), f"nothing left for {dtype}"
    too_big = mm._config(256, 256, 64, 4, 8)  # 4 stages of 64 KiB of A and B tiles, and a 128 KiB C tile
    assert mm.prune_configs([too_big], {"A": torch.empty(0, dtype=torch.float16)}) == []


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter's launch rule")
def test_interpreter_launches_the_pinned_config(monkeypatch):
    """No autotune in the interpreter (it would need a GPU to time configs): both launchers run `INTERPRETED`."""
    monkeypatch.setattr(mm, "_autotuned", lambda persistent: pytest.fail("autotune built in the interpreter"))
    a, b = _inputs(70, 40, 24, torch.float32)  # 2 tiles of the pinned 64 × 64
    _check("matmul", matmul(a, b), a, b)
    visits = torch.zeros(2, dtype=torch.int32)
    _check("matmul_persistent", matmul_persistent(a, b, tile_visits=visits), a, b)
    assert visits.tolist() == [1, 1]


def test_matmul_empty_k_gives_zeros():
    for fn in (matmul, matmul_persistent):
        assert torch.equal(fn(torch.ones(3, 0, device=DEVICE), torch.ones(0, 4, device=DEVICE)),
                           torch.zeros(3, 4, device=DEVICE))


@pytest.mark.parametrize("num_pid_m, num_pid_n, group_m", [(3, 2, 4), (8, 5, 4), (7, 3, 2), (1, 9, 8)])
def test_grouped_order_visits_every_tile_once(num_pid_m, num_pid_n, group_m):
    order = grouped_order(num_pid_m, num_pid_n, group_m)
    assert sorted(order) == [(m, n) for m in range(num_pid_m) for n in range(num_pid_n)]
    # the first group_m programs walk down one tile column (that is what keeps B's column in L2)
    assert order[:min(group_m, num_pid_m)] == [(m, 0) for m in range(min(group_m, num_pid_m))]


@pytest.mark.parametrize("fn", [matmul, matmul_persistent])
@pytest.mark.parametrize("a_shape, b_shape, dtype, match", [
    ((4, 5), (6, 3), torch.float32, r"inner dims differ: a is \(4, 5\), b is \(6, 3\)"),
    ((2, 4, 5), (5, 3), torch.float32, "takes 2-D"),
    ((4, 5), (5, 3), torch.float64, "a dtype float64 is not supported"),
])
def test_matmul_rejects_bad_input(fn, a_shape, b_shape, dtype, match):
    with pytest.raises(ValueError, match=match):
        fn(torch.zeros(a_shape, dtype=dtype, device=DEVICE), torch.zeros(b_shape, dtype=dtype, device=DEVICE))


@pytest.mark.parametrize("a, b, match", [
    (torch.zeros(8, 16).t(), torch.zeros(8, 8), r"a has strides \(1, 16\) in float32"),           # transposed
    (torch.zeros(8, 37, dtype=torch.float16), torch.zeros(37, 8, dtype=torch.float16),
     r"a has strides \(37, 1\) in float16"),                                                           # 74-byte rows
    (torch.zeros(8, 8), torch.zeros(8, 3), r"b has strides \(3, 1\)"),                                # 12-byte rows
])
def test_tma_refuses_a_layout_it_cannot_take(a, b, match):
    with pytest.raises(ValueError, match="tma=True cannot take this layout: " + match):
        matmul_persistent(a.to(DEVICE), b.to(DEVICE), tma=True)


def test_tile_visits_is_checked():
    match = r"tile_visits must be int32 of shape \(4,\)" if INTERPRETED else "tile_visits is for the interpreter"
    with pytest.raises(ValueError, match=match):
        matmul_persistent(torch.zeros(100, 8, device=DEVICE), torch.zeros(8, 100, device=DEVICE),
                          tile_visits=torch.zeros(3, dtype=torch.int32, device=DEVICE))
