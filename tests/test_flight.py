"""The collectives flight recorder: `diagnose` names the rank and the op where ranks diverged (hand-made
buffers), the ring records what ranks really did (file read back), and a real hang or desync under
`lab.distributed.run` ends in an error that says who is where."""

import time

import pytest
import torch
import torch.distributed as dist

from lab.distributed import Mesh, RankError, RankTimeout, all_gather_single, count_collectives, flight, run
from lab.distributed.comm import ALL_GATHER
from lab.distributed.flight import Entry

TP, WORLD = (0, 1, 2, 3), (0, 1, 2, 3)


def _tp(seq: int, op: str = "all_reduce", state: str = "finished") -> Entry:
    return Entry(seq, op, "tp", TP, state, "[8]", "float32")


def _history(last: int, op: str = "all_reduce") -> list[Entry]:
    return [_tp(seq, op) for seq in range(1, last + 1)]


# --- diagnose on hand-made buffers -----------------------------------------------------------------------

def test_a_rank_in_a_different_op_is_named_with_the_op_and_sequence_number():
    buffers = {r: [*_history(40), _tp(41, "all_reduce", "entered")] for r in (0, 1, 2)}
    buffers[3] = [*_history(40), _tp(41, "all_gather", "entered")]
    assert flight.diagnose(buffers) == ("rank 3 is in all_gather #41 on tp group; "
                                        "ranks 0–2 are in all_reduce #41 on tp group")
    assert flight.culprits(buffers) == [3]


def test_a_rank_outside_any_collective_is_named_with_what_it_did_last():
    dp = (0, 1, 2, 3)
    ops = [Entry(seq, "all_reduce", "dp", dp, "finished") for seq in range(1, 41)]
    buffers = {r: [*ops, Entry(41, "all_reduce", "dp", dp, "entered")] for r in (0, 2, 3)}
    buffers[1] = ops
    assert flight.diagnose(buffers) == ("rank 1 is not in a collective (its last: all_reduce #40 on dp group); "
                                        "ranks 0, 2, 3 are in all_reduce #41 on dp group")
    assert flight.culprits(buffers) == [1]


def test_a_rank_waiting_on_another_group_is_shown_there():
    tp0, dp1 = (0, 1), (1, 3)
    buffers = {
        0: [Entry(5, "all_reduce", "tp", tp0, "entered")],
        1: [Entry(4, "all_reduce", "tp", tp0), Entry(3, "reduce_scatter_tensor", "dp", dp1, "entered")],
        3: [Entry(3, "reduce_scatter_tensor", "dp", dp1, "entered")],  # agrees with rank 1 on dp: no line
    }
    assert flight.diagnose(buffers) == ("rank 1 is in reduce_scatter_tensor #3 on dp group; "
                                        "rank 0 is in all_reduce #5 on tp group")


def test_different_shapes_of_the_same_op_are_a_divergence_and_are_shown():
    buffers = {0: [Entry(7, "all_reduce", "tp", (0, 1), "failed", "[8]", "float32")],
               1: [Entry(7, "all_reduce", "tp", (0, 1), "failed", "[4]", "float32")]}
    assert flight.diagnose(buffers) == ("rank 0 failed in all_reduce #7 on tp group (float32 [8]); "
                                        "rank 1 failed in all_reduce #7 on tp group (float32 [4])")
    assert flight.culprits(buffers) == []  # one against one: neither is the odd one out


