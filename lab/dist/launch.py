"""Start local ranks, supervise them, and say exactly which one failed.

`run(fn, world_size)` is what notebooks, tests, the grader and `python -m lab.train --nproc N` use to get
N real processes in a real process group on one machine. It exists because the obvious tools fail in the
ways a course cannot afford (measured in the course's reference notes):

- `mp.spawn` cannot run a function defined in a notebook cell (it re-imports `__main__`), so ranks are
  forked by default.
- A forked child hangs forever in its first parallel op if the parent had used OpenMP, unless the child
  calls `torch.set_num_threads(1)` first — which every rank does before anything else.
- Plain `multiprocessing` waits forever on a rank stuck outside a collective, so the parent watches every
  rank and kills them all at the first failure or at a deadline.
- When the notebook kernel or pytest is killed, its children would live on; each rank asks the kernel to
  SIGKILL it when its parent dies (`PR_SET_PDEATHSIG`), and leads its own process group so that anything
  it started dies with it.
- When one rank crashes, the others fail too ("Connection closed by peer"); the error names the rank
  whose failure came first in the chain, with its traceback, not a bystander.

The rendezvous store lives in the parent (created on port 0, so there is no free-port race) and the
ranks join it as clients. Under `torchrun` none of this is needed: `init_from_env` joins that group.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
START_METHODS = ("fork", "spawn")
_PR_SET_PDEATHSIG = 1
# Errors a rank reports because *another* rank failed; they never name the culprit.
_SECONDARY = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out waiting",
              "timed out", "DistNetworkError", "DistStoreError", "NCCL communicator was aborted")


class RankError(RuntimeError):
    """A rank failed. `rank` is the culprit (or a list of ranks); `traceback_text` its traceback."""

    def __init__(self, message: str, rank: int | list[int], traceback_text: str = "") -> None:
        super().__init__(message + (f"\n{traceback_text.rstrip()}" if traceback_text else ""))
        self.rank = rank
        self.traceback_text = traceback_text


class RankTimeout(RankError):
    """Ranks were still running at the deadline."""


def launched_by_torchrun() -> bool:
    """True inside a process started by torchrun (or any launcher that sets the env:// variables)."""
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init_from_env(backend: str | None = None, timeout_s: float = 1800.0) -> tuple[int, int]:
    """Join the process group torchrun set up: NCCL with one GPU per local rank when CUDA is there,
    gloo otherwise. Returns (rank, world_size)."""
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def _die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the parent's deadline still bounds the rank's life
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _rank_main(payload: tuple, rank: int, world_size: int, port: int, backend: str, pg_timeout_s: float,
               parent_pid: int, conn: Connection) -> None:
    """The body of every rank: isolate, join the group, run fn, send back the result or the traceback."""
    os.setsid()  # lead a process group: the parent can kill this rank and everything it started
    _die_with_parent(parent_pid)
    torch.set_num_threads(1)  # before any op: forked children hang in OpenMP otherwise
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        fn, args, kwargs = payload
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=timedelta(seconds=pg_timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout_s))
        result = fn(*args, **kwargs)
        conn.send(("ok", result))
    except BaseException as error:  # noqa: BLE001 - everything, SystemExit included, goes to the parent
        summary = f"{type(error).__name__}: {error}".splitlines()[0] if str(error) else type(error).__name__
        conn.send(("error", summary, traceback.format_exc(), time.time()))
        conn.close()
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    conn.close()


def _validate(world_size: int, backend: str, start_method: str, timeout_s: float) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an integer >= 1")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {', '.join(map(repr, BACKENDS))}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size} but "
                         f"{torch.cuda.device_count()} GPU(s) are visible; use backend='gloo' on CPUs")
    if start_method not in START_METHODS:
        raise ValueError(f"start_method={start_method!r} must be one of {', '.join(map(repr, START_METHODS))}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s!r} must be > 0")


_PREIMPORTED = False


def _preimport() -> None:
    """Import torch.distributed's heavy submodules once in the parent, so forked ranks need not."""
    global _PREIMPORTED
    if not _PREIMPORTED:
        for name in ("torch.distributed.fsdp", "torch.distributed.tensor.parallel",
                     "torch.distributed.pipelining", "torch.distributed.device_mesh"):
            try:
                __import__(name)
            except ImportError:  # older torch: the chapter that needs it will say so
                pass
        _PREIMPORTED = True


