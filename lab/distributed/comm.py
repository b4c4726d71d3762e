"""Count collective calls and bytes, per operation and per process group.

The course makes claims like "ZeRO-2 moves as many bytes as DDP" or "ring all-reduce sends 2(W−1)/W of
the tensor per rank"; tests and notebooks check them by counting:

    with count_collectives() as counts:
        train_step()
    counts.calls["all_reduce"], counts.bytes["reduce_scatter_single"], counts.by_group[(0, 1)].bytes
    print(counts.table())

The context manager temporarily replaces the functions of `torch.distributed` (`dist.all_reduce`, ...)
with counting wrappers, and restores them on exit, also after an exception; contexts nest (an inner
context's calls are counted by the outer one too). Only code that looks the function up on the module at
call time (`dist.all_reduce(...)`, as all of `lab` does) is counted — not `from torch.distributed import
all_reduce` done before the context, and not torch internals such as DDP's reducer or FSDP2.

torch 2.13 renamed `all_gather_into_tensor` and `reduce_scatter_tensor` to `all_gather_single` and
`reduce_scatter_single` and warns (FutureWarning) on every call of the old names; torch 2.5-2.12 have only the
old ones. `all_gather_single` and `reduce_scatter_single` here call whichever this torch has, and every count
is kept under the new name, whichever name the code called: a count reads the same on every torch.

Bytes are those of the tensor each rank hands to the operation — its own contribution:
- all_reduce, broadcast, reduce, gather: the tensor;
- scatter: the shard this rank receives (its `tensor`);
- all_gather, all_gather_into_tensor, all_gather_single: the input shard;
- reduce_scatter, reduce_scatter_tensor, reduce_scatter_single, all_to_all, all_to_all_single: the whole input;
- send, isend: the message sent; recv, irecv: the message received (counted under their own names);
  batch_isend_irecv counts each of its ops as an isend or an irecv;
- barrier: 0 bytes.
Groups are keyed by their global ranks, e.g. (0, 1); the default group is "world".
"""

from __future__ import annotations

import functools
import inspect
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# torch's current name of each collective that torch 2.13 renamed; `record` counts the old name under it
RENAMED = {"all_gather_into_tensor": "all_gather_single", "reduce_scatter_tensor": "reduce_scatter_single"}
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


def all_gather_single(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                      group: dist.ProcessGroup | None = None, async_op: bool = False) -> dist.Work | None:
    """`output_tensor` (W times `input_tensor`'s size) receives every rank's `input_tensor`, rank r's in block r:
    torch's `all_gather_single`, or its pre-2.13 name `all_gather_into_tensor`. Looked up on `torch.distributed`
    at call time, so that `count_collectives` and the flight recorder see the call."""
    return getattr(dist, ALL_GATHER)(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM,
                          group: dist.ProcessGroup | None = None, async_op: bool = False) -> dist.Work | None:
    """`input` holds W equal blocks; rank r's `output` receives block r reduced over the ranks: torch's
    `reduce_scatter_single`, or its pre-2.13 name `reduce_scatter_tensor` (looked up at call time, as above)."""
    return getattr(dist, REDUCE_SCATTER)(output, input, op=op, group=group, async_op=async_op)


# operation -> the name of its argument whose bytes are counted (None: counts no bytes)
PAYLOAD_ARGUMENT = {
    "all_reduce": "tensor", "broadcast": "tensor", "reduce": "tensor", "gather": "tensor", "scatter": "tensor",
    "all_gather": "tensor", "all_gather_into_tensor": "input_tensor", "all_gather_single": "input_tensor",
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


def group_key(group: dist.ProcessGroup | None) -> str | tuple[int, ...]:
    """"world" for the default group, else the group's global ranks."""
    if group is None or group is dist.group.WORLD:
        return "world"
    return tuple(dist.get_process_group_ranks(group))


@dataclass
class OpCounts:
    """Calls and bytes per operation name."""

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)


@dataclass
class CollectiveCounts(OpCounts):
    """Calls and bytes per operation, in total and per group (`by_group[(0, 1)].bytes["all_reduce"]`)."""

    by_group: dict[str | tuple[int, ...], OpCounts] = field(default_factory=dict)

    def record(self, op: str, nbytes: int, group: dist.ProcessGroup | None) -> None:
        op = RENAMED.get(op, op)
        for counts in (self, self.by_group.setdefault(group_key(group), OpCounts())):
            counts.calls[op] += 1
            counts.bytes[op] += nbytes

    def table(self) -> str:
        """One row per (group, operation), then the totals per operation."""
        lines = [f"{'group':<16}{'operation':<24}{'calls':>8}{'bytes':>16}"]
        for key, counts in sorted(self.by_group.items(), key=lambda item: str(item[0])):
            lines += [f"{str(key):<16}{op:<24}{counts.calls[op]:>8}{counts.bytes[op]:>16,}"
                      for op in sorted(counts.calls)]
        lines += [f"{'total':<16}{op:<24}{self.calls[op]:>8}{self.bytes[op]:>16,}" for op in sorted(self.calls)]
        return "\n".join(lines)

    summary = table

    def __str__(self) -> str:
        return self.table()


def _counting(op: str, original: Callable, counts: CollectiveCounts) -> Callable:
    signature = inspect.signature(original)
    argument = PAYLOAD_ARGUMENT[op]

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs).arguments
        counts.record(op, _nbytes(bound.get(argument)) if argument else 0, bound.get("group"))
        return original(*args, **kwargs)

    return wrapper


def _counting_batch(original: Callable, counts: CollectiveCounts) -> Callable:
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
    saved = {op: getattr(dist, op) for op in PAYLOAD_ARGUMENT if hasattr(dist, op)}
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
