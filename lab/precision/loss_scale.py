"""Dynamic loss scaling for fp16 training, written out from scratch (the rule `torch.amp.GradScaler` applies).

fp16 has 5 exponent bits: its smallest subnormal is 2^-24 ≈ 6e-8, and gradients of a small loss routinely fall
below it and flush to zero. Multiplying the loss by a large `scale` before backward shifts every gradient up by the
same factor, into fp16's range; the gradients are divided by it again (in fp32) before clipping and the optimizer
step. Too large a scale overflows to inf instead, so the scale is chosen by feedback:

- a step whose gradients hold an inf or nan is skipped, and the scale backs off (× `backoff_factor`);
- after `growth_interval` clean steps in a row the scale grows (× `growth_factor`), probing for headroom.

One training step reads::

    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)      # optional: needed before clipping, which must see true gradients
    clip_grad_norm(params, max_norm)
    scaler.step(optimizer)          # skipped if an inf/nan was found
    scaler.update()

With sharded gradients (ZeRO pieces, TP shards) each rank sees only its own part, so one rank may overflow
while another does not; the overflow flag is all-reduced (MAX) so that every rank skips the same steps, or the
replicas would drift apart.

The scale is kept as an fp32 value and updated with GradScaler's arithmetic (the product formed in double and
rounded to fp32; a growth that would reach inf is refused), so the two trajectories agree bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist


def _fp32(value: float) -> float:
    """`value` rounded to the nearest fp32 number: the scale lives in fp32 as GradScaler's does."""
    return torch.tensor(value, dtype=torch.float32).item()


def _grads(target: torch.optim.Optimizer | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients an optimizer will apply, or those of the parameters given (tensors whose `.grad` is set)."""
    params = ([p for group in target.param_groups for p in group["params"]]
              if isinstance(target, torch.optim.Optimizer) else list(target))
    return [p.grad for p in params if p.grad is not None]


class DynamicLossScaler:
    """Scale the loss up before backward, unscale the gradients before the step, skip the steps that overflowed.

    Arguments as `torch.amp.GradScaler`'s (and its defaults): the first scale 2^16, ×2 after `growth_interval`
    clean steps, ×0.5 on every overflow. `enabled=False` makes every method a pass-through, so a training loop
    calls the same methods whatever its precision.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True) -> None:
        if not 0 < _fp32(init_scale) < float("inf"):
            raise ValueError(f"init_scale={init_scale} must be > 0 and finite in fp32 (at most ~3.4e38)")
        if not growth_factor > 1:
            raise ValueError(f"growth_factor={growth_factor} must be > 1")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor={backoff_factor} must be in (0, 1)")
        if not isinstance(growth_interval, int) or isinstance(growth_interval, bool) or growth_interval < 1:
            raise ValueError(f"growth_interval={growth_interval!r} must be an integer >= 1")
        self.enabled = enabled
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self._scale = _fp32(init_scale)
        self._growth_tracker = 0  # clean steps in a row since the last growth or overflow
        self._found_inf: bool | None = None  # set by unscale_ and consumed by update: one check per step
        self._stepped = False

    def get_scale(self) -> float:
        """The current scale (1.0 when disabled)."""
        return self._scale if self.enabled else 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss × scale`, to call backward on: every gradient comes out multiplied by the scale."""
        if not self.enabled:
            return loss
        return loss * torch.tensor(self._scale, dtype=torch.float32, device=loss.device)

    @torch.no_grad()
    def unscale_(self, target: torch.optim.Optimizer | Iterable[torch.Tensor],
                 group: dist.ProcessGroup | None = None) -> None:
        """Divide the gradients by the scale, in place, and record whether any of them holds an inf or nan.

        `target` is the optimizer (its parameters' gradients) or the parameters themselves. The gradients must
        be fp32 (the master gradients of `lab.precision.master`): an fp16 gradient divided in fp16 would underflow
        again, which is what scaling was for. The division is a multiplication by the fp32 reciprocal of the
        scale, as GradScaler does (identical for the power-of-2 scales of the default factors). The overflow flag
        is all-reduced with MAX over `group` (the world, when a process group is initialized), so that ranks
        holding different shards agree to skip a step together.
        """
        if not self.enabled:
            return
        if self._found_inf is not None:
            raise RuntimeError("unscale_() was already called since the last update(): the gradients would be "
                               "divided by the scale twice")
        grads = _grads(target)
        low = sorted({str(g.dtype) for g in grads if g.dtype.itemsize < 4})
        if low:
            raise ValueError(f"unscale_ got {', '.join(low)} gradients; it needs fp32 ones: unscale the fp32 master "
                             "gradients (MasterWeights.grads_to_master first)")
        inv_scale = _fp32(1.0 / self._scale)
        device = grads[0].device if grads else torch.device("cpu")
        finite = torch.ones((), dtype=torch.bool, device=device)
        for grad in grads:
            grad.mul_(inv_scale)
            finite &= torch.isfinite(grad).all()
        found_inf = (~finite).float()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
        self._found_inf = bool(found_inf.item())

    def step(self, optimizer: torch.optim.Optimizer, group: dist.ProcessGroup | None = None) -> bool:
        """Unscale (unless `unscale_` was called already) and take the optimizer step, unless a gradient held an
        inf or nan: that step is skipped, since its update would write inf/nan into the weights. Returns whether
        the step was taken."""
        if not self.enabled:
            optimizer.step()
            return True
        if self._stepped:
            raise RuntimeError("step() was already called since the last update()")
        if self._found_inf is None:
            self.unscale_(optimizer, group)
        self._stepped = True
        if self._found_inf:
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """Adjust the scale after a step: back off and restart the count on an overflow; grow after
        `growth_interval` clean steps in a row (unless the grown scale would be inf in fp32)."""
        if not self.enabled:
            return
        if self._found_inf is None:
            raise RuntimeError("update() needs the inf/nan check of this step: call unscale_() or step() first")
        if self._found_inf:
            self._scale = _fp32(self._scale * self.backoff_factor)
            self._growth_tracker = 0
        elif self._growth_tracker + 1 == self.growth_interval:
            grown = _fp32(self._scale * self.growth_factor)
            if grown != float("inf"):
                self._scale = grown
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
        self._found_inf, self._stepped = None, False

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state, with GradScaler's keys: a checkpoint of either loads into the other."""
        if not self.enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s state (a no-op when disabled, as GradScaler)."""
        if not self.enabled:
            return
        if not state:
            raise ValueError("empty scaler state: it was saved from a disabled scaler")
        self._scale = _fp32(state["scale"])
        self.growth_factor, self.backoff_factor = state["growth_factor"], state["backoff_factor"]
        self.growth_interval, self._growth_tracker = state["growth_interval"], state["_growth_tracker"]
