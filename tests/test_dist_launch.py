"""The rank launcher: results in rank order, and every way a rank can fail ends with the rank named and
no process left behind."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from lab.dist import RankError, RankTimeout, run


def _descendants() -> set[int]:
    """Live child processes, except multiprocessing's resource tracker (one per parent, started by spawn)."""
    alive = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(child.cmdline()):
                alive.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.fixture
def no_leftovers():
    before = _descendants()
    yield
    deadline = time.monotonic() + 5
    while _descendants() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _descendants() - before == set(), "processes left behind"


def _all_reduce_rank(offset: int, scale: int = 1) -> float:
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return value.item() * scale + offset


def test_results_in_rank_order_with_args_and_kwargs(no_leftovers):
    assert run(_all_reduce_rank, 4, 10, scale=2) == [30.0] * 4
    assert run(lambda: dist.get_rank() * 10, 3) == [0, 10, 20]  # lambdas and closures work with fork
    assert run(lambda: (dist.get_world_size(), os.environ["WORLD_SIZE"]), 1) == [(1, "1")]


def test_spawn_runs_an_importable_function(no_leftovers):
    assert run(_all_reduce_rank, 2, 0, start_method="spawn", timeout_s=120) == [3.0, 3.0]


def _raise_on_rank_1():
    if dist.get_rank() == 1:
        raise KeyError("oops")
    dist.all_reduce(torch.ones(1))


def test_a_rank_that_raises_is_named_with_its_traceback(no_leftovers):
    with pytest.raises(RankError) as err:
        run(_raise_on_rank_1, 4)
    assert err.value.rank == 1
    assert str(err.value).splitlines()[0].startswith("rank 1 failed: KeyError: 'oops'")
    assert 'raise KeyError("oops")' in err.value.traceback_text


def _hang_on_rank_2():
    if dist.get_rank() == 2:
        time.sleep(600)
    dist.all_reduce(torch.ones(1))


def test_a_rank_stuck_outside_a_collective_is_named(no_leftovers):
    start = time.monotonic()
    with pytest.raises(RankError) as err:
        run(_hang_on_rank_2, 4, pg_timeout_s=3)
    assert err.value.rank == [2]
    assert "rank(s) [2] never joined it" in str(err.value).splitlines()[0]
    assert time.monotonic() - start < 15


def _exit_on_rank_3():
    if dist.get_rank() == 3:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


def test_a_rank_that_exits_is_named_with_its_exit_code(no_leftovers):
    with pytest.raises(RankError) as err:
        run(_exit_on_rank_3, 4)
    assert err.value.rank == 3
    assert str(err.value).splitlines()[0].startswith("rank 3 exited with code 3 before returning a result")


def _fork_grandchild_then_raise(pid_file):
    if dist.get_rank() == 0:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(pid_file, "w") as f:
            f.write(str(child.pid))
        raise RuntimeError("left a grandchild behind")
    dist.barrier()


def test_processes_started_by_a_rank_die_with_it(tmp_path, no_leftovers):
    pid_file = tmp_path / "grandchild.pid"
    with pytest.raises(RankError, match="rank 0 failed: RuntimeError: left a grandchild behind"):
        run(_fork_grandchild_then_raise, 2, str(pid_file))
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while psutil.pid_exists(grandchild) and psutil.Process(grandchild).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "grandchild still running"
        time.sleep(0.05)


def test_the_deadline_kills_ranks_that_never_return(no_leftovers):
    start = time.monotonic()
    with pytest.raises(RankTimeout) as err:
        run(lambda: time.sleep(600) if dist.get_rank() == 1 else None, 3, timeout_s=2)
    assert err.value.rank == [1]
    assert "rank(s) [1] did not finish within timeout_s=2 s (finished: [0, 2]" in str(err.value)
    assert time.monotonic() - start < 10


def test_ranks_die_when_their_parent_is_killed(tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    script = textwrap.dedent(f"""
        import os, time
        from lab.dist import run
        def sleeper():
            open(os.path.join({str(pid_dir)!r}, str(os.getpid())), "w").close()
            time.sleep(600)
        run(sleeper, 3, timeout_s=600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    while len(os.listdir(pid_dir)) < 3:
        assert time.monotonic() < deadline and parent.poll() is None, "ranks did not start"
        time.sleep(0.1)
    ranks = [int(name) for name in os.listdir(pid_dir)]
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 5
    while any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in ranks):
        assert time.monotonic() < deadline, "ranks outlived their killed parent"
        time.sleep(0.05)


def _mismatched_sizes():
    size = 8 if dist.get_rank() == 1 else 4
    dist.all_reduce(torch.ones(size))


def test_debug_mode_turns_silent_size_mismatches_into_errors(no_leftovers):
    with pytest.raises(RankError, match="mismatch"):
        run(_mismatched_sizes, 2, debug=True, pg_timeout_s=10)


@pytest.mark.parametrize("world_size, kwargs, message", [
    (0, {}, "world_size=0 must be an integer >= 1"),
    (2, dict(backend="mpi"), "backend='mpi' must be one of 'gloo', 'nccl'"),
    (2, dict(start_method="forkserver"), "start_method='forkserver' must be one of 'fork', 'spawn'"),
    (2, dict(timeout_s=0), "timeout_s=0 must be > 0"),
])
def test_bad_arguments(world_size, kwargs, message):
    with pytest.raises(ValueError) as err:
        run(_all_reduce_rank, world_size, 0, **kwargs)
    assert str(err.value) == message


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has GPUs: nccl would work")
def test_nccl_without_gpus_says_so():
    with pytest.raises(ValueError, match="backend='nccl' needs one GPU per rank: world_size=2 but 0 GPU"):
        run(_all_reduce_rank, 2, 0, backend="nccl")
