"""`python -m lab.train --precision`: bf16/fp16 with fp32 master weights and fp32 gradient sums, FP8 linears, in
every layout (issue 19).

What is checked, and why each check can fail:
- the engines sum gradients in `reduce_dtype`: gradients chosen so that a bf16 sum loses them (1 + 2^-9 is 1 in
  bf16), over micro-batches and over ranks, for every engine; with reduce_dtype=bf16 the same run loses them;
- the dtypes where the issue puts them: bf16 weights, ZeRO flat buffers and pipeline boundaries, fp32 gradient
  buffers and masters, fp32 logits into the loss;
- layouts in bf16, fp16 and FP8 train as the single-process run in that precision does: losses to 5e-4 and
  gradient norms (taken right after reduction) to 2e-2, where a constant factor in the reduction shows (x2);
  bf16 rounds differently when TP or CP split a matmul, hence the tolerances (measured: 1e-4 and 7.5e-3);
- FP8 reaches every linear of every layout (TP's column and row pieces, the experts) but the router and output;
- fp16's loss scale and skipped steps are the same on every rank and in every layout.
"""

from __future__ import annotations

import functools
import re
import shutil

import pytest
import torch
from test_train import _assert_same_losses
from torch import nn

from lab.calc.memory import static_bytes, training_precision
from lab.checkpoint import CheckpointOptions, _read_metadata, read_full
from lab.config import load_config
from lab.distributed import run as run_ranks
from lab.parallel.dp import BucketedDP, NaiveDP, OverlappedDP
from lab.parallel.optim import adamw
from lab.parallel.parallelize import build_mesh, parallelize
from lab.parallel.zero import Zero
from lab.precision.fp8_linear import FP8Matmul
from lab.precision.master import MasterWeights, MixedPrecisionPolicy
from lab.precision.scheme import precision_scheme
from lab.train import StepLog, run

TINY, MOE = "configs/tiny.toml", "configs/tiny-moe.toml"
SMALL = ("train.steps=3", "model.n_layers=4")  # bf16 matmuls are ~5x slower than fp32 ones on a CPU
TINY_BIT = 2.0**-9  # below half a bf16 ulp of 1 (2^-8): 1 + 2^-9 rounds to 1 in bf16, is exact in fp32


