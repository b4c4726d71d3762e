"""lab.measure.launch: the launch floor measured on this CPU, and the roofline with a floor.

The timings run on shared, loaded cores, so the measured tests assert only orderings by a wide factor that load
cannot reverse (each timing is the best of several: load only adds time). The model's arithmetic is checked
exactly on given numbers, and the trace reader on a trace written here and on the recorded H100 trace.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from lab.calc import roofline
from lab.config import PRESETS
from lab.measure import launch

H100_TRACE = Path(__file__).parents[1] / "benchmarks/results/2026-11-26-h100-80gb-hbm3-trace.json.gz"
# launch 5 µs, 1 TB/s, 100 TFLOP/s: round numbers whose three terms are easy to tell apart
MACHINE = launch.Machine("test", launch_s=5e-6, bandwidth=1e12, peak_flops=1e14)


def test_a_chain_of_tiny_ops_costs_far_more_than_one_op_over_the_same_bytes():
    chain, one = launch.chain_vs_one(numel=64, n_ops=200)
    assert chain > 10 * one  # measured ~120x: 200 launches against one


def test_time_per_op_stops_falling_at_a_floor_as_the_tensor_shrinks():
    sweep = launch.launch_sweep(sizes=(1, 64, 524288), n_ops=20)
    assert [nbytes for nbytes, _ in sweep] == [8, 512, 8 * 524288]
    (_, one), (_, sixty_four), (_, big) = sweep
    assert big > 5 * max(one, sixty_four)  # 4 MiB per op moves; 8 bytes and 512 bytes both sit on the floor
    assert sixty_four < 4 * one  # 64x the bytes, not 64x the time: the floor, not bandwidth, sets both
    assert launch.launch_floor(sweep) == min(one, sixty_four)


def test_python_adds_to_each_op_what_a_dispatch_from_cpp_does_not_pay():
    from_python, from_cpp = launch.python_share(numel=16, n_ops=400, repeats=9)
    assert from_python > from_cpp > 0


@pytest.mark.parametrize(("nbytes", "flops", "expected"), [
    (1e6, 1e6, (5e-6, "launch")),  # 1 µs of memory, 0.01 µs of compute: under the floor
    (1e8, 1e9, (1e-4, "memory")),  # 100 µs of memory against 10 µs of compute, above the 5 µs floor
    (1e8, 1e11, (1e-3, "compute")),  # 1 ms of compute
])
def test_op_time_is_the_largest_of_floor_memory_and_compute(nbytes, flops, expected):
    seconds, bound = launch.op_time(nbytes, flops, MACHINE)
    assert (seconds, bound) == (pytest.approx(expected[0], rel=1e-12), expected[1])


def test_fusing_a_chain_saves_its_launches_when_small_and_its_round_trips_when_large():
    small = [(1e6, 1e6)] * 3  # three launch-bound ops: 15 µs eager, one 5 µs launch fused
    assert launch.fusion_saving(small, (2e6, 3e6), MACHINE) == pytest.approx(1e-5, rel=1e-12)
    large = [(1e8, 1e8)] * 3  # three memory-bound ops of 100 µs; fused, x in and y out only: 200 MB, 200 µs
    assert launch.fusion_saving(large, (2e8, 3e8), MACHINE) == pytest.approx(1e-4, rel=1e-12)


def test_a_tiny_llama_block_is_launch_bound_at_16_tokens_and_not_at_16k():
    cfg = PRESETS["tiny"]
    short = launch.block_bounds(roofline.llama_block_ops(cfg, batch=1, seq=16, dtype="fp32"), MACHINE)
    assert {bound for _, _, bound in short} == {"launch"}
    long = launch.block_bounds(roofline.llama_block_ops(cfg, batch=16, seq=1024, dtype="fp32"), MACHINE)
    assert "launch" not in {bound for _, _, bound in long}  # 16k tokens: the smallest op moves 8 MB, 8 µs


@pytest.mark.parametrize("field", ["launch_s", "bandwidth", "peak_flops"])
def test_a_machine_with_a_non_positive_number_is_refused_naming_it(field):
    with pytest.raises(ValueError, match=f"Machine {field}=0 must be > 0"):
        launch.Machine("bad", **{"launch_s": 1e-6, "bandwidth": 1e9, "peak_flops": 1e12, field: 0})


def test_a_trace_is_read_as_kernel_times_and_the_gaps_between_them(tmp_path):
    events = [{"cat": "kernel", "name": "a", "ts": 100.0, "dur": 10.0},
              {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 90.0, "dur": 4.0},
              {"cat": "kernel", "name": "c", "ts": 145.0, "dur": 5.0},  # out of order in the file
              {"cat": "kernel", "name": "b", "ts": 130.0, "dur": 10.0},
              {"cat": "cuda_driver", "name": "cuLaunchKernelEx", "ts": 95.0, "dur": 6.0},
              {"cat": "cpu_op", "name": "aten::add", "ts": 80.0, "dur": 50.0}]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    trace = launch.read_kernel_trace(path)
    assert (trace.kernels, trace.launches) == (3, 2)
    assert (trace.busy_s, trace.span_s, trace.median_gap_s) == pytest.approx((25e-6, 50e-6, 12.5e-6))
    assert (trace.median_kernel_s, trace.median_launch_s, trace.idle) == pytest.approx((10e-6, 5e-6, 0.5))


def test_the_recorded_h100_step_left_the_gpu_idle_between_short_kernels():
    trace = launch.read_kernel_trace(H100_TRACE)
    assert trace.kernels == 2404 and trace.launches == trace.kernels
    assert trace.median_kernel_s < 20e-6 and trace.idle > 0.5  # a tiny model: the host could not keep up


def test_a_profiled_step_names_its_ops_and_the_time_between_them():
    import torch

    x = torch.ones(8)
    profile = launch.profile_step(lambda: [x.mul(2.0) for _ in range(30)])
    assert ("aten::mul", 30) in [(name, calls) for name, calls, _ in profile.top]
    assert 0 < profile.in_ops_s < profile.wall_s and profile.between_ops_s > 0 and profile.unprofiled_s > 0


@pytest.mark.parametrize(("name", "category"), [
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "matmul"),  # cuBLAS on Hopper (the recorded trace)
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "matmul"),
    ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128", "matmul"),  # an FP8 _scaled_mm
    ("triton_tem_fused_mm_4", "matmul"), ("_matmul_kernel", "matmul"), ("aten::mm", "matmul"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "attention"),
    ("void cudnn::fusion::convert_dq_to_16bits<true>(void const*)", "attention"),  # SDPA's, though it converts
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"), ("_bwd_dkdv_kernel", "attention"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>", "copy+cast"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda>", "copy+cast"),
    ("void at::native::CatArrayBatchedCopy<at::native::OpaqueType<4u>, unsigned int, 3, 64, 64>", "copy+cast"),
    ("triton_poi_fused__to_copy_3", "copy+cast"), ("triton_poi_fused__to_copy_clone_7", "copy+cast"),
    ("triton_poi_fused__to_copy_add_mul_silu_12", "elementwise"),  # a cast fused into real work
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "elementwise"),
    ("void at::native::multi_tensor_apply_kernel<at::native::TensorListMetadata<4>>", "elementwise"),
    ("_swiglu_forward", "elementwise"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_5", "other"),  # a fused RMSNorm: a reduction
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>", "other"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "communication"),
])
def test_each_kernel_name_falls_in_its_category(name, category):
    from lab.measure.kernel_time import kernel_category

    assert kernel_category(name) == category


def test_the_recorded_h100_step_by_category_half_elementwise_and_copies():
    """The recorded trace's kernel time by category: the same kernels read_kernel_trace counts, sorted by what they
    do. Its bf16 training step spends 41% of kernel time in elementwise kernels and 11% in copies and casts,
    against 31% in matmuls (a 1024-wide model: launch-bound, the tensor cores mostly wait)."""
    from lab.measure.kernel_time import CATEGORIES, shares, trace_time_by_category

    totals = trace_time_by_category(H100_TRACE)
    assert list(totals) == list(CATEGORIES)
    assert sum(totals.values()) == pytest.approx(launch.read_kernel_trace(H100_TRACE).busy_s, rel=1e-9)
    share = shares(totals)
    assert (share["matmul"], share["attention"], share["elementwise"], share["copy+cast"], share["other"]) == \
        pytest.approx((0.310, 0.069, 0.415, 0.112, 0.094), abs=0.001)
    assert share["communication"] == 0
    with pytest.raises(ValueError, match="kernel time 0.0: expected > 0"):
        shares(dict.fromkeys(CATEGORIES, 0.0))
