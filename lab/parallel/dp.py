"""Data parallelism: every rank holds the whole model and a slice of the batch.

After each backward pass the ranks average their gradients, so every replica takes the same optimiser
step and the replicas never drift apart. Averaging the per-rank mean losses' gradients over equal-sized
slices gives exactly the gradient of the mean loss over the whole batch — the reason a data-parallel run
reproduces a single-process run step for step.

Three ways to average, each a small class with the same training loop (ZeRO in `lab.parallel.zero` too):

    dp = BucketedDP(model, group, bucket_mb=25)       # any nn.Module; rank 0's weights are broadcast here
    optimizer = adamw(dp.parameters(), lr=3e-3, weight_decay=0.1)      # or any torch.optim.Optimizer
    for i, (x, y) in enumerate(micro_batches):
        with dp.backward_context(last_micro_batch=i == len(micro_batches) - 1):
            (loss_fn(model(x), y) / len(micro_batches)).backward()
    dp.finish()                                       # wait for the gradient communication
    norm = clip_grad_norm(dp.parameters(), 1.0)       # global norm, as torch.nn.utils.clip_grad_norm_
    optimizer.step()
    dp.after_step()                                   # ZeRO-1/2: all-gather the updated shards
    dp.zero_grad()                                    # or optimizer.zero_grad() / model.zero_grad(): as good

The engines only reduce gradients: the optimizer is the caller's, built over `dp.parameters()` — the tensors
this rank updates (whole parameters here; ZeRO's shard pieces) — so that every layout and mixed precision
share one optimizer step. Any `torch.optim.Optimizer` will do (`torch.optim.AdamW(dp.parameters(),
betas=(0.9, 0.999))`); `lab.parallel.optim.adamw` is lab.train's, with its betas and its decay groups.

DDP's contract, for any model: wrapping broadcasts the parameters and buffers of the group's first rank, so the
replicas start equal however each rank initialised them; clearing the gradients the ordinary way
(`optimizer.zero_grad()`, `model.zero_grad()`) is enough, also where they live in buckets.

- `NaiveDP`: compute, then communicate — one all-reduce per parameter after the whole backward pass.
- `OverlappedDP`: a hook per parameter launches its all-reduce as soon as its gradient is ready, while
  backward goes on computing the gradients of earlier layers.
- `BucketedDP`: gradients are copied into a few large contiguous buffers ("buckets"), each all-reduced as
  soon as all of its gradients are in: fewer, larger messages, each paying the per-message latency once.
- `TorchDDP`: torch's `DistributedDataParallel` behind the same loop, to check and time ours against.

Checkpoints: an engine says what it holds of each parameter as a `ParamBox` — which parameter, where the box
starts in it, the values (the weight, the optimizer's states) — and how to put loaded values back
(`state_boxes`, `load_boxes`). `lab.checkpoint` turns boxes into DCP chunks and knows no engine: here every
tensor the optimizer updates is a whole parameter, one box at offset 0; ZeRO overrides both.

Gradient accumulation: inside `no_sync()` (every micro-batch but the last) nothing is communicated; the
gradients add up locally and the last micro-batch's backward sends their sum once.

Mixed precision: every engine sums gradients — over micro-batches and over ranks — in `reduce_dtype` (fp32 by
default, FSDP2's name). A bf16 parameter's gradient is moved, as autograd finishes it, into `param.main_grad` in
that dtype (Megatron's name; a bf16 parameter cannot hold an fp32 `.grad`), which is what is reduced and what the
fp32 master weights take (`lab.precision.master`). Parameters already in `reduce_dtype` keep theirs in `.grad`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lab.parallel.placement import placement_of
from lab.precision.master import reduced_gradient


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the memory these tensors really hold: each storage counted once (views share one), freed
    storages (resized to zero, as ZeRO-3 does) count zero. Measuring, not computing from shapes."""
    storages = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@torch.no_grad()
