"""Cost models of the course (parameters, memory, FLOPs, communication, bubbles, inference).

Torch-free on purpose: widgets and command-line calculators import it instantly, and every formula
lives here once so that notebooks, exercises and tests agree.
"""

from lab.calc.flops import FlopsEstimate, hfu, mfu, training_flops, utilization
from lab.calc.hardware import HARDWARE, Accelerator, get_accelerator
from lab.calc.memory import (
    MemoryEstimate,
    estimate_memory,
    korthikanti_layer_bytes,
    playbook_num_params,
    stage_params,
    static_bytes,
)
from lab.calc.params import count_params, param_breakdown

__all__ = [
    "HARDWARE",
    "Accelerator",
    "FlopsEstimate",
    "MemoryEstimate",
    "count_params",
    "estimate_memory",
    "get_accelerator",
    "hfu",
    "korthikanti_layer_bytes",
    "mfu",
    "param_breakdown",
    "playbook_num_params",
    "stage_params",
    "static_bytes",
    "training_flops",
    "utilization",
]
