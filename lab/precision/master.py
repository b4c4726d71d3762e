"""Mixed-precision training with fp32 master weights: the model computes in bf16/fp16, the optimizer updates fp32.

Why the fp32 copy: a weight stored in bf16 keeps 8 significant bits, so around 1.0 its neighbours are 2^-7 apart
and any update smaller than half of that (2^-8 ≈ 0.004) rounds back to the same weight. With lr 1e-4 almost every
AdamW update is that small: a bf16 model updated in bf16 stops learning, silently. The fp32 master copy receives
every update, however small, and they add up; the bf16 copy the model computes with is re-rounded from it after
each step. The same holds for gradients summed over micro-batches: in bf16 each addition rounds to 8 bits, in fp32
the sum is exact to 24.

The knobs carry the names of FSDP2's `MixedPrecisionPolicy` (torch.distributed.fsdp), so the two read alike:

- `param_dtype`: the dtype of the copy the model computes with (forward and backward);
- `reduce_dtype`: the dtype gradients are summed in — over micro-batches here, over ranks in the engines;
- `output_dtype`: the dtype the model's output is cast to (the loss is best taken in fp32), None to keep it.

`MasterWeights` works on whatever tensors it is given — whole parameters, TP shards, ZeRO's flat pieces — so
the optimizer, which `lab.train` builds outside the data-parallel engines, is built over `master_params` in
every layout. The masters start from the fp32 values the model's weights were rounded from (`initial`), not from
the rounded weights: FSDP2's contract, whose fp32 sharded parameter is the master and whose bf16 copy is made from
it. Upcasting the rounded copy instead would start every master up to half an ulp away from the fp32 run's
weights (2^-11 of each value in fp16, 2^-8 in bf16), a gap that no later step closes. One step reads::

    loss.backward()                 # per micro-batch; then grads_to_master() to accumulate in reduce_dtype
    masters.grads_to_master()       # the model's low-precision gradients added into the fp32 master gradients
    optimizer.step()                # over masters.master_params
    masters.master_to_model()       # the updated masters rounded into the model's bf16/fp16 weights
    optimizer.zero_grad()
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Which dtype the model computes in (`param_dtype`), which one gradients are summed in (`reduce_dtype`), and
    which one the model's output is cast to (`output_dtype`, None: left as computed). FSDP2's names."""

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    output_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            dtype = getattr(self, field)
            if dtype not in _NAMES and not (field == "output_dtype" and dtype is None):
                raise ValueError(f"{field}={dtype} must be one of {', '.join(map(str, _NAMES))}")
        if self.reduce_dtype.itemsize < self.param_dtype.itemsize:
            raise ValueError(f"reduce_dtype={self.reduce_dtype} must be at least as wide as "
                             f"param_dtype={self.param_dtype}: a sum is never kept coarser than its terms")

    @classmethod
    def preset(cls, name: str) -> MixedPrecisionPolicy:
        """The policy of a `--precision` name: fp32, or bf16/fp16 compute with fp32 gradient sums and output."""
        if name not in PRESETS:
            raise ValueError(f"precision {name!r} must be one of {', '.join(PRESETS)}")
        return PRESETS[name]

    @property
    def needs_master_weights(self) -> bool:
        """An fp32 copy is needed whenever the model's own weights are coarser than fp32."""
        return self.param_dtype != torch.float32

    @property
    def needs_loss_scaling(self) -> bool:
        """fp16's 5 exponent bits flush small gradients to zero (`lab.precision.loss_scale`); bf16 has fp32's 8."""
        return self.param_dtype == torch.float16


# The logits are cast to fp32: the loss's log-sum-exp over the vocabulary is where low precision hurts most.
PRESETS = {"fp32": MixedPrecisionPolicy(),
           "bf16": MixedPrecisionPolicy(torch.bfloat16, torch.float32, torch.float32),
           "fp16": MixedPrecisionPolicy(torch.float16, torch.float32, torch.float32)}


def reduced_gradient(param: torch.Tensor) -> torch.Tensor | None:
    """Where a parameter's summed gradient is: its `.grad`, or, when it was summed in another dtype than the
    parameter's (fp32 sums of a bf16 model: a bf16 parameter cannot hold an fp32 `.grad`), `param.main_grad` —
    Megatron's name for that buffer, which the data-parallel engines of `lab.parallel` use too."""
    return param.grad if param.grad is not None else getattr(param, "main_grad", None)


