"""Start local ranks, supervise them, and say exactly which one failed.

`run(fn, world_size)` is what notebooks, tests, the grader and `python -m lab.train --nproc N` use to get
N real processes in a real process group on one machine. It exists because the obvious tools fail in the
ways a course cannot afford (measured in the course's reference notes):

- `mp.spawn` cannot run a function defined in a notebook cell (it re-imports `__main__`), so ranks are
  forked by default: a child inherits everything the kernel has defined, lambdas and closures included.
- A forked child hangs forever in its first parallel op if the parent had used OpenMP, unless the child
  calls `torch.set_num_threads(1)` first — which every rank does before anything else.
- Plain `multiprocessing` waits forever on a rank stuck outside a collective, so the parent watches every
  rank and kills them all at the first failure, or when one is hung. Hung means no progress, not a long run:
  each rank bumps a counter in its flight-recorder file (every finished collective, every `flight.heartbeat()`;
  lab.train beats once a step), and a rank whose counter stands still for `hang_timeout_s` is hung. A run that
  progresses may last for days; a wall-clock limit (`timeout_s`) applies only when one is asked for.
- When the notebook kernel or pytest is killed, its children would live on; each rank asks the kernel to
  SIGKILL it when its parent dies (`PR_SET_PDEATHSIG`), and leads its own process group so that anything
  it started dies with it when the parent kills that group. (If the parent is SIGKILLed, only the ranks
  die at once: a process a rank started must watch its own parent, as DataLoader workers do.)
- When one rank crashes, the others fail too ("Connection closed by peer"); the error names the rank
  whose failure came first in the chain, with its traceback, not a bystander. A rank that hangs is shown
  where it hangs: every rank prints its Python stack on SIGUSR1 (`faulthandler`), which the parent asks
  for before killing it, and records its recent collectives in a ring the parent can read (`flight.py`),
  so that the error also says which rank is in which collective ("collectives: rank 3 is in all_gather #2").

The rendezvous store lives in the parent (created on port 0, so there is no free-port race) and the
ranks join it as clients. It is created only after every rank has been forked, and each rank learns its
port through its pipe: forking while the store's server thread holds a lock leaves the child stuck in
that lock for good (seen in CI: one rank in four never reached `init_process_group`). Under `torchrun` none
of this is needed: `init_from_env` joins that group.
POSIX only (process groups, signals); PDEATHSIG is Linux only and skipped elsewhere.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import functools
import math
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
START_METHODS = ("fork", "spawn")
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_RESTART_COUNT, _MAX_RESTARTS = "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"  # torchrun's names
_PR_SET_PDEATHSIG = 1
_GRACE_S = 1.0  # how long a bystander's error waits for the culprit's error to arrive
HANG_TIMEOUT_S = 300.0  # no progress for this long and a rank is hung (lab.train and lab serve: --hang-timeout)
# Errors a rank reports because *another* rank failed; they never name the culprit.
_SECONDARY = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out waiting",
              "timed out", "DistNetworkError", "DistStoreError", "NCCL communicator was aborted")


class RankError(RuntimeError):
    """A rank failed. `rank` is the culprit (or a list of ranks); `traceback_text` its traceback; `summary` the
    culprit's own error in one line ("CheckpointError: ...", "NotImplementedError: ..."), empty when it raised
    none (killed, hung, or ranks that never joined), so that callers need not take `message` apart."""

    def __init__(self, message: str, rank: int | list[int], traceback_text: str = "", summary: str = "") -> None:
        super().__init__(message + (f"\n{traceback_text.rstrip()}" if traceback_text else ""))
        self.message, self.rank, self.traceback_text, self.summary = message, rank, traceback_text, summary

    def __reduce__(self):  # picklable, e.g. by a grader that runs learners' code in a subprocess
        return type(self), (self.message, self.rank, self.traceback_text, self.summary)


class RankTimeout(RankError):
    """Ranks were hung (no progress for `hang_timeout_s`) or still running at the deadline (`timeout_s`);
    `traceback_text` shows where each one was."""


def launched_by_torchrun() -> bool:
    """True inside a process started by torchrun (or any launcher that sets the env:// variables)."""
    return all(key in os.environ for key in _TORCHRUN_ENV)


def init_from_env(backend: str | None = None, timeout_s: float = 1800.0) -> tuple[int, int]:
    """Join the process group torchrun set up: NCCL with one GPU per local rank when CUDA is there,
    gloo otherwise. Returns (rank, world_size); does nothing but return them if a group already exists."""
    if not dist.is_initialized():
        if not launched_by_torchrun():
            missing = ", ".join(key for key in _TORCHRUN_ENV if key not in os.environ)
            raise RuntimeError(f"init_from_env needs the variables torchrun sets; {missing} not set "
                               f"(start local ranks with lab.distributed.run instead)")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        from lab.distributed import flight  # here, not at the top: `python -m lab.distributed.flight` imports us

        flight.start_from_env()  # records this rank's collectives when LAB_FLIGHT_DIR names a directory
    return dist.get_rank(), dist.get_world_size()


# --- the rank (child) side -----------------------------------------------------------------------------

def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this rank when its parent dies: a killed kernel must not leave ranks behind.
    (Strictly, when the parent *thread* that started it ends; `run` blocks that thread until the ranks end.)"""
    if sys.platform != "linux":  # elsewhere the parent's deadline still bounds the rank's life
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _summary(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return text.splitlines()[0]


def _rank_main(payload: tuple | bytes, rank: int, world_size: int, backend: str, pg_timeout_s: float,
               debug: bool, parent_pid: int, stack_path: str, conn: Connection) -> None:
    """The body of every rank: isolate, join the group, run fn, send back the result or the traceback."""
    torch.set_num_threads(1)  # before any op: forked children hang in OpenMP otherwise
    os.setsid()  # lead a process group: the parent can kill this rank and everything it started
    _die_with_parent(parent_pid)
    faulthandler.register(signal.SIGUSR1, file=open(stack_path, "w"), all_threads=True)
    from lab.distributed import flight  # here, not above: `python -m lab.distributed.flight` must import it first
    flight.start(os.path.dirname(stack_path), rank)  # its ring of collectives, readable by the parent at any time
    port = conn.recv()  # the parent starts its store once every rank is forked (see the module docstring)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        fn, args, kwargs = pickle.loads(payload) if isinstance(payload, bytes) else payload
        if backend == "nccl":
            torch.cuda.set_device(rank)
        if debug:  # the group is wrapped in a checker when it is created: set before init
            dist.set_debug_level(dist.DebugLevel.DETAIL)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=timedelta(seconds=pg_timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout_s))
        flight.heartbeat()  # joined: the watchdog's clock starts from here, not from the fork
        result = fn(*args, **kwargs)
        if dist.is_initialized():  # fn may have destroyed it itself
            dist.destroy_process_group()
        message = ("ok", result)
    except BaseException as error:  # everything, SystemExit and KeyboardInterrupt included, goes to the parent
        message = ("error", time.time(), _summary(error), traceback.format_exc())
    for stream in (sys.stdout, sys.stderr):  # the parent kills the rank once it has its result: flush first
        with contextlib.suppress(Exception):
            stream.flush()
    # Plain pickle, not Connection.send: multiprocessing's pickler would pass tensors as shared-memory
    # handles, which die with this process as soon as it exits below. Bytes are copied.
    try:
        conn.send_bytes(pickle.dumps(message))
    except Exception as error:  # e.g. a result that cannot be pickled
        conn.send_bytes(pickle.dumps(("error", time.time(), f"could not send the result back: {_summary(error)}",
                                      traceback.format_exc())))
    os._exit(0)  # at once: the parent knows the outcome, and a broken group can hang in its destructors


# --- the parent side -----------------------------------------------------------------------------------

def _validate(fn: Callable, world_size: int, backend: str, start_method: str, timeout_s: float | None,
              hang_timeout_s: float | None, pg_timeout_s: float) -> None:
    if not callable(fn):
        raise TypeError(f"fn={fn!r} must be callable")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an integer >= 1")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {', '.join(map(repr, BACKENDS))}")
    if start_method not in START_METHODS:
        raise ValueError(f"start_method={start_method!r} must be one of {', '.join(map(repr, START_METHODS))}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size} but "
                         f"{torch.cuda.device_count()} GPU(s) are visible; use backend='gloo' on CPUs")
    if backend == "nccl" and start_method == "fork" and torch.cuda.is_initialized():
        raise ValueError("backend='nccl' with start_method='fork' needs a parent that has not used CUDA yet "
                         "(a forked child cannot initialise it again); pass start_method='spawn'")
    for name, value in (("timeout_s", timeout_s), ("hang_timeout_s", hang_timeout_s), ("pg_timeout_s", pg_timeout_s)):
        if value is not None and not (isinstance(value, int | float) and value > 0):
            raise ValueError(f"{name}={value!r} must be > 0 (seconds)" + ("" if name == "pg_timeout_s" else
                                                                           " or None (no limit)"))


@functools.cache
def _preimport() -> None:
    """Import torch.distributed's heavy submodules once in the parent, so that forked ranks need not:
    each rank importing FSDP or pipelining itself costs seconds, on every launch."""
    for name in ("torch.distributed.fsdp", "torch.distributed.tensor.parallel",
                 "torch.distributed.pipelining", "torch.distributed.device_mesh"):
        try:
            __import__(name)
        except ImportError:  # older torch: the chapter that needs it will say so
            pass


def _pickle_for_spawn(fn: Callable, args: tuple, kwargs: dict) -> bytes:
    """spawn starts fresh interpreters, so fn travels pickled: by value with cloudpickle when it is installed
    (lambdas and notebook functions work), else by name with pickle (fn must be importable from a module)."""
    try:
        import cloudpickle
    except ImportError:
        cloudpickle = None
    if cloudpickle is not None:
        return cloudpickle.dumps((fn, args, kwargs))
    try:
        return pickle.dumps((fn, args, kwargs))
    except (pickle.PicklingError, AttributeError, TypeError) as error:
        raise TypeError(f"start_method='spawn' could not pickle fn={getattr(fn, '__qualname__', fn)} or its "
                        f"arguments ({error}); define fn at module level, or pip install cloudpickle") from error


def run(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo", timeout_s: float | None = None,
        hang_timeout_s: float | None = HANG_TIMEOUT_S, pg_timeout_s: float = 30.0, start_method: str = "fork",
        debug: bool = False, max_restarts: int = 0, **kwargs: Any) -> list:
    """Run `fn(*args, **kwargs)` on `world_size` local ranks in one process group; return their results.

    Results come back in rank order (pickled through pipes). On the first failure, when a rank has made no
    progress for `hang_timeout_s` seconds (finished no collective, called no `flight.heartbeat()`), or — only if
    `timeout_s` is given — when ranks are still running after `timeout_s` seconds, every rank is killed and
    `RankError` (or `RankTimeout`) names the culprit. None turns either limit off. A collective that waits for a
    missing rank fails after `pg_timeout_s`. `debug=True` makes
    mismatched collectives (e.g. different sizes on different ranks, which gloo can silently get wrong)
    fail loudly, at about 2.5x the latency. With `start_method="spawn"`, `fn` is sent with cloudpickle if
    it is installed, else by name (then it must be importable, and the usual multiprocessing rule applies:
    a script guards its entry point with `if __name__ == "__main__":`).

    `max_restarts=K` starts the whole group again after a failure, up to K times, as `torchrun --max-restarts K`
    does: one rank lost means the group's collectives are broken, so every rank restarts. Each attempt's ranks
    find its number in torchrun's variables (`restarts()` reads them), so `fn` can resume from its last
    checkpoint under either launcher. Each failure and restart is logged on stderr; when the restarts are spent,
    the last failure is raised.
    """
    _validate(fn, world_size, backend, start_method, timeout_s, hang_timeout_s, pg_timeout_s)
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        raise ValueError(f"max_restarts={max_restarts!r} must be an integer >= 0")
    _preimport()
    launch = functools.partial(_launch_connecting, fn, world_size, args, kwargs, backend, _Limits(timeout_s,
                               hang_timeout_s), pg_timeout_s, start_method, debug, max_restarts=max_restarts)
    for restart in range(max_restarts):
        try:
            return launch(restart)
        except RankError as error:
            print(f"lab.distributed.run: {str(error).splitlines()[0]}\n"
                  f"lab.distributed.run: restart {restart + 1}/{max_restarts}: starting {world_size} rank(s) again",
                  file=sys.stderr, flush=True)
    return launch(max_restarts)  # the last attempt: its failure is raised


def restarts() -> tuple[int, int]:
    """(restarts so far, restarts allowed) of this group: (0, 0) for a group that never restarts. Read from the
    variables torchrun sets (`torchrun --max-restarts`), which `run(max_restarts=...)` sets too."""
    return int(os.environ.get(_RESTART_COUNT, 0)), int(os.environ.get(_MAX_RESTARTS, 0))


@contextlib.contextmanager
def _restart_env(restart: int, max_restarts: int) -> Iterator[None]:
    """Tell the ranks started inside which attempt they run in, as torchrun tells its workers: a child gets the
    parent's environment as it is when the child starts, so it is set around the start only."""
    saved = {key: os.environ.get(key) for key in (_RESTART_COUNT, _MAX_RESTARTS)}
    os.environ.update({_RESTART_COUNT: str(restart), _MAX_RESTARTS: str(max_restarts)})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value


# Gloo connects every pair of ranks over TCP when a group is made; on a loaded machine a connection is now and then
# refused or reset ("Gloo connectFullMesh failed ... Connection closed by peer": seen once in ~4,000 group starts
# of the test suite on 2 busy cores). Nothing is wrong with the ranks' code, so the group is started once more.
TRANSIENT_CONNECT = "Gloo connectFullMesh failed"


def _launch_connecting(*args: Any, max_restarts: int) -> list:
    """`_launch`, started once more when gloo could not connect the ranks (a transient failure of the machine,
    not of `fn`; the whole group starts again, as a restart does)."""
    try:
        return _launch(*args, max_restarts=max_restarts)
    except RankError as error:
        if TRANSIENT_CONNECT not in str(error):
            raise
        print(f"lab.distributed.run: gloo could not connect the ranks ({str(error).splitlines()[0][:120]}...); "
              "starting them again, once", file=sys.stderr, flush=True)
        return _launch(*args, max_restarts=max_restarts)


def _launch(fn: Callable, world_size: int, args: tuple, kwargs: dict, backend: str, limits: _Limits,
            pg_timeout_s: float, start_method: str, debug: bool, restart: int, max_restarts: int) -> list:
    """One attempt of `run`: start the ranks, supervise them, and leave none behind."""
    payload = (fn, args, kwargs) if start_method == "fork" else _pickle_for_spawn(fn, args, kwargs)
    context = mp.get_context(start_method)
    store = None
    stack_dir = tempfile.mkdtemp(prefix="lab-ranks-")
    stack_paths = [os.path.join(stack_dir, f"rank{rank}.stack") for rank in range(world_size)]
    ranks, conns = [], []
    try:
        for rank in range(world_size):
            parent_end, child_end = context.Pipe()
            process = context.Process(
                target=_rank_main, name=f"lab-rank-{rank}", daemon=False,
                args=(payload, rank, world_size, backend, pg_timeout_s, debug, os.getpid(), stack_paths[rank],
                      child_end))
            with warnings.catch_warnings(), _restart_env(restart, max_restarts):
                warnings.simplefilter("ignore", DeprecationWarning)  # Python >= 3.12 warns on fork with threads
                process.start()
            child_end.close()
            ranks.append(process)
            conns.append(parent_end)
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=pg_timeout_s))
        for conn in conns:
            with contextlib.suppress(OSError):  # a rank that already died is reported by _supervise
                conn.send(store.port)
        return _supervise(ranks, conns, limits, stack_paths)
    finally:
        _kill_all(ranks)
        for conn in conns:
            conn.close()
        shutil.rmtree(stack_dir, ignore_errors=True)
        del store


