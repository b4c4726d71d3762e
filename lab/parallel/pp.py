"""Pipeline parallelism, executed: each rank holds a slice of the layers and runs a schedule's ops in order.

The model is cut into pp·v chunks of consecutive layers (`build_chunk`), equal ones unless a split says otherwise
(`lab.layout.stage_layers`: Llama 3's lighter first and last stage, or counts per stage); virtual stage s runs on
rank s mod pp (Megatron's round-robin, so v > 1 is the interleaved layout; the rule is `lab.calc.schedules`'s,
shared with the memory model). The first stage also owns the token embedding, the last the final norm, the
output layer and the loss. Every rank then walks its list of ops from a `lab.calc.schedules.Schedule` —
the very objects the bubble simulator plays:

    F(mb, c)  receive the activations of micro-batch mb from the previous stage (the first stage embeds its
              tokens instead), run chunk c, send the output on (the last stage computes the loss instead)
    B(mb, c)  receive the gradient of that output from the next stage (the last: backward from the loss),
              backpropagate through chunk c, send the input's gradient back
    W(mb, c)  zero-bubble schedules only: B computed just the gradients the previous stage waits for; W now
              computes the weight gradients from what B left behind

What crosses a boundary is described once, by a `Boundary` (micro-batch, seq / seq_shards, d_model, dtype):
sequence parallelism keeps the residual stream sharded along the sequence between stages, context
parallelism hands each rank its chunks of the sequence, a bf16 model sends bf16. Shapes are agreed in
advance, so a receive needs no size message. Sends are asynchronous (isend) and only waited for at the end of the step;
a receive blocks until its data is there. A rank therefore waits exactly where the simulator says it idles,
and never deadlocks on a schedule the simulator can play. Each message has a tag made of its micro-batch,
virtual stage and direction, so a receive cannot take another op's message (gloo matches on tags; NCCL
matches in order, which these schedules also keep).

The loss of each micro-batch is divided by m, as in gradient accumulation: after the step every rank holds
the gradients of the whole batch for its layers, exactly those of a single process. Losses that arise inside a
stage (a mixture of experts' balancing losses) are added to that stage's backward by `extra_loss`, divided by m
likewise: their gradients flow back through the earlier stages with the activations' gradients.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from lab.calc.schedules import B, Op, Schedule, W, virtual_stage_layers
from lab.collectives.p2p import group_info
from lab.config import ModelConfig
from lab.loss import LossFn, cross_entropy, model_loss
from lab.model import RMSNorm, Transformer, build_model, materialize


def cut_to_stage(model: Transformer, virtual_stage: int, virtual_stages: int, split: str = "even") -> Transformer:
    """Keep (in place) what virtual stage `virtual_stage` of `virtual_stages` runs: its layers (as many as `split`
    gives it; same names as in the whole model, so materialising gives them the very same initial weights), the
    embedding on the first stage, the final norm and output layer on the last. Works on `meta`: nothing else is
    ever allocated."""
    cfg = model.cfg
    if cfg.tie_embeddings and virtual_stages > 1:
        raise ValueError(f"{cfg.name} ties its embedding and output weights: pipeline parallelism would need the "
                         "first and last stages to share a gradient, which lab does not do yet")
    layers = virtual_stage_layers(cfg.n_layers, virtual_stage, virtual_stages, split)
    for name in list(model.layers):
        if int(name) not in layers:
            del model.layers[name]
    if virtual_stage > 0:
        model.tok_embeddings = None
    if virtual_stage < virtual_stages - 1:
        model.norm = model.output = None
    return model


def build_chunk(cfg: ModelConfig, virtual_stage: int, virtual_stages: int, device: str | torch.device = "cpu",
                seed: int = 0, split: str = "even") -> Transformer:
    """The materialised part of the model that virtual stage `virtual_stage` of `virtual_stages` runs, its layers
    split over the stages as `split` says (`lab.layout.stage_layers`)."""
    return materialize(cut_to_stage(build_model(cfg), virtual_stage, virtual_stages, split), device, seed)


@dataclass(frozen=True)
class Boundary:
    """What crosses a pipeline boundary for one micro-batch: (micro-batch, seq / seq_shards, d_model) of `dtype`.
    `seq_shards` is tp under sequence parallelism, whose residual stream stays sharded along the sequence."""

    d_model: int
    seq_shards: int = 1
    dtype: torch.dtype = torch.float32

    def shape(self, tokens: torch.Tensor) -> tuple[int, int, int]:
        """The boundary's shape for the micro-batch of token ids `tokens` (B, T) this rank holds."""
        return tokens.shape[0], tokens.shape[1] // self.seq_shards, self.d_model


