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
                                             r"\(allowed 2x, or 16 ulps at the reference's scale\)$"):
        assert_error_ratio("op", (reference - 2.1e-3).float(), baseline, reference)


def test_the_floor_follows_the_reference_scale() -> None:
    """Where torch is exact, FLOOR_ULPS roundoff units at the reference's own magnitude are allowed — for a
    gradient of ~1e-3 that is ~1.9e-9 in fp32, so an error of 1e-8 (harmless next to 1, wrong next to 1e-3) fails."""
    reference = torch.full((4,), 1e-3, dtype=torch.float64)
    exact = reference.float()
    assert error_ratio(exact, exact, reference) <= 2
    assert error_ratio((reference + 1e-8).float(), exact, reference) > 2


@pytest.mark.parametrize("kernel_ulps, passes", [(6, True), (15, True), (40, False)])
def test_a_few_ulps_pass_whatever_torchs_own_error(kernel_ulps, passes) -> None:
    """When torch is within 2.5 ulps, a kernel a few ulps off (another summation order: 6 ulps, 2.4x torch's, on
    an AVX-512 CPU) passes, and one some tens of ulps off does not: the verdict follows the error's size, not the
    ratio of two tiny numbers."""
    reference = torch.linspace(-0.7, 0.7, 64, dtype=torch.float64)
    ulp = torch.finfo(torch.float32).eps * 0.7
    baseline, result = (reference + 2.5 * ulp).float(), (reference + kernel_ulps * ulp).float()
    assert (error_ratio(result, baseline, reference) <= 2) == passes


def test_nan_and_shape_mismatch() -> None:
    reference = torch.zeros(3, dtype=torch.float64)
    result = torch.tensor([0.0, float("nan"), 0.0])
    assert max_error(result, reference) == float("inf")
    assert max_error(torch.tensor([float("nan")]), torch.tensor([float("nan")], dtype=torch.float64)) == 0
    with pytest.raises(ValueError, match=r"shape \(2,\) differs from the reference's \(3,\)"):
        max_error(torch.zeros(2), reference)


def test_a_zero_by_cancellation_takes_the_scale_of_its_terms() -> None:
    """Attention's dq with one key is exactly 0 (its terms cancel): at its own scale no roundoff at all is allowed,
    at the scale of the terms that cancelled (given) a few ulps are, and a real error still fails."""
    reference = torch.zeros(8, dtype=torch.float64)
    exact = reference.float()
    roundoff = torch.full((8,), 1.3e-7)
    assert error_ratio(roundoff, exact, reference) > 1e20
    assert error_ratio(roundoff, exact, reference, scale=1.0) <= 2
    assert error_ratio(torch.full((8,), 1e-4), exact, reference, scale=1.0) > 2
