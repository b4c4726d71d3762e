"""ZeRO-Offload's cost model: what stays on the GPU, what moves over PCIe, when the CPU's step hides."""

import pytest

from lab.calc.hardware import HARDWARE, GiB
from lab.calc.memory import static_bytes
from lab.calc.offload import PCIE, offload_hide_tokens, offload_step

H100 = HARDWARE["h100"].peak_flops("bf16")


def test_a_13b_model_fits_one_32gb_v100_only_with_offload():
    # ZeRO-Offload (Ren et al., ATC 2021), abstract: "train models with over 13 billion parameters on a single GPU"
    # (a 32 GB V100); without it mixed-precision Adam needs 16 bytes a parameter on the GPU
    step = offload_step(13e9, 2048, 125e12, pcie_bandwidth=PCIE["gen3"])
    assert step.gpu_bytes < 32 * GiB < sum(static_bytes(13e9).values())
    # DeepSpeed's estimate_zero2_model_states_mem_needs with offload: GPU 2Ψ, CPU 16Ψ (before its 1.5 buffer factor)
    assert (step.gpu_bytes, step.cpu_bytes) == (2 * 13e9, 16 * 13e9)


def test_pcie_carries_4_psi_per_step_split_over_dp():
    # the paper's §4.1: fp16 gradients down (2M) and fp16 parameters up (2M); §3.3: the minimum for GPU fwd/bwd
    one, eight = offload_step(7e9, 4096, H100), offload_step(7e9, 4096, H100, dp=8)
    assert one.pcie_bytes == 4 * 7e9 and eight.pcie_bytes == one.pcie_bytes / 8
    assert one.pcie_s == pytest.approx(28e9 / 64e9)  # 0.44 s on PCIe Gen5 x16


def test_the_step_is_free_exactly_above_the_token_threshold():
    tokens = offload_hide_tokens(H100)
    assert offload_step(7e9, tokens * 0.99, H100).exposed_s > 0
    assert offload_step(7e9, tokens * 1.01, H100).exposed_s == 0
    assert offload_step(7e9, tokens, H100).compute_s == pytest.approx(
        offload_step(7e9, tokens, H100).pcie_s + offload_step(7e9, tokens, H100).cpu_step_s)
    assert offload_hide_tokens(H100, dp=8) == pytest.approx(tokens / 8)


def test_bad_input_says_which_value():
    with pytest.raises(ValueError, match="tokens=0"):
        offload_step(7e9, 0, H100)
    with pytest.raises(ValueError, match="mfu=1.5"):
        offload_step(7e9, 1, H100, mfu=1.5)
