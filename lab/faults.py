"""Failures on purpose: `--inject-failure rank=R,step=S[,kind=raise|kill|hang]` makes one rank fail at one step.

Runs at scale are interrupted every few hours (Llama 3 405B: 419 unexpected interruptions in 54 days), so the
path that recovers from a failure — the launcher restarts the whole group, which resumes from its last
checkpoint — is code like any other, and needs a failure on demand to be tested.

The failure fires on rank R during step S, after the step's forward and backward (gradients reduced) and before
its optimizer step: step S's update is lost, and a restart redoes it from the last checkpoint. It fires on the
first attempt only (restart count 0, `lab.distributed.restarts`): a restart that failed again at the same
place would never get past it. The kinds are the three ways a rank is lost:

    raise  a Python error, RuntimeError("injected failure: rank R at step S"): the launcher shows its traceback
    kill   SIGKILL of the rank itself, as the OOM killer or a lost node do: no traceback, only the signal
    hang   blocks forever in Python, outside any collective (a deadlock, a stuck file system): the other ranks
           wait in their next collective until the collective timeout, then the launcher names the missing rank
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

from lab.distributed import restarts

KINDS = ("raise", "kill", "hang")
USAGE = "rank=R,step=S[,kind=raise|kill|hang]"


@dataclass(frozen=True)
class InjectedFailure:
    """Rank `rank` fails at step `step` (counted from 1, as the log counts) in the way `kind` says."""

    rank: int
    step: int
    kind: str = "raise"

    def __post_init__(self) -> None:
        for name, minimum in (("rank", 0), ("step", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"inject-failure {name}={value!r} must be an integer >= {minimum}")
        if self.kind not in KINDS:
            raise ValueError(f"inject-failure kind={self.kind!r} must be one of {', '.join(KINDS)}")

    @classmethod
    def parse(cls, text: str) -> InjectedFailure:
        """`rank=1,step=3,kind=kill` -> InjectedFailure(1, 3, "kill"); any bad part is one ValueError line."""
        fields: dict[str, str] = {}
        for item in text.split(","):
            key, equals, value = (part.strip() for part in item.partition("="))
            if not equals or key not in ("rank", "step", "kind") or key in fields:
                raise ValueError(f"inject-failure {text!r}: {item.strip()!r} is not rank=R, step=S or kind=K, "
                                 f"each once (expected {USAGE})")
            fields[key] = value
        if missing := [key for key in ("rank", "step") if key not in fields]:
            raise ValueError(f"inject-failure {text!r} names no {' and no '.join(missing)} (expected {USAGE})")
        numbers = {}
        for key in ("rank", "step"):
            try:
                numbers[key] = int(fields[key])
            except ValueError:
                raise ValueError(f"inject-failure {key}={fields[key]!r} must be an integer") from None
        return cls(numbers["rank"], numbers["step"], fields.get("kind", "raise"))

    def check(self, world_size: int, steps: int) -> None:
        """Refuse a failure that would never fire in a run of `world_size` ranks and `steps` steps."""
        if self.rank >= world_size:
            raise ValueError(f"inject-failure rank={self.rank} must be in 0..{world_size - 1} (the run has "
                             f"{world_size} rank(s))")
        if self.step > steps:
            raise ValueError(f"inject-failure step={self.step} must be in 1..{steps} (the run has {steps} steps)")
        if self.kind == "hang" and world_size == 1:
            raise ValueError("inject-failure kind='hang' needs 2 or more ranks: a hang is noticed by the ranks "
                             "that wait for it in a collective")

    def maybe_fire(self, rank: int, step: int) -> None:
        """Fail now if this is rank `rank` at step `step` of the first attempt; else return at once."""
        if (rank, step) != (self.rank, self.step) or restarts()[0] > 0:
            return
        print(f"lab.faults: injecting a failure on rank {rank} at step {step} (kind={self.kind})", file=sys.stderr,
              flush=True)
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while self.kind == "hang":  # in Python, in no collective: the others wait for this rank in theirs
            time.sleep(60)
        raise RuntimeError(f"injected failure: rank {rank} at step {step}")
