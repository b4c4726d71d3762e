"""Chapter 09's checks: the solutions pass with any secret, the released stubs score nothing, and every
plausible-but-wrong kernel (mutant) fails the checks named for it.

Every kernel runs in Triton's interpreter inside the sandbox (which sets `TRITON_INTERPRET=1` wherever triton is
allowed). A mutant is the solution cell with one classic mistake — a tail padded with 0 instead of −inf before a
max, a K loop that stops at the last full slab (the tail never loaded), a running output not rescaled when the max
moves, keys past the end that score 0, reductions over the wrong axis or the padded width, programs that write
their partial sums to one place — planted so that no store leaves its tensor. Every check of the mutant's exercise
runs (`isolated`): only the checks named for it may fail, each with the hint written for that mistake. A store
outside its tensor, which crashes the interpreter, is a test of its own.
"""

from __future__ import annotations

import pytest
from grading_support import Chapter, chapter_tests

from lab.grading.checks import ch09
from lab.grading.sandbox import _environment

EXERCISES = ("09.fused_softmax", "09.matmul_tiles", "09.flash_attention_loop", "09.rmsnorm_backward",
             "09.launch_bound")

SOFTMAX_RAGGED = "widths that are not a power of two (a masked tail), one row among them; fp32 and fp16"
SOFTMAX_LARGE = "logits in the hundreds: no overflow"
SOFTMAX_STRIDED = "a slice of a wider tensor: rows in_stride elements apart"
MATMUL_RAGGED = "M, N and K that are not multiples of the 32-wide tiles, several slabs of K"
MATMUL_SHORT_K = "one row of A (M = 1), K shorter than one slab"
MATMUL_TRANSPOSED = "fp16 inputs and a transposed (non-contiguous) B"
FLASH_BLOCKS = "sequences of several whole key blocks, no mask"
FLASH_SHORT = "one token, and a sequence shorter than one key block"
FLASH_CAUSAL = "causal mask, sequences of several blocks"
RMS_DX = "dx: one row, and rows over several programs; widths not a power of two"
RMS_DW = "dweight: the sum over every row, rows spread over several programs"
EACH_TERM = "a block's ops on random machines: some launch-, some memory-, some compute-bound"
TINY = "the elementwise ops of a tiny model (a few KB each): every one on the launch floor"
FUSION = "fusing a chain into one kernel: launch-bound chains save launches, memory-bound ones bytes"
ROOFLINE_BOUND = 'return times[bound], "memory" if times["memory"] > times["compute"] else "compute"'

