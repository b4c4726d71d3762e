"""lab.calc.zero: ZeRO-3's parameter bytes at rest and while one or two layers are gathered."""

from __future__ import annotations

import pytest

from lab.calc.memory import static_bytes
from lab.calc.zero import zero3_param_bytes


def test_at_rest_is_the_playbooks_zero3_parameter_shard():
    """The playbook's ZeRO section (figure zero3_memoryusage, Llama 3.1 8B at DP=8): ZeRO-3 leaves 1.875 GiB of
    bf16 parameters per GPU (15 GiB / 8), the parameter column of calc.memory's ZeRO-3 ladder."""
    n = 8.03e9
    assert zero3_param_bytes(n, 32, 8, gathered=0) / 2**30 == pytest.approx(1.875, rel=0.01)
    assert zero3_param_bytes(n, 32, 8, gathered=0) == pytest.approx(static_bytes(int(n), zero=3, dp=8)["params"])


def test_prefetch_holds_one_more_layer():
    """With prefetch the next layer is whole too: one layer's bf16 bytes (2Ψ/L) more than without."""
    n, layers = 70.6e9, 80
    one, two = zero3_param_bytes(n, layers, 64, gathered=1), zero3_param_bytes(n, layers, 64, gathered=2)
    assert two - one == pytest.approx(2 * n / layers)
    assert one == pytest.approx(2 * n / 64 + 2 * n / 80)


@pytest.mark.parametrize("args, message", [
    ((0, 32, 8), "n_params=0 must be > 0"),
    ((8e9, 0, 8), "n_layers=0 must be an integer >= 1"),
    ((8e9, 32, 8, 3.0), "gathered=3.0 must be an integer >= 0"),
    ((8e9, 2, 8, 3), "gathered=3 must be at most n_layers=2"),
])
def test_bad_input_is_one_clear_line(args, message):
    with pytest.raises(ValueError, match=message):
        zero3_param_bytes(*args)
