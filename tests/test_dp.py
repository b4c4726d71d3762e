"""Data parallelism (naive, overlapped, bucketed) on real gloo ranks equals one process, and torch's DDP.

The harness here (`train`, `assert_matches_reference`) is shared with tests/test_zero.py: every variant
runs the same loop — micro-batches, `finish`, clipping, AdamW with an LR schedule — on the same global
batches, and must give the single-process run's per-step losses and final parameters.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lab.config import ModelConfig, TrainConfig
from lab.data import SyntheticTokens, shard_rows
from lab.distributed import count_collectives, run
from lab.model import build_model, materialize, set_recompute
from lab.parallel.dp import BucketedDP, NaiveDP, TorchDDP
from lab.parallel.optim import adamw, clip_grad_norm
from lab.parallel.zero import TorchFSDP2, make_data_parallel

# The tiny preset with 2 layers and odd widths: no parameter count divides by 2 or 4, so ZeRO pads its shards.
CONFIG = ModelConfig.from_preset("tiny", n_layers=2, d_model=33, d_ff=37, vocab_size=97)
# The same with experts in its second block and the output layer sharing the embedding's weight.
MODELS = {"tiny": CONFIG, "tied-moe": ModelConfig.from_preset(
    "tiny-moe", n_layers=2, n_dense_layers=1, d_model=33, d_ff=37, d_ff_expert=19, vocab_size=97, tie_embeddings=True)}
TRAIN = TrainConfig(global_batch=12, seq_len=16, lr=3e-3, weight_decay=0.1, grad_clip=1.0)  # 12 = dp*grad_accum*k
STEPS = 3
BUCKET_MB = 0.01  # 2,621 fp32 gradients per bucket: about ten buckets for this model


def make_engine(kind: str, model: nn.Module, bucket_mb: float = BUCKET_MB):
    """"single", a DP mode ("naive", "overlapped", "bucketed"), "zero1".."zero3", "ddp" or "fsdp2"."""
    if kind == "ddp":
        return TorchDDP(model, None, bucket_mb)
    if kind == "fsdp2":
        return TorchFSDP2(model, None)
    zero = int(kind[-1]) if kind.startswith("zero") else 0
    dp_mode = "naive" if kind == "single" or zero else kind
    return make_data_parallel(model, None, zero=zero, dp_mode=dp_mode, bucket_mb=bucket_mb)


def micro_batches(step_batch: tuple[torch.Tensor, torch.Tensor], grad_accum: int) -> list[tuple]:
    """This rank's rows of the global batch, split into `grad_accum` micro-batches."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    inputs, targets = (shard_rows(t, rank, world) for t in step_batch)
    return list(zip(inputs.chunk(grad_accum), targets.chunk(grad_accum), strict=True))


def train(kind: str, grad_accum: int = 1, steps: int = STEPS, recompute: str = "none",
          model_name: str = "tiny") -> dict:
    """The training loop `lab.train` runs, with engine `kind`; per-step losses and final parameters (numpy:
    lab.distributed.run cannot send tensors back)."""
    config = MODELS[model_name]
    model = materialize(build_model(config), seed=0)
    set_recompute(model, recompute)
    engine = make_engine(kind, model)
    optimizer = adamw(engine.parameters(), TRAIN.lr, TRAIN.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (step + 1) / steps)  # warm-up
    data = SyntheticTokens(config.vocab_size, TRAIN.seq_len, TRAIN.global_batch, seed=0)
    losses = []
    for _ in range(steps):
        loss = torch.zeros(())
        batches = micro_batches(data.next_batch(), grad_accum)
        for i, (x, y) in enumerate(batches):
            with engine.backward_context(last_micro_batch=i == len(batches) - 1):
                micro_loss = F.cross_entropy(engine.model(x).flatten(0, 1), y.flatten())
                (micro_loss / grad_accum).backward()
            loss += micro_loss.detach() / grad_accum
        engine.finish()
        clip_grad_norm(engine.parameters(), TRAIN.grad_clip)
        optimizer.step()
        engine.after_step()
        scheduler.step()
        engine.zero_grad()
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        losses.append(loss.item())
    return {"losses": losses, "params": {name: t.numpy() for name, t in engine.full_parameters().items()}}


def train_variants(kinds: tuple[str, ...], grad_accums: tuple[int, ...] = (1, 3),
                   model_name: str = "tiny") -> dict[tuple[str, int], dict]:
    """Every (kind, grad_accum) in one launch: starting ranks costs more than training this model."""
    return {(kind, accum): train(kind, accum, model_name=model_name) for kind in kinds for accum in grad_accums}


@functools.cache
def dp_runs(world: int) -> dict[tuple[str, int], dict]:
    return run(train_variants, world, ("naive", "overlapped", "bucketed", "ddp"))[0]


@functools.cache
def reference(model_name: str = "tiny") -> dict:
    """One process, the whole global batch in one backward pass: the ground truth."""
    return train("single", model_name=model_name)


