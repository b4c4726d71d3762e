"""FSDP2's options and HSDP on 4 gloo ranks: every variant's gradients, right after the backward (before any
optimizer step), equal one process on the whole batch; HSDP lays a gradient out as (Replicate, Shard(0)) over a
2 x 2 mesh; reshard_after_forward=False holds whole parameters between forward and backward; bf16 parameters
compute in bf16 and keep fp32 gradients."""

import dataclasses

import pytest
import torch

from lab.config import load_config
from lab.distributed import run
from lab.measure.fsdp2 import VARIANTS, reference_gradients, sharded_gradients

CFG = dataclasses.replace(load_config("configs/tiny.toml").model, n_layers=2)  # 2 blocks: the prefetch has a next
WORLD = 4


def _all_variants(cfg) -> dict[str, dict]:
    results = {variant: sharded_gradients(cfg, variant) for variant in VARIANTS}
    return results if torch.distributed.get_rank() == 0 else {}


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    return run(_all_variants, WORLD, CFG)[0]


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return reference_gradients(CFG)


def _max_error(grads: dict, reference: dict) -> float:
    assert grads.keys() == reference.keys()
    return max((grads[name].float() - want).abs().max().item() for name, want in reference.items())


@pytest.mark.parametrize("variant", ["fsdp2", "no-reshard", "prefetch", "hsdp"])
def test_gradients_equal_one_process(runs, reference, variant):
    assert _max_error(runs[variant]["grads"], reference) < 1e-6


def test_hsdp_shards_inside_a_replica_and_replicates_across(runs):
    hsdp, fsdp = runs["hsdp"], runs["fsdp2"]
    assert hsdp["mesh"] == {"replicate": 2, "shard": 2} and hsdp["placements"] == ["Replicate()", "Shard(dim=0)"]
    assert fsdp["mesh"] == {"shard": WORLD} and fsdp["placements"] == ["Shard(dim=0)"]
    assert hsdp["held_after_forward"] == 2 * fsdp["held_after_forward"]  # a half, not a quarter, of each block


def test_no_reshard_keeps_whole_parameters_from_forward_to_backward(runs):
    # after block 0's forward: its whole parameters (4 shards' worth) instead of this rank's shard
    assert runs["no-reshard"]["held_after_forward"] == WORLD * runs["fsdp2"]["held_after_forward"]


def test_bf16_parameters_compute_in_bf16_and_keep_fp32_gradients(runs, reference):
    mixed = runs["bf16-params"]
    assert (mixed["forward_dtype"], mixed["grad_dtype"]) == ("bfloat16", "float32")
    error = _max_error(mixed["grads"], reference)
    assert 1e-6 < error < 1e-2  # bf16 rounding, not a different gradient