def broadcast_from_first_rank(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Copy the parameters and buffers of `group`'s first rank into every other rank's `module`, as DDP does when
    it wraps a model: replicas that start apart would never meet again. An expert's weight (expert parallelism)
    is skipped: the ranks of `group` hold different experts, and so is a tensor on `meta` (a dry run's: it has no
    values to copy). One broadcast per dtype, of everything flattened."""
    tensors = [t for t in [*(p for p in module.parameters() if not placement_of(p).expert), *module.buffers()]
               if not t.is_meta]
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    source = dist.get_global_rank(group, 0) if group is not None else 0
    for same_kind in by_kind.values():
        flat = torch.cat([t.reshape(-1) for t in same_kind])
        dist.broadcast(flat, src=source, group=group)
        for t, value in zip(same_kind, flat.split([t.numel() for t in same_kind]), strict=True):
            t.copy_(value.view_as(t))


@torch.no_grad()
def all_reduce_gradients(params: Iterable[nn.Parameter], group: dist.ProcessGroup | None = None,
                         reduce_dtype: torch.dtype = torch.float32) -> None:
    """Naive data parallelism: one all-reduce per parameter, after the whole backward pass, of its gradient as
    the engines keep it (`.grad`, or `main_grad` in `reduce_dtype` for a parameter of another dtype).

    A parameter that got no gradient on this rank (unused, or used only for some inputs) takes part with
    zeros: every rank must issue the same all-reduces in the same order, whatever its data did. One that no
    rank used thus ends with a zero gradient rather than None, so AdamW still decays it and moves it by its
    momentum; torch DDP (`find_unused_parameters=True`) spends one more all-reduce, of a used-flag per
    parameter, to leave those at None as a single process would.
    """
    world = dist.get_world_size(group)
    for param in params:
        grad = gradient_buffer(param, reduce_dtype)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
        grad.div_(world)


def gradient_buffer(param: nn.Parameter, reduce_dtype: torch.dtype) -> torch.Tensor:
    """The tensor holding `param`'s summed gradient (`reduced_gradient`), zeros when backward gave it none: every
    rank must take part in every collective, whatever its data did."""
    grad = reduced_gradient(param)
    if grad is None:
        grad = torch.zeros_like(param, dtype=reduce_dtype)
        if param.dtype == reduce_dtype:
            param.grad = grad
        else:
            param.main_grad = grad
    return grad


WEIGHT = "param"  # the kind of value, among those a checkpoint moves, that is the parameter's own value


@dataclass
class ParamBox:
    """What one rank holds of one parameter, for a checkpoint: `values` by kind (`WEIGHT`, the optimizer's states),
    each the box of `param` that starts at `offsets` and has the value's shape. A 0-dim value (AdamW's step count)
    is one number for the whole parameter. `param` is the parameter as the model built it on this rank: a TP shard
    is itself a box of the full tensor, which its placement locates. A rank holds at most one box per parameter."""

    param: nn.Parameter
    offsets: tuple[int, ...]
    values: dict[str, torch.Tensor]


class DataParallel:
    """What every variant here and ZeRO (`lab.parallel.zero`) share: a rank group, the initial broadcast, the
    `no_sync` switch and what a checkpoint asks (`state_boxes`, `load_boxes`, `parameter_of`).

    The rest of the interface — `finish`, `parameters`, `after_step`, `zero_grad`, `resident_tensors` — is the
    loop in this module's docstring; each subclass decides when to communicate.
    """

    broadcasts = True  # rank 0's weights are copied to the others at wrap time (False: the engine does it itself)

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None,
                 reduce_dtype: torch.dtype = torch.float32) -> None:
        self.model, self.group, self.reduce_dtype = model, group, reduce_dtype
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        if self.world > 1 and self.broadcasts:
            broadcast_from_first_rank(model, group)
        self.sync = True  # False inside no_sync(): accumulate locally, communicate nothing
        self.params = [p for p in model.parameters() if p.requires_grad]

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this block only accumulate gradients (every micro-batch but the last)."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def backward_context(self, last_micro_batch: bool) -> AbstractContextManager:
        """`no_sync()` for every micro-batch but the last: the loop body is the same for all of them."""
        return nullcontext() if last_micro_batch else self.no_sync()

    def resident_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes of `resident_tensors`, each storage counted once."""
        return {kind: storage_bytes(tensors) for kind, tensors in self.resident_tensors(optimizer).items()}

    # --- checkpoints: what this rank holds, as boxes of the parameters ------------------------------------------

    def state_boxes(self, values: list[dict[str, torch.Tensor]]) -> list[ParamBox]:
        """This rank's boxes, to save. `values` holds, for each tensor of `parameters()` in order, its values by
        kind (its weight, as the optimizer updates it, under `WEIGHT`), each of that tensor's shape or 0-dim. Here
        each tensor is a whole parameter: its box starts at 0."""
        return [ParamBox(param, (0,) * param.dim(), dict(held))
                for param, held in zip(self.parameters(), values, strict=True)]

    def load_boxes(self, values: list[dict[str, torch.Tensor]]) -> tuple[list[ParamBox], Callable[[], None]]:
        """Boxes to load into, and what to call once they are filled: it copies them into `values` (laid out as
        for `state_boxes`: where each loaded value belongs) and into whatever else the engine keeps. Here the boxes
        are `values` themselves: nothing is left to do."""
        return self.state_boxes(values), lambda: None

    def parameter_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The parameter that `tensor`, as the model registers it, stands for (the `param` of its box): itself
        here; ZeRO-3's model holds this rank's piece instead outside forward."""
        return tensor


class NaiveDP(DataParallel):
    """Compute, then communicate: one all-reduce per parameter after the whole backward pass.

    Also the base of the other two variants: every rank updates the full (replicated) parameters, since after
    `finish()` each holds the full average of the gradients.
    """

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None,
                 reduce_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(model, group, reduce_dtype)
        # Parameters whose `main_grad` still holds the gradient `finish()` handed out: the next gradient autograd
        # delivers replaces it, so that the user's own zero_grad() (which cannot see `main_grad`) is enough
        self.handed_out: set[nn.Parameter] = set()
        self._register_hooks()

    def _register_hooks(self) -> None:
        """A parameter of another dtype than `reduce_dtype` moves each gradient autograd finishes into its
        `main_grad`, in `reduce_dtype`: the sum over micro-batches is then made in that dtype too."""
        for param in self.params:
            if param.dtype != self.reduce_dtype:
                param.register_post_accumulate_grad_hook(self._to_main_grad)

    @torch.no_grad()
    def _to_main_grad(self, param: nn.Parameter) -> None:
        if getattr(param, "main_grad", None) is None or param in self.handed_out:
            self.handed_out.discard(param)
            param.main_grad = param.grad.to(self.reduce_dtype)
        else:
            param.main_grad.add_(param.grad)
        param.grad = None

    def finish(self) -> None:
        """Called once after the last backward of a step: afterwards each parameter's gradient (`.grad`, or
        `main_grad` in `reduce_dtype`) is the average over ranks."""
        if self.world > 1:
            all_reduce_gradients(self.params, self.group, self.reduce_dtype)
        self.handed_out = set(self.params)

    def parameters(self) -> list[torch.Tensor]:
        """What this rank's optimizer updates: every trainable parameter."""
        return self.params

    def after_step(self) -> None:
        """Nothing to do: every rank updated the same full parameters."""

    def zero_grad(self) -> None:
        """Drop the gradients. Optional: the user's `optimizer.zero_grad()` or `model.zero_grad()` is enough."""
        for param in self.params:
            param.grad = None
            if param.dtype != self.reduce_dtype:
                param.main_grad = None
        self.handed_out.clear()

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """A copy of every parameter by name (`Zero.full_parameters` gathers the shards to give the same)."""
        return {name: param.detach().clone() for name, param in self.model.named_parameters()}

    def resident_tensors(self, optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor | None]]:
        """The tensors held right now as parameters, gradients and `optimizer`'s states (AdamW's m, v and step)."""
        grads = [p.grad for p in self.params] + [getattr(p, "main_grad", None) for p in self.params]
        states = [t for state in optimizer.state.values() for t in state.values()]
        return {"params": list(self.params), "grads": grads, "optimizer": states}