def assert_matches_reference(result: dict, rel: float = 1e-5, model_name: str = "tiny") -> None:
    """Per-step losses within `rel`, and every final parameter tensor within `rel` (‖got − want‖ / ‖want‖).
    Per tensor, not per element: Adam turns float rounding in a near-zero gradient into a visible change of
    that one weight — by the same amount in torch's DDP and FSDP2 — so element-wise checks would be brittle."""
    expected = reference(model_name)
    for step, (got, want) in enumerate(zip(result["losses"], expected["losses"], strict=True), start=1):
        assert abs(got - want) <= rel * abs(want), f"step {step}: loss {got} vs {want}"
    assert result["params"].keys() == expected["params"].keys()
    for name, want in expected["params"].items():
        want, got = torch.from_numpy(want), torch.from_numpy(result["params"][name])
        assert got.shape == want.shape, name
        error = ((got - want).norm() / want.norm()).item()
        assert error <= rel, f"{name}: relative error {error:.1e}"


@pytest.mark.parametrize("grad_accum", [1, 3])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", ["naive", "overlapped", "bucketed"])
def test_data_parallel_equals_one_process(mode, world, grad_accum):
    assert_matches_reference(dp_runs(world)[mode, grad_accum])


@pytest.mark.parametrize("grad_accum", [1, 3])
@pytest.mark.parametrize("world", [2, 4])
def test_torch_ddp_gives_the_same_as_lab(world, grad_accum):
    """torch DDP with small buckets (bucket_cap_mb=BUCKET_MB) and no_sync(): the same losses and parameters."""
    assert_matches_reference(dp_runs(world)["ddp", grad_accum])


def _first_batch() -> tuple[torch.Tensor, torch.Tensor]:
    return SyntheticTokens(CONFIG.vocab_size, TRAIN.seq_len, TRAIN.global_batch, seed=0).batch(0)


def _one_step_counts(mode: str, grad_accum: int) -> dict:
    model = materialize(build_model(CONFIG), seed=0)
    engine = make_engine(mode, model)
    per_backward = []
    for i, (x, y) in enumerate(micro_batches(_first_batch(), grad_accum)):
        with count_collectives() as counts, engine.backward_context(last_micro_batch=i == grad_accum - 1):
            (F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / grad_accum).backward()
        per_backward.append((dict(counts.calls), dict(counts.bytes)))
    with count_collectives() as at_finish:
        engine.finish()
    return {"backward": per_backward, "finish": (dict(at_finish.calls), dict(at_finish.bytes)),
            "n_params": len(engine.params), "grad_bytes": sum(4 * p.numel() for p in engine.params),
            "n_buckets": len(engine.buckets) if isinstance(engine, BucketedDP) else None}


def _count_all_modes(grad_accum: int) -> dict:
    return {mode: _one_step_counts(mode, grad_accum) for mode in ("naive", "overlapped", "bucketed")}


def test_all_reduce_volume_timing_and_no_sync():
    """All-reduce bytes = gradient bytes, in one call per parameter or per bucket; naive sends after backward,
    the others during it; micro-batches under no_sync send nothing."""
    for mode, c in run(_count_all_modes, 2, 3)[0].items():
        assert c["backward"][0] == c["backward"][1] == ({}, {}), mode  # no_sync: accumulate only
        calls = c["n_buckets"] if mode == "bucketed" else c["n_params"]
        expected = ({"all_reduce": calls}, {"all_reduce": c["grad_bytes"]})
        during, after = c["backward"][2], c["finish"]
        assert (during, after) == ((({}, {}), expected) if mode == "naive" else (expected, ({}, {}))), mode


@pytest.mark.parametrize("bucket_mb", [1e-4, 0.01, 0.05, 100.0])
def test_bucket_layout(bucket_mb):
    """Buckets take the parameters in reverse order and close at the first parameter that brings them to
    at least bucket_mb MiB (torch DDP's rule): these three facts fix the layout."""
    engine = BucketedDP(materialize(build_model(CONFIG)), None, bucket_mb=bucket_mb)
    cap = int(bucket_mb * 2**20) // 4
    assert [p for b in engine.buckets for p in b.params] == engine.params[::-1]
    assert all(b.buffer.numel() >= cap for b in engine.buckets[:-1])
    assert all(b.buffer.numel() - b.params[-1].numel() < cap for b in engine.buckets)
    assert sum(engine.bucket_sizes) == 4 * sum(p.numel() for p in engine.params)
    expected_count = {1e-4: len(engine.params), 0.01: 8, 0.05: 2, 100.0: 1}[bucket_mb]  # worked by hand
    assert len(engine.buckets) == expected_count
    for bucket in engine.buckets:
        for param in bucket.params:
            assert param.main_grad.untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr()


def test_single_process_and_bad_mode():
    model = materialize(build_model(CONFIG))
    assert type(make_data_parallel(model, None, dp_mode="naive")) is NaiveDP  # dp=1: no process group
    with pytest.raises(ValueError, match="dp_mode='ring' must be one of 'naive', 'overlapped', 'bucketed'"):
        make_data_parallel(model, None, dp_mode="ring")


