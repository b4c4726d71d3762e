"""The rank launcher: results in rank order, and every way a rank can fail ends with the rank named and
no process left behind."""

import inspect
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
from dist_workers import all_reduce_on_gpu, all_reduce_rank

from lab.distributed import RankError, RankTimeout, flight, init_from_env, launched_by_torchrun, restarts, run

REPO = Path(__file__).resolve().parents[1]


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


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_until_gone(pids: list[int], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not all(_gone(pid) for pid in pids):
        assert time.monotonic() < deadline, f"still running: {[pid for pid in pids if not _gone(pid)]}"
        time.sleep(0.05)


@pytest.fixture
def no_leftovers():
    """Fails the test if it leaves any process of its own behind."""
    before = _descendants()
    yield
    deadline = time.monotonic() + 5
    while _descendants() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _descendants() - before == set(), "processes left behind"


# --- results --------------------------------------------------------------------------------------------

def test_results_come_back_in_rank_order_with_args_and_kwargs(no_leftovers):
    assert run(all_reduce_rank, 4, 10, scale=2) == [30.0] * 4  # 1+2+3+4 = 10, summed across 4 ranks
    assert run(lambda: dist.get_rank() * 10, 3) == [0, 10, 20]  # lambdas work with fork
    secret = {"word": "closure"}
    assert run(lambda: (secret["word"], dist.get_world_size(), os.environ["WORLD_SIZE"]), 1) == [("closure", 1, "1")]


def test_prints_of_the_ranks_reach_the_parents_output(capfd, no_leftovers):
    run(lambda: print(f"hello from rank {dist.get_rank()}"), 2)
    out = capfd.readouterr().out
    assert "hello from rank 0" in out and "hello from rank 1" in out


def test_spawn_runs_an_importable_function(no_leftovers):
    assert run(all_reduce_rank, 2, 0.0, start_method="spawn") == [3.0, 3.0]


def test_spawn_without_cloudpickle_refuses_a_lambda_with_one_clear_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "cloudpickle", None)  # makes `import cloudpickle` fail
    with pytest.raises(TypeError, match="start_method='spawn' could not pickle fn=.*<lambda>.*pip install cloudpickle"):
        run(lambda: 0, 2, start_method="spawn")


def test_init_from_env_joins_an_existing_group_or_says_what_is_missing(monkeypatch):
    assert run(init_from_env, 2) == [(0, 2), (1, 2)]  # inside run the group exists already
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    assert not launched_by_torchrun()
    with pytest.raises(RuntimeError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set"):
        init_from_env()


# --- failures: the rank is named and nothing is left running --------------------------------------------

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
    copy = pickle.loads(pickle.dumps(err.value))  # e.g. sent back by a grader's subprocess
    assert (copy.rank, str(copy)) == (1, str(err.value))


def _hang_on_rank_1():
    if dist.get_rank() == 1:
        time.sleep(600)  # never reaches the collective
    dist.all_reduce(torch.ones(1))


def test_a_rank_missing_from_a_collective_is_named_where_it_hangs(no_leftovers):
    start = time.monotonic()
    with pytest.raises(RankError) as err:
        run(_hang_on_rank_1, 4, pg_timeout_s=3)
    assert err.value.rank == [1]
    assert "failed in a collective while rank(s) [1] never joined it" in str(err.value).splitlines()[0]
    assert "rank 1 was here" in err.value.traceback_text and "in _hang_on_rank_1" in err.value.traceback_text
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


def _killed_on_rank_1():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))


def test_a_rank_killed_by_a_signal_is_named(no_leftovers):
    with pytest.raises(RankError, match="^rank 1 was killed by signal SIGKILL") as err:
        run(_killed_on_rank_1, 2)
    assert err.value.rank == 1


def test_a_result_that_cannot_be_sent_back_is_an_error(no_leftovers):
    with pytest.raises(RankError, match="^rank 0 failed: could not send the result back"):
        run(lambda: (lambda: 0), 1)  # a lambda cannot be pickled


