"""Cost models of the course (parameters, memory, FLOPs, communication, bubbles, inference).

Torch-free on purpose: widgets and command-line calculators import it instantly, and every formula
lives here once so that notebooks, exercises and tests agree.
"""

from lab.calc.params import count_params, param_breakdown

__all__ = ["count_params", "param_breakdown"]
