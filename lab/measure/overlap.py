"""When does communication run, and how much of it hides behind compute? Measured on real ranks.

Data parallelism is only fast if the gradient all-reduces run *while* backward is still computing: the
playbook's first optimisation. This module records one training step of any engine of `lab.parallel.dp` or
`lab.parallel.zero` as a timeline of three kinds of spans, all in seconds from the start of the step:

- "compute": the forward and the backward of each block (from module hooks and gradient hooks);
- "comm": each collective, from the moment it is launched to the moment it completes (queueing included);
  completion comes from the operation's future when the backend gives one (gloo: all-reduce, all-gather),
  else it is the moment a `wait()` on it returned — an upper bound;
- "wait": time the training loop sat blocked in a collective: communication that did *not* hide.

Collectives are timed the way `lab.distributed.count_collectives` counts them, by temporarily wrapping the
functions of `torch.distributed` (so torch's own DDP and FSDP2, which bypass them, are not timed).

    timelines = {kind: lab.distributed.run(step_timeline, 2, kind)[0] for kind in ("naive", "bucketed")}
    plot_timelines(timelines)

`lab.calc.comms.zero3_overlap_ratio` is the other half of the story: the playbook's appendix A3
("Math for Compute/Communication Overlap") gives the condition for ZeRO-3's all-gathers to hide behind a
block's compute on real hardware.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import astuple, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lab.config import ModelConfig
from lab.data import SyntheticTokens, shard_rows
from lab.distributed.comm import ALL_GATHER, REDUCE_SCATTER, RENAMED
from lab.model import build_model, materialize
from lab.parallel.dp import NaiveDP
from lab.parallel.optim import adamw
from lab.parallel.zero import Zero, make_data_parallel

# operation (as this torch names what `lab.distributed` calls) -> its name in the legend. Spans are labelled with
# torch's current name ("all_gather_single"), as `count_collectives` counts them, on every torch.
TIMED_OPS = {"all_reduce": "all-reduce", ALL_GATHER: "all-gather", REDUCE_SCATTER: "reduce-scatter"}
KINDS = ("naive", "overlapped", "bucketed", "zero1", "zero2", "zero3", "zero3-no-prefetch")
LR, WEIGHT_DECAY = 3e-3, 0.1


@dataclass(frozen=True)
class Span:
    lane: str  # "compute", "comm" or "wait"
    label: str  # "fwd L3", "bwd L3", "all_reduce", ...
    start: float  # seconds since the step began
    end: float
    nbytes: int = 0  # bytes the rank handed to the collective (comm spans)


class _TimedWork:
    """A collective's handle that notes when `wait()` returns (and how long the caller was blocked)."""

    def __init__(self, work: dist.Work, recorder: StepRecorder, op: str, nbytes: int, launched: float) -> None:
        self.work, self.recorder, self.op, self.nbytes, self.launched = work, recorder, op, nbytes, launched
        self.completed: float | None = None
        try:  # gloo gives futures for all-reduce and all-gather, not for reduce-scatter
            work.get_future().then(self._on_complete)
        except RuntimeError:
            pass

    def _on_complete(self, _future: torch.futures.Future) -> None:
        self.completed = time.perf_counter()

    def wait(self, *args) -> bool:
        start = time.perf_counter()
        result = self.work.wait(*args)
        end = time.perf_counter()
        self.completed = min(self.completed or end, end)
        self.recorder.add("wait", self.op, start, end, self.nbytes)
        self.recorder.add("comm", self.op, self.launched, self.completed, self.nbytes)
        return result

    def __getattr__(self, name: str):
        return getattr(self.work, name)


class StepRecorder:
    """Hooks on a model's blocks and parameters, and wrappers around the collectives, that write `Span`s.

    The hooks are registered after the engine's own, so a gradient hook fires once the engine has already
    launched whatever that gradient completed; on the full parameters, which autograd fills (ZeRO-3's module
    holds its pieces, `engine.parameter_of`). Nothing is recorded outside `recording()`.
    """

    def __init__(self, model: nn.Module, engine: NaiveDP | Zero) -> None:
        self.spans: list[Span] = []
        self.origin: float | None = None
        self._forward_start: dict[str, float] = {}
        self._missing: dict[str, int] = {}  # gradients a block still waits for in this backward
        self._done: list[tuple[float, str]] = []  # (time, block) when a block's last gradient arrived
        for name, block in model.layers.items():
            block.register_forward_pre_hook(lambda _m, _a, name=name: self._forward_start.__setitem__(
                name, time.perf_counter()))
            block.register_forward_hook(lambda _m, _a, _o, name=name: self.add(
                "compute", f"fwd L{name}", self._forward_start[name], time.perf_counter()))
            for param in (engine.parameter_of(p) for p in block.parameters() if p.requires_grad):
                param.register_post_accumulate_grad_hook(lambda _p, name=name: self._on_grad(name))
        self._sizes = {name: sum(p.requires_grad for p in block.parameters()) for name, block in model.layers.items()}

    def add(self, lane: str, label: str, start: float, end: float, nbytes: int = 0) -> None:
        if self.origin is not None:
            self.spans.append(Span(lane, label, start - self.origin, end - self.origin, nbytes))

    def _on_grad(self, block: str) -> None:
        self._missing[block] -= 1
        if self._missing[block] == 0:
            self._done.append((time.perf_counter(), block))

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, cut into one compute span per block: a block's backward ends when its last
        gradient arrives (the first span also holds the output layer's, the last one the embedding's)."""
        self._missing, self._done = dict(self._sizes), []
        start = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        edges = [start] + [t for t, _ in self._done]
        for (t0, t1), (_, block) in zip(zip(edges, edges[1:], strict=False), self._done, strict=True):
            self.add("compute", f"bwd L{block}", t0, t1)
        self.add("compute", "bwd embedding", edges[-1], end)

    def _timed(self, op: str, original: Callable) -> Callable:
        label = RENAMED.get(op, op)

        def wrapper(*args, async_op: bool = False, **kwargs):
            tensor = args[1] if op != "all_reduce" and len(args) > 1 else args[0] if args else None
            nbytes = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
            launched = time.perf_counter()
            work = original(*args, async_op=async_op, **kwargs)
            if async_op:
                return _TimedWork(work, self, label, nbytes, launched)
            end = time.perf_counter()  # a blocking call: all of it is waiting
            self.add("comm", label, launched, end, nbytes)
            self.add("wait", label, launched, end, nbytes)
            return work

        return wrapper

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Record the spans of the code inside the block, timed from its start."""
        saved = {op: getattr(dist, op) for op in TIMED_OPS}
        self.spans, self.origin = [], time.perf_counter()
        try:
            for op, original in saved.items():
                setattr(dist, op, self._timed(op, original))
            yield
        finally:
            for op, original in saved.items():
                setattr(dist, op, original)


