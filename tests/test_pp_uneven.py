"""Uneven pipeline stages (issue 37): Llama 3's lighter first and last stage, or layer counts given per stage.

The split rule is `lab.layout.stage_layers`; the executor, the memory model and the simulator read it. On real ranks
an uneven split gives the single-process loss and gradients, as an even one does (tests/test_pp.py)."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lab.calc.bubble import simulate
from lab.calc.memory import estimate_memory, stage_params
from lab.calc.schedules import make_schedule, rank_layers
from lab.config import PRESETS, ParallelConfig, load_config
from lab.distributed import run
from lab.layout import check_stages, describe, stage_layers
from lab.model import build_model, materialize
from lab.parallel.pp import Pipeline, build_chunk
from lab.train import build_parser, config_from_args
from lab.train import run as train

BATCH, SEQ = 12, 16


def _model(n_layers: int):
    return dataclasses.replace(PRESETS["tiny"], n_layers=n_layers, vocab_size=96, d_ff=80)


def _batch(cfg) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def _reference(cfg) -> tuple[float, dict[str, torch.Tensor]]:
    inputs, targets = _batch(cfg)
    model = materialize(build_model(cfg), seed=1)
    loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def test_the_split_rules():
    assert stage_layers(8, 4) == [2, 2, 2, 2]
    assert stage_layers(126, 16, "llama3") == [7] + [8] * 14 + [7]  # Llama 3 405B at PP16
    assert stage_layers(126, 8, "llama3") == [15] + [16] * 6 + [15]  # TorchTitan's PP8
    assert stage_layers(126, 32, "llama3") == [3] + [4] * 30 + [3]  # PP16, two chunks a rank
    assert [len(layers) for layers in rank_layers(126, 16, 2, "llama3")] == [7] + [8] * 14 + [7]
    assert stage_layers(8, 5, "llama3") == [1, 2, 2, 2, 1]
    assert stage_layers(8, 1, "llama3") == [8] and stage_layers(8, 2, "llama3") == [4, 4]
    assert stage_layers(8, 2, "3,5") == [3, 5] and stage_layers(8, 3, " 2, 4 ,2") == [2, 4, 2]
    assert rank_layers(8, 2, 1, "3,5") == [[0, 1, 2], [3, 4, 5, 6, 7]]
    assert rank_layers(6, 2, 2, "llama3") == [[0, 3, 4], [1, 2, 5]]  # stages [1, 2, 2, 1], round-robin


@pytest.mark.parametrize("n_layers, stages, split, message", [
    (8, 3, "even", r"pp\*chunks = 3 must divide n_layers=8"),
    (8, 3, "llama3", r"pp_layers='llama3' cannot split n_layers=8 over 3 virtual stages: it needs n_layers \+ 2 = 10"),
    (2, 4, "llama3", r"cannot split n_layers=2 over 4"),  # k = 1 would leave the ends no layer
    (8, 2, "3,4", r"pp_layers='3,4' adds up to 7 layers; n_layers=8"),
    (8, 3, "3,5", r"pp_layers='3,5' gives 2 stage\(s\); the layout has pp\*pp_virtual_stages = 3"),
    (8, 2, "0,8", r"pp_layers='0,8' must be 'even', 'llama3' or comma-separated layer counts >= 1"),
    (8, 2, "uneven", r"pp_layers='uneven' must be 'even', 'llama3' or comma-separated"),
])
def test_impossible_splits_are_refused_in_one_line(n_layers, stages, split, message):
    with pytest.raises(ValueError, match=message):
        stage_layers(n_layers, stages, split)


def test_the_config_takes_the_split_and_checks_it():
    assert ParallelConfig().pp_layers == "even"
    with pytest.raises(ValueError, match=r"pp_layers='3,5,1' gives 3 stage\(s\)"):
        ParallelConfig(pp=2, pp_layers="3,5,1")
    with pytest.raises(ValueError, match=r"parallel.pp_layers=35 must be of type str"):
        load_config("configs/tiny.toml", ["parallel.pp=2", "parallel.pp_layers=35"])
    with pytest.raises(ValueError, match=r"pp_layers='4,5' adds up to 9 layers; n_layers=8"):
        load_config("configs/tiny.toml", ["parallel.pp=2", "parallel.pp_layers='4,5'"])
    with pytest.raises(ValueError, match=r"pp\*pp_virtual_stages = 3\*1 = 3 must divide n_layers=8"):
        check_stages(8, 3, 1)  # the even rule keeps its message
    config = load_config("configs/tiny.toml", ["parallel.pp=5", "parallel.pp_layers='llama3'"])
    assert describe(config.parallel) == "pp=5, pp_schedule=1f1b, pp_layers=llama3"
    assert describe(ParallelConfig(pp=2)) == "pp=2, pp_schedule=1f1b"
    config, nproc = config_from_args(build_parser().parse_args(["--config", "configs/tiny.toml", "--nproc", "2",
                                                                "--pp", "2", "--pp-layers", "3,5"]))
    assert config.parallel.pp_layers == "3,5" and nproc == 2


def _pipelines(cases: list[tuple[int, str, int, int, str]]):
    """On every rank of the group, each case (n_layers, schedule, microbatches, chunks, split): the loss (last
    stage) and this rank's gradients, and the layer names its chunks hold."""
    rank, pp = dist.get_rank(), dist.get_world_size()
    results = []
    for n_layers, name, microbatches, chunks, split in cases:
        cfg = _model(n_layers)
        schedule = make_schedule(name, pp, microbatches, chunks)
        modules = [build_chunk(cfg, schedule.virtual_stage(rank, c), schedule.virtual_stages, seed=1, split=split)
                   for c in range(chunks)]
        loss = Pipeline(modules, schedule, None).step(*_batch(cfg))
        layers = [int(layer) for module in modules for layer in module.layers]
        grads = {n: p.grad for module in modules for n, p in module.named_parameters()}
        results.append((None if loss is None else loss.item(), grads, layers))
    return results


