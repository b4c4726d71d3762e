"""Catching an FP8 instability at the step it happens: the checks a run under delayed scaling needs.

Delayed scaling (`fp8.AmaxHistory`) quantises this step's tensor with a scale made from *earlier* amaxes. When an
activation outlier arrives — a token whose one channel is thousands of times the rest, as the massive activations
of large models are — the stale scale maps it far past ±fp8_max, the cast saturates it (lab's `fp8.quantize`
clamps; a bare cast would give inf), and the step computes with a tensor that no longer holds its largest value.
Nothing crashes: the loss and the gradient norm stay finite but wrong. What catches it is the comparison the
scale was made from — this tensor's amax against the history's max — and the count of saturated values, checked
on every quantised operand before the history learns the new amax; then the loss and gradient norm being finite
(what a non-saturating cast breaks). Current (just-in-time) scaling takes its scale from the tensor itself and
has no such step.

`MonitoredFP8Matmul` is `fp8_linear.FP8Matmul` recording a `CastCheck` per quantised operand; `outlier_run` trains
a two-layer MLP through it on a stream with one outlier token, for the chapter's demonstration and its test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lab.precision.fp8 import Scaling, amax, fp8_max
from lab.precision.fp8_linear import FP8Matmul

# A new amax above twice the history's max is a jump, not drift: the largest values lose more than half their
# magnitude to saturation. Under it, a new record of a noisy amax (a Gaussian's max creeps up with every sample)
# clips a value or two by a few percent, which delayed scaling accepts by design.
JUMP = 2.0


@dataclass(frozen=True)
class CastCheck:
    """One quantised operand: its `amax`, the amax its scale was made from (`reference`: the history's max under
    delayed scaling, its own under current), and how many values the cast saturated."""

    key: str
    amax: float
    reference: float
    saturated: int

    @property
    def jump(self) -> float:
        """amax / reference: above 1, the scale was made for a smaller tensor."""
        return self.amax / self.reference if self.reference > 0 else math.inf if self.amax > 0 else 0.0

    @property
    def overflowed(self) -> bool:
        return self.jump > JUMP and self.saturated > 0


class MonitoredFP8Matmul(FP8Matmul):
    """`FP8Matmul` that checks every operand it quantises against the amax its scale came from, *before* the
    history is updated with this step's amax (after it, the history holds the new amax and agrees with anything)."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 — FP8Matmul's own arguments
        super().__init__(*args, **kwargs)
        self.checks: list[CastCheck] = []

    def quantize(self, key: str, t: torch.Tensor, scaling: Scaling) -> tuple[torch.Tensor, torch.Tensor]:
        now = float(amax(t, _per_tensor(scaling)))
        history = self.histories.get(key)
        reference = float(history.window.max()) if history is not None and len(history) else now
        q, scale = super().quantize(key, t, scaling)
        saturated = int((t.detach().float().abs() * scale.float().expand_as(t) > fp8_max(scaling.fmt)).sum()) \
            if scale.numel() == 1 else 0                                # row/tile scales are current: none saturate
        self.checks.append(CastCheck(key, now, reference, saturated))
        return q, scale


def _per_tensor(scaling: Scaling) -> Scaling:
    """The same format, one group for the whole tensor: the amax a per-tensor check compares."""
    return Scaling(scaling.fmt)


@dataclass
class StepReport:
    """One training step: its loss, gradient norm (before clipping) and every FP8 cast it made."""

    step: int
    loss: float
    grad_norm: float
    casts: list[CastCheck] = field(default_factory=list)

    def alarms(self) -> list[str]:
        """What the chapter's checks say about this step, one line each; empty when it looks healthy."""
        lines = [f"step {self.step}: {c.key} amax {c.amax:.4g} is {c.jump:.3g}x its scale's amax "
                 f"{c.reference:.4g}: {c.saturated} values saturated" for c in self.casts if c.overflowed]
        lines += [f"step {self.step}: {name} is {value}" for name, value in
                  (("loss", self.loss), ("grad norm", self.grad_norm)) if not math.isfinite(value)]
        return lines


def outlier_run(recipe: str | None, steps: int = 24, outlier_step: int | None = 16, outlier: float = 3e4,
                seed: int = 0) -> list[StepReport]:
    """Train a two-layer MLP (32 → 64 → 32, GELU) to imitate a fixed teacher on fresh Gaussian tokens, every
    linear through a `MonitoredFP8Matmul(recipe)` (None: float32), plain SGD (lr 0.2) with gradient clipping at
    1 (torch.optim would cost its 3 s import in a test process that needs nothing else from it). At
    `outlier_step` one token's channel 3 is set to `outlier`: the same data whatever the recipe, so the reports
    of two recipes compare step by step. The loss is the teacher-relative squared error."""
    if outlier_step is not None and not 0 <= outlier_step < steps:
        raise ValueError(f"outlier_step={outlier_step!r}: expected None or an int in [0, {steps})")
    g = torch.Generator().manual_seed(seed)
    d, h, n = 32, 64, 64
    teacher = [torch.randn(h, d, generator=g) / d**0.5, torch.randn(d, h, generator=g) / h**0.5]
    weights = [torch.nn.Parameter(t.clone() + torch.randn(t.shape, generator=g) * 0.5 * t.std()) for t in teacher]
    matmuls = [MonitoredFP8Matmul(recipe, accum_bits=None) if recipe else None for _ in weights]
    reports = []
    for step in range(steps):
        x = torch.randn(n, d, generator=g)
        if step == outlier_step:
            x[5, 3] = outlier
        target = F.gelu(x @ teacher[0].T) @ teacher[1].T
        hidden = x
        for i, (w, mm) in enumerate(zip(weights, matmuls, strict=True)):
            hidden = mm(hidden, w) if mm is not None else hidden @ w.T
            hidden = F.gelu(hidden) if i == 0 else hidden
        loss = (hidden - target).pow(2).mean() / target.pow(2).mean()
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(weights, 1.0))
        with torch.no_grad():
            for w in weights:
                w -= 0.2 * w.grad
                w.grad = None
        casts = [c for mm in matmuls if mm is not None for c in mm.checks]
        for mm in matmuls:
            if mm is not None:
                mm.checks.clear()
        reports.append(StepReport(step, float(loss.detach()), grad_norm, casts))
    return reports