@dataclass(frozen=True)
class _Limits:
    """When the parent stops ranks that have not failed: at a wall-clock limit, and when a rank has made no
    progress for `hang_timeout_s` (None: never)."""

    timeout_s: float | None
    hang_timeout_s: float | None


class _Watchdog:
    """When each rank last made progress, from the counters in their flight-recorder files (`flight.progress`):
    reading a file needs no help from the rank, so a rank blocked in C++ is watched as well as a busy one."""

    def __init__(self, stack_paths: list[str]) -> None:
        from lab.distributed import flight  # not at the top: see _rank_main

        self.progress = flight.progress
        self.paths = [flight.file_path(Path(path).parent, rank) for rank, path in enumerate(stack_paths)]
        self.counts: list[int | None] = [None] * len(stack_paths)
        self.since = [time.monotonic()] * len(stack_paths)

    def idle(self, rank: int, now: float) -> float:
        """Seconds since `rank`'s counter last moved (or since the launch, if it never did)."""
        count = self.progress(self.paths[rank])
        if count != self.counts[rank]:
            self.counts[rank], self.since[rank] = count, now
        return now - self.since[rank]


def _supervise(ranks: list, conns: list[Connection], limits: _Limits, stack_paths: list[str]) -> list:
    """Collect every rank's result; raise at the first failure (once its cause is known), at the first hung rank,
    or at the deadline if there is one."""
    deadline = time.monotonic() + (math.inf if limits.timeout_s is None else limits.timeout_s)
    watchdog = _Watchdog(stack_paths)
    results: dict[int, Any] = {}
    failures: dict[int, tuple[float, str, str]] = {}  # rank -> (when, one-line summary, traceback)
    first_failure_at = 0.0
    while len(results) < len(ranks):
        running = [r for r in range(len(ranks)) if r not in results and r not in failures]
        now = time.monotonic()
        if failures and (not running or now >= deadline or now - first_failure_at > _GRACE_S
                         or any(not _is_secondary(summary) for _, summary, _ in failures.values())):
            raise _culprit(failures, running, ranks, stack_paths)
        if now >= deadline:
            raise _stuck(running, running, sorted(results), f"did not finish within timeout_s={limits.timeout_s:g} s",
                         ranks, stack_paths)
        if limits.hang_timeout_s is not None and not failures:
            idle = {r: watchdog.idle(r, now) for r in running}
            if max(idle.values()) >= limits.hang_timeout_s:
                # the ranks one hang stopped stop within moments of each other: those idle half as long are suspects
                stalled = [r for r in running if idle[r] >= limits.hang_timeout_s / 2]
                raise _stuck(stalled, running, sorted(results), f"made no progress for hang_timeout_s="
                             f"{limits.hang_timeout_s:g} s (no collective finished, no heartbeat)", ranks, stack_paths)
        watched = {conns[r]: r for r in running} | {ranks[r].sentinel: r for r in running}
        for ready in wait(list(watched), timeout=min(0.2, deadline - now)):
            rank = watched[ready]
            if rank in results or rank in failures:
                continue
            message = _receive(conns[rank])
            if message is None and not ranks[rank].is_alive():  # died without a word: os._exit, a signal
                ranks[rank].join()
                message = ("error", time.time(), _exit_description(ranks[rank].exitcode), "")
            if message is None:
                continue
            if message[0] == "ok":
                results[rank] = message[1]
            else:
                failures[rank] = message[1:]
                first_failure_at = first_failure_at or time.monotonic()
    return [results[r] for r in range(len(ranks))]


