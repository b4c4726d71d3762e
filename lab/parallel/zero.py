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

The units of sharding are chosen by a policy, as FSDP2's `fully_shard` is applied per submodule: `units=` a
module type (lab's `Block` by default: one transformer block per unit), a tuple of types, or a function of a
submodule saying whether it is a unit; a root unit holds everything left (embedding, final norm, output layer).
Stages 1-2 also take a plain list of parameters (one unit, like torch's `ZeroRedundancyOptimizer`).
A unit's parameters are copied into one flat buffer padded so that dp divides its length (parameter counts
rarely divide evenly), and the model's parameters become views of it. ZeRO-3 frees the buffer by resizing
its storage to zero bytes (FSDP1's trick): the parameter tensors — and the views autograd saved for
backward — stay valid objects, and see the values again once the buffer is gathered again.

The optimizer is the caller's — any `torch.optim.Optimizer` (lab.train's is `lab.parallel.optim.adamw`) —
built over `Zero.parameters()`: one Parameter per piece (a parameter ∩ this rank's shard, flattened), views of
the shard, so the update lands in it in place. `piece.flat_range` is its (start, end) in `param.flatten()`,
`piece.decays` whether it is a piece of a ≥2-D parameter (lab's AdamW decays only those); any LR scheduler can
drive it. Clipping needs the *global* gradient norm: each piece's placement says it lives on this rank only, so
the squares of every rank's shard add up to the norm in one all-reduce of a number
(`lab.parallel.optim.clip_grad_norm`).

Where the gradients are, after `finish()`: each piece's `.grad` (`main_grad` for a bf16 piece) is the average
over ranks of its slice of the gradient. ZeRO-3 also keeps FSDP's contract (FSDP1's `use_orig_params`): outside
its forward the module's parameters *are* this rank's pieces — `model.named_parameters()` yields each parameter's
piece, empty where the shard holds none of it — so `torch.optim.AdamW(model.parameters())` and a look at
`param.grad` work as in FSDP2 (whose shards are dim-0 rows of each parameter rather than flat slices);
`full_parameters()` gathers the full values. Stages 1-2 keep the whole parameters on the module, as DDP does.

FP8 all-gather (`fp8_all_gather=True`, stage 3; torchao's float8 all-gather for FSDP2, `Float8LinearConfig(
enable_fsdp_float8_all_gather=True)`, torchao/float8/README.md and torchao/float8/fsdp_utils.py): ZeRO-3 moves
the parameters' bytes three times a step, so gathering them in a 1-byte format halves the traffic of a bf16
gather (a quarter of fp32's). Each rank casts its shard to E4M3 with one scale per parameter, gathers the uint8
bytes (gloo and NCCL both gather uint8; neither knows float8) and divides by the scale after the gather: the
model computes with the dequantized values, while the shard the optimizer updates stays exact (the FP8 copy
exists only for compute), and the gradients are reduce-scattered in `reduce_dtype` as before. The scale must
be the same on every rank, or rank 1's bytes would be read back with rank 0's scale: each rank takes the amax
of its pieces of each parameter, and one all-reduce(MAX) of those (one number per parameter of the unit) gives
every rank the parameter's amax, hence one tensorwise scale — what torchao does, so that the gathered FP8
weight can feed a tensorwise FP8 GEMM as it is. The other choice, one scale per shard gathered beside the
bytes, needs no collective before the cast (the all-reduce is a small, latency-bound call that cannot overlap
its own gather) and follows outliers more finely, but a parameter cut across two shards then carries two
scales, which no tensorwise GEMM takes. torchao gathers only the weights of its FP8 linears this way, which the
GEMM casts to FP8 with that same scale anyway (so the gather adds no error there); lab gathers every parameter
of the unit in FP8, so here the weights the model computes with are the FP8 values: the price is measured in
tests/test_zero_fp8_gather.py and chapter 10. torchao also computes the amaxes once per step for all
parameters (`precompute_float8_dynamic_scale_for_fsdp`); lab computes them at each gather (forward and
backward), from the same shard, so both gathers give the same values.

Checkpoints: a flat piece cuts matrices mid-row, so it is no box of its parameter; `state_boxes` and `load_boxes`
gather each unit back into whole parameters (the same boxes on every dp rank, which DCP writes once), and
`lab.checkpoint` sees only boxes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch import nn

from lab.config import DP_MODES
from lab.distributed import all_gather_single, reduce_scatter_single
from lab.model import Block
from lab.parallel.dp import (
    WEIGHT,
    BucketedDP,
    DataParallel,
    NaiveDP,
    OverlappedDP,
    ParamBox,
    broadcast_from_first_rank,
    storage_bytes,
)
from lab.parallel.placement import place, placement_of, set_replicas
from lab.precision.fp8 import Scaling, amax, dequantize, quantize, scale_from_amax

DP_ENGINES = {"naive": NaiveDP, "overlapped": OverlappedDP, "bucketed": BucketedDP}  # the engine of each --dp-mode
assert tuple(DP_ENGINES) == DP_MODES, f"lab.config.DP_MODES {DP_MODES} and DP_ENGINES {tuple(DP_ENGINES)} differ"

# How ZeRO-3's FP8 all-gather casts a parameter: E4M3, one current scale per tensor (torchao's float8 all-gather)
FP8_GATHER = Scaling("e4m3", "tensor")

# Which submodules are sharding units: a module type, a tuple of types, or a function of a submodule
UnitPolicy = type[nn.Module] | tuple[type[nn.Module], ...] | Callable[[nn.Module], bool]


def sharding_units(model: nn.Module, units: UnitPolicy) -> list[nn.Module]:
    """The submodules of `model` that the policy `units` selects, in module order. A module inside a selected one
    belongs to that unit (the outermost wins), as a parameter belongs to one unit only."""
    selects = (lambda m: isinstance(m, units)) if isinstance(units, type | tuple) else units
    chosen, inside = [], None  # named_modules() walks depth first: a unit's submodules follow it
    for name, module in model.named_modules():
        if inside is not None and name.startswith(inside):
            continue
        if module is not model and selects(module):
            chosen.append(module)
            inside = f"{name}."
    return chosen


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
        self.handed_out = False  # `grad` holds the sum finish() reduced (ZeRO-1 keeps the buffer between steps)
        self.gathered, self.in_backward = stage < 3, False
        self.gather_handle: dist.Work | None = None
        self.fp8: tuple[torch.Tensor, torch.Tensor] | None = None  # gathered FP8 bytes and scales, to dequantize
        self.next_forward: Unit | None = None  # the unit to prefetch while this one computes (ZeRO-3)
        self.next_backward: Unit | None = None

    def ranges(self) -> list[tuple[int, int, nn.Parameter]]:
        """(lo, hi, parameter) for each parameter in this rank's shard: its piece is `shard[lo:hi]`."""
        end = self.start + self.shard_numel
        result = []
        for param, offset in self.offsets.items():
            lo, hi = max(offset, self.start) - self.start, min(offset + param.numel(), end) - self.start
            if lo < hi:
                result.append((lo, hi, param))
        return result


class Zero(DataParallel):
    """ZeRO stage 1, 2 or 3 over the ranks of `group`, with the training loop of `lab.parallel.dp`.

    `model` is any module, its units chosen by `units` (see `UnitPolicy`; lab's `Block` by default, also inside
    a pipeline rank's chunks), or for stages 1-2 a plain list of parameters. Rank 0's values are broadcast first.
    `prefetch` (stage 3) starts gathering the next unit — in forward order, then in backward order —
    while the current one computes, so that its all-gather overlaps compute instead of waiting.
    `fp8_all_gather` (stage 3; `lab.train --fp8-all-gather`) gathers the parameters in E4M3 (see the module's
    docstring).
    Under `no_sync()` the full gradients of every unit accumulate locally until the last micro-batch (memory
    traded for communication, as FSDP2's `set_requires_gradient_sync(False)` does). Every parameter must get
    a gradient in every backward pass: a unit is complete when all of its parameters have one. Each `finish()`
    hands out that step's gradient, whether or not gradients were cleared since the last one.
    """

    def __init__(self, model: nn.Module | Iterable[nn.Parameter], group: dist.ProcessGroup | None, stage: int,
                 prefetch: bool = True, reduce_dtype: torch.dtype = torch.float32, units: UnitPolicy = Block,
                 fp8_all_gather: bool = False) -> None:
        if stage not in (1, 2, 3):
            raise ValueError(f"stage={stage!r} must be 1, 2 or 3 (stage 0 is plain data parallelism)")
        if not isinstance(model, nn.Module):
            if stage == 3:
                raise ValueError("stage=3 needs the module (it gathers each unit before its forward): a list of "
                                 "parameters takes stage 1 or 2")
            model = nn.ParameterList(model)  # the same Parameter objects, named "0", "1", ...
        super().__init__(model, group, reduce_dtype)
        if fp8_all_gather and stage != 3:
            raise ValueError(f"fp8_all_gather needs stage=3 (got stage={stage}): only ZeRO-3 all-gathers the "
                             f"parameters before each forward; stages 1-2 gather the updated weights themselves")
        self.stage, self.prefetch, self.fp8_all_gather = stage, prefetch, fp8_all_gather
        modules = sharding_units(model, units)
        owners, claimed = [], set()
        for module in modules:  # a parameter shared by two units (tied) belongs to the first
            owners.append((module, [p for p in module.parameters() if p.requires_grad and p not in claimed]))
            claimed.update(owners[-1][1])
        owners.insert(0, (model, [p for p in self.params if p not in claimed]))  # the root: everything left
        owners = [(module, params) for module, params in owners if params]
        self.names = dict(model.named_parameters())  # the full parameters, by name (ZeRO-3 puts pieces in place)
        self.units = [Unit(params, dist.get_rank(group), self.world, stage, reduce_dtype) for _, params in owners]
        self._in_flight: tuple[Unit, dist.Work] | None = None  # the reduce-scatter still running
        self.pieces_elsewhere: list[tuple[nn.Parameter, torch.Tensor]] = []  # ZeRO-3's empty pieces, for .grad
        for unit in self.units:
            for param in unit.params:
                param.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, unit))
        # The optimizer sees one Parameter per piece of this rank's shard: views, so its update lands in the
        # shard. A piece keeps its parameter's placement (held by 1/world of the ranks that held the parameter)
        # and whether it decays (a piece of a matrix does).
        self.pieces = []
        self.spans: list[tuple[Unit, int, int, nn.Parameter]] = []  # each piece's (unit, lo, hi, parameter)
        self.local: dict[nn.Parameter, nn.Parameter] = {}  # each parameter's piece (ZeRO-3 puts it on the module)
        for unit in self.units:
            for lo, hi, param in unit.ranges():
                piece = nn.Parameter(unit.shard[lo:hi])
                spot = placement_of(param)
                place(piece, dataclasses.replace(spot, replicas=spot.replicas // self.world if spot.replicas else 1))
                piece.decays = param.dim() >= 2
                start = unit.start + lo - unit.offsets[param]
                piece.flat_range = (start, start + piece.numel())  # its slice of param.flatten()
                self.pieces.append((piece, unit.shard_grad[lo:hi]))
                self.spans.append((unit, lo, hi, param))
                self.local[param] = piece
        if stage == 3:
            self._shard_parameters(model, [module for module, _ in owners])
        self.full_of = {piece: param for param, piece in self.local.items()}  # a piece's full parameter

    # --- ZeRO-3: gather each unit just in time, free it right after ----------------------------------------

    def _shard_parameters(self, model: nn.Module, modules: list[nn.Module]) -> None:
        for unit in self.units:  # a parameter of which this rank holds nothing: an empty piece on the module
            for param in unit.params:
                if param not in self.local:
                    self.local[param] = nn.Parameter(unit.shard[:0])
                    self.local[param].flat_range = (0, 0)
                    self.pieces_elsewhere.append((self.local[param], unit.shard_grad[:0]))
        # where each parameter is registered: (module, attribute), several places for a tied weight
        self.slots: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for name, param in module._parameters.items():
                if param is not None and param in self.local:
                    self.slots.setdefault(param, []).append((module, name))
        root_first = modules[0] is self.model
        backward = self.units[:1] + self.units[:0:-1] if root_first else self.units[::-1]
        for order, attribute in ((self.units, "next_forward"), (backward, "next_backward")):
            for unit, following in zip(order, order[1:], strict=False):
                setattr(unit, attribute, following)
        for unit, module in zip(self.units, modules, strict=True):
            self._free(unit)
            self._put_on_module(unit, full=False)
            module.register_forward_pre_hook(functools.partial(self._before_forward, unit))
            module.register_forward_hook(functools.partial(self._after_forward, unit))

    def _put_on_module(self, unit: Unit, full: bool) -> None:
        """The module's parameters: the full ones (views of the gathered buffer) for the unit's forward, this
        rank's pieces the rest of the time. Autograd keeps the full ones it saved, whatever the module holds."""
        for param in unit.params:
            for module, name in self.slots[param]:
                module._parameters[name] = param if full else self.local[param]

    def _gather(self, unit: Unit | None, wait: bool = True) -> None:
        if unit is None:
            return
        if not unit.gathered:
            unit.full.untyped_storage().resize_(unit.full.numel() * unit.full.element_size())
            if self.fp8_all_gather:
                shard_fp8, scales = self._cast_to_fp8(unit)
                full_fp8 = torch.empty(unit.full.numel(), dtype=torch.uint8, device=unit.full.device)
                unit.gather_handle = all_gather_single(full_fp8, shard_fp8, group=self.group, async_op=True)
                unit.fp8 = full_fp8, scales
            else:
                unit.gather_handle = all_gather_single(unit.full, unit.shard, group=self.group, async_op=True)
            unit.gathered = True
        if wait and unit.gather_handle is not None:
            unit.gather_handle.wait()
            unit.gather_handle = None
            if unit.fp8 is not None:
                self._dequantize(unit, *unit.fp8)
                unit.fp8 = None

    @torch.no_grad()
    def _cast_to_fp8(self, unit: Unit) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's shard in E4M3, as uint8 bytes, and each parameter's scale (in `unit.offsets` order), the
        same on every rank: one all-reduce(MAX) of this rank's amax of each parameter (0 where it holds none)."""
        index = {param: i for i, param in enumerate(unit.offsets)}
        pieces = unit.ranges()
        amaxes = torch.zeros(len(index), dtype=torch.float32, device=unit.shard.device)
        for lo, hi, param in pieces:
            amaxes[index[param]] = amax(unit.shard[lo:hi], FP8_GATHER)
        dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=self.group)
        scales = scale_from_amax(amaxes, FP8_GATHER.fmt)
        shard_fp8 = torch.zeros(unit.shard_numel, dtype=FP8_GATHER.dtype, device=unit.shard.device)  # 0: padding
        for lo, hi, param in pieces:
            shard_fp8[lo:hi] = quantize(unit.shard[lo:hi], FP8_GATHER, scales[index[param]])[0]
        return shard_fp8.view(torch.uint8), scales

    @torch.no_grad()
    def _dequantize(self, unit: Unit, full_fp8: torch.Tensor, scales: torch.Tensor) -> None:
        """The gathered bytes, each parameter divided by its scale, into the unit's buffer (in its dtype)."""
        values = full_fp8.view(FP8_GATHER.dtype)
        full = unit.full.data  # written as a collective writes it: autograd's version counter of the views it
        for i, (param, offset) in enumerate(unit.offsets.items()):  # saved in forward must not see a change
            end = offset + param.numel()
            full[offset:end] = dequantize(values[offset:end], scales[i], FP8_GATHER)
        full[end:].zero_()  # the padding, as an exact gather leaves it

    def _free(self, unit: Unit) -> None:
        unit.full.untyped_storage().resize_(0)
        unit.gathered = False

    def _before_forward(self, unit: Unit, module: nn.Module, args: tuple) -> None:
        self._put_on_module(unit, full=True)
        if unit.in_backward:  # activation checkpointing recomputes the forward inside backward: already gathered
            return
        self._gather(unit)
        if self.prefetch:
            self._gather(unit.next_forward, wait=False)

    def _after_forward(self, unit: Unit, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        self._put_on_module(unit, full=False)
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
        elif unit.handed_out:  # ZeRO-1's full buffer still holds the step finish() reduced: start from zero
            unit.grad.zero_()
        unit.handed_out = False
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
        handle = reduce_scatter_single(unit.shard_grad, unit.grad, group=self.group, async_op=True)
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
            unit.reduced, unit.handed_out = False, True
        for piece, grad in self.pieces + self.pieces_elsewhere:  # a bf16 piece cannot hold an fp32 .grad: main_grad
            if piece.dtype == grad.dtype:
                piece.grad = grad
            else:
                piece.main_grad = grad

    def parameters(self) -> list[torch.Tensor]:
        """What this rank's optimizer updates: the pieces of its shards (views: the update lands in the shard)."""
        return [piece for piece, _ in self.pieces]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(its parameter's name, piece) for each of `parameters()`: parameter groups by name, as over a module."""
        names = {param: name for name, param in self.names.items()}
        return [(names[self.full_of[piece]], piece) for piece, _ in self.pieces]

    def after_step(self) -> None:
        """Stages 1-2 all-gather the updated shards into the full parameters (stage 3 gathers them when the next
        forward needs them)."""
        if self.stage < 3:
            handles = [all_gather_single(unit.full, unit.shard, group=self.group, async_op=True)
                       for unit in self.units]
            for handle in handles:
                handle.wait()

    def zero_grad(self) -> None:
        """Drop the pieces' gradients. Optional: `optimizer.zero_grad()` does the same, and the next backward
        starts ZeRO-1's full gradient buffers from zero either way."""
        for piece, _ in self.pieces + self.pieces_elsewhere:
            piece.grad = None

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
                all_gather_single(full, unit.shard, group=self.group)
            for param, offset in unit.offsets.items():
                values[param] = full[offset:offset + param.numel()].view(param.shape).clone()
        return {name: values[param] for name, param in self.names.items() if param in values}

    # --- checkpoints: a flat piece cutting a matrix mid-row is no box, so save and load whole units ------------

    def parameter_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The full parameter of a piece that ZeRO-3 registers on the module (any other tensor: itself)."""
        return self.full_of.get(tensor, tensor)

    @torch.no_grad()
    def state_boxes(self, values: list[dict[str, torch.Tensor]]) -> list[ParamBox]:
        """Each unit's values gathered over dp (one all-gather per kind), every parameter then one whole box: the
        same boxes on every dp rank, which DCP writes once. Costs one unit's full buffers at a time. A 0-dim value
        is taken from this rank's piece of the parameter (a parameter of which it holds none has no such value
        here: another rank saves it). Every rank must hold the same kinds: the optimizer stepped on all or none."""
        kinds = _shaped_kinds(values)
        boxes = []
        for unit in self.units:
            full = {}
            for kind, dtype in kinds.items():
                shard = torch.zeros(unit.shard_numel, dtype=dtype, device=unit.shard.device)
                for (owner, lo, hi, _), held in zip(self.spans, values, strict=True):
                    if owner is unit and kind in held:
                        shard[lo:hi] = held[kind]
                full[kind] = torch.empty(unit.full.numel(), dtype=dtype, device=unit.shard.device)
                all_gather_single(full[kind], shard, group=self.group)
            numbers = self._numbers(unit, values)
            boxes += [ParamBox(param, (0,) * param.dim(), {**_slices(full, offset, param), **numbers.get(param, {})})
                      for param, offset in unit.offsets.items()]
        return boxes

    @torch.no_grad()
    def load_boxes(self, values: list[dict[str, torch.Tensor]]) -> tuple[list[ParamBox], Callable[[], None]]:
        """Every parameter of every unit whole (the whole TP-local model's state at once), each rank keeping its
        shard afterwards: its pieces' values, and its shard of the weights (stages 1-2: the full buffer too)."""
        kinds = _shaped_kinds(values)
        numbers = {kind: held[kind].dtype for held in values for kind in held if held[kind].dim() == 0}
        fulls, loaded, boxes = {}, {}, []
        for unit in self.units:
            fulls[unit] = full = {kind: torch.zeros(unit.full.numel(), dtype=dtype, device=unit.shard.device)
                                  for kind, dtype in kinds.items()}
            for param, offset in unit.offsets.items():
                loaded[param] = {kind: torch.zeros((), dtype=dtype) for kind, dtype in numbers.items()}
                boxes.append(ParamBox(param, (0,) * param.dim(), {**_slices(full, offset, param), **loaded[param]}))

        @torch.no_grad()
        def put_back() -> None:
            for unit, full in fulls.items():
                unit.shard.copy_(full[WEIGHT][unit.start:unit.start + unit.shard_numel])
                if self.stage < 3:
                    unit.full.copy_(full[WEIGHT])
            for (unit, lo, hi, param), held in zip(self.spans, values, strict=True):
                lo, hi = unit.start + lo, unit.start + hi  # in the unit's full buffers
                for kind, value in held.items():
                    value.copy_(loaded[param][kind] if value.dim() == 0 else fulls[unit][kind][lo:hi])

        return boxes, put_back

    def _numbers(self, unit: Unit, values: list[dict[str, torch.Tensor]]) -> dict[nn.Parameter, dict]:
        """The 0-dim values of each parameter of `unit` this rank holds a piece of, from that piece."""
        return {param: {kind: value for kind, value in held.items() if value.dim() == 0}
                for (owner, _, _, param), held in zip(self.spans, values, strict=True) if owner is unit}


def _shaped_kinds(values: list[dict[str, torch.Tensor]]) -> dict[str, torch.dtype]:
    """The kinds of value that have a shape (not 0-dim), with their dtype."""
    return {kind: value.dtype for held in values for kind, value in held.items() if value.dim() > 0}


def _slices(full: dict[str, torch.Tensor], offset: int, param: nn.Parameter) -> dict[str, torch.Tensor]:
    """Each kind's values of `param`, viewed in its unit's full flat buffer at `offset`."""
    return {kind: flat[offset:offset + param.numel()].view(param.shape) for kind, flat in full.items()}


class TorchFSDP2(NaiveDP):
    """The production API that does ZeRO-3's job — torch's FSDP2, `fully_shard` on each block then on the
    root, parameters as DTensors sharded on dim 0 — behind the same loop, for side-by-side checks and
    benchmarks. Accumulation: `set_requires_gradient_sync(False)` keeps unsharded gradients, as `no_sync` does."""

    broadcasts = False  # done in __init__, before the parameters become shards

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(group or dist.group.WORLD, "cuda" if dist.get_backend(group) == "nccl" else "cpu")
        broadcast_from_first_rank(model, group)  # before fully_shard: afterwards each rank holds different shards
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
                       reduce_dtype: torch.dtype = torch.float32, units: UnitPolicy = Block,
                       fp8_all_gather: bool = False) -> NaiveDP | Zero:
    """Plain data parallelism (`dp_mode`) for zero=0, else ZeRO-`zero` with sharding `units`, over `group`,
    summing gradients in `reduce_dtype` (ZeRO-3: gathering the parameters in FP8 if `fp8_all_gather`).

    Works for a single process too (zero=0, no process group): nothing is communicated. ZeRO needs an
    initialised process group.
    """
    if zero:
        if not dist.is_initialized():
            raise ValueError(f"zero={zero} needs a process group: start ranks with lab.distributed.run or torchrun")
        return Zero(model, group, zero, reduce_dtype=reduce_dtype, units=units, fp8_all_gather=fp8_all_gather)
    if fp8_all_gather:
        raise ValueError("fp8_all_gather=True needs zero=3 (got zero=0): only ZeRO-3 all-gathers the parameters")
    if dp_mode not in DP_MODES:
        raise ValueError(f"dp_mode={dp_mode!r} must be one of {', '.join(map(repr, DP_MODES))}")
    options = {"bucket_mb": bucket_mb} if dp_mode == "bucketed" else {}
    return DP_ENGINES[dp_mode](model, group, reduce_dtype=reduce_dtype, **options)
