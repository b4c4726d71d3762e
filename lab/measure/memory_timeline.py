"""A memory timeline of training steps, by category: parameters, optimizer state, activations, gradients...

PyTorch's profiler records every allocation and free; its memory profiler then works out what each
tensor *is* (a parameter, an activation saved for backward, a gradient, an optimizer state, a temporary)
from the autograd graph. That is the picture behind the playbook's memory profile figure: activations
climb during the forward pass and drain during the backward pass as gradients appear, and the first
optimizer step allocates Adam's two states, which is why every later step peaks higher than step 1.

The same code reads a CPU or a CUDA device. The categorisation is a private PyTorch API
(`torch.profiler._memory_profiler`, present since 2.1), so it is isolated here.

Kineto, the profiler's C++ backend, writes trace markers ("USDT: ... profiler_start") straight to file
descriptor 2, past Python's `sys.stderr` and whatever log level is set; a notebook kernel forwards that
descriptor into the cell's output. `memory_timeline` therefore holds descriptor 2 while it profiles and
passes on every line that is not such a marker.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

# The profiler's categories, in the column order of `MemoryProfileTimeline._coalesce_timeline`
# (column 0 is unused; the last column is memory it could not classify).
CATEGORIES = ("parameter", "optimizer_state", "input", "temporary", "activation", "gradient",
              "autograd_detail", "unknown")
PHASES = ("forward", "backward", "optimizer")
KINETO_MARKERS = ("USDT:", "STAGE:")  # the prefixes of kineto's own progress lines on descriptor 2


@dataclass
class MemoryTimeline:
    times_ms: list[float]
    bytes_by_category: dict[str, list[int]]
    phases: list[tuple[int, str, float, float]]  # (step, phase, start_ms, end_ms)

    @property
    def total(self) -> list[int]:
        return [sum(column) for column in zip(*self.bytes_by_category.values(), strict=True)]

    def peak(self, step: int | None = None) -> int:
        """Peak total bytes over the whole timeline, or within training step `step` (1-based)."""
        if step is None:
            return max(self.total)
        start = min(s for k, _, s, _ in self.phases if k == step)
        end = max(e for k, _, _, e in self.phases if k == step)
        return max(b for t, b in zip(self.times_ms, self.total, strict=True) if start <= t <= end)

    def plot(self, ax=None, title: str = "memory during training steps"):
        """A stacked area chart by category with the phases shaded (needs matplotlib)."""
        import matplotlib.pyplot as plt

        ax = ax or plt.subplots(figsize=(9, 3.5))[1]
        shown = {k: [b / 2**20 for b in v] for k, v in self.bytes_by_category.items() if max(v) > 0}
        ax.stackplot(self.times_ms, *shown.values(), labels=list(shown), step="post")
        shades = {"forward": "#e8f0ff", "backward": "#ffece8", "optimizer": "#eaffea"}
        for step, phase, start, end in self.phases:
            ax.axvspan(start, end, color=shades[phase], zorder=-1)
            ax.text((start + end) / 2, ax.get_ylim()[1] * 0.97, f"{phase[0].upper()}{step}", ha="center",
                    va="top", fontsize=8)
        ax.set_xlabel("time (ms)")
        ax.set_ylabel("MiB")
        ax.set_title(title)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        return ax


def language_model_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
                        targets: torch.Tensor) -> Callable[[], None]:
    """One training step of a language model, with its phases named for the profiler."""

    def step() -> None:
        with record_function("forward"):
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return step


def memory_timeline(step: Callable[[], None], steps: int = 2, device: str | torch.device = "cpu") -> MemoryTimeline:
    """Profile `steps` calls of `step` (which names its phases with `record_function`) on `device`."""
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # the profiler files each allocation under cuda:N
        device = torch.device("cuda", torch.cuda.current_device())
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with _without_kineto_markers(), profile(activities=activities, profile_memory=True, record_shapes=True,
                                            with_stack=True) as prof:
        for _ in range(steps):
            step()
    times_us, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(device)
    origin = times_us[1] if len(times_us) > 1 and times_us[0] < 0 else times_us[0]  # t=-1: pre-existing
    times_ms = [max(t - origin, 0) / 1000 for t in times_us]
    columns = list(zip(*sizes, strict=True))[1:]
    by_category = {name: list(col) for name, col in zip(CATEGORIES, columns, strict=True)}
    phases, counts = [], dict.fromkeys(PHASES, 0)
    for start_ns, end_ns, name in sorted(_phase_events(prof.profiler.kineto_results.experimental_event_tree())):
        counts[name] += 1
        phases.append((counts[name], name, (start_ns / 1000 - origin) / 1000, (end_ns / 1000 - origin) / 1000))
    return MemoryTimeline(times_ms, by_category, phases)


@contextmanager
def _without_kineto_markers() -> Iterator[None]:
    """Send descriptor 2 to a temporary file for the duration, then write back all but kineto's markers."""
    sys.stderr.flush()
    with tempfile.TemporaryFile() as held:
        saved = os.dup(2)
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines = held.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines if not line.startswith(KINETO_MARKERS)))


def _phase_events(nodes) -> list[tuple[int, int, str]]:
    """(start, end, name) of the `record_function` phases in the profiler's event tree, in the memory timeline's
    clock (ns). Walked by hand rather than through `prof.events()`: torch's parser now and then meets a corrupt
    event name there (UnicodeDecodeError); such a node is skipped here, ours never are."""
    found, stack = [], list(nodes)
    while stack:
        node = stack.pop()
        try:
            name = node.name
        except UnicodeDecodeError:
            name = None
        if name in PHASES and node.tag == _EventType.TorchOp:  # on a GPU the same name also marks its kernels' span
            found.append((node.start_time_ns, node.end_time_ns, name))
        else:
            stack.extend(node.children)
    return found