def _receive(conn: Connection) -> tuple | None:
    try:
        return pickle.loads(conn.recv_bytes()) if conn.poll() else None
    except (EOFError, OSError):
        return None


def _exit_description(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code} before returning a result"


def _is_secondary(summary: str) -> bool:
    return any(marker in summary for marker in _SECONDARY)


def _culprit(failures: dict, running: list[int], ranks: list, stack_paths: list[str]) -> RankError:
    """Name the rank whose failure caused the others: a primary error first (the earliest), then a rank that
    never joined the collective the others timed out in, then the one rank the flight recorders single out
    (it called another collective than the others), then the earliest error of all."""
    primary = {r: f for r, f in failures.items() if not _is_secondary(f[1])}
    if primary:
        rank = min(primary, key=lambda r: primary[r][0])
        _, summary, tb = primary[rank]
        verb = "" if summary.startswith(("was killed", "exited")) else "failed: "
        others = sorted(set(failures) - {rank})
        tail = f" (then rank(s) {others} failed too)" if others else ""
        return RankError(f"rank {rank} {verb}{summary}{tail}", rank, tb, summary if verb else "")
    diagnosis, collectives, odd, _ = _collectives(stack_paths)
    rank = min(failures, key=lambda r: failures[r][0])
    if len(odd) == 1 and odd[0] in failures and not running:  # the recorders point at it: it called another op
        rank = odd[0]
    _, summary, tb = failures[rank]
    if running:
        stacks = _dump_stacks(running, ranks, stack_paths)
        return RankError(f"rank(s) {sorted(failures)} failed in a collective while rank(s) {running} never "
                         f"joined it: {summary}{diagnosis}", running,
                         "\n".join([*stacks.values(), f"rank {rank}: {tb}", collectives]))
    return RankError(f"rank {rank} failed: {summary}{diagnosis}", rank, f"{tb}\n{collectives}", summary)


