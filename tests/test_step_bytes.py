"""The optimizer step without an op per parameter: master-weight casts and AdamW over all tensors at once.

`MasterWeights` moves gradients into the fp32 masters and the updated masters back into the bf16 model with
multi-tensor (`torch._foreach_*`) ops over one flat buffer, and `adamw` runs torch's foreach AdamW. Both must give
the per-parameter loop's numbers bit for bit, and the number of ops they dispatch must not grow with the number of
parameters (a TorchDispatchMode counts every op that computes: views, which launch nothing, are left out, and so
are AdamW's reads of its per-tensor step counts, numbers that live on the host: `foreach` AdamW keeps them on the
CPU whatever the parameters' device, so reading them costs no kernel and no synchronisation).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lab.parallel.optim import BETAS, EPS, adamw
from lab.precision.master import PRESETS, MasterWeights, MixedPrecisionPolicy, reduced_gradient

POLICIES = {"bf16": PRESETS["bf16"], "fp16": PRESETS["fp16"],
            "bf16 sums": MixedPrecisionPolicy(torch.bfloat16, torch.bfloat16)}  # rounded after each addition


class OpCounter(TorchDispatchMode):
    """The ops that compute (not views, not host reads of CPU numbers, not profiler marks) run inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        host_read = func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "cpu"
        if not (func.is_view or host_read or func.namespace == "profiler"):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _params(n: int, dtype: torch.dtype, seed: int = 0) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(3 + i % 4, 5, generator=gen).to(dtype)) for i in range(n)]


def _gradients(params: list[nn.Parameter], seed: int) -> None:
    """A new gradient in every parameter but the second (unused this micro-batch); the third's arrives summed in
    fp32 by an engine (`main_grad`), not in `.grad`."""
    gen = torch.Generator().manual_seed(seed)
    for i, param in enumerate(params):
        grad = torch.randn(param.shape, generator=gen)
        if i == 2:
            param.main_grad = grad
        elif i != 1:
            param.grad = grad.to(param.dtype)


def _per_parameter_grads_to_master(masters: MasterWeights) -> None:
    """`grads_to_master` as it was, one parameter at a time (lab.precision.master before issue 36)."""
    for param, master in zip(masters.model_params, masters.master_params, strict=True):
        if param.grad is None:
            summed = reduced_gradient(param)
            if summed is not None:
                master.grad = summed.float()
            continue
        if master.grad is None:
            master.grad = param.grad.float()
        else:
            master.grad.add_(param.grad.float())
        if masters.policy.reduce_dtype != torch.float32:
            master.grad.copy_(master.grad.to(masters.policy.reduce_dtype))
        param.grad.zero_()


def _step(params: list[nn.Parameter], policy: MixedPrecisionPolicy, multi_tensor: bool) -> list[torch.Tensor]:
    """Two micro-batches' gradients into the masters, an update, the masters back into the model; everything."""
    masters = MasterWeights(params, policy)
    for micro_batch in range(2):
        _gradients(params, seed=10 + micro_batch)
        with torch.no_grad():
            masters.grads_to_master() if multi_tensor else _per_parameter_grads_to_master(masters)
    grads = [m.grad.clone() if m.grad is not None else torch.full((1,), -1.0) for m in masters.master_params]
    with torch.no_grad():
        for master in masters.master_params:
            master.sub_(0.37 * master.grad if master.grad is not None else 0.0)  # an update far below bf16's ulp
        if multi_tensor:
            masters.master_to_model()
        else:
            for param, master in zip(params, masters.master_params, strict=True):
                param.copy_(master)
    return grads + [p.grad for p in params if p.grad is not None] + [p.detach() for p in params]


@pytest.mark.parametrize("policy", POLICIES)
def test_master_step_is_the_per_parameter_loop_bit_for_bit(policy):
    dtype = POLICIES[policy].param_dtype
    got = _step(_params(5, dtype), POLICIES[policy], multi_tensor=True)
    want = _step(_params(5, dtype), POLICIES[policy], multi_tensor=False)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"tensor {i} differs from the per-parameter loop's"


def _master_step_ops(n: int) -> list[str]:
    params = _params(n, torch.bfloat16)
    masters = MasterWeights(params, PRESETS["bf16"])
    ops = []
    _gradients(params, seed=1)
    with OpCounter() as counter:
        masters.grads_to_master()  # new master gradients (a cast each, before)
    ops += counter.ops
    _gradients(params, seed=2)
    with OpCounter() as counter:
        masters.grads_to_master()  # added into them (a cast, an add and a zero each, before)
        masters.master_to_model()  # a cast each, before
    return ops + counter.ops


def test_master_step_ops_do_not_grow_with_the_parameter_count():
    few, many = _master_step_ops(4), _master_step_ops(40)
    assert len(many) == len(few) <= 8, f"{len(few)} ops for 4 parameters, {len(many)} for 40: {many}"


def test_adamw_is_foreach_bit_for_bit_and_its_ops_do_not_grow_with_the_parameter_count():
    def steps(n: int, foreach: bool) -> tuple[list[torch.Tensor], int]:
        params = _params(n, torch.float32)
        optimizer = (adamw(params, lr=1e-3, weight_decay=0.1) if foreach else
                     torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1}],
                                       lr=1e-3, betas=BETAS, eps=EPS, foreach=False))
        for step in range(3):
            _gradients(params, seed=step)
            params[2].grad = params[2].main_grad
            with OpCounter() as counter:
                optimizer.step()
        return [p.detach() for p in params], len(counter.ops)

    (got, few), (want, _), (_, many) = steps(4, True), steps(4, False), steps(40, True)
    assert all(group["foreach"] for group in adamw(_params(2, torch.float32), 1e-3, 0.1).param_groups)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert many == few, f"AdamW's step dispatched {few} ops for 4 parameters, {many} for 40"