def _forks_without_end(pid_dir: str) -> None:
    """Rank 0 starts a process that keeps forking sleepers, waits for a few, then raises. Every process it starts
    writes its pid to `pid_dir` (the forker's as `forker-<pid>`), so that the test can kill them if `run` did not."""
    if dist.get_rank() == 0:
        if os.fork() == 0:
            Path(pid_dir, f"forker-{os.getpid()}").touch()
            for _ in range(200):  # bounded, in case the test fails to kill it
                if os.fork() == 0:
                    Path(pid_dir, str(os.getpid())).touch()
                    time.sleep(600)
                    os._exit(0)
                time.sleep(0.02)
            time.sleep(600)
            os._exit(0)
        while len(os.listdir(pid_dir)) < 6:  # the forker and five sleepers
            time.sleep(0.02)
        raise RuntimeError("left its children behind")
    dist.barrier()


def _pids(pid_dir: Path) -> list[int]:
    """The forker first: killed before its sleepers, it cannot start new ones."""
    return sorted((int(name.removeprefix("forker-")) for name in os.listdir(pid_dir)),
                  key=lambda pid: f"forker-{pid}" not in os.listdir(pid_dir))


def _kill_started_since(pids: list[int], since: float) -> None:
    """SIGKILL these pids, skipping any that ended and whose number went to a process started before the test."""
    for pid in pids:
        try:
            if psutil.Process(pid).create_time() >= since - 1:
                os.kill(pid, signal.SIGKILL)
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass


def test_processes_started_by_a_rank_die_with_it(tmp_path, no_leftovers):
    since = time.time()
    try:
        with pytest.raises(RankError, match="^rank 0 failed: RuntimeError: left its children behind"):
            run(_forks_without_end, 2, str(tmp_path))
        _wait_until_gone(_pids(tmp_path))
    finally:  # if run left them running, they must not outlive the test (they hold its output open)
        _kill_started_since(_pids(tmp_path), since)
        _kill_started_since(_pids(tmp_path), since)  # sleepers forked while the first pass ran


def test_the_deadline_kills_ranks_that_never_return(no_leftovers):
    start = time.monotonic()
    with pytest.raises(RankTimeout) as err:
        run(lambda: time.sleep(600) if dist.get_rank() == 1 else None, 3, timeout_s=2)
    assert err.value.rank == [1]
    assert str(err.value).splitlines()[0] == ("rank(s) [1] did not finish within timeout_s=2 s "
                                              "(still running: [1]; finished: [0, 2])")
    assert "rank 1 was here" in err.value.traceback_text
    assert time.monotonic() - start < 10


def test_the_deadline_names_the_rank_the_others_wait_for(no_leftovers):
    with pytest.raises(RankTimeout) as err:
        run(_hang_on_rank_1, 3, timeout_s=2, pg_timeout_s=60)  # the collective would wait for a minute
    assert err.value.rank == [1]
    assert "(still running: [0, 1, 2], of which [0, 2] wait in torch.distributed" in str(err.value)


def _collectives_apart(count: int, seconds: float) -> int:
    for _ in range(count):
        time.sleep(seconds)
        dist.all_reduce(torch.ones(1))
    return count


def test_a_run_longer_than_the_hang_timeout_that_makes_progress_finishes(no_leftovers):
    """A hang is no progress, not a long run: six collectives 0.6 s apart outlast hang_timeout_s=2 (and would
    outlast any wall-clock limit that small), and the run finishes."""
    start = time.monotonic()
    assert run(_collectives_apart, 2, 6, 0.6, hang_timeout_s=2) == [6, 6]
    assert time.monotonic() - start > 2 * 1.5  # it did run well past one hang timeout


def _beats_without_collectives(count: int, seconds: float) -> int:
    for _ in range(count):
        time.sleep(seconds)  # work that issues no collective, e.g. a step on one rank
        flight.heartbeat()
    return count


