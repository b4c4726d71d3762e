"""The error-ratio rule itself (lab.kernels.accuracy): what passes, what fails, and the floor's scale."""

from __future__ import annotations

import pytest
import torch

from lab.kernels.accuracy import assert_error_ratio, error_ratio, max_error


def test_a_kernel_passes_at_up_to_twice_torchs_error() -> None:
    reference = torch.linspace(-1, 1, 11, dtype=torch.float64)
    baseline = (reference + 1e-3).float()  # torch's own error: 1e-3
    assert_error_ratio("op", (reference + 1.9e-3).float(), baseline, reference)
    with pytest.raises(AssertionError, match=r"^op float32 \(11,\): error 0.0021 is 2.1x torch's own 0.001 "
                                             r"\(allowed 2x\)$"):
        assert_error_ratio("op", (reference - 2.1e-3).float(), baseline, reference)


def test_the_floor_follows_the_reference_scale() -> None:
    """Where torch is exact, one roundoff unit at the reference's own magnitude is allowed — for a gradient of
    ~1e-3 that is ~1e-10 in fp32, so an error of 1e-8 (harmless next to 1, wrong next to 1e-3) fails."""
    reference = torch.full((4,), 1e-3, dtype=torch.float64)
    exact = reference.float()
    assert error_ratio(exact, exact, reference) <= 2
    assert error_ratio((reference + 1e-8).float(), exact, reference) > 50


def test_nan_and_shape_mismatch() -> None:
    reference = torch.zeros(3, dtype=torch.float64)
    result = torch.tensor([0.0, float("nan"), 0.0])
    assert max_error(result, reference) == float("inf")
    assert max_error(torch.tensor([float("nan")]), torch.tensor([float("nan")], dtype=torch.float64)) == 0
    with pytest.raises(ValueError, match=r"shape \(2,\) differs from the reference's \(3,\)"):
        max_error(torch.zeros(2), reference)
