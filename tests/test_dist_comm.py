"""The collective counter: calls and bytes per operation and per group; torch restored afterwards."""

import pytest
import torch
import torch.distributed as dist

from lab.dist import count_collectives, run


def _counted_ops():
    rank = dist.get_rank()
    pair = dist.new_group([0, 1])
    with count_collectives() as counts:
        dist.all_reduce(torch.ones(10))                      # 40 bytes
        dist.all_gather_into_tensor(torch.empty(4), torch.ones(2))  # input shard: 8 bytes
        dist.reduce_scatter_tensor(torch.empty(3), torch.ones(6))   # whole input: 24 bytes
        dist.all_reduce(torch.ones(5, dtype=torch.float64), group=pair)  # 40 bytes on the pair
        peer = 1 - rank
        ops = [dist.P2POp(dist.isend, torch.ones(7), peer), dist.P2POp(dist.irecv, torch.empty(7), peer)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        if rank == 0:
            dist.send(torch.ones(3), 1)
        else:
            dist.recv(torch.empty(3), 0)
    return dict(counts.calls), dict(counts.bytes), {str(k): dict(v) for k, v in counts.by_group.items()}


def test_counts_per_operation_and_group():
    for rank, (calls, nbytes, by_group) in enumerate(run(_counted_ops, 2)):
        assert calls["all_reduce"] == 2 and nbytes["all_reduce"] == 80
        assert nbytes["all_gather_into_tensor"] == 8
        assert nbytes["reduce_scatter_tensor"] == 24
        assert calls["isend"] == calls["irecv"] == 1 and nbytes["isend"] == 28
        assert nbytes["send" if rank == 0 else "recv"] == 12
        assert by_group["(0, 1)"] == {"all_reduce": 40, "all_reduce calls": 1}
        assert by_group["world"]["all_reduce"] == 40


def test_torch_is_restored_even_after_an_exception():
    originals = (dist.all_reduce, dist.isend, dist.P2POp, dist.batch_isend_irecv)
    with pytest.raises(ZeroDivisionError), count_collectives():
        assert dist.all_reduce is not originals[0]
        raise ZeroDivisionError
    assert (dist.all_reduce, dist.isend, dist.P2POp, dist.batch_isend_irecv) == originals


def _nested():
    with count_collectives() as outer:
        dist.all_reduce(torch.ones(1))
        with count_collectives() as inner:
            dist.all_reduce(torch.ones(1))
            ops = [dist.P2POp(dist.isend, torch.ones(1), 1 - dist.get_rank()),
                   dist.P2POp(dist.irecv, torch.empty(1), 1 - dist.get_rank())]
            for request in dist.batch_isend_irecv(ops):
                request.wait()
    return outer.calls["all_reduce"], inner.calls["all_reduce"], outer.calls["isend"], inner.calls["isend"]


def test_contexts_nest():
    assert run(_nested, 2) == [(2, 1, 1, 1)] * 2


def test_table_lists_every_operation():
    with count_collectives() as counts:
        counts.record("all_reduce", 1024, None)
    assert "all_reduce" in counts.table() and "1,024" in counts.table()