class OverlappedDP(NaiveDP):
    """All-reduce each gradient as soon as autograd has finished accumulating it.

    Backward computes the last layer's gradients first; their all-reduce runs (asynchronously) while the
    earlier layers' gradients are still being computed, so most communication hides behind compute.
    Every parameter must get a gradient on every rank in every step (torch DDP's default contract): a rank
    whose data skipped a parameter would pair its all-reduces with other ranks' different ones. `BucketedDP`
    lifts the restriction.
    """

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None,
                 reduce_dtype: torch.dtype = torch.float32) -> None:
        self.handles: list[dist.Work] = []
        super().__init__(model, group, reduce_dtype)

    def _register_hooks(self) -> None:
        super()._register_hooks()  # first: a bf16 gradient is in main_grad by the time ours runs
        for param in self.params:
            param.register_post_accumulate_grad_hook(self._on_grad_ready)

    @torch.no_grad()
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if self.sync and self.world > 1:
            grad = reduced_gradient(param)
            grad.div_(self.world)  # average = sum of (grad / world): divide first, as DDP does
            self.handles.append(dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.group, async_op=True))

    def finish(self) -> None:
        launched = len(self.handles)
        for handle in self.handles:
            handle.wait()
        self.handles.clear()
        self.handed_out = set(self.params)
        if self.world > 1 and launched != len(self.params):
            raise RuntimeError(f"{len(self.params) - launched} of {len(self.params)} parameters got no gradient on "
                               f"this rank: OverlappedDP needs every parameter used in every step (use BucketedDP)")


