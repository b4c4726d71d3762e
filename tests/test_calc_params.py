"""lab.calc's parameter counts against the published sizes of the models the presets copy."""

import pytest

from lab.calc import count_params, param_breakdown
from lab.config import PRESETS

# Sizes as published by the model authors (Hugging Face model cards / safetensors metadata).
PUBLISHED = {
    "smollm-135m": 134_515_008,
    "llama3-1b": 1_235_814_400,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
    "mixtral-8x7b": 46_702_792_704,
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_count_equals_published(name):
    assert count_params(PRESETS[name]) == PUBLISHED[name]


def test_moe_active_parameters():
    # Mixtral: "12.9B active parameters per token"; DeepSeek-V3: "671B total, 37B activated".
    assert round(param_breakdown(PRESETS["mixtral-8x7b"])["active"] / 1e9, 1) == 12.9
    deepseek = param_breakdown(PRESETS["deepseek-v3"])
    # 671,026,419,200 published minus 58 MoE layers x 256 routing biases, which lab's router does not have
    assert deepseek["total"] == 671_026_419_200 - 58 * 256
    assert round(deepseek["active"] / 1e9) == 38  # 37.5B: the paper rounds it down to 37B


def test_breakdown_adds_up():
    for cfg in PRESETS.values():
        parts = param_breakdown(cfg)
        assert parts["total"] == sum(v for k, v in parts.items() if k not in ("total", "active"))