def _stuck(suspects: list[int], running: list[int], finished: list[int], what: str, ranks: list,
           stack_paths: list[str]) -> RankTimeout:
    """Name the ranks stuck (the suspects: all those still running at the deadline, or those a hang stopped), and
    — from the stacks — which of them were stuck somewhere other than a torch.distributed call (those waiting in a
    collective are waiting for them); if all wait in one, those the flight recorders single out (they called
    another collective). `what` says how they are stuck ("did not finish within timeout_s=2 s")."""
    stacks = _dump_stacks(running, ranks, stack_paths)
    diagnosis, collectives, odd, inside = _collectives(stack_paths)
    # in a collective: by its stack, or by its recorder (an async op's wait() is called from lab's code, not torch's)
    waiting = [r for r in running if r in inside or _innermost_frame_in_torch_distributed(stacks[r])]
    # stuck outside torch.distributed; else, if all wait in it, those the recorders point at (a different op)
    culprits = [r for r in suspects if r not in waiting] or [r for r in odd if r in suspects] or suspects
    note = f", of which {waiting} wait in torch.distributed" if waiting and culprits != running else ""
    return RankTimeout(f"rank(s) {culprits} {what} (still running: {running}{note}; finished: {finished})"
                       f"{diagnosis}", culprits, "\n".join([*stacks.values(), collectives]))