def run(fn, world_size: int, *args, backend: str = "gloo", timeout_s: float = 120.0, pg_timeout_s: float = 30.0,
        start_method: str = "fork", debug: bool = False, **kwargs) -> list:
    """Run `fn(*args, **kwargs)` on `world_size` local ranks in one process group; return their results.

    Results come back in rank order. On the first failure, or if ranks are still running after
    `timeout_s` seconds, every rank is killed and `RankError` (or `RankTimeout`) names the culprit.
    A collective that waits for a missing rank fails after `pg_timeout_s`. `debug=True` makes
    mismatched collectives (e.g. different sizes on different ranks, which gloo can silently get wrong)
    fail loudly, at a cost in speed. With `start_method="spawn"`, `fn` must be importable by name.
    """
    _validate(world_size, backend, start_method, timeout_s)
    _preimport()
    if debug:
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    context = mp.get_context(start_method)
    payload = (fn, args, kwargs)  # fork: inherited as is; spawn: pickled, so fn must be importable
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=pg_timeout_s))
    ranks, conns = [], []
    try:
        for rank in range(world_size):
            parent_end, child_end = context.Pipe(duplex=False)
            process = context.Process(
                target=_rank_main, name=f"lab-rank-{rank}", daemon=False,
                args=(payload, rank, world_size, store.port, backend, pg_timeout_s, os.getpid(), child_end))
            process.start()
            child_end.close()
            ranks.append(process)
            conns.append(parent_end)
        return _supervise(ranks, conns, timeout_s)
    finally:
        _kill_all(ranks)
        if debug:
            dist.set_debug_level(dist.DebugLevel.OFF)
        del store


def _supervise(ranks: list, conns: list[Connection], timeout_s: float) -> list:
    deadline = time.monotonic() + timeout_s
    results: dict[int, object] = {}
    failures: dict[int, tuple[float, str, str]] = {}  # rank -> (when, one-line summary, traceback)
    first_failure_at = None
    while len(results) < len(ranks):
        now = time.monotonic()
        if failures and (now - first_failure_at > 2.0 or len(failures) + len(results) == len(ranks)
                         or any(not _is_secondary(summary) for _, summary, _ in failures.values())):
            raise _culprit(failures, results, len(ranks))
        if now >= deadline:
            running = [r for r in range(len(ranks)) if r not in results and r not in failures]
            done = sorted(results)
            raise RankTimeout(f"rank(s) {running} did not finish within timeout_s={timeout_s:g} s "
                              f"(finished: {done}; a rank stuck outside a collective, or a collective "
                              f"waiting for it)", running)
        pending = [r for r in range(len(ranks)) if r not in results and r not in failures]
        watched = [conns[r] for r in pending] + [ranks[r].sentinel for r in pending]
        for ready in wait(watched, timeout=min(0.2, max(deadline - now, 0.01))):
            rank = next(r for r in pending if ready in (conns[r], ranks[r].sentinel))
            if rank in results or rank in failures:
                continue
            message = _receive(conns[rank])
            if message is None and not ranks[rank].is_alive():
                ranks[rank].join()
                message = ("error", _exit_description(ranks[rank].exitcode), "", time.time())
            if message is None:
                continue
            if message[0] == "ok":
                results[rank] = message[1]
            else:
                failures[rank] = (message[3], message[1], message[2])
                first_failure_at = first_failure_at or time.monotonic()
    return [results[r] for r in range(len(ranks))]


def _receive(conn: Connection):
    try:
        return conn.recv() if conn.poll() else None
    except (EOFError, OSError):
        return None


def _exit_description(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code} before returning a result"


def _is_secondary(summary: str) -> bool:
    return any(marker in summary for marker in _SECONDARY)


def _culprit(failures: dict, results: dict, world_size: int) -> RankError:
    """Name the rank whose failure caused the others: a primary error first, then the earliest one."""
    primary = {r: f for r, f in failures.items() if not _is_secondary(f[1])}
    if primary:
        rank = min(primary, key=lambda r: primary[r][0])
        _, summary, tb = primary[rank]
        verb = "" if summary.startswith(("was killed", "exited")) else "failed: "
        others = sorted(set(failures) - {rank})
        tail = f" (then rank(s) {others} failed too)" if others else ""
        return RankError(f"rank {rank} {verb}{summary}{tail}", rank, tb)
    missing = [r for r in range(world_size) if r not in failures and r not in results]
    rank = min(failures, key=lambda r: failures[r][0])
    _, summary, tb = failures[rank]
    if missing:
        return RankError(f"rank(s) {sorted(failures)} failed in a collective while rank(s) {missing} never "
                         f"joined it: {summary}", missing, tb)
    return RankError(f"rank {rank} failed: {summary}", rank, tb)


def _kill_all(ranks: list) -> None:
    """SIGKILL every rank's process group (the rank and anything it started) and reap the ranks."""
    for process in ranks:
        if process.pid is None:
            continue
        for kill in (os.killpg, os.kill):  # the group, and the rank itself in case it had not yet called setsid
            try:
                kill(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for process in ranks:
        process.join(timeout=5)

