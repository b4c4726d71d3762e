"""lab.collectives equal torch.distributed's collectives, using only point-to-point messages."""

import pytest
import torch
import torch.distributed as dist

from lab import collectives as lc
from lab.collectives.p2p import REDUCE_OPS
from lab.distributed import all_gather_single, reduce_scatter_single, run
from lab.distributed.comm import count_collectives

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TORCH_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
             "product": dist.ReduceOp.PRODUCT, "avg": dist.ReduceOp.AVG}


def _data(shape, dtype, seed):
    # small integers: every summation order gives the same result, so equality can be exact in any dtype
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=g).to(dtype)


def _op_data(t: torch.Tensor, op: str) -> torch.Tensor:
    """Inputs on which every op is exact: products of values in 1..3, averages in float32."""
    if op == "product":
        return t.clamp(-1, 1) + 2
    return t.float() if op == "avg" else t


def _reduce_scatter(input: torch.Tensor):
    return lambda output, op: reduce_scatter_single(output, input, op=op)


def _torch_reduce(collective, t: torch.Tensor, op: str) -> torch.Tensor:
    """torch's result for `op`; gloo has no AVG, so the reference average is the sum divided by the world size."""
    collective(t, dist.ReduceOp.SUM if op == "avg" else TORCH_OPS[op])
    return t / dist.get_world_size() if op == "avg" else t


def _check_all_ops(numel: int, dtype: torch.dtype) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    failures = []

    def expect(name, ours, theirs):
        if not torch.equal(ours, theirs):
            failures.append(f"{name} rank {rank}: {ours.tolist()} != {theirs.tolist()}")

    x = _data((numel,), dtype, seed=rank)
    root = world - 1  # not rank 0, to exercise the renumbering
    block = _data((world * numel,), dtype, seed=10 + rank)
    for op in REDUCE_OPS:  # every op of every reducing collective: a wrong op passes for no other
        a, b = _op_data(x, op), _op_data(block, op)
        theirs = _torch_reduce(dist.all_reduce, a.clone(), op)
        expect(f"ring_all_reduce[{op}]", lc.ring_all_reduce(a.clone(), op), theirs)
        expect(f"tree_all_reduce[{op}]", lc.tree_all_reduce(a.clone(), op), theirs)
        theirs = _torch_reduce(lambda t, o: dist.reduce(t, dst=root, op=o), a.clone(), op)
        ours = lc.tree_reduce(a.clone(), dst=root, op=op)
        if rank == root:
            expect(f"tree_reduce[{op}]", ours, theirs)
        theirs = _torch_reduce(_reduce_scatter(b.clone()), torch.empty(numel, dtype=b.dtype), op)
        ours = lc.ring_reduce_scatter(torch.empty(numel, dtype=b.dtype), b.clone(), op)
        expect(f"ring_reduce_scatter[{op}]", ours, theirs)

    theirs = x.clone()
    dist.broadcast(theirs, src=root)
    expect("tree_broadcast", lc.tree_broadcast(x.clone(), src=root), theirs)

    theirs = torch.empty(world * numel, dtype=dtype)
    all_gather_single(theirs, x)
    expect("ring_all_gather", lc.ring_all_gather(torch.empty(world * numel, dtype=dtype), x), theirs)

    gathered = [torch.empty(numel, dtype=dtype) for _ in range(world)]
    lc.gather(x, gathered if rank == root else None, dst=root)
    if rank == root:
        expect("gather", torch.stack(gathered), torch.stack([_data((numel,), dtype, r) for r in range(world)]))
    pieces = [_data((numel,), dtype, 100 + r) for r in range(world)]
    expect("scatter", lc.scatter(torch.empty(numel, dtype=dtype), pieces if rank == 0 else None, src=0), pieces[rank])

    # all-to-all with uneven blocks: rank i sends i+j+1 elements to rank j
    inputs = [torch.full((rank + j + 1,), float(10 * rank + j), dtype=dtype) for j in range(world)]
    outputs = [torch.empty(j + rank + 1, dtype=dtype) for j in range(world)]
    lc.all_to_all(outputs, inputs)
    for j in range(world):
        expect(f"all_to_all from {j}", outputs[j], torch.full((j + rank + 1,), float(10 * j + rank), dtype=dtype))
    lc.barrier()
    return failures


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_every_collective_equals_torch(world, dtype):
    numel = 2 * world + 3  # odd, and not divisible by the world size
    for rank, failures in enumerate(run(_check_all_ops, world, numel, dtype, timeout_s=60)):
        assert failures == [], f"rank {rank}: {failures}"


def _ring_messages(numel: int) -> dict:
    x = torch.ones(numel)
    with count_collectives() as counts:
        lc.ring_all_reduce(x)
    return {"calls": dict(counts.calls), "bytes": dict(counts.bytes), "value": x[0].item()}


def test_ring_all_reduce_uses_only_point_to_point_messages():
    world, numel = 4, 1000
    for result in run(_ring_messages, world, numel, timeout_s=60):
        assert result["value"] == world
        assert set(result["calls"]) == {"isend", "irecv"}
        assert result["calls"]["isend"] == 2 * (world - 1)
        # each rank sends 2(W-1)/W of the tensor: the bandwidth-optimal ring
        assert result["bytes"]["isend"] == 2 * (world - 1) * (numel // world) * 4


def _in_subgroup(numel):
    rank = dist.get_rank()
    odd = dist.new_group([1, 3])
    even = dist.new_group([0, 2])
    group = odd if rank % 2 else even
    x = torch.full((numel,), float(rank))
    lc.ring_all_reduce(x, group=group)
    return x[0].item()


def test_collectives_work_on_subgroups():
    assert run(_in_subgroup, 4, 7, timeout_s=60) == [2.0, 4.0, 2.0, 4.0]


def test_bad_arguments():
    with pytest.raises(ValueError, match="op='mean' must be one of"):
        lc.ring_all_reduce(torch.ones(3), "mean")
