"""Stopping a run on SIGTERM: at the end of the current step, after a checkpoint, so that a requeued job resumes.

Slurm sends SIGTERM before a job's time limit when asked to (`#SBATCH --signal=B:TERM@120`, which the script of
`lab.distributed.slurm` passes on to the ranks), and clusters do the same before preempting a job; a run that
ignores it is SIGKILLed seconds later and loses every step since its last checkpoint. With `--checkpoint-dir`,
`lab.train` instead:

- only notes the signal in its handler: a step, a collective or a save is never cut halfway;
- at the end of each step, asks every rank whether any was signalled (an all-reduce of one flag): ranks signalled
  a step apart must still stop at the same step, or those that went on would wait in a collective for the others;
- saves a checkpoint at that step (unless the step's regular save has just written it) and leaves with
  `StoppedBySignal`, which `python -m lab.train` reports in one line and turns into exit status 143
  (`EXIT_STOPPED`: 128 + SIGTERM, what a shell reports for a process SIGTERM ended), not 0: the run is not done.

`--resume` continues from that checkpoint. Without `--checkpoint-dir` there is nothing to save, and SIGTERM keeps
its default action: the run ends at once.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from lab.checkpoint import Checkpointer, complete_checkpoints, finish_save, save

EXIT_STOPPED = 128 + signal.SIGTERM


class StoppedBySignal(RuntimeError):
    """The run stopped on SIGTERM after step `step`, whose checkpoint is `path`."""

    def __init__(self, step: int, path: str) -> None:
        super().__init__(f"stopped by SIGTERM after step {step}: checkpoint {path} written; run again with --resume "
                         f"to continue from it (exit status {EXIT_STOPPED})")
        self.step, self.path = step, path


class StopOnSignal:
    """Notes SIGTERM while installed; `agreed` says, on every rank alike, whether any rank got it. Disabled (no
    checkpoint to write), it installs nothing and never communicates."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.signalled = enabled, False
        self._previous: Any = None

    def install(self) -> None:
        """Handle SIGTERM from now on; Python runs handlers in the main thread only, so elsewhere nothing changes."""
        if self.enabled and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._note)

    def uninstall(self) -> None:
        """Put back the handler found by `install` (a notebook or a test goes on after the run)."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.signalled = True

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank has been signalled: the largest flag over all ranks (a collective, so every rank of the
        group must call it, once a step)."""
        if not self.enabled or not dist.is_initialized() or dist.get_world_size() == 1:
            return self.signalled
        flag = torch.tensor([float(self.signalled)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def checkpoint_now(checkpointer: Checkpointer, step: int, par: Any, optimizer: torch.optim.Optimizer, scheduler: Any,
                   data: Any) -> str:
    """A complete checkpoint of `step`, and its path: the one the step's regular save wrote (waited for when it is
    asynchronous), or a new one. Every rank calls it (a save is collective)."""
    if checkpointer.pending is not None:  # an asynchronous save still writing: its files must be complete first
        finish_save(checkpointer.pending)
        checkpointer.pending = None
    options = checkpointer.options
    if options.every and step % options.every == 0:  # the step's own `after_step` saved it
        return complete_checkpoints(options.dir)[-1]
    return save(options.dir, step, par, optimizer, scheduler, data, checkpointer.config, checkpointer.scaler)