def test_point_to_point_ops_pair_up_per_direction():
    pp = (0, 1)
    buffers = {  # rank 0 sends twice; rank 1 received once, then waits for rank 2
        0: [Entry(1, "send", "pp", pp, peer=1), Entry(2, "send", "pp", pp, "entered", peer=1)],
        1: [Entry(1, "recv", "pp", pp, peer=0), Entry(1, "recv", "world", WORLD, "entered", peer=2)],
    }
    assert flight.diagnose(buffers).splitlines()[0] == ("rank 1 is in recv #1 from rank 2 on world; "
                                                        "rank 0 is in send #2 to rank 1 on pp group")
    both_send = {  # each answers the other's first message, then both send again before receiving: a deadlock
        r: [Entry(1, op, "pp", pp, peer=1 - r) for op in (("send", "recv") if r == 0 else ("recv", "send"))]
        + [Entry(2, "send", "pp", pp, "entered", peer=1 - r)] for r in (0, 1)
    }
    assert sorted(flight.diagnose(both_send).splitlines()) == [
        "rank 0 is in send #2 to rank 1 on pp group; rank 1 is in send #2 to rank 0 on pp group",
        "rank 1 is in send #2 to rank 0 on pp group; rank 0 is in send #2 to rank 1 on pp group"]


def test_agreeing_ranks_say_so_even_when_their_rings_start_at_different_numbers():
    buffers = {0: _history(41)[30:], 1: _history(41)[35:], 2: [*_history(40)[20:], _tp(41, state="entered")]}
    assert flight.diagnose(buffers) == (
        "the ranks' collectives agree (no rank issued a different one, none is missing one): "
        "rank 0 is not in a collective (its last: all_reduce #41 on tp group); "
        "rank 1 is not in a collective (its last: all_reduce #41 on tp group); rank 2 is in all_reduce #41 on tp group")
    assert flight.culprits(buffers) == []
    assert flight.diagnose({0: [], 1: []}) == "no collectives were recorded"


# --- the recorder, read back -----------------------------------------------------------------------------

def test_under_torchrun_recording_starts_from_the_environment_and_stop_restores_torch(monkeypatch, tmp_path):
    original = dist.all_reduce
    monkeypatch.delenv(flight.ENV_DIR, raising=False)
    assert flight.start_from_env() is None and dist.all_reduce is original
    monkeypatch.setenv(flight.ENV_DIR, str(tmp_path))
    monkeypatch.setenv("RANK", "5")
    try:
        assert flight.start_from_env() == tmp_path / "rank5.flight" and dist.all_reduce is not original
    finally:
        flight.stop()
    assert dist.all_reduce is original and dist.batch_isend_irecv.__module__ == "torch.distributed.distributed_c10d"
    assert flight.read(tmp_path) == {5: []}