def test_a_heartbeat_is_progress_too(no_leftovers):
    assert run(_beats_without_collectives, 1, 6, 0.6, hang_timeout_s=2) == [6]


def test_no_wall_clock_limit_unless_asked():
    """`lab serve --tp 2` died after 120 s while it progressed: that default limit is gone."""
    assert inspect.signature(run).parameters["timeout_s"].default is None


def test_a_hung_rank_is_named_within_the_hang_timeout(no_leftovers):
    start = time.monotonic()
    with pytest.raises(RankTimeout) as err:
        run(_hang_on_rank_1, 2, hang_timeout_s=2, pg_timeout_s=60)  # the collective would wait for a minute
    elapsed = time.monotonic() - start
    assert err.value.rank == [1]
    assert str(err.value).splitlines()[0] == (
        "rank(s) [1] made no progress for hang_timeout_s=2 s (no collective finished, no heartbeat) (still running: "
        "[0, 1], of which [0] wait in torch.distributed; finished: [])")
    assert "collectives: rank 1 has not issued a collective; rank 0 is in all_reduce #1 on world" in str(err.value)
    assert "rank 1 was here" in err.value.traceback_text and "in _hang_on_rank_1" in err.value.traceback_text
    assert elapsed < 2 + 5


def test_ranks_die_when_their_parent_is_killed(tmp_path):
    script = textwrap.dedent(f"""
        import os, time
        from pathlib import Path
        from lab.distributed import run

        def sleeper():
            Path({str(tmp_path)!r}, str(os.getpid())).touch()
            time.sleep(600)

        run(sleeper, 3, timeout_s=600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while len(os.listdir(tmp_path)) < 3:
            assert time.monotonic() < deadline and parent.poll() is None, "ranks did not start"
            time.sleep(0.05)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    _wait_until_gone([int(name) for name in os.listdir(tmp_path)])


def _mismatched_sizes():
    dist.all_reduce(torch.ones(8 if dist.get_rank() == 1 else 4))


def test_debug_mode_turns_silent_size_mismatches_into_errors(no_leftovers):
    with pytest.raises(RankError, match="Detected mismatch between collectives"):
        run(_mismatched_sizes, 2, debug=True, pg_timeout_s=10)
    assert dist.get_debug_level() == dist.DebugLevel.OFF  # the parent is left as it was


# --- arguments ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size, kwargs, message", [
    (0, {}, "world_size=0 must be an integer >= 1"),
    (2.0, {}, "world_size=2.0 must be an integer >= 1"),
    (2, dict(backend="mpi"), "backend='mpi' must be one of 'gloo', 'nccl'"),
    (2, dict(start_method="forkserver"), "start_method='forkserver' must be one of 'fork', 'spawn'"),
    (2, dict(timeout_s=0), "timeout_s=0 must be > 0 (seconds) or None (no limit)"),
    (2, dict(hang_timeout_s=-1.5), "hang_timeout_s=-1.5 must be > 0 (seconds) or None (no limit)"),
    (2, dict(hang_timeout_s="2"), "hang_timeout_s='2' must be > 0 (seconds) or None (no limit)"),
    (2, dict(pg_timeout_s=-1), "pg_timeout_s=-1 must be > 0 (seconds)"),
])
def test_bad_arguments_are_one_clear_line(world_size, kwargs, message):
    with pytest.raises(ValueError) as err:
        run(all_reduce_rank, world_size, 0.0, **kwargs)
    assert str(err.value) == message


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has 2 GPUs: nccl works here")
def test_nccl_without_gpus_says_so():
    with pytest.raises(ValueError, match="backend='nccl' needs one GPU per rank: world_size=2 but 0 GPU"):
        run(all_reduce_rank, 2, 0.0, backend="nccl")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs for NCCL")
def test_nccl_all_reduce_on_two_gpus():
    start_method = "spawn" if torch.cuda.is_initialized() else "fork"  # a forked child cannot re-initialise CUDA
    assert run(all_reduce_on_gpu, 2, backend="nccl", start_method=start_method) == [3.0, 3.0]


def test_tensor_results_survive_the_rank_exiting():
    # tensors must be copied back, not shared through memory that dies with the rank
    results = run(lambda: torch.full((3,), float(dist.get_rank())), 3)
    assert [r.tolist() for r in results] == [[0.0] * 3, [1.0] * 3, [2.0] * 3]


# --- restarts (max_restarts) ----------------------------------------------------------------------------

def _rank_1_fails_in_the_first_attempts(failing_attempts: int) -> tuple[int, int]:
    restart, max_restarts = restarts()
    if restart < failing_attempts and dist.get_rank() == 1:
        raise RuntimeError(f"attempt {restart} fails")
    dist.all_reduce(torch.ones(1))
    return restart, max_restarts


def test_max_restarts_starts_the_whole_group_again_and_tells_each_rank_its_attempt(capfd, no_leftovers):
    """As torchrun --max-restarts: every rank starts again, and finds the attempt in TORCHELASTIC_RESTART_COUNT
    (the limit in TORCHELASTIC_MAX_RESTARTS); the parent's environment is left as it was."""
    assert run(_rank_1_fails_in_the_first_attempts, 2, 1, max_restarts=2) == [(1, 2), (1, 2)]
    err = capfd.readouterr().err
    assert "lab.distributed.run: rank 1 failed: RuntimeError: attempt 0 fails" in err
    assert "lab.distributed.run: restart 1/2: starting 2 rank(s) again" in err and "restart 2/2" not in err
    assert "TORCHELASTIC_RESTART_COUNT" not in os.environ and restarts() == (0, 0)


def test_when_the_restarts_are_spent_the_last_failure_is_raised(capfd, no_leftovers):
    with pytest.raises(RankError, match="rank 1 failed: RuntimeError: attempt 1 fails") as err:
        run(_rank_1_fails_in_the_first_attempts, 2, 5, max_restarts=1)
    assert err.value.rank == 1
    assert capfd.readouterr().err.count("starting 2 rank(s) again") == 1


def _rank_1_hangs_in_the_first_attempt() -> int:
    if restarts()[0] == 0 and dist.get_rank() == 1:
        while True:  # in Python, in no collective
            time.sleep(60)
    dist.all_reduce(torch.ones(1))
    return restarts()[0]


def test_a_hang_fails_at_the_collective_timeout_and_the_group_restarts(capfd, no_leftovers):
    assert run(_rank_1_hangs_in_the_first_attempt, 2, pg_timeout_s=2, max_restarts=1) == [1, 1]
    assert "lab.distributed.run: restart 1/1" in capfd.readouterr().err


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_bad_max_restarts_is_one_clear_line(value):
    with pytest.raises(ValueError) as err:
        run(all_reduce_rank, 2, 0.0, max_restarts=value)
    assert str(err.value) == f"max_restarts={value!r} must be an integer >= 0"


def _gloo_refuses_rank_1_once(flag: str) -> int:
    """Rank 1 of the first group fails as gloo does when a TCP connection of its mesh is refused."""
    if dist.get_rank() == 1 and not os.path.exists(flag):
        open(flag, "w").close()
        raise RuntimeError("Gloo connectFullMesh failed with [pair.cc:553] Connection closed by peer")
    dist.all_reduce(torch.ones(1))
    return dist.get_rank()


def test_a_group_gloo_could_not_connect_starts_once_more(tmp_path, capfd, no_leftovers):
    """A refused connection is the machine's, not the code's: the group starts again, once, whatever
    max_restarts says; any other failure (and a second refusal) is raised."""
    assert run(_gloo_refuses_rank_1_once, 2, str(tmp_path / "refused")) == [0, 1]
    assert "gloo could not connect the ranks" in capfd.readouterr().err
    with pytest.raises(RankError, match="rank 1 failed: RuntimeError: attempt 0 fails"):
        run(_rank_1_fails_in_the_first_attempts, 2, 1)
    assert "gloo could not connect" not in capfd.readouterr().err
