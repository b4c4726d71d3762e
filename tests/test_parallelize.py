"""`lab.parallel.parallelize`: each rank allocates only its own shards, holding exactly the single-process values;
`check_supported` is the one list of refusals (and the README names each); the loop knows only the pipeline.

The per-step parity of every composed layout with one process is tests/test_compose.py."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lab import distributed as lab_dist
from lab import train, trainer
from lab.config import PRESETS, UNSUPPORTED, ParallelConfig, check_supported, load_config
from lab.distributed import Mesh
from lab.measure.memory import PeakAllocation
from lab.model import build_model, materialize, num_params
from lab.parallel.parallelize import parallelize
from lab.parallel.placement import placement_of

ROOT = Path(__file__).resolve().parents[1]


def _shard_on_ranks(preset: str, layout: dict) -> dict:
    """parallelize() on this rank, measured: the peak bytes allocated while building it, the bytes it keeps, and
    whether every local value equals its piece of the single-process model."""
    cfg = PRESETS[preset]
    parallel = ParallelConfig(**layout)
    mesh = Mesh(dp=parallel.dp, tp=parallel.tp, ep=parallel.ep)
    with PeakAllocation() as peak:
        par = parallelize(cfg, mesh, parallel, torch.device("cpu"), seed=3, seq_len=32)
    whole = dict(materialize(build_model(cfg), seed=3).named_parameters())
    exact = all(torch.equal(param, placement_of(param).local(whole[name]))
                for name, param in par.model.named_parameters())
    kept = sum(p.numel() * p.element_size() for p in par.model.parameters())
    return {"peak": peak.bytes, "kept": kept, "exact": exact, "rank": dist.get_rank()}


@pytest.mark.parametrize("preset, layout", [("tiny", {"tp": 4}), ("tiny-moe", {"dp": 4, "ep": 4})])
def test_a_rank_allocates_its_shards_only_never_the_whole_model(preset, layout):
    """Built on meta, sharded, then materialised: the peak while building a TP (or EP) rank is its shards plus one
    parameter's full tensor at a time — not the whole model first, which is what sharding a materialised model
    costs (the old path: at least the model's bytes on every rank)."""
    model_bytes = 4 * num_params(build_model(PRESETS[preset]))
    results = lab_dist.run(_shard_on_ranks, 4, preset, layout)
    for r in results:
        assert r["exact"], f"rank {r['rank']}: a local value differs from its piece of the single-process model"
        assert r["kept"] < 0.5 * model_bytes
        assert r["peak"] < 0.6 * model_bytes, f"rank {r['rank']} peaked at {r['peak']:,} B; whole model {model_bytes:,}"
    with PeakAllocation() as whole:  # the measurement itself sees a whole model when there is one
        materialize(build_model(PRESETS[preset]))
    assert whole.bytes >= model_bytes


@pytest.mark.parametrize("rule", [rule for rule, *_ in UNSUPPORTED])
def test_every_refusal_is_one_named_line_and_the_readme_lists_it(rule):
    layouts = {
        "zero>=2 with pp": ("configs/tiny.toml", ["parallel.dp=2", "parallel.pp=2", "parallel.zero=2",
                                                  "parallel.grad_accum=2"]),
        "zero with ep": ("configs/tiny-moe.toml", ["parallel.dp=2", "parallel.ep=2", "parallel.zero=1"]),
        "tp with mla": (None, ["model.preset='deepseek-v3'", "parallel.tp=2"]),
        "sp with moe": ("configs/tiny-moe.toml", ["parallel.tp=2", "parallel.sp=true"]),
        "pp with tied embeddings": (None, ["model.preset='smollm-135m'", "parallel.pp=2", "parallel.grad_accum=2"]),
        "zero-bubble with recompute": ("configs/tiny.toml", ["parallel.pp=2", "parallel.grad_accum=2",
                                                             "parallel.pp_schedule='zb-h1'",
                                                             "parallel.recompute='full'"]),
    }
    path, overrides = layouts[rule]
    config = load_config(path, overrides)
    with pytest.raises(ValueError, match=re.escape(f"lab.train does not run {rule} (")) as err:
        check_supported(config)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=re.escape(rule)):  # a notebook calling run() is refused too
        train.run(config, config.parallel.world_size, verbose=False)
    assert f"`{rule}`" in (ROOT / "README.md").read_text(), f"README's list of refusals lacks `{rule}`"


def test_the_training_loop_asks_the_layout_nothing_but_whether_there_is_a_pipeline():
    """train_worker reads no degree but through `parallelize`: a reader finds each parallelism in its module."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(trainer.train_worker)))
    read = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not read & {"tp", "cp", "ep", "sp", "zero", "tp_group", "cp_group", "ep_group", "dp_rank", "cp_rank"}


def test_the_trainer_reaches_into_none_of_the_parts_of_what_parallelize_built():
    """lab.trainer asks `Parallelized` (forward_backward, finish_gradients, mean_loss, ...): it sets none of its
    attributes and reads none of its parts' (no `par.engine.no_sync()`, no `par.pipeline.grad_scale = ...`), which
    would make the loop know the layout again."""
    tree = ast.parse(inspect.getsource(trainer))

    def is_par(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "par"

    through = {ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Attribute) and is_par(node.value)}
    stored = {ast.unparse(node) for node in ast.walk(tree) if is_par(node) and isinstance(node.ctx, ast.Store)}
    private = {ast.unparse(node) for node in ast.walk(tree) if is_par(node) and node.attr.startswith("_")}
    assert not through | stored | private
    asked = {node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call) and is_par(node.func)}
    assert {"forward_backward", "finish_gradients", "mean_loss", "after_step", "zero_grad"} <= asked


def test_flags_are_the_parallel_config_fields():
    parser = train.build_parser()
    dests = {action.dest for action in parser._actions}
    import dataclasses

    assert {f.name for f in dataclasses.fields(ParallelConfig)} <= dests
    args = parser.parse_args(["--pp", "2", "--pp-chunks", "2", "--pp-schedule", "interleaved", "--sp", "--tp", "2",
                              "--grad-accum", "2", "--nproc", "8"])
    config, nproc = train.config_from_args(args)
    assert (config.parallel.pp_virtual_stages, config.parallel.sp, config.parallel.dp, nproc) == (2, True, 2, 8)


def test_cli_runs_dp2_tp2_pp2_on_eight_ranks():
    out = subprocess.run([sys.executable, "-m", "lab.train", "--config", "configs/tiny.toml", "--nproc", "8", "--dp",
                          "2", "--tp", "2", "--pp", "2", "--grad-accum", "2", "--steps", "2", "--quiet"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "on 8 rank(s) [dp=2, tp=2, pp=2, grad_accum=2, pp_schedule=1f1b]" in out.stdout
