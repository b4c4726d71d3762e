"""ZeRO: data parallelism that stops replicating what it does not need to (Rajbhandari et al., 2020).

Plain data parallelism keeps a full copy of the parameters, the gradients and AdamW's two moments on every
rank. ZeRO shards them over the dp ranks, in three stages:

  stage 1  optimizer states: each rank runs AdamW on its 1/dp shard of the (flattened) parameters. The
           gradients are reduce-scattered (each rank receives the sum of its shard only) and the updated
           shards all-gathered: reduce-scatter + all-gather move the same bytes as one all-reduce.
           A unit's reduce-scatter starts as soon as backward has produced all its gradients, like a
           bucket of `BucketedDP`; the full gradient buffers stay allocated, reused every step.
  stage 2  + gradients: a unit's full gradient is freed as soon as its reduce-scatter is done, during
           backward; only the shard's gradient stays. The same bytes again.
  stage 3  + parameters (FSDP): only the shard of the parameters stays. A block's parameters are gathered
           just before its forward, freed after it, gathered again just before its backward and freed once
           its gradient is reduce-scattered: 3x the parameters' bytes on the wire instead of 2x.

The unit of sharding is one transformer block, plus a root unit for everything else (embedding, final norm,
output layer), which stays gathered through the whole forward and the whole backward, as FSDP's root does.
A unit's parameters are copied into one flat buffer padded so that dp divides its length (parameter counts
rarely divide evenly), and the model's parameters become views of it. ZeRO-3 frees the buffer by resizing
its storage to zero bytes (FSDP1's trick): the parameter tensors — and the views autograd saved for
backward — stay valid objects, and see the values again once the buffer is gathered again.

The optimizer is the caller's (torch's AdamW in `lab.train`), built over `Zero.parameters()`: one Parameter
per piece (a parameter ∩ this rank's shard), views of the shard, so the update lands in it in place; weight
decay applies to pieces of ≥2-D parameters only, and any LR scheduler can drive it. Clipping needs the
*global* gradient norm: each piece's placement says it lives on this rank only, so the squares of every
rank's shard add up to the norm in one all-reduce of a number (`lab.parallel.optim.clip_grad_norm`).
"""

from __future__ import annotations

import dataclasses
import functools
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch import nn

from lab.model import Block
from lab.parallel.dp import BucketedDP, DataParallel, NaiveDP, OverlappedDP, storage_bytes
from lab.parallel.placement import place, placement_of, set_replicas

DP_MODES = {"naive": NaiveDP, "overlapped": OverlappedDP, "bucketed": BucketedDP}


