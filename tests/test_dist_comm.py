"""The collective counter: calls and bytes per operation and per group; torch restored afterwards."""

import warnings

import pytest
import torch
import torch.distributed as dist

from lab.distributed import all_gather_single, count_collectives, reduce_scatter_single, run


def _counted_ops():
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    pair = dist.new_group([0, 1])
    with count_collectives() as counts:
        dist.all_reduce(torch.ones(10))                                  # 40 bytes
        all_gather_single(torch.empty(4), torch.ones(2))                 # the input shard: 8 bytes
        reduce_scatter_single(torch.empty(3), torch.ones(6))             # the whole input: 24 bytes
        dist.all_reduce(torch.ones(5, dtype=torch.float64), group=pair)  # 40 bytes, on the pair
        ops = [dist.P2POp(dist.isend, torch.ones(7), peer), dist.P2POp(dist.irecv, torch.empty(7), peer)]
        for request in dist.batch_isend_irecv(ops):                     # 28 bytes each way
            request.wait()
        if rank == 0:
            dist.send(torch.ones(3), 1)                                  # 12 bytes sent...
        else:
            dist.recv(torch.empty(3), 0)                                 # ...and received
        with warnings.catch_warnings():  # the name before torch 2.13 (deprecated since): counted under the new one
            warnings.simplefilter("ignore", FutureWarning)
            dist.all_gather_into_tensor(torch.empty(2, dtype=torch.float16), torch.ones(1, dtype=torch.float16))  # 2 B
    by_group = {key: (dict(c.calls), dict(c.bytes)) for key, c in counts.by_group.items()}
    return dict(counts.calls), dict(counts.bytes), by_group, counts.table()


def test_counts_per_operation_and_group():
    for rank, (calls, nbytes, by_group, table) in enumerate(run(_counted_ops, 2)):
        assert calls["all_reduce"] == 2 and nbytes["all_reduce"] == 80
        assert calls["all_gather_single"] == 2 and nbytes["all_gather_single"] == 8 + 2
        assert calls["reduce_scatter_single"] == 1 and nbytes["reduce_scatter_single"] == 24
        assert "all_gather_into_tensor" not in calls
        assert calls["isend"] == calls["irecv"] == 1 and nbytes["isend"] == nbytes["irecv"] == 28
        assert calls["send" if rank == 0 else "recv"] == 1
        assert nbytes["send" if rank == 0 else "recv"] == 12 and ("recv" if rank == 0 else "send") not in calls
        assert by_group[(0, 1)] == ({"all_reduce": 1}, {"all_reduce": 40})
        world_calls, world_bytes = by_group["world"]
        assert world_bytes["all_reduce"] == 40 and world_bytes["isend"] == 28
        assert sum(world_calls.values()) + 1 == sum(calls.values())  # everything but the pair's all_reduce
        assert "(0, 1)" in table and "world" in table and "total" in table


def test_torch_is_restored_even_after_an_exception():
    originals = (dist.all_reduce, dist.isend, dist.P2POp, dist.batch_isend_irecv)
    with pytest.raises(ZeroDivisionError), count_collectives():
        assert dist.all_reduce is not originals[0]
        raise ZeroDivisionError
    assert (dist.all_reduce, dist.isend, dist.P2POp, dist.batch_isend_irecv) == originals


def _nested():
    peer = 1 - dist.get_rank()
    with count_collectives() as outer:
        dist.all_reduce(torch.ones(1))
        with count_collectives() as inner:
            dist.all_reduce(torch.ones(1))
            ops = [dist.P2POp(dist.isend, torch.ones(1), peer), dist.P2POp(dist.irecv, torch.empty(1), peer)]
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        dist.barrier()
    return outer.calls["all_reduce"], inner.calls["all_reduce"], outer.calls["isend"], inner.calls["isend"], \
        outer.calls["barrier"], inner.calls["barrier"]


def test_contexts_nest():
    assert run(_nested, 2) == [(2, 1, 1, 1, 1, 0)] * 2


def test_table_lists_every_operation_per_group_and_in_total():
    with count_collectives() as counts:
        counts.record("all_reduce", 1024, None)
        counts.record("all_reduce", 1024, None)
    lines = counts.table().splitlines()
    assert lines[1].split() == ["world", "all_reduce", "2", "2,048"]
    assert lines[2].split() == ["total", "all_reduce", "2", "2,048"]
    assert str(counts) == counts.summary() == counts.table()