def _record(directory):
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    flight.start(directory, capacity=64 if rank == 0 else 16)  # rank 1's ring overflows
    dist.all_reduce(torch.ones(2, 3), group=dist.new_group([0, 1], group_desc="tp"))  # as Mesh names its groups
    dist.all_reduce(torch.ones(4), async_op=True).wait()
    with count_collectives() as counts:  # counting nests inside recording
        all_gather_single(torch.empty(4, dtype=torch.float64), torch.ones(2, dtype=torch.float64))
        ops = [dist.P2POp(dist.isend, torch.ones(7), peer), dist.P2POp(dist.irecv, torch.empty(7), peer)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    if rank == 0:
        dist.send(torch.ones(3), 1)
    else:
        dist.recv(torch.empty(3), src=0)
    for _ in range(20):
        dist.barrier()
    flight.stop()
    return dict(counts.calls)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    directory = tmp_path_factory.mktemp("flight")
    return directory, run(_record, 2, directory)


def test_the_ring_holds_each_ranks_collectives_in_order(recorded):
    directory, results = recorded
    buffers = flight.read(directory)
    first = [(e.seq, e.op, e.group, e.ranks, e.state, e.dtype, e.shapes, e.peer) for e in buffers[0][:6]]
    assert first == [
        (1, "all_reduce", "tp", (0, 1), "finished", "float32", "[2, 3]", None),
        (1, "all_reduce", "world", (0, 1), "finished", "float32", "[4]", None),  # async: its future completed
        (2, ALL_GATHER, "world", (0, 1), "finished", "float64", "[2]", None),  # as this torch names it
        (1, "isend", "world", (0, 1), "issued", "float32", "[7]", 1),  # gloo gives isend no future
        (1, "irecv", "world", (0, 1), "issued", "float32", "[7]", 1),
        (2, "send", "world", (0, 1), "finished", "float32", "[3]", 1),
    ]
    assert [e.seq for e in buffers[0] if e.op == "barrier"] == list(range(3, 23))
    assert results[0] == results[1] == {"all_gather_single": 1, "isend": 1, "irecv": 1}


def test_a_full_ring_keeps_the_newest_entries(recorded):
    directory, _ = recorded
    buffers = flight.read(directory)
    assert [(e.seq, e.op) for e in buffers[1]] == [(seq, "barrier") for seq in range(7, 23)]  # 26 recorded
    assert flight.diagnose(buffers).startswith("the ranks' collectives agree")  # from where both rings overlap


def test_the_report_and_the_command_line(recorded, capsys, tmp_path):
    directory, _ = recorded
    flight.main([str(directory), "1"])
    out = capsys.readouterr().out
    assert "rank 1's last collectives:\n  barrier #22 on world: finished" in out and "Flight Recorder" not in out
    nccl = tmp_path / "rank0.flight"
    data = bytearray((directory / "rank0.flight").read_bytes())
    data[32:48] = b"nccl".ljust(16, b"\0")  # the header's backend field
    nccl.write_bytes(data)
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" in flight.report(tmp_path)
    assert flight.report(tmp_path / "empty").startswith("no flight-recorder files")


# --- real hangs under the launcher ------------------------------------------------------------------------

def _all_gather_on_rank_3():
    mesh = Mesh(tp=4)
    x = torch.ones(4)
    dist.all_reduce(x, group=mesh.tp_group)
    if dist.get_rank() == 3:
        dist.all_gather([torch.empty(4) for _ in range(4)], x, group=mesh.tp_group)
    else:
        dist.all_reduce(x, group=mesh.tp_group)


def test_a_desync_on_a_mesh_group_names_the_rank_the_op_and_the_group():
    with pytest.raises(RankTimeout) as err:  # the mismatched ops wait for each other: a hang
        run(_all_gather_on_rank_3, 4, timeout_s=4)
    lines = str(err.value).splitlines()
    assert lines[1] == ("collectives: rank 3 is in all_gather #2 on tp group; "
                        "ranks 0–2 are in all_reduce #2 on tp group")
    assert err.value.rank == [3]  # every rank waits in torch.distributed: the stacks alone cannot tell
    assert "rank 3 was here" in err.value.traceback_text  # the stacks are still there
    assert "rank 3's last collectives:\n  all_reduce #1 on tp group: finished" in err.value.traceback_text


def _sleep_on_rank_1():
    dist.all_reduce(torch.ones(1))
    if dist.get_rank() == 1:
        time.sleep(600)
    dist.all_reduce(torch.ones(1))


def test_a_rank_stuck_outside_collectives_is_named_when_the_others_time_out():
    with pytest.raises(RankError) as err:
        run(_sleep_on_rank_1, 3, pg_timeout_s=2)
    assert str(err.value).splitlines()[1] == ("collectives: rank 1 is not in a collective (its last: all_reduce #1 "
                                              "on world); ranks 0, 2 failed in all_reduce #2 on world")


def _all_gather_on_rank_2():
    x = torch.ones(4)
    if dist.get_rank() == 2:
        time.sleep(0.6)  # its timeout comes last: the earliest error is a bystander's
        dist.all_gather([torch.empty(4) for _ in range(3)], x)
    else:
        dist.all_reduce(x)


def test_a_desync_that_times_out_on_every_rank_names_the_odd_one_out():
    with pytest.raises(RankError) as err:  # on the default group gloo times out on every rank alike
        run(_all_gather_on_rank_2, 3, pg_timeout_s=2)
    # (if rank 2's error came after the launcher's 1 s grace, rank 2 is named as still running: [2])
    assert err.value.rank in (2, [2]) and "rank 2" in str(err.value).splitlines()[0]
    assert str(err.value).splitlines()[1] == ("collectives: rank 2 failed in all_gather #1 on world; "
                                              "ranks 0, 1 failed in all_reduce #1 on world")
