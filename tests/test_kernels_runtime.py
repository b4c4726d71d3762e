"""lab.kernels.runtime: the mode, the input check every kernel starts with, and the pinned launch rules."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from lab.kernels import runtime  # noqa: E402
from lab.kernels.add import add  # noqa: E402


def test_a_tensor_on_another_device_is_refused_in_one_line() -> None:
    other = "meta" if runtime.DEVICE == "cpu" else "cpu"
    x = torch.ones(3, device=other)
    with pytest.raises(ValueError, match=rf"^x is on {other}: this process runs Triton kernels on "):
        add(x, x)


def test_a_dtype_the_lane_cannot_compute_is_refused() -> None:
    bad = torch.bfloat16 if runtime.interpreted() else torch.float64
    x = torch.ones(3, dtype=bad, device=runtime.DEVICE)
    with pytest.raises(ValueError, match=rf"x dtype {str(bad).removeprefix('torch.')} is not supported"):
        add(x, x)


@pytest.mark.parametrize(("n", "expected"), [(1, 1), (2, 2), (3, 4), (64, 64), (65, 128), (0, 1)])
def test_next_power_of_2(n: int, expected: int) -> None:
    assert runtime.next_power_of_2(n) == expected


def test_launch_rules_pin_one_configuration_per_lane() -> None:
    """The interpreter packs rows up to 65536 elements a program (few programs: its cost is per program);
    a GPU up to 2048, with more warps for wider blocks."""
    rows, _ = runtime.row_launch(n_rows=600, block_cols=128)
    assert rows == (512 if runtime.interpreted() else 16)
    assert runtime.row_launch(n_rows=3, block_cols=1024)[0] == (4 if runtime.interpreted() else 2)
    with pytest.raises(ValueError, match="last dim 0 is out of range: a row-wise kernel takes 1 to 65536 columns"):
        runtime.check_row(0)