def make_engine(kind: str, model: nn.Module, bucket_mb: float = 0.25) -> NaiveDP | Zero:
    """One of `KINDS` over the default process group: the engine `make_data_parallel` builds for a training run,
    and ZeRO-3 once more with prefetching off, to show what prefetching hides."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} must be one of {', '.join(map(repr, KINDS))}")
    zero = int(kind[4]) if kind.startswith("zero") else 0
    engine = make_data_parallel(model, None, zero=zero, dp_mode="naive" if zero else kind, bucket_mb=bucket_mb)
    if kind == "zero3-no-prefetch":
        engine.prefetch = False  # read at every gather: switching it off after construction is enough
    return engine


def step_timeline(kind: str, config: ModelConfig | None = None, batch: int = 8, seq_len: int = 64,
                  bucket_mb: float = 0.25, steps: int = 3) -> dict:
    """Train `steps` steps of `kind` on this rank's share of `batch` sequences; the timeline of the last one
    (the first steps warm up allocators and the optimizer's states). A rank function for `lab.distributed.run`:
    returns {"spans": [Span as tuples], "step_s": seconds, "exposed_s": seconds blocked in collectives}."""
    config = config or ModelConfig.from_preset("tiny")
    model = materialize(build_model(config), seed=0)
    engine = make_engine(kind, model, bucket_mb)
    optimizer = adamw(engine.parameters(), LR, WEIGHT_DECAY)
    recorder = StepRecorder(model, engine)
    data = SyntheticTokens(config.vocab_size, seq_len, batch, seed=0)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(steps):
        inputs, targets = (shard_rows(t, rank, world) for t in data.next_batch())
        dist.barrier()  # every rank starts the step together, as they would in a real job
        with recorder.recording() if step == steps - 1 else nullcontext():
            start = time.perf_counter()
            recorder.backward(F.cross_entropy(engine.model(inputs).flatten(0, 1), targets.flatten()))
            engine.finish()
            optimizer.step()
            engine.after_step()  # ZeRO-1/2: all-gather the updated shards
            engine.zero_grad()
            step_s = time.perf_counter() - start
    spans = recorder.spans
    return {"spans": [astuple(s) for s in spans], "step_s": step_s,
            "exposed_s": sum(s.end - s.start for s in spans if s.lane == "wait")}


_COLOURS = {"fwd": "#90caf9", "bwd": ("#1565c0", "#42a5f5"), "all_reduce": "#ef6c00",
            "all_gather_single": "#2e7d32", "reduce_scatter_single": "#6a1b9a", "wait": "#c62828"}


def plot_timelines(timelines: dict[str, dict], ax=None, title: str = "one training step, rank 0"):
    """Two lanes per timeline (compute above, communication below); red = the loop blocked in a collective.
    `timelines` maps a name to what `step_timeline` returned. Needs matplotlib; returns the axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ax = ax or plt.subplots(figsize=(10, 1.1 * len(timelines) + 0.8))[1]
    ticks, names = [], []
    for row, (name, timeline) in enumerate(timelines.items()):
        y = -3 * row
        spans = [Span(*s) for s in timeline["spans"]]
        backward = 0
        for s in spans:
            width = (s.end - s.start) * 1e3
            if s.lane == "compute":
                colour = _COLOURS["fwd"] if s.label.startswith("fwd") else _COLOURS["bwd"][backward % 2]
                backward += s.label.startswith("bwd")
                ax.barh(y, width, left=s.start * 1e3, height=0.8, color=colour)
            elif s.lane == "wait":
                ax.barh(y, width, left=s.start * 1e3, height=0.8, color="none", edgecolor=_COLOURS["wait"],
                        hatch="////", linewidth=0)
            else:
                ax.barh(y - 1, width, left=s.start * 1e3, height=0.6, color=_COLOURS[s.label], alpha=0.75,
                        edgecolor="white", linewidth=0.5)
        ticks += [y, y - 1]
        names += [f"{name}: compute", f"{name}: comm"]
    ax.set_yticks(ticks, names, fontsize=8)
    ax.set_xlabel("ms since the step began")
    ax.set_title(title)
    legend = [Patch(color=_COLOURS["fwd"], label="forward"),
              Patch(color=_COLOURS["bwd"][0], label="backward (per block)"),
              Patch(facecolor="none", edgecolor=_COLOURS["wait"], hatch="////", label="blocked on communication")]
    shown = {Span(*s).label for t in timelines.values() for s in t["spans"] if s[0] == "comm"}
    legend += [Patch(color=_COLOURS[RENAMED.get(op, op)], label=name) for op, name in TIMED_OPS.items()
               if RENAMED.get(op, op) in shown]
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return ax