class Unit:
    """The parameters of one block (or of the root) in one flat buffer that the dp ranks shard."""

    def __init__(self, params: list[nn.Parameter], rank: int, world: int, stage: int,
                 reduce_dtype: torch.dtype = torch.float32) -> None:
        self.params = params
        self.shard_numel = -(-sum(p.numel() for p in params) // world)  # ceil: the last shard ends in padding
        self.full = torch.zeros(self.shard_numel * world, dtype=params[0].dtype, device=params[0].device)
        self.offsets: dict[nn.Parameter, int] = {}
        offset = 0
        with torch.no_grad():
            for param in params:
                self.full[offset:offset + param.numel()].copy_(param.reshape(-1))
                param.data = self.full[offset:offset + param.numel()].view_as(param)
                self.offsets[param] = offset
                offset += param.numel()
        self.start = rank * self.shard_numel  # this rank's shard is full[start:start + shard_numel]
        shard = self.full[self.start:self.start + self.shard_numel]
        self.shard = shard.clone() if stage == 3 else shard  # ZeRO-3 frees `full`: the shard needs its own memory
        # Gradients in reduce_dtype: summed over micro-batches and reduce-scattered in it (fp32 under bf16 weights)
        self.reduce_dtype = reduce_dtype
        self.shard_grad = torch.zeros_like(self.shard, dtype=reduce_dtype)
        self.grad: torch.Tensor | None = torch.zeros_like(self.full, dtype=reduce_dtype) if stage == 1 else None
        self.ready = 0  # parameters whose gradient of this backward pass is in `grad`
        self.reduced = False  # reduce-scatter launched this step
        self.gathered, self.in_backward = stage < 3, False
        self.gather_handle: dist.Work | None = None
        self.next_forward: Unit | None = None  # the unit to prefetch while this one computes (ZeRO-3)
        self.next_backward: Unit | None = None

    def pieces(self) -> list[tuple[torch.Tensor, torch.Tensor, nn.Parameter]]:
        """(piece of the shard, its gradient, the parameter it is a piece of) for each parameter in the shard."""
        end = self.start + self.shard_numel
        result = []
        for param, offset in self.offsets.items():
            lo, hi = max(offset, self.start) - self.start, min(offset + param.numel(), end) - self.start
            if lo < hi:
                result.append((self.shard[lo:hi], self.shard_grad[lo:hi], param))
        return result


class Zero(DataParallel):
    """ZeRO stage 1, 2 or 3 over the ranks of `group`, with the training loop of `lab.parallel.dp`.

    `prefetch` (stage 3) starts gathering the next unit — in forward order, then in backward order —
    while the current one computes, so that its all-gather overlaps compute instead of waiting.
    Under `no_sync()` the full gradients of every unit accumulate locally until the last micro-batch (memory
    traded for communication, as FSDP2's `set_requires_gradient_sync(False)` does). Every parameter must get
    a gradient in every backward pass: a unit is complete when all of its parameters have one.
    """

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None, stage: int, prefetch: bool = True,
                 reduce_dtype: torch.dtype = torch.float32) -> None:
        if stage not in (1, 2, 3):
            raise ValueError(f"stage={stage!r} must be 1, 2 or 3 (stage 0 is plain data parallelism)")
        super().__init__(model, group, reduce_dtype)
        self.stage, self.prefetch = stage, prefetch
        blocks = [m for m in model.modules() if isinstance(m, Block)]  # also in a pipeline rank's chunks
        in_blocks = {p for block in blocks for p in block.parameters()}
        owners = [(model, [p for p in self.params if p not in in_blocks])]  # the root: all outside the blocks
        owners += [(block, [p for p in block.parameters() if p.requires_grad]) for block in blocks]
        owners = [(module, params) for module, params in owners if params]
        self.units = [Unit(params, dist.get_rank(group), self.world, stage, reduce_dtype) for _, params in owners]
        self._in_flight: tuple[Unit, dist.Work] | None = None  # the reduce-scatter still running
        for unit in self.units:
            for param in unit.params:
                param.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, unit))
        if stage == 3:
            self._shard_parameters([module for module, _ in owners])
        # The optimizer sees one Parameter per piece of this rank's shard: views, so its update lands in the
        # shard. A piece keeps its parameter's placement (held by 1/world of the ranks that held the parameter)
        # and whether it decays (a piece of a matrix does).
        self.pieces = []
        for unit in self.units:
            for shard, grad, param in unit.pieces():
                piece = nn.Parameter(shard)
                spot = placement_of(param)
                place(piece, dataclasses.replace(spot, replicas=spot.replicas // self.world if spot.replicas else 1))
                piece.decays = param.dim() >= 2
                self.pieces.append((piece, grad))

    # --- ZeRO-3: gather each unit just in time, free it right after ----------------------------------------

    def _shard_parameters(self, modules: list[nn.Module]) -> None:
        root_first = modules[0] is self.model
        backward = self.units[:1] + self.units[:0:-1] if root_first else self.units[::-1]
        for order, attribute in ((self.units, "next_forward"), (backward, "next_backward")):
            for unit, following in zip(order, order[1:], strict=False):
                setattr(unit, attribute, following)
        for unit, module in zip(self.units, modules, strict=True):
            self._free(unit)
            module.register_forward_pre_hook(functools.partial(self._before_forward, unit))
            module.register_forward_hook(functools.partial(self._after_forward, unit))

    def _gather(self, unit: Unit | None, wait: bool = True) -> None:
        if unit is None:
            return
        if not unit.gathered:
            unit.full.untyped_storage().resize_(unit.full.numel() * unit.full.element_size())
            unit.gather_handle = dist.all_gather_into_tensor(unit.full, unit.shard, group=self.group, async_op=True)
            unit.gathered = True
        if wait and unit.gather_handle is not None:
            unit.gather_handle.wait()
            unit.gather_handle = None

    def _free(self, unit: Unit) -> None:
        unit.full.untyped_storage().resize_(0)
        unit.gathered = False

    def _before_forward(self, unit: Unit, module: nn.Module, args: tuple) -> None:
        if unit.in_backward:  # activation checkpointing recomputes the forward inside backward: already gathered
            return
        self._gather(unit)
        if self.prefetch:
            self._gather(unit.next_forward, wait=False)

    def _after_forward(self, unit: Unit, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if unit.in_backward:
            return
        if isinstance(output, torch.Tensor) and output.requires_grad:  # its gradient arrives just before backward
            output.register_hook(functools.partial(self._before_backward, unit))
        self._free(unit)

    def _before_backward(self, unit: Unit, grad: torch.Tensor) -> None:
        unit.in_backward = True
        self._gather(unit)
        if self.prefetch:
            self._gather(unit.next_backward, wait=False)

    # --- gradients: into the unit's flat buffer, reduce-scattered once the unit is complete ----------------

    @torch.no_grad()
    def _on_grad_ready(self, unit: Unit, param: nn.Parameter) -> None:
        if unit.grad is None:
            unit.grad = torch.zeros(unit.full.shape, dtype=unit.reduce_dtype, device=unit.full.device)
        offset = unit.offsets[param]
        unit.grad[offset:offset + param.numel()].add_(param.grad.reshape(-1))
        param.grad = None
        unit.ready += 1
        if unit.ready == len(unit.params):  # the unit's backward is over
            unit.ready = 0
            if self.stage == 3:
                self._free(unit)
                unit.in_backward = False
            if self.sync:
                self._reduce_scatter(unit)

    def _reduce_scatter(self, unit: Unit) -> None:
        self._wait_reduce_scatter()  # one in flight at a time: ZeRO-2/3 free a unit's full gradient soon after
        unit.grad.div_(self.world)
        handle = dist.reduce_scatter_tensor(unit.shard_grad, unit.grad, group=self.group, async_op=True)
        self._in_flight, unit.reduced = (unit, handle), True

    def _wait_reduce_scatter(self) -> None:
        if self._in_flight is not None:
            unit, handle = self._in_flight
            handle.wait()
            if self.stage >= 2:
                unit.grad = None  # only the shard's gradient stays
            self._in_flight = None

    # --- the step ------------------------------------------------------------------------------------------

    def finish(self) -> None:
        """Wait for the reduce-scatters; afterwards each rank holds the averaged gradient of its shard. Units that
        were not reduce-scattered during backward (a pipeline runs every micro-batch under `no_sync()`) are now."""
        for i, unit in enumerate(self.units):
            if not unit.reduced:
                if unit.grad is None or unit.ready:
                    raise RuntimeError(f"unit {i} has parameters without a gradient: every parameter must get one in "
                                       f"every backward pass")
                self._reduce_scatter(unit)
        self._wait_reduce_scatter()
        for unit in self.units:
            unit.reduced = False
        for piece, grad in self.pieces:  # a bf16 piece cannot hold an fp32 .grad: main_grad, as in lab.parallel.dp
            if piece.dtype == grad.dtype:
                piece.grad = grad
            else:
                piece.main_grad = grad

    def parameters(self) -> list[torch.Tensor]:
        """What this rank's optimizer updates: the pieces of its shards (views: the update lands in the shard)."""
        return [piece for piece, _ in self.pieces]

    def after_step(self) -> None:
        """Stages 1-2 all-gather the updated shards into the full parameters (stage 3 gathers them when the next
        forward needs them)."""
        if self.stage < 3:
            handles = [dist.all_gather_into_tensor(unit.full, unit.shard, group=self.group, async_op=True)
                       for unit in self.units]
            for handle in handles:
                handle.wait()

    def zero_grad(self) -> None:
        for piece, _ in self.pieces:
            piece.grad = None
        if self.stage == 1:
            for unit in self.units:
                unit.grad.zero_()

    def resident_tensors(self, optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor | None]]:
        """The tensors held right now as parameters (full buffers while gathered, shards), gradients (full flat
        buffers while they exist, shards) and `optimizer`'s states; `resident_bytes` measures them."""
        params = [p for unit in self.units for p in unit.params] + [unit.shard for unit in self.units]
        grads = [unit.grad for unit in self.units] + [unit.shard_grad for unit in self.units]
        states = [t for state in optimizer.state.values() for t in state.values()]
        return {"params": params, "grads": grads, "optimizer": states}

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """A copy of every parameter's full value, by name, on every rank (to compare with a single process
        or to save a checkpoint). ZeRO-3 all-gathers each unit into a temporary buffer for it."""
        values = {}
        for unit in self.units:
            full = unit.full
            if self.stage == 3:
                full = torch.empty(unit.full.shape, dtype=unit.full.dtype, device=unit.full.device)
                dist.all_gather_into_tensor(full, unit.shard, group=self.group)
            for param, offset in unit.offsets.items():
                values[param] = full[offset:offset + param.numel()].view(param.shape).clone()
        return {name: values[param] for name, param in self.model.named_parameters() if param in values}


class TorchFSDP2(NaiveDP):
    """The production API that does ZeRO-3's job — torch's FSDP2, `fully_shard` on each block then on the
    root, parameters as DTensors sharded on dim 0 — behind the same loop, for side-by-side checks and
    benchmarks. Accumulation: `set_requires_gradient_sync(False)` keeps unsharded gradients, as `no_sync` does."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(group or dist.group.WORLD, "cuda" if dist.get_backend(group) == "nccl" else "cpu")
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        super().__init__(model, group)  # the parameters are now DTensor shards
        set_replicas(self.params, 1)  # each shard on one rank only

    def backward_context(self, last_micro_batch: bool) -> AbstractContextManager:
        self.model.set_requires_gradient_sync(last_micro_batch)
        return nullcontext()

    def finish(self) -> None:
        """Nothing to wait for: FSDP2's backward returns once its reduce-scatters are done."""

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {name: param.full_tensor().clone() for name, param in self.model.named_parameters()}

    def resident_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        def local(tensors):
            return [t.to_local() if hasattr(t, "to_local") else t for t in tensors if t is not None]

        states = [t for state in optimizer.state.values() for t in state.values()]
        return {"params": storage_bytes(local(self.params)), "grads": storage_bytes(local(p.grad for p in self.params)),
                "optimizer": storage_bytes(local(states))}


def make_data_parallel(model: nn.Module, group: dist.ProcessGroup | None, *, zero: int = 0,
                       dp_mode: str = "bucketed", bucket_mb: float = 25.0,
                       reduce_dtype: torch.dtype = torch.float32) -> NaiveDP | Zero:
    """Plain data parallelism (`dp_mode`) for zero=0, else ZeRO-`zero`, over `group`, summing gradients in
    `reduce_dtype`.

    Works for a single process too (zero=0, no process group): nothing is communicated. ZeRO needs an
    initialised process group.
    """
    if zero:
        if not dist.is_initialized():
            raise ValueError(f"zero={zero} needs a process group: start ranks with lab.distributed.run or torchrun")
        return Zero(model, group, zero, reduce_dtype=reduce_dtype)
    if dp_mode not in DP_MODES:
        raise ValueError(f"dp_mode={dp_mode!r} must be one of {', '.join(map(repr, DP_MODES))}")
    options = {"bucket_mb": bucket_mb} if dp_mode == "bucketed" else {}
    return DP_MODES[dp_mode](model, group, reduce_dtype=reduce_dtype, **options)
