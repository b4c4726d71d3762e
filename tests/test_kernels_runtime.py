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


def test_squeezed_index_makes_a_one_element_value_an_index_under_numpy_2_4() -> None:
    """Triton 3.6's interpreter patch (`int(data)` of a 1-element array, which NumPy >= 2.4 refuses), wrapped by
    `squeezed_index`: a scalar kernel value then bounds a `range`, whatever the Triton version beneath."""
    import numpy as np

    class Value:  # what the interpreter holds for a scalar kernel argument: a 1-element array
        def __init__(self, n: int) -> None:
            self.handle = type("Handle", (), {"data": np.array([n], dtype=np.int32)})()

    class Scope:
        def set_attr(self, obj: object, name: str, value: object) -> None:
            setattr(obj, name, value)

    def triton_3_6_patch(tensor: type, scope: Scope) -> None:
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    runtime.squeezed_index(triton_3_6_patch)(Value, Scope())
    assert range(0, Value(5), 2) == range(0, 5, 2)


def test_the_interpreter_runs_with_the_squeezed_index() -> None:
    if not runtime.interpreted():
        pytest.skip("the interpreter's patch is installed only in the interpreter")
    from triton.runtime import interpreter

    assert hasattr(interpreter._patch_lang_tensor, "__wrapped__")
