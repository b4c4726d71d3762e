"""benchmarks/compose.py: its torch side trains the single-process model, and a layout that cannot run is a row."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_support import load_benchmark

from lab.config import load_config
from lab.distributed import run

REPO = Path(__file__).resolve().parents[1]


def _compose():
    return load_benchmark("compose")


@pytest.mark.parametrize("overrides", [
    # FSDP2 x DTensor TP, two micro-batches (gradient sync held back on the first), clipping over two meshes
    ("parallel.dp=2", "parallel.tp=2", "parallel.zero=3", "parallel.grad_accum=2"),
    # replicate over dp x torch's interleaved 1F1B on build_chunk's chunks, clipping summed over the stages
    ("parallel.dp=2", "parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual_stages=2",
     "parallel.grad_accum=2"),
], ids=["zero3-dp2-tp2", "dp2-pp2-interleaved"])
def test_torch_stack_trains_the_single_process_model(overrides):
    """The ratio means something only if torch's composition computes what lab's does: its per-step losses on
    4 ranks equal the same worker's on one process (no parallelism), so nothing is dropped or counted twice."""
    compose = _compose()
    common = ["train.steps=3"]
    single = run(compose.torch_worker, 1, load_config(REPO / "configs/tiny.toml", common))[0]["losses"]
    composed = run(compose.torch_worker, 4, load_config(REPO / "configs/tiny.toml", [*common, *overrides]),
                   timeout_s=300)[0]["losses"]
    assert composed == pytest.approx(single, rel=1e-5)


def test_a_layout_that_cannot_run_is_a_row_not_a_crash():
    """lab.train refuses ZeRO-2 under a pipeline (lab.config.UNSUPPORTED): the row says so; no rank starts."""
    compose = _compose()
    layout = compose.Layout("zero2-dp2-pp2-tp2", "configs/tiny.toml",
                            ("parallel.dp=2", "parallel.pp=2", "parallel.tp=2", "parallel.zero=2"), "no torch: test")
    lab_ms, torch_ms = compose.measure(layout, ["train.steps=3"])
    assert lab_ms.startswith("refused: ") and "zero=2" in lab_ms
    assert torch_ms == "no torch: test"