CASES = {2: [(8, "1f1b", 4, 1, "3,5"), (8, "zb-h1", 2, 1, "1,7"), (6, "interleaved", 2, 2, "llama3")],
         3: [(7, "1f1b", 3, 1, "llama3"), (10, "interleaved", 3, 2, "llama3")]}


@pytest.mark.parametrize("pp", sorted(CASES))
def test_uneven_stages_equal_one_process(pp):
    """Each layer on exactly the rank `rank_layers` says, and the single-process loss and gradients."""
    per_rank = run(_pipelines, pp, CASES[pp])
    for i, (n_layers, name, _, chunks, split) in enumerate(CASES[pp]):
        ref_loss, ref_grads = _reference(_model(n_layers))
        results = [cases[i] for cases in per_rank]
        assert [layers for *_, layers in results] == rank_layers(n_layers, pp, chunks, split)
        losses = [loss for loss, *_ in results if loss is not None]
        assert len(losses) == 1 and losses[0] == pytest.approx(ref_loss, rel=1e-6)
        seen = {}
        for _, grads, _ in results:
            assert not set(grads) & set(seen), "a parameter on two ranks"
            seen.update(grads)
        assert set(seen) == set(ref_grads), f"{name} {split}"
        for key, grad in seen.items():
            torch.testing.assert_close(grad, ref_grads[key], rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


def test_lab_train_with_uneven_stages_matches_one_process():
    common = ["train.steps=4", "parallel.grad_accum=2"]
    single = [log.loss for log in train(load_config("configs/tiny.toml", common), verbose=False)]
    config = load_config("configs/tiny.toml", [*common, "parallel.pp=2", "parallel.pp_layers='3,5'"])
    pipelined = [log.loss for log in train(config, 2, verbose=False)]
    assert pipelined == pytest.approx(single, rel=1e-5)


def test_the_memory_model_and_the_simulator_follow_the_split():
    """calc.memory counts each stage's own layers; the simulator runs a heavier stage's ops longer."""
    cfg = PRESETS["llama3-405b"]
    even, llama3 = (ParallelConfig(pp=14, grad_accum=14), ParallelConfig(pp=16, grad_accum=16, pp_layers="llama3"))
    block = (stage_params(cfg, ParallelConfig(pp=126, grad_accum=126), 1)[0])  # one layer on a middle stage
    assert stage_params(cfg, llama3, 1)[0] == 8 * block and stage_params(cfg, even, 1)[0] == 9 * block
    first, middle = (estimate_memory(cfg, 4096, 1, llama3, stage=s).activations_breakdown["layers"] for s in (0, 1))
    assert first / 7 == pytest.approx(middle / 8 * 16 / 15)  # 1F1B: stage 0 holds 16 micro-batches, stage 1 holds 15
    assert estimate_memory(cfg, 4096, 1, llama3).stage in (0, 1)
    sim = simulate(make_schedule("1f1b", 4, 8), layers=[1, 2, 2, 1])
    assert sim.busy == pytest.approx([8 * (1 + 2) * 2 / 3, 8 * 3 * 4 / 3, 8 * 3 * 4 / 3, 8 * 3 * 2 / 3])
    assert sim.makespan > simulate(make_schedule("1f1b", 4, 8)).makespan  # the middle stages set the pace
