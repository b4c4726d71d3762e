"""lab.collectives equal torch.distributed's collectives, using only point-to-point messages."""

import pytest
import torch
import torch.distributed as dist

from lab import collectives as lc
from lab.dist import run
from lab.dist.comm import count_collectives

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TORCH_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
             "product": dist.ReduceOp.PRODUCT, "avg": dist.ReduceOp.AVG}


def _data(shape, dtype, seed):
    # small integers: every summation order gives the same result, so equality can be exact in any dtype
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=g).to(dtype)


def _check_all_ops(numel: int, dtype: torch.dtype) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    failures = []

    def expect(name, ours, theirs):
        if not torch.equal(ours, theirs):
            failures.append(f"{name} rank {rank}: {ours.tolist()} != {theirs.tolist()}")

    x = _data((numel,), dtype, seed=rank)
    for op in ("sum", "max", "min"):
        theirs = x.clone()
        dist.all_reduce(theirs, TORCH_OPS[op])
        expect(f"ring_all_reduce[{op}]", lc.ring_all_reduce(x.clone(), op), theirs)
        expect(f"tree_all_reduce[{op}]", lc.tree_all_reduce(x.clone(), op), theirs)
    small = _data((numel,), dtype, seed=rank).clamp(-1, 1) + 2  # products stay exact
    theirs = small.clone()
    dist.all_reduce(theirs, dist.ReduceOp.PRODUCT)
    expect("ring_all_reduce[product]", lc.ring_all_reduce(small.clone(), "product"), theirs)
    theirs = x.clone().float()
    dist.all_reduce(theirs)
    expect("ring_all_reduce[avg]", lc.ring_all_reduce(x.clone().float(), "avg"), theirs / world)

    root = world - 1  # not rank 0, to exercise the renumbering
    theirs = x.clone()
    dist.broadcast(theirs, src=root)
    expect("tree_broadcast", lc.tree_broadcast(x.clone(), src=root), theirs)
    theirs = x.clone()
    dist.reduce(theirs, dst=root)
    ours = lc.tree_reduce(x.clone(), dst=root)
    if rank == root:
        expect("tree_reduce", ours, theirs)

    block = _data((world * numel,), dtype, seed=10 + rank)
    theirs = torch.empty(numel, dtype=dtype)
    dist.reduce_scatter_tensor(theirs, block)
    expect("ring_reduce_scatter", lc.ring_reduce_scatter(torch.empty(numel, dtype=dtype), block), theirs)
    theirs = torch.empty(world * numel, dtype=dtype)
    dist.all_gather_into_tensor(theirs, x)
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