@torch.no_grad()
def weight_gradients(module: nn.Module, inputs: torch.Tensor, grad_output: torch.Tensor) -> None:
    """Accumulate `module`'s parameter gradients from its input and the gradient of its output: the W pass
    of zero-bubble schedules, which autograd would otherwise have done inside the backward."""
    if hasattr(module, "weight_gradient"):  # a layer with its own rule (RMSNorm, the vocabulary-parallel embedding)
        pairs = [(module.weight, module.weight_gradient(inputs, grad_output))]
    elif isinstance(module, nn.Linear):
        grad = grad_output.flatten(0, -2).T @ inputs.flatten(0, -2)
        pairs = [(module.weight, grad)] + ([(module.bias, grad_output.flatten(0, -2).sum(0))] if module.bias is not None
                                          else [])
    elif isinstance(module, nn.Embedding):
        grad = torch.zeros_like(module.weight).index_add_(0, inputs.flatten(), grad_output.flatten(0, -2))
        pairs = [(module.weight, grad)]
    else:
        raise TypeError(f"no weight-gradient rule for {type(module).__name__}")
    # Accumulated by autograd itself (a leaf as the root): hooks that wait for a parameter's gradient fire,
    # as those of the data-parallel engines do.
    torch.autograd.backward([param for param, _ in pairs], [grad for _, grad in pairs])


_WEIGHTED = (nn.Linear, RMSNorm, nn.Embedding)  # every parameter of lab.model (and of its TP layers) lives in one