# --- gradients right after finish(), before clipping and the optimizer ----------------------------------------
# AdamW with clipping hides a uniform scale of the gradients (a missing 1/dp), so compare the gradients themselves.

def _named_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient by name; a parameter that got none has gradient zero."""
    return {name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
            for name, p in model.named_parameters()}


@functools.cache
def reference_grads() -> dict[str, torch.Tensor]:
    """One process, the whole first batch in one backward pass."""
    model = materialize(build_model(CONFIG), seed=0)
    x, y = _first_batch()
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    return _named_grads(model)


def engine_after_finish(kind: str, grad_accum: int):
    """The engine `kind` after the backward passes and `finish()` of the first step (nothing after it)."""
    engine = make_engine(kind, materialize(build_model(CONFIG), seed=0))
    batches = micro_batches(_first_batch(), grad_accum)
    for i, (x, y) in enumerate(batches):
        with engine.backward_context(last_micro_batch=i == len(batches) - 1):
            (F.cross_entropy(engine.model(x).flatten(0, 1), y.flatten()) / grad_accum).backward()
    engine.finish()
    return engine


def assert_grads_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rel: float = 1e-5) -> None:
    """Per tensor: ‖got − want‖ ≤ rel·‖want‖ (summation order differs between ranks and one process)."""
    assert got.keys() == want.keys()
    for name, expected in want.items():
        error = (got[name] - expected).norm().item()
        assert error <= rel * expected.norm().item() + 1e-12, \
            f"{name}: ‖Δ‖ = {error:.2e}, ‖grad‖ = {expected.norm():.2e}, ratio {got[name].norm() / expected.norm():.3f}"


def _dp_grads(grad_accum: int) -> dict[str, dict[str, torch.Tensor]]:
    return {kind: _named_grads(engine_after_finish(kind, grad_accum).model) for kind in ("naive", "overlapped",
                                                                                         "bucketed", "ddp")}


@pytest.mark.parametrize("world,grad_accum", [(2, 1), (4, 3)])
def test_averaged_gradients_equal_one_process_right_after_finish(world, grad_accum):
    """The all-reduced gradient is the mean over ranks: a sum (a missing 1/dp) is off by exactly dp."""
    for rank, by_kind in enumerate(run(_dp_grads, world, grad_accum)):
        for kind, grads in by_kind.items():
            assert_grads_close({name.removeprefix("module."): g for name, g in grads.items()}, reference_grads()), \
                (kind, rank)


# --- a parameter that gets no gradient: unused, or used on some ranks only -----------------------------------

class Branchy(nn.Module):
    """Four 8→8 layers and a parameter no forward uses; `sometimes` runs only when asked (on some ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.zeroth, self.first = nn.Linear(8, 8), nn.Linear(8, 8)
        self.unused = nn.Linear(8, 1, bias=False)  # a module, so that it sits between first and sometimes
        self.sometimes, self.last = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_sometimes: bool) -> torch.Tensor:
        h = torch.tanh(self.first(torch.tanh(self.zeroth(x))))
        if use_sometimes:
            h = h + torch.tanh(self.sometimes(h))
        return self.last(h)


# About 64 fp32 gradients (a Linear has 72): buckets [last] [sometimes] [unused, first] [zeroth].
BRANCHY_BUCKET_MB = 64 * 4 / 2**20


def _branchy_batch(rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))


def _branchy_grads() -> dict:
    """BucketedDP on a model where rank 0 uses `sometimes` and the others do not, and nobody uses `unused`."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Branchy()
    engine = BucketedDP(model, None, bucket_mb=BRANCHY_BUCKET_MB)
    with count_collectives() as counts:
        model(_branchy_batch(rank), use_sometimes=rank == 0).pow(2).mean().backward()
        engine.finish()
    return {"grads": _named_grads(model), "calls": dict(counts.calls), "n_buckets": len(engine.buckets),
            "bucket_params": [len(b.params) for b in engine.buckets]}


@pytest.mark.parametrize("world", [2, 3])
def test_bucketed_dp_with_parameters_that_get_no_gradient(world):
    """A bucket whose parameter got no gradient on this rank must still be all-reduced — and in the same order
    on every rank, as torch DDP's reducer does (buckets go out strictly in index order): otherwise the replicas
    drift, or one rank's bucket is averaged with another rank's different bucket."""
    torch.manual_seed(0)
    model = Branchy()
    losses = [model(_branchy_batch(r), use_sometimes=r == 0).pow(2).mean() for r in range(world)]
    (sum(losses) / world).backward()
    expected = _named_grads(model)
    results = run(_branchy_grads, world)
    assert results[0]["bucket_params"] == [2, 2, 3, 2]  # the layout the model was built for
    for rank, result in enumerate(results):
        assert result["calls"] == {"all_reduce": result["n_buckets"]}, rank  # one all-reduce per bucket
        assert_grads_close(result["grads"], expected)
        for name, grad in result["grads"].items():
            assert torch.equal(grad, results[0]["grads"][name]), f"rank {rank} drifted from rank 0 in {name}"
