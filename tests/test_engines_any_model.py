"""lab's data-parallel and ZeRO engines on a model of the user's own (not `lab.model`), with DDP's and FSDP's
contracts, at 2 ranks: rank 0's weights and buffers are broadcast at wrap time, sharding units come from a policy,
the optimizer is torch's AdamW as the user builds it, the user's `optimizer.zero_grad()` is the only clearing,
and ZeRO-3's module parameters are the local shards, carrying `.grad` after `finish()`.

One launch runs every engine; the single process runs here. Each rank starts from different weights and a
different buffer (rank 1's are not the reference's): after wrapping, and after every step, its parameters must
be the single-process ones. Gradients are compared right after reduction, before the optimizer (which would
hide a uniform scale such as a missing 1/dp).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lab.distributed import run
from lab.parallel.dp import BucketedDP, NaiveDP
from lab.parallel.zero import Zero

WORLD, STEPS, GRAD_ACCUM, ROWS = 2, 3, 2, 8
ENGINES = ("naive", "bucketed", "bucketed-in-place", "zero1", "zero2", "zero2-list", "zero3")
ADAMW = dict(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.01)


class Mlp(nn.Module):
    """A residual MLP block; 165 parameters, which 2 does not divide (ZeRO pads)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 11), nn.Linear(11, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    """A user's model: no `layers`, a buffer that scales its features."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.blocks, self.head = nn.Linear(5, 7), nn.Sequential(Mlp(7), Mlp(7)), nn.Linear(7, 3, bias=False)
        self.register_buffer("scale", torch.ones(7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x) * self.scale))


def build(seed: int) -> Net:
    """Rank r builds its model from seed r: only rank 0's (seed 0) is the single process's."""
    torch.manual_seed(seed)
    model = Net()
    model.scale.uniform_(0.5, 1.5)
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, 5, generator=generator), torch.randn(ROWS, 3, generator=generator)


def wrap(kind: str, model: Net) -> tuple[NaiveDP | Zero, torch.optim.Optimizer]:
    """The engine and torch's AdamW, built as a user would: over the module's parameters (which ZeRO-3 has
    replaced by this rank's pieces), or over the engine's pieces for optimizer-state sharding (ZeRO-1/2)."""
    if kind == "naive":
        engine = NaiveDP(model, None)
    elif kind.startswith("bucketed"):
        engine = BucketedDP(model, None, bucket_mb=2e-4)  # 52 fp32 gradients a bucket: several buckets
    elif kind == "zero2-list":
        engine = Zero(list(model.parameters()), None, stage=2)
    elif kind == "zero3":
        engine = Zero(model, None, stage=3, units=lambda m: isinstance(m, Mlp))  # a policy as a function
    else:
        engine = Zero(model, None, stage=int(kind[-1]), units=Mlp)  # a policy as a module type
    params = engine.parameters() if kind in ("zero1", "zero2", "zero2-list") else model.parameters()
    return engine, torch.optim.AdamW(params, **ADAMW)


def full_values(engine: NaiveDP | Zero) -> dict[str, torch.Tensor]:
    values = engine.full_parameters()
    if isinstance(engine.model, nn.ParameterList):  # a plain list of parameters: named by position
        values = dict(zip((name for name, _ in Net().named_parameters()), values.values(), strict=True))
    return {name: value.numpy() for name, value in values.items()}


def reduced_gradients(kind: str, engine: NaiveDP | Zero, model: Net) -> dict[str, tuple[int, int, object]]:
    """Right after `finish()`: (start, end, gradient) of each parameter's local slice of `param.flatten()`,
    read where the contract says — `param.grad` (DDP; ZeRO-3's module parameters, its pieces), or the pieces'
    `.grad` (ZeRO-1/2)."""
    if kind.startswith("zero") and kind != "zero3":
        names = dict(zip(engine.names, (name for name, _ in Net().named_parameters()), strict=True))  # list: "0", ...
        return {names[name]: (*piece.flat_range, piece.grad.clone().numpy())
                for name, piece in engine.named_parameters()}
    grads = {}
    for name, param in model.named_parameters():
        start, end = getattr(param, "flat_range", (0, param.numel()))
        grads[name] = (start, end, param.grad.detach().clone().reshape(-1).numpy())
    return grads


def train(kind: str) -> dict:
    rank = dist.get_rank()
    model = build(seed=rank)
    if kind == "zero2-list":  # a list of parameters has no buffers: equal ones are the user's business
        model.scale.copy_(build(seed=0).scale)
    engine, optimizer = wrap(kind, model)
    trace = {"params": [full_values(engine)], "scale": model.scale.clone().numpy()}
    for step in range(STEPS):
        x, y = (t.chunk(WORLD)[rank] for t in batch(step))
        for i, (xm, ym) in enumerate(zip(x.chunk(GRAD_ACCUM), y.chunk(GRAD_ACCUM), strict=True)):
            with engine.backward_context(last_micro_batch=i == GRAD_ACCUM - 1):
                (F.mse_loss(model(xm), ym) / GRAD_ACCUM).backward()
        engine.finish()
        if step == 0:
            trace["grads"] = reduced_gradients(kind, engine, model)
        optimizer.step()
        engine.after_step()
        if kind == "bucketed-in-place":
            model.zero_grad(set_to_none=False)  # zeroes the bucket views in place
        else:
            optimizer.zero_grad()  # the user's own: no engine.zero_grad() anywhere
        trace["params"].append(full_values(engine))
    return trace


def train_every_engine() -> dict[str, dict]:
    torch.set_num_threads(1)
    return {kind: train(kind) for kind in ENGINES}


@functools.cache
def ranks() -> list[dict[str, dict]]:
    return run(train_every_engine, WORLD)


@functools.cache
def one_process() -> dict:
    """The whole batch in one process, torch's AdamW: the parameters after each step, the first gradients."""
    model = build(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    trace = {"params": [{n: p.detach().clone() for n, p in model.named_parameters()}], "scale": model.scale.clone()}
    for step in range(STEPS):
        x, y = batch(step)
        F.mse_loss(model(x), y).backward()
        if step == 0:
            trace["grads"] = {n: p.grad.clone().reshape(-1) for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        trace["params"].append({n: p.detach().clone() for n, p in model.named_parameters()})
    return trace


def assert_close(got, want: torch.Tensor, where: str, rel: float = 1e-5) -> None:
    """Per tensor, ‖got − want‖ ≤ rel·‖want‖: ranks sum in another order than one process."""
    error = (torch.as_tensor(got) - want).norm().item()
    assert error <= rel * want.norm().item() + 1e-7, f"{where}: ‖Δ‖ = {error:.2e}, ‖want‖ = {want.norm():.2e}"


def test_ranks_start_apart():
    """The test means something: rank 1's initial weights and buffer are not rank 0's."""
    assert not torch.equal(build(0).embed.weight, build(1).embed.weight)
    assert not torch.equal(build(0).scale, build(1).scale)


@pytest.mark.parametrize("kind", ENGINES)
def test_wrapping_broadcasts_rank0_weights_and_buffers(kind):
    want = one_process()
    for rank, result in enumerate(ranks()):
        for name, value in result[kind]["params"][0].items():
            assert_close(value, want["params"][0][name], f"{kind}, rank {rank}, {name} after wrapping", rel=0)
        if kind != "zero2-list":  # a list of parameters has no buffers: they stay the user's
            assert_close(result[kind]["scale"], want["scale"], f"{kind}, rank {rank}, buffer", rel=0)


@pytest.mark.parametrize("kind", ENGINES)
def test_equals_one_process_after_each_step(kind):
    """torch's AdamW(betas=(0.9, 0.999)), cleared only by the user's zero_grad: the single process's parameters
    after every step (stale gradients left in buckets or in ZeRO-1's buffers would add into the next step)."""
    want = one_process()
    for rank, result in enumerate(ranks()):
        for step in range(1, STEPS + 1):
            for name, value in result[kind]["params"][step].items():
                assert_close(value, want["params"][step][name], f"{kind}, rank {rank}, {name} after step {step}")


@pytest.mark.parametrize("kind", ENGINES)
def test_gradients_right_after_reduction(kind):
    """Each rank's local gradient, where the contract puts it, is its slice of the single-process gradient; the
    ranks' slices of each parameter cover it exactly once (sharded) or whole on each rank (replicated)."""
    want = one_process()["grads"]
    covered = {name: 0 for name in want}
    for rank, result in enumerate(ranks()):
        assert result[kind]["grads"].keys() <= want.keys()
        for name, (start, end, grad) in result[kind]["grads"].items():
            assert_close(grad, want[name][start:end], f"{kind}, rank {rank}, {name}[{start}:{end}]")
            covered[name] += end - start
    copies = 1 if kind.startswith("zero") else WORLD
    assert covered == {name: copies * grad.numel() for name, grad in want.items()}


def _zero3_contract() -> dict:
    """After ZeRO-3's `finish()`: is every module parameter one of the engine's pieces, with its `.grad`?"""
    torch.set_num_threads(1)
    model = build(seed=0)
    engine = Zero(model, None, stage=3, units=Mlp)
    x, y = batch(0)
    F.mse_loss(model(x), y).backward()
    engine.finish()
    pieces = {id(p) for p in engine.parameters()}
    return {name: (id(param) in pieces or param.numel() == 0, param.grad is not None and
                   param.grad.shape == param.shape, param.numel())
            for name, param in model.named_parameters()}


def test_zero3_module_parameters_are_the_local_shards():
    """FSDP's contract: outside forward, `model.parameters()` are this rank's pieces (empty where it holds none of
    a parameter) and each carries `.grad` after `finish()`; together the ranks' pieces are the whole model."""
    results = run(_zero3_contract, WORLD)
    for rank, result in enumerate(results):
        for name, (is_piece, has_grad, _) in result.items():
            assert is_piece and has_grad, f"rank {rank}: {name} is a piece: {is_piece}, has its .grad: {has_grad}"
    assert {n: sum(r[n][2] for r in results) for n in results[0]} == \
        {n: p.numel() for n, p in build(0).named_parameters()}


def test_zero3_needs_the_module():
    with pytest.raises(ValueError, match="stage=3 needs the module"):
        Zero(list(build(0).parameters()), None, stage=3)