def _collectives(stack_paths: list[str]) -> tuple[str, str, list[int], list[int]]:
    """The flight recorder's diagnosis, as lines for the error message ("\ncollectives: rank 3 is in ..."), every
    rank's last collectives (with the pointer to torch's own recorder on NCCL) for the details below it, the
    ranks the diagnosis points at, and the ranks inside a collective now. Read from the files the ranks keep next
    to their stacks: no help from a stuck rank is needed."""
    from lab.distributed import flight
    try:
        buffers, nccl = flight.read_all(Path(stack_paths[0]).parent)
    except (OSError, ValueError, struct.error) as error:  # a rank killed while it created its file
        return f"\ncollectives: the flight recorder could not be read ({error})", "", [], []
    hint = [flight.NCCL_HINT] if nccl else []
    diagnosis = "".join(f"\ncollectives: {line}" for line in flight.diagnose(buffers).splitlines())
    inside = [rank for rank, entries in buffers.items() if entries and entries[-1].state == "entered"]
    return diagnosis, "\n".join([flight.tail(buffers), *hint]), flight.culprits(buffers), inside


def _dump_stacks(which: list[int], ranks: list, stack_paths: list[str], wait_s: float = 1.0) -> dict[int, str]:
    """Where each rank in `which` is right now: its Python stack, printed by faulthandler on SIGUSR1."""
    for rank in which:
        _signal(ranks[rank].pid, signal.SIGUSR1, group=False)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not all(_read(stack_paths[r]) for r in which):
        time.sleep(0.02)
    time.sleep(0.05)  # let the last lines land
    return {rank: f"rank {rank} was here:\n{_user_frames(_read(stack_paths[rank]))}" for rank in which}


