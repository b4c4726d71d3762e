"""Ultra-Scale Lab: the package behind the course's notebooks.

Chapters import it for working implementations of every parallelism (`lab.parallel`), the rank
launcher (`lab.distributed`), cost models (`lab.calc`), widgets (`lab.widgets`) and exercise checks.
Submodules are imported on first use, so `import lab` stays cheap.
"""

from __future__ import annotations

import importlib
import os
import random

__version__ = "0.1.0"
_SUBMODULES = ("calc", "config", "data", "distributed", "doctor", "grading", "model", "parallel", "train", "widgets")


def setup(seed: int = 0, threads: int | None = None, quiet: bool = False) -> None:
    """First cell of a notebook: seed Python, NumPy and torch, optionally cap torch's CPU threads, and
    print one line saying what this machine offers."""
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # numpy is a dependency; tolerate a broken install in a notebook
        pass
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads={threads} must be >= 1")
        torch.set_num_threads(threads)
    if not quiet:
        from lab.doctor import gpu_names

        gpus = gpu_names()
        accel = f"{len(gpus)} GPU(s): {gpus[0]}" if gpus else "no GPU (CPU ranks use gloo)"
        print(f"lab {__version__} | torch {torch.__version__} | {os.cpu_count()} CPU cores, "
              f"{torch.get_num_threads()} torch threads | {accel} | seed {seed}")


def check(exercise: str | None = None, *, timeout: float = 60.0):
    """Check your answer to `exercise` (e.g. "01.param_count"), or every exercise of this notebook: your
    cell runs in a separate, sandboxed process against the course's checks, and a table shows the result."""
    from lab.grading.learner import check as _check

    return _check(exercise, timeout=timeout)


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"lab.{name}")
    raise AttributeError(f"module 'lab' has no attribute {name!r}")