class _Weighted(nn.Module):
    """loss = sum(w * c): the gradient of w is exactly c, whatever w is."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8, dtype=torch.bfloat16))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.weight.float() * c).sum()


ENGINES = {"naive": lambda m, r: NaiveDP(m, None, r), "overlapped": lambda m, r: OverlappedDP(m, None, r),
           "bucketed": lambda m, r: BucketedDP(m, None, reduce_dtype=r),
           **{f"zero{s}": functools.partial(lambda s, m, r: Zero(m, None, s, reduce_dtype=r), s) for s in (1, 2, 3)}}


def _master_gradients(reduce_dtype: torch.dtype) -> dict[str, list[float]]:
    """On each of 2 ranks, two micro-batches: rank 0's gradients are 1 then 2^-9, rank 1's 2^-9 then 0. The
    average of the sums is 1/2 + 2^-9 when every sum is made in fp32; a bf16 sum anywhere loses the 2^-9s."""
    rank = torch.distributed.get_rank()
    micro = [(1.0, TINY_BIT), (TINY_BIT, 0.0)][rank]
    seen = {}
    for kind, make in ENGINES.items():
        model = _Weighted()
        engine = make(model, reduce_dtype)
        masters = MasterWeights(engine.parameters(), MixedPrecisionPolicy(torch.bfloat16, reduce_dtype))
        for i, c in enumerate(micro):
            with engine.backward_context(last_micro_batch=i == len(micro) - 1):
                model(torch.full((8,), c)).backward()
        engine.finish()
        masters.grads_to_master()
        seen[kind] = sorted({v for m in masters.master_params for v in m.grad.tolist()})
    return seen


def test_every_engine_sums_gradients_over_micro_batches_and_ranks_in_fp32():
    for rank, seen in enumerate(run_ranks(_master_gradients, 2, torch.float32)):
        assert seen == dict.fromkeys(ENGINES, [0.5 + TINY_BIT]), f"rank {rank}: {seen}"


def test_summing_in_bf16_loses_what_fp32_keeps():
    """The control: the same run with reduce_dtype=bf16 (autograd's own bf16 .grad sums) gives 1/2."""
    for seen in run_ranks(_master_gradients, 2, torch.bfloat16):
        assert seen == dict.fromkeys(ENGINES, [0.5])


def _dtypes(overrides: list[str]) -> dict:
    """Where each dtype lives in one rank's parallelized bf16 model after one backward."""
    config = load_config(TINY, [*SMALL, *overrides])
    par = parallelize(config.model, build_mesh(config.parallel), config.parallel, torch.device("cpu"), 0, 8,
                      precision=precision_scheme("bf16"))
    loss_dtypes = []
    loss_fn = par.loss_fn

    def recording_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(logits, targets)
        loss_dtypes.append(str(loss.dtype))  # fp32 only if the bf16 logits were cast before the loss
        return loss

    tokens = torch.randint(0, config.model.vocab_size, (4, 9), generator=torch.Generator().manual_seed(0))
    inputs, targets = par.batch(tokens[:, :-1], tokens[:, 1:])
    if par.pipeline is not None:
        par.pipeline.loss_fn = recording_loss
        with par.engine.no_sync():
            par.pipeline.step(inputs, targets)
    else:
        recording_loss(par.model(inputs), targets).backward()
    par.finish_gradients()
    return {"model": sorted({str(p.dtype) for p in par.model.parameters()}),
            "masters": sorted({str(m.dtype) for m in par.parameters()}),
            "master_grads": sorted({str(m.grad.dtype) for m in par.parameters() if m.grad is not None}),
            "zero_buffers": sorted({(str(u.full.dtype), str(u.shard_grad.dtype)) for u in par.engine.units})
            if isinstance(par.engine, Zero) else None,
            "boundary": str(par.pipeline.boundary.dtype) if par.pipeline is not None else None,
            "loss": sorted(set(loss_dtypes))}


def test_bf16_weights_boundaries_and_zero_buffers_with_fp32_masters_and_sums():
    pp, zero = run_ranks(_dtypes, 2, ["parallel.pp=2"]), run_ranks(_dtypes, 2, ["parallel.dp=2", "parallel.zero=3"])
    for found in pp + zero:
        assert found["model"] == ["torch.bfloat16"]
        assert found["masters"] == found["master_grads"] == ["torch.float32"]
    assert pp[0]["boundary"] == pp[1]["boundary"] == "torch.bfloat16"
    assert pp[1]["loss"] == ["torch.float32"]  # the last stage's logits are cast for the loss
    assert zero[0]["zero_buffers"] == [("torch.bfloat16", "torch.float32")]


@functools.cache
def _reference(path: str, precision: str, extra: tuple[str, ...] = ()) -> tuple[StepLog, ...]:
    config = load_config(path, [*SMALL, f"train.precision='{precision}'", *extra])
    return tuple(run(config, 1, verbose=False))


def _train(path: str, precision: str, overrides: list[str]) -> list[StepLog]:
    config = load_config(path, [*SMALL, f"train.precision='{precision}'", *overrides])
    return run(config, config.parallel.world_size, verbose=False)


def _assert_same_training(reference: tuple[StepLog, ...], logs: list[StepLog]) -> None:
    _assert_same_losses([log.loss for log in reference], [log.loss for log in logs], rel=5e-4)
    _assert_same_losses([log.grad_norm for log in reference], [log.grad_norm for log in logs], rel=2e-2)


@pytest.mark.parametrize("precision, overrides", [
    pytest.param("bf16", ["parallel.dp=2", "parallel.tp=2", "parallel.zero=1"], id="bf16-zero1-dp2-tp2"),
    pytest.param("bf16", ["parallel.pp=2", "parallel.cp=2", "parallel.pp_schedule='1f1b'", "parallel.grad_accum=2"],
                 id="bf16-pp2-cp2-1f1b"),
    pytest.param("bf16", ["parallel.dp=2", "parallel.zero=3", "parallel.dp_mode='overlapped'"], id="bf16-zero3-dp2"),
    pytest.param("fp16", ["parallel.dp=2", "parallel.pp=2", "parallel.pp_schedule='zb-h1'",
                          "parallel.grad_accum=2"], id="fp16-dp2-pp2-zbh1"),
    pytest.param("fp8-tilewise", ["parallel.dp=2", "parallel.tp=2", "parallel.sp=true"], id="fp8-tilewise-dp2-tp2-sp"),
])
def test_layouts_match_single_process_in_their_precision(precision, overrides):
    reference, logs = _reference(TINY, precision), _train(TINY, precision, overrides)
    _assert_same_training(reference, logs)
    if precision == "fp16":  # the same scales, and the same steps skipped, as one process
        assert [(log.loss_scale, log.skipped) for log in logs] == [(r.loss_scale, r.skipped) for r in reference]


def test_fp16_takes_the_chunked_loss_and_trains_as_on_whole_logits():
    """fp16 tells the chunked loss its loss scale (`chunked_cross_entropy`'s grad_scale), over the micro-batches as
    backward divides it: the same losses, gradient norms, loss scales and skipped steps as torch's loss on whole
    fp32 logits, without those logits. (Not told, its backward would multiply fp16 gradients by the first scale,
    2^16, which is inf in fp16, and skip steps whole logits do not.)"""
    config = load_config(TINY, [*SMALL, "train.precision='fp16'"])
    par = parallelize(config.model, None, config.parallel, torch.device("cpu"), 0, config.train.seq_len,
                      precision=precision_scheme("fp16"))
    assert par.chunked_loss
    for accumulate in (["parallel.grad_accum=1"], ["parallel.grad_accum=2"]):
        chunked, whole = _train(TINY, "fp16", accumulate), _train(TINY, "fp16", [*accumulate, "train.loss='whole'"])
        _assert_same_training(tuple(whole), chunked)
        assert [(log.loss_scale, log.skipped) for log in chunked] == [(log.loss_scale, log.skipped) for log in whole]


def test_fp8_with_expert_parallelism_matches_data_parallelism():
    """The experts run their GEMMs in FP8 wherever they live: ep=2 equals dp=2 (the same tokens per expert)."""
    no_aux = ("model.aux_loss_coef=0.0", "model.z_loss_coef=0.0", "model.n_layers=2")
    dp = _train(MOE, "fp8-tensorwise", [*no_aux, "parallel.dp=2"])
    _assert_same_training(tuple(dp), _train(MOE, "fp8-tensorwise", [*no_aux, "parallel.dp=2", "parallel.ep=2"]))


def _converted(overrides: list[str], path: str) -> dict[str, list[str]]:
    config = load_config(path, [*SMALL, *overrides])
    par = parallelize(config.model, build_mesh(config.parallel), config.parallel, torch.device("meta"), 0, 8,
                      precision=precision_scheme("fp8-tensorwise"))
    kinds: dict[str, list[str]] = {"fp8": [], "high": []}
    for name, module in par.model.named_modules():
        if hasattr(module, "kernel") and isinstance(module, nn.Linear):
            kinds["fp8" if isinstance(module.kernel, FP8Matmul) else "high"].append(
                f"{type(module).__name__}:{name.rsplit('.', 1)[-1]}")
    return {k: sorted(set(v)) for k, v in kinds.items()}


def test_fp8_reaches_every_linear_of_every_layout_but_the_router_and_output():
    tp = run_ranks(_converted, 2, ["parallel.tp=2"], TINY)[0]
    assert tp["fp8"] == ["ColumnParallelLinear:w1", "ColumnParallelLinear:w3", "ColumnParallelLinear:wk",
                         "ColumnParallelLinear:wq", "ColumnParallelLinear:wv", "RowParallelLinear:w2",
                         "RowParallelLinear:wo"]
    assert all(name.endswith(":output") for name in tp["high"])
    ep = run_ranks(_converted, 2, ["parallel.ep=2", "parallel.dp=2"], MOE)[0]
    assert {"Linear:w1", "Linear:w2", "Linear:w3"} <= set(ep["fp8"])  # the experts this rank keeps
    assert sorted(ep["high"]) == ["Linear:output", "Linear:router"]


def test_fp8_tilewise_trains_within_half_a_percent_of_bf16():
    """The issue's goal on the toy budget: the final loss of FP8 with DeepSeek-V3's tile-wise scales is within
    0.5% of bf16's; fp32's is given for scale."""
    overrides = ["train.steps=40", "model.n_layers=2"]
    final = {p: run(load_config(TINY, [f"train.precision='{p}'", *overrides]), 1, verbose=False)[-1].loss
             for p in ("bf16", "fp8-tilewise")}
    gap = abs(final["fp8-tilewise"] - final["bf16"]) / final["bf16"]
    assert gap < 0.005, final


@pytest.mark.parametrize("overrides, message", [
    (["train.precision='fp64'"], "precision='fp64' must be one of 'fp32', 'bf16', 'fp16'"),
    (["train.precision='bf16'", "train.reduce_dtype='fp16'"],
     "reduce_dtype='fp16' with precision='bf16': gradients are summed in fp32 or in the compute dtype ('bf16')"),
    (["train.precision='fp32'", "train.reduce_dtype='bf16'"], "reduce_dtype='bf16' with precision='fp32'"),
])
def test_bad_precision_is_one_clear_line(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(TINY, overrides)


@pytest.mark.parametrize("precision, layout", [("fp16", ["parallel.dp=2", "parallel.zero=2"]),
                                               ("bf16", ["parallel.tp=2"])])
def test_resume_from_a_checkpoint_is_bit_for_bit(tmp_path, precision, layout):
    """A checkpoint holds the fp32 master weights and their AdamW moments (not the bf16/fp16 copies) and fp16's
    loss scale: steps 3-4 resumed from step 2 equal the uninterrupted run's exactly."""
    config = load_config(TINY, ["model.n_layers=2", "train.steps=4", f"train.precision='{precision}'", *layout])
    world = config.parallel.world_size

    def train(directory, resume: bool) -> list[StepLog]:
        return run(config, world, verbose=False, checkpoint=CheckpointOptions(str(directory), 2, 0, resume, False))

    whole = train(tmp_path / "whole", False)
    shutil.copytree(tmp_path / "whole" / "step-00000002", tmp_path / "resumed" / "step-00000002")
    resumed = train(tmp_path / "resumed", True)
    assert [(log.loss, log.grad_norm, log.loss_scale) for log in resumed] == \
        [(log.loss, log.grad_norm, log.loss_scale) for log in whole[2:]]
    saved = read_full(str(tmp_path / "whole" / "step-00000004"))
    assert {str(t.dtype) for k, t in saved.items() if k.startswith(("model.", "optim.")) and t.dim()} == \
        {"torch.float32"}
    saved_objects = _read_metadata(str(tmp_path / "whole" / "step-00000004")).state_dict_metadata
    assert any(key.startswith("scaler") for key in saved_objects) == (precision == "fp16")


def _live_bytes(precision: str, reduce_dtype: str, overrides: list[str]) -> tuple[dict[str, int], dict[str, int]]:
    """One training step of `parallelize`d tiny model; its live bytes (gradients still held, states made) and
    what `calc.memory.static_bytes` predicts for the same precision, layout and units."""
    config = load_config(TINY, [*SMALL, *overrides])
    p = config.parallel
    par = parallelize(config.model, build_mesh(p), p, torch.device("cpu"), 0, 8,
                      precision=precision_scheme(precision, reduce_dtype))
    optimizer = adamw(par.parameters(), 1e-3, 0.1)
    tokens = torch.randint(0, config.model.vocab_size, (4, 9), generator=torch.Generator().manual_seed(0))
    inputs, targets = par.batch(tokens[:, :-1], tokens[:, 1:])
    par.loss_fn(par.model(inputs), targets).backward()
    par.finish_gradients()
    optimizer.step()
    par.after_step()
    measured = par.resident_bytes(optimizer)
    measured["optimizer"] -= 4 * len(optimizer.state)  # AdamW's step counter per tensor: not in the calculator
    units = [u.full.numel() for u in par.engine.units] if isinstance(par.engine, Zero) else \
        sum(t.numel() for t in par.model.parameters())
    scheme, fp32_grad_accum = training_precision(precision, reduce_dtype)
    return measured, static_bytes(units, scheme, fp32_grad_accum=fp32_grad_accum, zero=p.zero, dp=p.dp)


@pytest.mark.parametrize("precision, reduce_dtype, overrides", [
    ("fp32", "fp32", []), ("bf16", "fp32", []), ("fp16", "fp32", []), ("fp8-tilewise", "fp32", []),
    ("bf16", "bf16", []), ("bf16", "fp32", ["parallel.dp=2", "parallel.zero=3"]),
    ("fp16", "fp32", ["parallel.dp=2", "parallel.zero=2"]),
])
def test_live_bytes_equal_calc_memory_for_each_precision(precision, reduce_dtype, overrides):
    """fp32: 4 + 4 + 8 bytes a parameter; bf16/fp16/FP8 with fp32 sums: 2 + 4 + 12 ("mixed-fp32-grads"); with
    16-bit sums: 2 + (2 + 4) + 12 (the playbook's fp32 gradient accumulation); ZeRO shards them as its ladder
    says. Padding aside (units are padded to a multiple of dp), to the byte."""
    ranks = run_ranks(_live_bytes, 2, precision, reduce_dtype, overrides) if overrides else \
        [_live_bytes(precision, reduce_dtype, overrides)]
    for measured, predicted in ranks:
        assert measured == predicted, (measured, predicted)


def test_kernels_in_the_interpreter_refuse_bf16_before_any_rank_starts(capsys):
    from lab.train import main

    assert main(["--kernels", "triton", "--precision", "fp8-tilewise", "--steps", "1", "--set",
                 "train.warmup_steps=0"]) == 2
    assert capsys.readouterr().err.strip().endswith("the kernels here take float32, float16; use --precision fp32 "
                                                    "or fp16, or --kernels eager")
