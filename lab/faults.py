"""Failures on purpose: `--inject-failure rank=R,step=S[,kind=raise|kill|hang]` makes one rank fail at one step;
`kind=straggler,delay_ms=D` makes it slow, `kind=bitflip[,param=NAME][,bit=B]` corrupts one of its parameters.

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

Two more kinds fail without stopping anything, the failures chapter 08b finds by comparing ranks
(`lab.distributed.health`):

    straggler  rank R sleeps `delay_ms` in every step from step S (default 1) on, before its forward: a slow
               GPU, a throttled node, a noisy neighbour. Every attempt, not only the first: a slow node stays slow
    bitflip    after step S's update, rank R flips bit `bit` (default 0, the lowest mantissa bit of an fp32) of the
               first element of parameter `param` (default the model's first): silent data corruption, first
               attempt only (a restart reloads a clean checkpoint)
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

import torch
from torch import nn

from lab.distributed import restarts

KINDS = ("raise", "kill", "hang", "straggler", "bitflip")
USAGE = "rank=R,step=S[,kind=raise|kill|hang|bitflip[,param=NAME,bit=B]] or rank=R,kind=straggler,delay_ms=D"
_OWN_FIELDS = {"straggler": ("delay_ms",), "bitflip": ("param", "bit")}  # the fields only one kind takes


@dataclass(frozen=True)
class InjectedFailure:
    """Rank `rank` fails at step `step` (counted from 1, as the log counts) in the way `kind` says; a straggler
    sleeps `delay_ms` per step from `step` on, a bit flip flips bit `bit` of parameter `param` (None: the first)."""

    rank: int
    step: int
    kind: str = "raise"
    delay_ms: float = 0.0
    param: str | None = None
    bit: int = 0

    def __post_init__(self) -> None:
        for name, minimum in (("rank", 0), ("step", 1), ("bit", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"inject-failure {name}={value!r} must be an integer >= {minimum}")
        if self.kind not in KINDS:
            raise ValueError(f"inject-failure kind={self.kind!r} must be one of {', '.join(KINDS)}")
        if self.kind == "straggler" and not self.delay_ms > 0:
            raise ValueError(f"inject-failure kind='straggler' needs delay_ms=D > 0 (got {self.delay_ms!r})")

    @classmethod
    def parse(cls, text: str) -> InjectedFailure:
        """`rank=1,step=3,kind=kill` -> InjectedFailure(1, 3, "kill"); any bad part is one ValueError line."""
        fields: dict[str, str] = {}
        keys = ("rank", "step", "kind", "delay_ms", "param", "bit")
        for item in text.split(","):
            key, equals, value = (part.strip() for part in item.partition("="))
            if not equals or key not in keys or key in fields:
                raise ValueError(f"inject-failure {text!r}: {item.strip()!r} is not rank=R, step=S or kind=K, "
                                 f"each once, or a kind's own delay_ms=D, param=NAME, bit=B (expected {USAGE})")
            fields[key] = value
        kind = fields.get("kind", "raise")
        if kind == "straggler":
            fields.setdefault("step", "1")  # slow from the first step on
        if missing := [key for key in ("rank", "step") if key not in fields]:
            raise ValueError(f"inject-failure {text!r} names no {' and no '.join(missing)} (expected {USAGE})")
        for key in ("delay_ms", "param", "bit"):
            if key in fields and key not in _OWN_FIELDS.get(kind, ()):
                raise ValueError(f"inject-failure {key}= belongs to kind="
                                 f"{next(k for k, own in _OWN_FIELDS.items() if key in own)}, not kind={kind}")
        numbers: dict[str, float] = {}
        for key, kind_of in (("rank", int), ("step", int), ("bit", int), ("delay_ms", float)):
            if key in fields:
                try:
                    numbers[key] = kind_of(fields[key])
                except ValueError:
                    raise ValueError(f"inject-failure {key}={fields[key]!r} must be "
                                     f"{'an integer' if kind_of is int else 'a number'}") from None
        return cls(numbers["rank"], numbers["step"], kind, numbers.get("delay_ms", 0.0), fields.get("param"),
                   numbers.get("bit", 0))

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
        if self.kind not in ("raise", "kill", "hang") or (rank, step) != (self.rank, self.step) or restarts()[0] > 0:
            return
        print(f"lab.faults: injecting a failure on rank {rank} at step {step} (kind={self.kind})", file=sys.stderr,
              flush=True)
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while self.kind == "hang":  # in Python, in no collective: the others wait for this rank in theirs
            time.sleep(60)
        raise RuntimeError(f"injected failure: rank {rank} at step {step}")

    def maybe_delay(self, rank: int, step: int) -> None:
        """A straggler's rank sleeps its delay, in every step from `step` on; every other rank returns at once."""
        if self.kind == "straggler" and rank == self.rank and step >= self.step:
            time.sleep(self.delay_ms / 1e3)

    def maybe_flip(self, rank: int, step: int, model: nn.Module) -> None:
        """A bit flip's rank, at its step of the first attempt, flips its bit in `model`'s parameter."""
        if self.kind != "bitflip" or (rank, step) != (self.rank, self.step) or restarts()[0] > 0:
            return
        params = dict(model.named_parameters())
        name = self.param if self.param is not None else next(iter(params))
        if name not in params:
            raise ValueError(f"inject-failure param={name!r} is not a parameter of rank {rank}'s model "
                             f"(it has {', '.join(list(params)[:4])}, ...)")
        print(f"lab.faults: flipping bit {self.bit} of {name}[0] on rank {rank} after step {step}", file=sys.stderr,
              flush=True)
        flip_bit(params[name], 0, self.bit)


@torch.no_grad()
def flip_bit(tensor: torch.Tensor, index: int, bit: int) -> None:
    """Flip bit `bit` (0: the least significant) of element `index` of the flattened `tensor`, in place: what a
    faulty memory cell or core does, with no error raised."""
    width = tensor.element_size() * 8
    if not 0 <= bit < width:
        raise ValueError(f"bit={bit} must be in 0..{width - 1} for a {tensor.dtype} element")
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    flat = tensor.view(-1).view(ints)
    mask = torch.tensor(1, dtype=torch.int64).bitwise_left_shift(bit).to(ints)  # bit 31 wraps to the sign bit
    flat[index] ^= mask