@dataclass
class _Stash:
    """What a micro-batch leaves on a rank between its F and its B (and W)."""

    inputs: torch.Tensor  # received activations (a leaf requiring grad), or token ids on the first stage
    output: torch.Tensor  # the chunk's output, or the loss on the last stage
    extra: torch.Tensor | None  # the stage's own loss terms (`extra_loss`), backpropagated with the output
    calls: list[tuple[nn.Module, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # split only
    output_grads: list[torch.Tensor] = field(default_factory=list)
    # split only: parameters no recorded call covers (the output weight of the last stage's own chunked loss) and
    # their gradients from B, accumulated in W
    direct: list[nn.Parameter] = field(default_factory=list)
    direct_grads: list[torch.Tensor] = field(default_factory=list)


@dataclass(frozen=True)
class OpTiming:
    """Seconds from the step's start: when the rank reached the op, when its input was there and it started
    computing (the gap is the op's wait: the bubble), and when it ended."""

    op: Op
    reached: float
    start: float
    end: float


class Pipeline:
    """One rank's share of a pipeline: its chunks, the schedule, and the ranks before and after it.

        pipeline = Pipeline(chunks, schedule, mesh.pp_group)
        loss = pipeline.step(tokens, targets)   # every micro-batch's forward and backward; the loss on the
                                                # last stage (None elsewhere); grads in the chunks' .grad

    `loss_fn` is the last stage's loss on its whole logits; None: the stage's own loss from its final hidden
    states and output weight (`lab.loss.model_loss`: the chunked cross-entropy, no fp32 logits of the whole
    micro-batch), what `lab.parallel.parallelize` passes when tp = 1.
    """

    def __init__(self, chunks: list[Transformer], schedule: Schedule, group: dist.ProcessGroup | None,
                 loss_fn: LossFn | None = cross_entropy, op_delay: dict[str, float] | None = None,
                 boundary: Boundary | None = None,
                 extra_loss: Callable[[nn.Module], torch.Tensor | None] | None = None) -> None:
        if schedule.bidirectional:
            raise ValueError(f"{schedule.name} runs in the simulator (lab.calc.bubble) only: lab's pipeline "
                             f"executes one-directional schedules")
        self.rank, world, self._global = group_info(group)
        if world != schedule.pp or len(chunks) != schedule.chunks:
            raise ValueError(f"a {schedule.name} schedule for pp={schedule.pp} with {schedule.chunks} chunk(s) per "
                             f"rank needs {schedule.pp} ranks holding that many chunks (got {world} ranks, "
                             f"{len(chunks)} chunks)")
        self.chunks, self.schedule, self.group, self.loss_fn = chunks, schedule, group, loss_fn
        self.op_delay = op_delay or {}  # seconds of extra work per op kind, to make stages visible on a CPU
        self.boundary = boundary or Boundary(chunks[0].cfg.d_model, dtype=next(chunks[0].parameters()).dtype)
        self.extra_loss = extra_loss  # called after each chunk's forward: loss terms of its own (or None)
        self.timings: list[OpTiming] = []
        self.peak_in_flight = 0
        self._recording: list | None = None
        if schedule.split_backward:
            for chunk in chunks:
                for module in chunk.modules():
                    if isinstance(module, _WEIGHTED):
                        # first, before a TP layer's own hook replaces its output by the reduced one
                        module.register_forward_hook(self._record_call, prepend=True)
            if any(chunk.recompute != "none" for chunk in chunks):
                raise ValueError("zero-bubble schedules split the backward by hand: use recompute='none'")

    def _record_call(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if self._recording is not None:
            self._recording.append((module, args[0], output))

    def _stage(self, chunk: int) -> int:
        return self.schedule.virtual_stage(self.rank, chunk)

    def _peer(self, stage: int) -> int:
        return self._global(self.schedule.rank_of(stage)[0])

    def _tag(self, microbatch: int, stage: int, backward: bool) -> int:
        return (microbatch * self.schedule.virtual_stages + stage) * 2 + backward

    def step(self, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None,
             grad_scale: float = 1.0) -> torch.Tensor | None:
        """Run the schedule on this rank's batch (split into the schedule's micro-batches). `positions`: those of
        this rank's tokens, for RoPE (default 0..T-1; context parallelism passes its chunks'). Every backward
        starts from `grad_scale` (fp16's loss scale) instead of 1."""
        m = self.schedule.microbatches
        if tokens.shape[0] % m:
            raise ValueError(f"batch of {tokens.shape[0]} sequences must be divisible by microbatches={m}")
        self._grad_scale = grad_scale  # what backward starts from, d(scaled loss)/d(loss)
        self._tokens, self._targets = tokens.chunk(m), targets.chunk(m)
        self._positions = torch.arange(tokens.shape[1], device=tokens.device) if positions is None else positions
        self._stash: dict[tuple[int, int], _Stash] = {}
        self._sends: list[dist.Work] = []
        self._loss = torch.zeros((), device=tokens.device)
        self.timings, self.peak_in_flight = [], 0
        start = time.perf_counter()
        self._step_start = start
        for op in self.schedule.ops[self.rank]:
            self._ready = reached = time.perf_counter() - start  # a receive moves `_ready` to its arrival
            {"F": self._forward, B: self._backward, W: self._weights}[op.kind](op)
            self.timings.append(OpTiming(op, reached, self._ready, time.perf_counter() - start))
        for request in self._sends:
            request.wait()
        last = self._stage(self.schedule.chunks - 1) == self.schedule.virtual_stages - 1
        return self._loss if last else None

    def _synthetic_work(self, kind: str) -> None:
        """`op_delay`'s extra seconds, spent after the op's compute and before its result is sent on."""
        if self.op_delay.get(kind):
            time.sleep(self.op_delay[kind] / self.schedule.chunks)

    def _receive(self, microbatch: int, stage: int, backward: bool) -> torch.Tensor:
        """The activation (or gradient) on the boundary between `stage` and its neighbour."""
        tokens = self._tokens[microbatch]
        buffer = torch.empty(self.boundary.shape(tokens), device=tokens.device, dtype=self.boundary.dtype)
        peer = self._peer(stage + 1 if backward else stage - 1)
        dist.irecv(buffer, peer, group=self.group, tag=self._tag(microbatch, stage, backward)).wait()
        self._ready = time.perf_counter() - self._step_start
        return buffer

    def _send(self, tensor: torch.Tensor, microbatch: int, to_stage: int, backward: bool) -> None:
        self._sends.append(dist.isend(tensor.detach().contiguous(), self._peer(to_stage), group=self.group,
                                      tag=self._tag(microbatch, to_stage, backward)))

    def _forward(self, op: Op) -> None:
        stage, last = self._stage(op.chunk), self.schedule.virtual_stages - 1
        if stage == 0:
            inputs = self._tokens[op.microbatch]
        else:
            inputs = self._receive(op.microbatch, stage, backward=False).requires_grad_()
        calls: list = []
        self._recording = calls if self.schedule.split_backward else None
        try:
            if stage == last:
                output = model_loss(self.chunks[op.chunk], inputs, self._positions, self._targets[op.microbatch],
                                    self.loss_fn, self._grad_scale / self.schedule.microbatches
                                    ) / self.schedule.microbatches
                self._loss += output.detach()
            else:
                output = self.chunks[op.chunk](inputs, self._positions)
            extra = self.extra_loss(self.chunks[op.chunk]) if self.extra_loss else None
            extra = None if extra is None else extra / self.schedule.microbatches
        finally:
            self._recording = None
        self._synthetic_work("F")
        if stage < last:
            self._send(output, op.microbatch, stage + 1, backward=False)
        # the chunked loss multiplies the output weight itself, outside any recorded call
        own_loss = self.schedule.split_backward and stage == last and self.loss_fn is None
        direct = [self.chunks[op.chunk].output.weight] if own_loss else []
        self._stash[(op.microbatch, op.chunk)] = _Stash(inputs, output, extra, calls, direct=direct)
        self.peak_in_flight = max(self.peak_in_flight, len(self._stash))

    def _backward(self, op: Op) -> None:
        stage, last = self._stage(op.chunk), self.schedule.virtual_stages - 1
        stash = self._stash[(op.microbatch, op.chunk)]
        def scaled(loss: torch.Tensor) -> torch.Tensor | None:
            return None if self._grad_scale == 1.0 else torch.full_like(loss, self._grad_scale)

        grad = scaled(stash.output) if stage == last else self._receive(op.microbatch, stage, backward=True)
        roots, root_grads = [stash.output], [grad]  # the loss (last stage) or the output and its gradient
        if stash.extra is not None:
            roots.append(stash.extra)
            root_grads.append(scaled(stash.extra))
        wants_input = stage > 0
        if self.schedule.split_backward:
            # Only the gradients other stages wait for, and those at the output of every weighted module;
            # autograd skips the weight-gradient products (no parameter is asked for). W does those.
            # A parameter used outside any recorded call (the output weight, whose gradient the chunked loss
            # computed in its forward) is asked for here and accumulated in W.
            targets = ([stash.inputs] if wants_input else []) + [out for _, _, out in stash.calls] + stash.direct
            grads = torch.autograd.grad(roots, targets, root_grads, allow_unused=True)
            grads = [torch.zeros_like(t) if g is None else g for t, g in zip(targets, grads, strict=True)]
            input_grad = grads[0] if wants_input else None
            grads = grads[1:] if wants_input else grads
            split = len(grads) - len(stash.direct)
            stash.output_grads, stash.direct_grads = grads[:split], grads[split:]
        else:
            torch.autograd.backward(roots, root_grads)
            input_grad = stash.inputs.grad if wants_input else None
            del self._stash[(op.microbatch, op.chunk)]
        self._synthetic_work(B)
        if wants_input:
            self._send(input_grad, op.microbatch, stage - 1, backward=True)

    def _weights(self, op: Op) -> None:
        stash = self._stash.pop((op.microbatch, op.chunk))
        for (module, inputs, _), grad_output in zip(stash.calls, stash.output_grads, strict=True):
            weight_gradients(module, inputs, grad_output)
        if stash.direct:  # accumulated by autograd, as `weight_gradients` does: the engines' hooks fire
            torch.autograd.backward(stash.direct, stash.direct_grads)
        self._synthetic_work(W)


def timed_step(cfg: ModelConfig, schedule: Schedule, tf: float, tb: float, tw: float = 0.0,
               batch: int | None = None, seq: int = 16) -> list[OpTiming]:
    """Run one pipeline step on this rank with `tf`, `tb`, `tw` seconds of synthetic work added to each op
    (F, and B as the whole backward or, split, B = tb - tw then W = tw — the simulator's time model), and
    return its op timings, in seconds from a barrier that all ranks leave together. Called on every rank
    (`lab.distributed.run(timed_step, pp, ...)`), to lay the measured timeline over `lab.calc.bubble.simulate`'s."""
    rank = dist.get_rank(group=None)
    chunks = [build_chunk(cfg, schedule.virtual_stage(rank, c), schedule.virtual_stages)
              for c in range(schedule.chunks)]
    delay = {"F": tf, B: tb - tw, W: tw} if schedule.split_backward else {"F": tf, B: tb}
    pipeline = Pipeline(chunks, schedule, None, op_delay=delay)
    tokens = torch.randint(0, cfg.vocab_size, (batch or schedule.microbatches, seq + 1),
                           generator=torch.Generator().manual_seed(0))
    pipeline.step(tokens[:, :-1], tokens[:, 1:])  # a first step warms up the connections and allocators
    dist.barrier()
    pipeline.step(tokens[:, :-1], tokens[:, 1:])
    return pipeline.timings
