"""The benchmarks are scripts, not a package: their tests load one by file name."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(stem: str) -> ModuleType:
    """benchmarks/<stem>.py as the module bench_<stem>, registered in sys.modules (dataclasses look their module
    up there)."""
    spec = importlib.util.spec_from_file_location(f"bench_{stem}", BENCHMARKS / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