def _user_frames(stack: str) -> str:
    """A forked rank's stack goes on down to the parent's `run` call: keep the part above `_rank_main`."""
    lines = stack.splitlines() or ["(no stack: the rank did not answer)"]
    end = next((i for i, line in enumerate(lines) if line.endswith(" in _rank_main")), len(lines))
    return "\n".join(lines[:end])


def _read(path: str) -> str:
    return Path(path).read_text().strip() if os.path.exists(path) else ""  # absent: the rank was still starting


def _innermost_frame_in_torch_distributed(stack: str) -> bool:
    frames = [line for line in stack.splitlines() if line.strip().startswith("File ")]
    return bool(frames) and f"torch{os.sep}distributed{os.sep}" in frames[0]


def _signal(pid: int | None, signum: int, group: bool) -> None:
    if pid is None:
        return
    try:
        (os.killpg if group else os.kill)(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_all(ranks: list) -> None:
    """SIGKILL every rank's process group (the rank and anything it started) and reap the ranks."""
    for process in ranks:
        _signal(process.pid, signal.SIGKILL, group=True)
        if process.exitcode is None:  # still running, maybe before its setsid: not yet a group of its own
            _signal(process.pid, signal.SIGKILL, group=False)
    for process in ranks:
        process.join(timeout=5)