class Bucket:
    """A few parameters whose gradients live side by side in one flat buffer (`param.main_grad` views).

    In `reduce_dtype`, fp32 by default, so that gradients accumulated over micro-batches keep their precision
    even when the model computes in bf16 (what Megatron and picotron do); contiguous so that one collective
    sends them all.
    """

    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype = torch.float32) -> None:
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=params[0].device)
        offset = 0
        for param in params:
            param.main_grad = self.buffer[offset:offset + param.numel()].view_as(param)
            offset += param.numel()
        self.ready = 0  # parameters whose gradient of the last micro-batch is in the buffer
        self.handle: dist.Work | None = None

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


class BucketedDP(NaiveDP):
    """Overlapped *and* bucketed: picotron's `DataParallelBucket`, Megatron's and torch DDP's design.

    Parameters are assigned to buckets in reverse order — the order backward produces their gradients —
    a bucket closing once it holds at least `bucket_mb` MiB (torch DDP's rule for `bucket_cap_mb`). A hook
    adds each new gradient into its `main_grad` view and frees it; when a bucket's last gradient is in, the
    whole bucket is all-reduced asynchronously. `finish()` waits, then points each `param.grad` at its
    averaged `main_grad` for the optimizer (no copy); a parameter of another dtype than the buckets' (a bf16
    one, fp32 buckets) leaves it in `main_grad`, for its fp32 master weight.

    The user's ordinary `optimizer.zero_grad()` clears the buckets too: it sets `.grad` to None, so the next
    gradient autograd delivers for that parameter is a new tensor, which then *replaces* the bucket's old value
    (`handed_out`); `zero_grad(set_to_none=False)` zeroes the bucket views in place, and autograd accumulates
    into them. Clearing nothing accumulates over steps, as torch does.

    Buckets go out strictly in index order on every rank, as in torch DDP's reducer: a rank whose data left
    a parameter without a gradient (an unused or conditionally used layer) holds back its bucket and every
    later one until `finish()`, which sends them with the missing gradients as zeros. Launching a later
    bucket first would pair it with another rank's different bucket in the same collective slot. (As in
    `all_reduce_gradients`, a parameter no rank used ends with a zero gradient, not None.)
    """

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None, bucket_mb: float = 25.0,
                 reduce_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(model, group, reduce_dtype)
        cap = int(bucket_mb * 2**20) // reduce_dtype.itemsize  # elements
        self.buckets: list[Bucket] = []
        pending: list[nn.Parameter] = []
        for param in reversed(self.params):
            pending.append(param)
            if sum(p.numel() for p in pending) >= cap:
                self.buckets.append(Bucket(pending, reduce_dtype))
                pending = []
        if pending:
            self.buckets.append(Bucket(pending, reduce_dtype))
        for bucket in self.buckets:
            for param in bucket.params:
                param.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, bucket))
        self.next_bucket = 0  # the first bucket not yet all-reduced this step

    def _register_hooks(self) -> None:
        """None here: the buckets' hooks (registered once the buckets exist) add every gradient into its
        `main_grad` view, in the buckets' dtype."""

    @property
    def bucket_sizes(self) -> list[int]:
        """Bytes of each bucket, in the order they are all-reduced."""
        return [bucket.nbytes for bucket in self.buckets]

    @torch.no_grad()
    def _on_grad_ready(self, bucket: Bucket, param: nn.Parameter) -> None:
        # .grad still finish()'s bucket view: autograd has accumulated into the bucket itself. Else a new tensor:
        # it replaces the bucket's value of the last step (.grad was cleared since finish()), or adds to this one's
        if param.grad.data_ptr() != param.main_grad.data_ptr():
            (param.main_grad.copy_ if param in self.handed_out else param.main_grad.add_)(param.grad)
        self.handed_out.discard(param)
        param.grad = None  # the gradient now lives in the bucket; free autograd's copy
        if self.sync:
            bucket.ready += 1
            while self.next_bucket < len(self.buckets) and self._complete(self.buckets[self.next_bucket]):
                self._all_reduce(self.buckets[self.next_bucket])

    @staticmethod
    def _complete(bucket: Bucket) -> bool:
        return bucket.ready == len(bucket.params)

    def _all_reduce(self, bucket: Bucket) -> None:
        self.next_bucket += 1
        if self.world > 1:
            bucket.buffer.div_(self.world)
            bucket.handle = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def finish(self) -> None:
        for param in self.handed_out:  # no gradient this step: a zero one, not the last step's
            param.main_grad.zero_()
        for bucket in self.buckets[self.next_bucket:]:  # held back by a parameter without gradient: send now
            self._all_reduce(bucket)
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
            bucket.ready, bucket.handle = 0, None
        self.next_bucket = 0
        for param in self.params:
            if param.dtype == param.main_grad.dtype:
                param.grad = param.main_grad
        self.handed_out = set(self.params)

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None
        for bucket in self.buckets:
            bucket.buffer.zero_()
        self.handed_out.clear()


class TorchDDP(NaiveDP):
    """The production API that does `BucketedDP`'s job — torch's `DistributedDataParallel`: buckets of
    `bucket_mb`, all-reduces overlapped with backward, `no_sync` — behind this module's loop, for side-by-side
    checks and benchmarks. The forward must go through `self.model` (the DDP wrapper), which arms its hooks.
    Gradients are views of DDP's buckets (`gradient_as_bucket_view`), as they are of ours."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None, bucket_mb: float = 25.0) -> None:
        super().__init__(model, group)
        self.model = nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=bucket_mb,
                                                         gradient_as_bucket_view=True)

    def backward_context(self, last_micro_batch: bool) -> AbstractContextManager:
        return nullcontext() if last_micro_batch else self.model.no_sync()

    def finish(self) -> None:
        """Nothing to wait for: DDP's backward returns once its all-reduces are done."""

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {name: param.detach().clone() for name, param in self.model.module.named_parameters()}