MUTANTS = {  # name: (exercise, [(old, new) in the solution cell], checks that must fail)
    "softmax_tail_padded_with_zero": (  # the mutant: the tail enters the max and the sum
        "09.fused_softmax", [('other=float("-inf")', "other=0.0")], {SOFTMAX_RAGGED}),
    "softmax_tail_loaded_without_other": (  # masked lanes read as 0, as with other=0.0
        "09.fused_softmax", [('mask=mask, other=float("-inf")', "mask=mask")], {SOFTMAX_RAGGED}),
    "softmax_load_unmasked": (  # a mask on the store only: the tail reads the next row (the last row: past the end)
        "09.fused_softmax", [('cols, mask=mask, other=float("-inf"))', "cols)")], {SOFTMAX_RAGGED}),
    "softmax_no_max_subtracted": (
        "09.fused_softmax", [("x = x - tl.max(x, axis=0)", "x = x")],
        {SOFTMAX_LARGE}),
    "softmax_rows_assumed_contiguous": (
        "09.fused_softmax", [("in_ptr + row * in_stride", "in_ptr + row * n_cols")], {SOFTMAX_STRIDED}),
    "matmul_k_tail_never_loaded": (  # the mutant, planted safely: the loop stops at the last full slab
        "09.matmul_tiles", [("for k0 in range(0, K, BLOCK_K):", "for k0 in range(0, K - K % BLOCK_K, BLOCK_K):")],
        {MATMUL_RAGGED, MATMUL_SHORT_K}),
    "matmul_accumulator_reset_every_slab": (
        "09.matmul_tiles", [("acc += tl.dot(a, b", "acc = tl.dot(a, b")], {MATMUL_RAGGED}),
    "matmul_b_assumed_contiguous": (
        "09.matmul_tiles", [("ks[:, None] * stride_bk + rn[None, :] * stride_bn", "ks[:, None] * N + rn[None, :]")],
        {MATMUL_TRANSPOSED}),
    "flash_running_output_not_rescaled": (  # the mutant
        "09.flash_attention_loop", [("acc = acc * alpha[:, None] + tl.dot", "acc = acc + tl.dot")],
        {FLASH_BLOCKS, FLASH_CAUSAL}),
    "flash_running_sum_not_rescaled": (
        "09.flash_attention_loop", [("l_i = l_i * alpha + tl.sum", "l_i = l_i + tl.sum")],
        {FLASH_BLOCKS, FLASH_CAUSAL}),  # the causal check's hint names the rescaling too
    "flash_tail_keys_score_zero": (  # unmasked tail: keys past the end keep the score 0 of their zero padding
        "09.flash_attention_loop", [("visible = rn[None, :] < seq_len", "visible = rn[None, :] < start + BLOCK_N")],
        {FLASH_SHORT}),
    "flash_causal_by_lanes": (  # the block's lanes instead of the global positions: right in the first block only
        "09.flash_attention_loop", [("(rn[None, :] <= rm[:, None])",
                                     "(tl.arange(0, BLOCK_N)[None, :] <= tl.arange(0, BLOCK_M)[:, None])")],
        {FLASH_CAUSAL}),
    "flash_no_causal_mask": (
        "09.flash_attention_loop", [("visible = visible & (rn[None, :] <= rm[:, None])", "visible = visible")],
        {FLASH_CAUSAL}),
    "rmsnorm_mean_over_the_rows": (  # the mutant: a wrong reduction axis that still broadcasts
        "09.rmsnorm_backward", [("tl.sum(x_hat * w_dy, axis=1, keep_dims=True)",
                                 "tl.sum(x_hat * w_dy, axis=0, keep_dims=True)")], {RMS_DX}),
    "rmsnorm_mean_over_the_padded_width": (
        "09.rmsnorm_backward", [("keep_dims=True) / n_cols", "keep_dims=True) / BLOCK_COLS")], {RMS_DX}),
    "rmsnorm_dweight_summed_over_features": (  # the mutant: dweight reduced along the wrong axis
        "09.rmsnorm_backward", [("tl.sum(dy * x_hat, axis=0)", "tl.sum(dy * x_hat, axis=1)")],
        {RMS_DX, RMS_DW}),  # the store raises (its shape does not fit), so dx is lost too: both name the line
    "rmsnorm_programs_share_one_partial": (
        "09.rmsnorm_backward", [("dw_partial_ptr + pid * n_cols + cols", "dw_partial_ptr + cols")], {RMS_DW}),
    "launch_floor_forgotten": (  # the roofline of §2 without the floor: a tiny op takes its few nanoseconds of bytes
        "09.launch_bound", [('times = {"launch": launch_s, "memory"', 'times = {"memory"')], {EACH_TERM, TINY, FUSION}),
    "terms_summed_not_maxed": (
        "09.launch_bound", [("return times[bound], bound", "return sum(times.values()), bound")],
        {EACH_TERM, TINY, FUSION}),
    "launch_floor_summed": (  # the floor added to the roofline's time, as if the host waited for each kernel
        "09.launch_bound", [("return times[bound], bound",
                             'return launch_s + max(times["memory"], times["compute"]), bound')],
        {EACH_TERM, TINY, FUSION}),
    "bound_named_by_the_roofline_alone": (  # the right time, but "launch" never named
        "09.launch_bound", [("return times[bound], bound", ROOFLINE_BOUND)], {EACH_TERM, TINY}),
    "fused_kernel_priced_as_one_launch": (  # its bytes forgotten: a memory-bound chain saves far too much
        "09.launch_bound", [("fused_s, _ = op_time(*fused, launch_s, bandwidth, peak_flops)", "fused_s = launch_s")],
        {FUSION}),
    "fusion_saves_only_launches": (
        "09.launch_bound", [("return eager - fused_s", "return (len(chain) - 1) * launch_s")], {FUSION}),
}

CHAPTER = Chapter("09_gpu_kernels.ipynb", EXERCISES, MUTANTS, said=("returned", "raised"), isolated=True)
globals().update(chapter_tests(CHAPTER))