class MasterWeights:
    """fp32 master copies of a model's low-precision parameters, for the optimizer to update.

    `params` are the tensors this rank updates, already in `policy.param_dtype`; `initial`, one fp32 tensor per
    parameter, the values they were rounded from, which the masters copy (None: the parameters' own values,
    upcast, exact only where those were representable). Each master is a new fp32 leaf carrying the model
    tensor's attributes (a TP placement, ZeRO's `decays`): `clip_grad_norm` and `adamw` read them from whatever
    tensors they are given. Under an fp32 policy the masters are the parameters themselves — no copy, no extra
    bytes, and both methods do nothing.
    """

    def __init__(self, params: Iterable[torch.Tensor], policy: MixedPrecisionPolicy,
                 initial: Iterable[torch.Tensor] | None = None) -> None:
        self.policy = policy
        self.model_params = list(params)
        wrong = sorted({str(p.dtype) for p in self.model_params if p.dtype != policy.param_dtype})
        if wrong:
            raise ValueError(f"parameters in {', '.join(wrong)} given for param_dtype={policy.param_dtype}: cast "
                             "the model to param_dtype first")
        values = self.model_params if initial is None else _checked_initial(self.model_params, list(initial))
        self.master_params = [self._master(p, v) for p, v in zip(self.model_params, values, strict=True)]
        self._masters = {id(p): m for p, m in zip(self.model_params, self.master_params, strict=True)}

    def master(self, param: torch.Tensor) -> torch.Tensor:
        """The master copy of one of the tensors given (that tensor itself under fp32): what the optimizer updates
        and keeps state for, and what a checkpoint saves as the weight."""
        return self._masters[id(param)]

    def _master(self, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        if not self.policy.needs_master_weights:
            return param
        master = nn.Parameter(value.detach().float().clone())
        # placement, decays: what the optimizer and the norm read (torch's own state is not in __dict__)
        master.__dict__.update({k: v for k, v in vars(param).items() if not k.startswith("_")})
        return master

    @torch.no_grad()
    def grads_to_master(self) -> None:
        """Give the master gradients the model's gradients, in fp32.

        Where a data-parallel engine summed a gradient in another dtype than the parameter's (`main_grad`, see
        `reduced_gradient`), the master's gradient is that sum: the same buffer when it is fp32, no copy. Otherwise
        the model's `.grad` is added into the master gradient, summed in `reduce_dtype`, and zeroed. Called once per
        step, the sum over micro-batches is the one backward made in `param_dtype`; called after every
        micro-batch's backward, it is made in `reduce_dtype` instead (fp32: exact to 24 bits). A parameter without
        a gradient (unused this micro-batch) is skipped, so its master gradient stays None until one arrives, as
        autograd's would. The model's gradient is zeroed in place rather than freed: the engines keep views into
        it (gradient buckets, ZeRO's flat buffers). A `reduce_dtype` narrower than fp32 is emulated: the sum is
        rounded to it after each addition and kept in the fp32 tensor the optimizer needs.

        Each of those steps is one multi-tensor op over all the tensors (`torch._foreach_copy_` casts as it copies),
        and new master gradients are views of one flat fp32 buffer: a handful of ops whatever the parameter count,
        not a cast, an add and a zero per parameter (tests/test_step_bytes.py counts them)."""
        if not self.policy.needs_master_weights:
            return
        fresh, accumulate = [], []
        for param, master in zip(self.model_params, self.master_params, strict=True):
            if param.grad is None:
                summed = reduced_gradient(param)
                if summed is not None:
                    master.grad = summed.float()
            else:
                (fresh if master.grad is None else accumulate).append((param, master))
        if fresh:
            views = _flat_views([m for _, m in fresh], torch.float32)
            torch._foreach_copy_(views, [p.grad for p, _ in fresh])
            for view, (_, master) in zip(views, fresh, strict=True):
                master.grad = view
        if accumulate:
            torch._foreach_add_([m.grad for _, m in accumulate], [p.grad for p, _ in accumulate])
        summed = fresh + accumulate
        if summed and self.policy.reduce_dtype != torch.float32:
            grads = [m.grad for _, m in summed]
            rounded = _flat_views(grads, self.policy.reduce_dtype)
            torch._foreach_copy_(rounded, grads)
            torch._foreach_copy_(grads, rounded)
        if summed:
            torch._foreach_zero_([p.grad for p, _ in summed])

    def zero_grad(self) -> None:
        """Drop the master gradients (the model's are the engine's to clear)."""
        if self.policy.needs_master_weights:
            for master in self.master_params:
                master.grad = None

    @torch.no_grad()
    def master_to_model(self) -> None:
        """Copy the updated masters into the model's parameters, rounded (to nearest) to `param_dtype`; in place,
        so views of them (a ZeRO shard's pieces) see the new values. One multi-tensor copy, which casts as it copies
        (FSDP2 casts its parameters so), rather than a copy per parameter."""
        if self.policy.needs_master_weights and self.model_params:
            torch._foreach_copy_(self.model_params, self.master_params)


def _flat_views(like: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """Tensors shaped as `like`'s, in `dtype`: views of one new flat buffer, so one allocation, not one each."""
    buffer = torch.empty(sum(t.numel() for t in like), dtype=dtype, device=like[0].device)
    return [view.view(t.shape) for view, t in zip(buffer.split([t.numel() for t in like]), like, strict=True)]


@torch.no_grad()
def _checked_initial(params: list[torch.Tensor], initial: list[torch.Tensor]) -> list[torch.Tensor]:
    """`initial` if it is one fp32 tensor per parameter that rounds to that parameter; ValueError, one line, if not:
    masters started from other values would train another model than the one the weights hold."""
    if len(initial) != len(params):
        raise ValueError(f"initial has {len(initial)} tensors for {len(params)} parameters: give one per parameter")
    for i, (param, value) in enumerate(zip(params, initial, strict=True)):
        if value.dtype != torch.float32 or value.shape != param.shape:
            raise ValueError(f"initial[{i}] is {value.dtype} {tuple(value.shape)} for a parameter of shape "
                             f"{tuple(param.shape)}: it must be the fp32 value the parameter was rounded from")
        if param.device.type != "meta" and not torch.equal(value.to(param.dtype), param):
            raise ValueError(f"initial[{i}] does not round to its parameter (shape {tuple(param.shape)}): it must be "
                             "the fp32 value the parameter was rounded from")
    return initial
