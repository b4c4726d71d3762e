"""Count collective calls and bytes, per operation and per process group.

The course makes claims like "ZeRO-2 moves as many bytes as DDP" or "ring all-reduce sends 2(W−1)/W of
the tensor per rank"; tests and notebooks check them by counting:

    with count_collectives() as counts:
        train_step()
    counts.calls["all_reduce"], counts.bytes["reduce_scatter_tensor"], counts.by_group[(0, 1)]
    print(counts.table())

The context manager temporarily replaces the functions of `torch.distributed` (`dist.all_reduce`, ...)
with counting wrappers, and restores them on exit, also after an exception; contexts nest. Only code
that looks the function up on the module at call time (`dist.all_reduce(...)`, as all of `lab` does)
is counted, not torch internals such as DDP's reducer.

Bytes are those of the tensor each rank hands to the operation — its own contribution:
all_reduce, broadcast, reduce, gather, scatter: the tensor; all_gather(_into_tensor): the input shard;
reduce_scatter(_tensor), all_to_all(_single): the whole input; send/isend: the message sent;
recv/irecv: the message received (counted under their own names); barrier: 0.
"""

from __future__ import annotations

import functools
import inspect
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# operation -> the name of its argument whose bytes are counted (None: counts no bytes)
_PAYLOAD_ARGUMENT = {
    "all_reduce": "tensor", "broadcast": "tensor", "reduce": "tensor", "gather": "tensor", "scatter": "tensor",
    "all_gather": "tensor", "all_gather_into_tensor": "input_tensor", "all_gather_single": "input",
    "reduce_scatter": "input_list", "reduce_scatter_tensor": "input", "reduce_scatter_single": "input",
    "all_to_all": "input_tensor_list", "all_to_all_single": "input",
    "send": "tensor", "recv": "tensor", "isend": "tensor", "irecv": "tensor", "barrier": None,
}


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _group_key(group) -> str | tuple[int, ...]:
    if group is None or group is dist.group.WORLD:
        return "world"
    return tuple(dist.get_process_group_ranks(group))


@dataclass
class CollectiveCounts:
    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    by_group: dict = field(default_factory=dict)  # group key -> Counter of {op: bytes, "op calls": n}

    def record(self, op: str, nbytes: int, group) -> None:
        self.calls[op] += 1
        self.bytes[op] += nbytes
        per_group = self.by_group.setdefault(_group_key(group), Counter())
        per_group[op] += nbytes
        per_group[f"{op} calls"] += 1

    def table(self) -> str:
        lines = [f"{'operation':<24}{'calls':>8}{'bytes':>16}"]
        lines += [f"{op:<24}{self.calls[op]:>8}{self.bytes[op]:>16,}" for op in sorted(self.calls)]
        return "\n".join(lines)


def _counting(op: str, original, counts: CollectiveCounts):
    signature = inspect.signature(original)
    argument = _PAYLOAD_ARGUMENT[op]

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs).arguments
        counts.record(op, _nbytes(bound.get(argument)) if argument else 0, bound.get("group"))
        return original(*args, **kwargs)

    return wrapper


def _counting_batch(original, counts: CollectiveCounts):
    @functools.wraps(original)
    def wrapper(p2p_op_list):
        for p2p in p2p_op_list:
            counts.record(p2p.op.__name__, _nbytes(p2p.tensor), p2p.group)
        return original(p2p_op_list)

    return wrapper


class _P2POp(dist.P2POp):
    """`P2POp` accepts only the genuine `isend`/`irecv`: unwrap the counting wrappers it is given.
    (The batch call counts its ops; the unwrapped functions then do not count them a second time.)"""

    def __new__(cls, op, *args, **kwargs):
        return super().__new__(cls, inspect.unwrap(op), *args, **kwargs)

    def __init__(self, op, *args, **kwargs):
        super().__init__(inspect.unwrap(op), *args, **kwargs)


@contextmanager
def count_collectives() -> Iterator[CollectiveCounts]:
    """Count every `torch.distributed` collective and point-to-point call made inside the block."""
    counts = CollectiveCounts()
    saved = {op: getattr(dist, op) for op in _PAYLOAD_ARGUMENT if hasattr(dist, op)}
    saved_batch, saved_p2p_op = dist.batch_isend_irecv, dist.P2POp
    try:
        for op, original in saved.items():
            setattr(dist, op, _counting(op, original, counts))
        dist.batch_isend_irecv = _counting_batch(saved_batch, counts)
        dist.P2POp = _P2POp
        yield counts
    finally:
        for op, original in saved.items():
            setattr(dist, op, original)
        dist.batch_isend_irecv, dist.P2POp = saved_batch, saved_p2p_op