def test_a_kernel_that_writes_outside_its_tensor_is_told_about_masks():
    """Triton's interpreter writes raw memory: a store far outside its tensor kills the process (SIGSEGV; a few lanes
    past the end corrupt the heap, SIGABRT). The checks say so, and the hint is about masks and strides, not the
    wrong-answer hint of each check; the function is not called again (every check fails at once)."""
    from lab.grading.runner import KERNEL_CRASH_HINT

    result = CHAPTER.grade("09.fused_softmax", [("tl.store(out_ptr + row * out_stride + cols",
                                                 "tl.store(out_ptr + row * out_stride * 100_000 + cols")])
    assert result.points == 0 and not result.reason, result
    for check in result.checks:
        assert check.message.startswith("run_softmax() crashed the process (killed by SIG"), check.message
        assert "a lane past the end without a mask" in check.message and check.hint == KERNEL_CRASH_HINT, check


def test_sandboxes_with_triton_run_kernels_in_the_interpreter():
    """Only where triton is allowed: the interpreter, and a kernel's own error raised as itself (a stub inside a
    kernel then reads "not attempted", which the released-stubs test sees)."""
    from pathlib import Path

    env = _environment(Path("/work"), ("numpy", "torch", "triton"))
    assert env["TRITON_INTERPRET"] == "1" and env["TRITON_FRONT_END_DEBUGGING"] == "1"
    assert "TRITON_INTERPRET" not in _environment(Path("/work"), ("tomli_w", "torch"))


@pytest.mark.parametrize("rows, cols", [(1, 17), (40, 77)])
def test_the_rmsnorm_reference_is_autograd(rows, cols):
    """The dweight and dx the check expects are autograd's gradients of y = x · rsqrt(mean(x²) + eps) · w."""
    import torch

    g = torch.Generator().manual_seed(rows * cols)
    x, dy = (torch.randn(rows, cols, generator=g, dtype=torch.float64) for _ in range(2))
    weight = (1 + torch.randn(cols, generator=g, dtype=torch.float64) / 2).requires_grad_()
    x.requires_grad_()
    rstd = torch.rsqrt(x.pow(2).mean(-1) + 1e-6)
    (x * rstd[:, None] * weight).backward(dy)
    dx, dweight = ch09.rmsnorm_backward_reference(dy, x.detach(), weight.detach(), rstd.detach())
    torch.testing.assert_close(dx, x.grad)
    torch.testing.assert_close(dweight, weight.grad)


def test_error_ratio_rule_fails_a_kernel_far_off_and_says_where():
    """expect_accurate passes torch's own result and fails one value off, naming its index, both errors and the
    allowance."""
    import torch

    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    reference, baseline = torch.softmax(x.double(), -1), torch.softmax(x, -1)
    ch09.expect_accurate(baseline.flatten().tolist(), baseline, reference, "softmax")
    wrong = baseline.clone()
    wrong[2, 3] += 1e-3
    with pytest.raises(ch09.CheckFailed, match=r"softmax returned .* at \[2, 3\] .*expected at most 4x"):
        ch09.expect_accurate(wrong.flatten().tolist(), baseline, reference, "softmax")
    with pytest.raises(ch09.CheckFailed, match="returned 14 values, expected 15 numbers"):
        ch09.expect_accurate(baseline.flatten().tolist()[:-1], baseline, reference, "softmax")


@pytest.mark.parametrize("seed", range(3))
def test_the_launch_reference_is_lab_measure_launch(seed):
    """ch09 keeps its own copy of the rule so that grading imports no torch: it must stay lab.measure.launch's."""
    import random

    from lab.measure import launch

    rng = random.Random(seed)
    for bound in ("launch", "memory", "compute"):
        machine = ch09._machine(rng)
        lab_machine = launch.Machine("drawn", *machine)
        nbytes, flops = ch09._op(rng, bound, machine)
        assert ch09.reference_op_time(nbytes, flops, *machine) == launch.op_time(nbytes, flops, lab_machine)
        assert launch.op_time(nbytes, flops, lab_machine)[1] == bound
        chain, fused = ch09._chain(rng, machine, bound)
        assert ch09.reference_fusion_saving(chain, fused, *machine) == launch.fusion_saving(chain, fused, lab_machine)
