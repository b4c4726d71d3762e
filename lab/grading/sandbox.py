"""Run a student's exercise cell in a locked-down process and call its functions with plain data.

Why a process and not the notebook kernel (as Otter and nbgrader do): student code must not be able to touch
the checks, the expected values or the scores, and a multi-rank exercise needs a process of its own anyway.
The grader (this file) stays in charge of everything that decides a score:

* the child gets an empty working directory, a copy of only the `lab` modules the exercise may import, a
  scrubbed environment and `python -I -S` (so the editable install of `lab`, which would expose the checks
  and the reference implementations, is not on its path);
* `sandbox_child.py` locks itself down before importing the cell (Landlock file-system and signal rules,
  resource limits, no capabilities when root: see its docstring); a pids cgroup, when the machine lets us
  create one, caps the number of tasks even for root, for whom RLIMIT_NPROC does not count;
* a watchdog here counts the child's processes and memory, and the wall-time deadline is kept here;
  whatever happens, every process of the sandbox is SIGKILLed when it closes;
* arguments go in and return values come back as JSON lines on a private pipe; the checks compare them in
  the grader. Nothing the child prints or writes is ever read as a score.

Exercises that may use torch start warm: rather than spend ~2.4 s of CPU importing torch in every child, the
child is forked, in the state a fresh child has before it locks itself down, by a zygote that imported the
exercise's packages once (`_Zygote`, `zygote.py`). From then on it is the same child: same lockdown, limits,
watchdog, kill paths; the grader still learns its exit status and CPU time.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import itertools
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lab.grading.confine import (
    ALL_NETWORK_LAYERS,
    LAB_DIR,
    kill_all,
    make_cgroup,
    members,
    package_paths,
    rss_bytes,
    system_rules,
)
from lab.grading.sandbox_child import STACK_FILE, _qualname

CHILD = Path(__file__).with_name("sandbox_child.py")
# Carried into every sandbox whatever the exercise lists: the layout rules that lab.config, lab.calc, lab.model and
# lab.distributed all read. It imports nothing, so it brings nothing else along.
ALWAYS_CARRIED = ("lab.layout",)
ZYGOTE = Path(__file__).with_name("zygote.py")
_PYTHON = (sys.executable, "-I", "-S", "-B")  # how a sandbox child (and a zygote) starts: isolated, no site
_MAX_LINE = 1 << 20  # bytes of one answer: more is a protocol violation
NETWORK_LAYERS = ALL_NETWORK_LAYERS  # what a child may try (a test plants fewer: a sandbox without its namespace)


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per exercise. `max_procs` is checked by the watchdog, `max_tasks` (threads too) by the kernel."""

    wall_s: float = 60.0
    cpu_s: int = 60
    memory_mb: int = 1024
    max_procs: int = 16
    max_tasks: int = 256
    output_mb: int = 16

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"{field.name}={value!r} must be a number > 0")


class ExerciseError(Exception):
    """The sandbox as a whole failed (crash, timeout, import error, tampering): the exercise scores 0."""

    def __init__(self, reason: str, not_attempted: bool = False) -> None:
        super().__init__(reason)
        self.reason, self.not_attempted = reason, not_attempted


class CallError(Exception):
    """One call into the student's code raised; `where` names the student's line (empty when the student's code
    did not raise, e.g. ranks that hung), `function` the student's function that raised."""

    def __init__(self, message: str, where: str = "", not_attempted: bool = False, function: str = "") -> None:
        super().__init__(message + (f" ({where})" if where else ""))
        self.message, self.where, self.not_attempted, self.function = message, where, not_attempted, function


class SandboxDied(ExerciseError):
    """The child is gone: stopped at its deadline, crashed, or killed for a limit. During a call that call's
    function is to blame, not the exercise (the runner starts a fresh sandbox for the other functions' checks):
    `timed_out` when the call overran its time, `where` and `function` then name the student's line and function
    it was stopped in (from the stack the child dumped), and `signal` is what killed it otherwise (0: none)."""

    def __init__(self, reason: str, where: str = "", function: str = "", timed_out: bool = False,
                 signal_number: int = 0) -> None:
        super().__init__(reason)
        self.where, self.function, self.timed_out, self.signal = where, function, timed_out, signal_number


# --- the sandbox -----------------------------------------------------------------------------------------

def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and type(value).__name__ == "ModelConfig":
        return {"__config__": dataclasses.asdict(value)}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    return value


class Sandbox:
    """One exercise's cells in one child process: `start()`, then `call(fn, *args)` any number of times."""

    def __init__(self, parts: Sequence[tuple[str, str]], *, entry: Sequence[str], modules: Sequence[str],
                 packages: Sequence[str], limits: Limits, protect: Sequence[str] = (),
                 warm: bool | None = None) -> None:
        self.parts, self.entry, self.modules, self.limits = list(parts), list(entry), list(modules), limits
        self.packages, self.protect = tuple(sorted(packages)), tuple(sorted(str(Path(p).resolve())
                                                                             for p in protect))
        self.warm = ("torch" in self.packages and _pidfds()) if warm is None else warm  # see _Zygote
        self.proc: subprocess.Popen | _WarmChild | None = None
        self.violation, self.printed = "", ""
        self.ranks = "lab.distributed" in self.modules  # ranks meet over TCP: only a namespace can confine them
        self.network_layer = ""  # how the child is cut off from the network (see sandbox_child._own_network)
        self.network_tried: list[str] = []  # what the student's code tried to reach, in vain
        self._buffer, self._ids = b"", itertools.count()
        self._stop = threading.Event()
        self._allowed = limits.wall_s  # seconds the call in progress may run (the cell's import: the whole budget)

    # life cycle
    def start(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="lab-sandbox-"))
        lib, work = self.root / "lib", self.root / "work"
        self._copy_code(lib)
        work.mkdir()
        self.cgroup = make_cgroup(self.limits.max_tasks)
        site = _link_packages(lib, self.packages)
        sys_path = [str(lib), str(site)]
        rules = [*map(list, system_rules(self.protect)), [str(lib), "ro"], [str(work), "rw"],
                 *[[p, "ro"] for p in package_paths(self.packages)],
                 *([["/dev/shm", "rw"], ["/sys", "ro"]] if "torch" in self.packages else [])]  # gloo lists NICs
        settings = {"sys_path": sys_path, "lib": str(lib), "entry": self.entry, "ranks": self.ranks,
                    "network_layers": list(NETWORK_LAYERS),
                    "importable": [*self.modules, *self.packages],
                    "cgroup": str(self.cgroup) if self.cgroup else None, "landlock": rules,
                    "limits": {"cpu_s": int(self.limits.cpu_s), "memory_bytes": self.limits.memory_mb << 20,
                               "output_bytes": self.limits.output_mb << 20, "max_tasks": self.limits.max_tasks}}
        read_end, self._write_end = os.pipe()
        self._read_end = read_end
        env = _environment(work, self.packages)
        self.log = open(self.root / "output.txt", "wb")
        if self.warm:
            zygote = _zygote(self.packages)
            self.proc = zygote.spawn(cwd=work, env=env, argv=[str(lib / CHILD.name), "3"], log=self.log,
                                     answer=self._write_end)
            settings["parent_pid"] = zygote.proc.pid
        else:
            settings["parent_pid"] = os.getpid()
            self.proc = subprocess.Popen([*_PYTHON, str(lib / CHILD.name), str(self._write_end)],
                                         stdin=subprocess.PIPE, stdout=self.log, stderr=self.log, cwd=work, env=env,
                                         pass_fds=(self._write_end,), start_new_session=True)
        os.close(self._write_end)
        self.deadline = time.monotonic() + self.limits.wall_s
        threading.Thread(target=self._watch, daemon=True).start()
        self._send(settings)
        first = self._receive()
        if first.get("event") == "sandbox_error":
            raise ExerciseError(f"internal error: the sandbox could not start ({first.get('error')})")
        if first.get("event") == "import_error":
            raise ExerciseError(f"the cell raised when run: {first['error']}{self._where(first)}",
                                first.get("not_attempted", False))
        if first.get("event") == "missing":
            raise ExerciseError(f"the cell does not define {', '.join(first['names'])} (renamed or deleted?)")
        if first.get("event") != "ready":
            raise ExerciseError("the sandbox's channel was tampered with (unexpected message)")
        self.network_layer = str(first.get("network_layer", ""))

    def call(self, fn: str, *args: Any, world_size: int | None = None, deadline_s: float | None = None,
             **kwargs: Any) -> Any:
        """fn(*args, **kwargs) in the child (on `world_size` ranks through lab.distributed.run if given). Ranks
        still running after `deadline_s` (default: what the sandbox's budget leaves) are stopped and reported; a
        call in the child itself that runs longer than the budget leaves ends the child with a dump of its stack,
        raised as SandboxDied naming the student's line."""
        request_id = next(self._ids)
        remaining = max(1.0, self.deadline - time.monotonic() - max(2.0, self.limits.wall_s / 5))  # to report
        if deadline_s is not None:
            remaining = min(remaining, deadline_s)
        self._allowed = remaining
        self._send({"id": request_id, "fn": fn, "args": _encode(list(args)), "kwargs": _encode(kwargs),
                    "world_size": world_size, "timeout_s": remaining})
        answer = self._receive()
        if answer.get("id") != request_id:  # forging an answer gains nothing: the check still judges the value
            raise ExerciseError("the sandbox's channel was tampered with (an answer to a question not asked)")
        if "value" in answer:
            return answer["value"]
        frames = answer.get("where") or [[]]
        function = frames[-1][2] if isinstance(frames[-1], list) and len(frames[-1]) == 3 else ""
        raise CallError(str(answer.get("error", "error")), self._where(answer).removeprefix(", "),
                        bool(answer.get("not_attempted")), str(function))

    def close(self) -> None:
        self._stop.set()
        self._kill("")
        if self.proc is not None:
            self._reap()
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            os.close(self._read_end)
            self.log.close()
        if getattr(self, "cgroup", None):
            for _ in range(50):
                try:
                    self.cgroup.rmdir()
                    break
                except OSError:
                    self._kill("")
                    time.sleep(0.02)
        if getattr(self, "root", None):
            try:
                self.printed = (self.root / "output.txt").read_bytes()[-4000:].decode(errors="replace")
            except OSError:
                pass
            shutil.rmtree(self.root, ignore_errors=True)

    def output(self) -> str:
        """The last 4000 characters the student's code printed (shown to learners, never graded)."""
        return self.printed

    def __enter__(self) -> Sandbox:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # internals
    def _copy_code(self, lib: Path) -> None:
        (lib / "lab").mkdir(parents=True)
        (lib / "lab" / "__init__.py").write_text('"""A copy of `lab` with only the modules this exercise may use."""\n')
        for module in dict.fromkeys((*self.modules, *ALWAYS_CARRIED)):
            relative = Path(*module.split(".")[1:])
            source = LAB_DIR / relative
            if source.is_dir():
                shutil.copytree(source, lib / "lab" / relative, ignore=shutil.ignore_patterns("__pycache__"))
            else:  # a module alone, its package's other modules left out (lab.kernels.runtime)
                (lib / "lab" / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(source.with_suffix(".py"), (lib / "lab" / relative).with_suffix(".py"))
        shutil.copy(CHILD, lib / CHILD.name)
        (lib / "answer.py").write_text("\n".join(text for _, text in self.parts) + "\n")

    def _where(self, answer: dict) -> str:
        """', in 01.param_count (cell 3) line 3: return x' from the child's innermost frame
        ([line in answer.py, text, function])."""
        frames = answer.get("where") or []
        if not frames or not isinstance(frames[-1], list) or len(frames[-1]) != 3:
            return ""
        line, text, _ = frames[-1]
        for label, part in self.parts:
            lines = part.count("\n") + 1
            if isinstance(line, int) and line <= lines:
                return f", in {label} line {line}: {str(text)[:120]}"
            line -= lines if isinstance(line, int) else 0
        return ""

    def _send(self, message: dict) -> None:
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._died() from None

    def _receive(self) -> dict:
        while b"\n" not in self._buffer:
            timeout = self.deadline - time.monotonic()
            ready = select.select([self._read_end], [], [], max(0.0, timeout))[0] if timeout > 0 else []
            if not ready:
                self._kill(self._overran())
                raise self._died()
            chunk = os.read(self._read_end, 1 << 16)
            if not chunk:
                raise self._died()
            self._buffer += chunk
            if len(self._buffer) > _MAX_LINE:
                self._kill("sent more than 1 MiB in one answer")
                raise self._died()
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):
            message = None
        if not isinstance(message, dict):
            raise ExerciseError("the sandbox's channel was tampered with (not a JSON object)")
        tried = message.get("network")
        if isinstance(tried, list):
            self.network_tried += [str(t)[:200] for t in tried[:5]]  # per answer: each check learns of its own
        return message

    def _death(self) -> str:
        """Why the child is gone, in one line."""
        grace = time.monotonic() + max(0.1, min(2.0, self.deadline - time.monotonic()))
        while self._alive() and time.monotonic() < grace:
            time.sleep(0.01)
        if self._alive():
            self._kill("stopped answering (it closed its channel to the grader)")
        cpu_s = self._reap()
        if self.violation:
            return self.violation
        if self._dump():
            return self._overran()
        code = self.proc.returncode
        if code in (-signal.SIGXCPU, -signal.SIGKILL) and cpu_s >= self.limits.cpu_s - 0.5:
            return f"used more than {self.limits.cpu_s} s of CPU time"
        if code is not None and code < 0:
            return f"the process crashed (killed by {signal.Signals(-code).name})"
        return f"the process exited (status {code}) before answering: sys.exit, os._exit or a crash in the cell"

    @property
    def _answer(self) -> Path:
        return self.root / "lib" / "answer.py"

    def _overran(self) -> str:
        return f"did not finish within {self._allowed:.0f} s (an endless loop or a deadlock?)"

    def _died(self) -> SandboxDied:
        """The child's death (see `_death`) with what the grader knows of it: the student's line it was stopped at
        when it overran its time (the innermost frame of the answer in the thread that ran the call)."""
        reason, dump = self._death(), self._dump()
        code = self.proc.returncode or 0
        frames = []
        for block in re.split(r"\n(?=\S)", dump):  # one block per thread, most recent call first
            found = re.findall(r'File "(.*)", line (\d+) in (\S+)', block)
            if any(path.endswith(CHILD.name) and name == "_call" for path, _, name in found):
                frames = [(int(line), name) for path, line, name in found if path == str(self._answer)]
        where, function = "", ""
        if frames:
            line, name = frames[0]
            text = self._answer.read_text(errors="replace").splitlines()[line - 1:line] or [""]
            function = _qualname(str(self._answer), line, name)
            where = self._where({"where": [[line, text[0].strip(), function]]}).removeprefix(", ")
        return SandboxDied(reason, where, function, reason == self._overran(),
                           -code if code < 0 and not self.violation and not dump else 0)

    def _dump(self) -> str:
        """What the child's faulthandler wrote when a call overran its time ("Timeout (0:00:08)!" and every
        thread's stack), else "" (bounded: a student can write there too, and gain nothing by it)."""
        try:
            with open(self.root / "work" / STACK_FILE, errors="replace") as f:
                text = f.read(1 << 16)
        except OSError:
            return ""
        return text if text.startswith("Timeout (") else ""

    def _alive(self) -> bool:
        """Whether the child still runs, without reaping it (so that wait4 can still read its CPU time)."""
        if self.proc is None or self.proc.returncode is not None:
            return False
        if isinstance(self.proc, _WarmChild):
            return self.proc.alive()
        try:
            return os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
        except ChildProcessError:
            return False

    def _reap(self) -> float:
        """Wait for the child; return the CPU seconds it used (wait4 knows, Popen.wait does not)."""
        if isinstance(self.proc, _WarmChild):
            return self.proc.reap()
        if self.proc.returncode is None:
            _, status, usage = os.wait4(self.proc.pid, 0)
            self.proc.returncode = os.waitstatus_to_exitcode(status)
            self._cpu_s = usage.ru_utime + usage.ru_stime
        return getattr(self, "_cpu_s", 0.0)

    def _kill(self, reason: str) -> None:
        if reason and not self.violation:
            self.violation = reason
        if self.proc is not None:
            root = {self.proc.pid}
            kill_all(lambda: set(members(self.proc.pid, self.cgroup)) | (root if self._alive() else set()),
                     self.proc.pid)

    def _watch(self) -> None:
        """Count the sandbox's processes and their memory (RLIMIT_AS is per process) while it runs."""
        while not self._stop.wait(0.05):
            pids = members(self.proc.pid, self.cgroup)
            if len(pids) > self.limits.max_procs:
                self._kill(f"started more than {self.limits.max_procs} processes (a fork bomb?)")
                return
            if rss_bytes(pids) > 2 * (self.limits.memory_mb << 20):
                self._kill(f"used more than {2 * self.limits.memory_mb} MiB of memory across its processes")
                return


# --- warm start: a zygote per allowed-packages set ---------------------------------------------------------

@functools.cache
def _pidfds() -> bool:
    """Whether this machine has what a zygote needs: fork and pidfds (Linux >= 5.3), not a learner's Mac."""
    try:
        os.close(os.pidfd_open(os.getpid()))
        return True
    except (AttributeError, OSError):
        return False


def _link_packages(lib: Path, packages: Sequence[str]) -> Path:
    """`lib/site`, holding links to the allowed packages only (site-packages itself stays unreadable): the
    `site` of a sandbox and of a zygote."""
    site = lib / "site"
    site.mkdir(parents=True)
    for path in package_paths(packages):
        (site / Path(path).name).symlink_to(path)
    return site


def _environment(work: Path, packages: Sequence[str] = ()) -> dict[str, str]:
    """The whole environment of a sandbox (and of a zygote): nothing of the grader's. Where triton is allowed,
    kernels run in Triton's interpreter — the sandbox cannot open a GPU, and `triton.jit` reads the choice when a
    kernel is decorated — and an error in a kernel's body is raised as itself, at its line of the answer, rather
    than wrapped in an InterpreterError (so that a released stub still reads "not attempted")."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8",
           "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    if "triton" in packages:
        env.update(TRITON_INTERPRET="1", TRITON_FRONT_END_DEBUGGING="1")
    return env


class _WarmChild:
    """A sandbox child forked by a zygote, seen from the grader as Sandbox uses a Popen: pid, stdin, returncode.
    It is the zygote's child, not ours: a pidfd (sent by the zygote) says whether it still runs without reaping
    it, and the zygote reaps it when asked and sends back its exit status and CPU time (what wait4 gives a cold
    child's parent). Until then it stays a zombie, so `Sandbox._kill` can never signal a recycled pid."""

    def __init__(self, zygote: _Zygote, pid: int, pidfd: int, stdin: Any) -> None:
        self.zygote, self.pid, self.pidfd, self.stdin = zygote, pid, pidfd, stdin
        self.returncode: int | None = None
        self.cpu_s = 0.0

    def alive(self) -> bool:
        return not select.select([self.pidfd], [], [], 0)[0]  # a pidfd turns readable when the process exits

    def reap(self) -> float:
        if self.returncode is None:
            answer, _ = self.zygote.request({"reap": self.pid})
            if answer is None:  # the zygote died, so its children did too (PR_SET_PDEATHSIG)
                self.returncode = -signal.SIGKILL
            else:
                self.returncode = os.waitstatus_to_exitcode(answer["status"])
                self.cpu_s = answer["cpu_s"]
            os.close(self.pidfd)
        return self.cpu_s


class _Zygote:
    """A process that imported the allowed packages once and forks sandbox children on request (see zygote.py).

    Used for sandboxes whose packages include torch, whose import costs each cold child ~2.4 s of CPU; others
    start cold: without torch a start costs a fraction of that, and forking after importing other packages
    (jax, which starts XLA's threads) has not been vetted. The zygote is
    started like a cold child (same interpreter flags, environment, a site dir of the allowed packages only),
    never runs student code, and dies with the grader: PR_SET_PDEATHSIG fires when the *thread* that started a
    process ends, so it is started from a thread that lasts as long as the grader."""

    def __init__(self, packages: tuple[str, ...]) -> None:
        self.packages, self.lock, self.owner = packages, threading.Lock(), os.getpid()
        self.root = Path(tempfile.mkdtemp(prefix="lab-zygote-"))
        lib, work = self.root / "lib", self.root / "work"
        _link_packages(lib, packages)
        work.mkdir()
        for source in (CHILD, ZYGOTE):
            shutil.copy(source, lib / source.name)
        self.socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        started = threading.Event()

        def start_and_stay() -> None:
            try:
                with open(self.root / "output.txt", "wb") as log:
                    self.proc = subprocess.Popen(
                        [*_PYTHON, str(lib / ZYGOTE.name), str(theirs.fileno()), str(os.getpid()), *packages],
                        stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=work,
                        env=_environment(work, packages), pass_fds=(theirs.fileno(),), start_new_session=True)
            finally:
                theirs.close()
                started.set()
            threading.Event().wait()  # forever: the zygote's PR_SET_PDEATHSIG is tied to this thread

        threading.Thread(target=start_and_stay, name="lab-zygote", daemon=True).start()
        started.wait()
        self.socket.settimeout(300)
        try:
            ready = self.socket.recv(64)
        except OSError:
            ready = b""
        self.socket.settimeout(None)
        if not ready:
            self.close()
            raise ExerciseError(f"internal error: the sandbox's zygote for {', '.join(packages)} did not start")

    def request(self, message: dict, fds: Sequence[int] = ()) -> tuple[dict | None, list[int]]:
        """One request, its answer (None: the zygote is gone) and the fds sent with it, one thread at a time."""
        with self.lock:
            try:
                socket.send_fds(self.socket, [json.dumps(message).encode()], list(fds))
                data, received, _, _ = socket.recv_fds(self.socket, 1 << 16, 1)
            except OSError:
                return None, []
            return (json.loads(data) if data else None), received

    def spawn(self, *, cwd: Path, env: dict[str, str], argv: list[str], log: Any, answer: int) -> _WarmChild:
        stdin, stdin_ours = os.pipe()
        try:
            reply, fds = self.request({"spawn": {"cwd": str(cwd), "env": env, "argv": argv}},
                                 [stdin, log.fileno(), log.fileno(), answer])
        finally:
            os.close(stdin)
        if reply is None or len(fds) != 1:
            os.close(stdin_ours)
            raise ExerciseError("internal error: the sandbox's zygote did not start a child")
        return _WarmChild(self, reply["pid"], fds[0], os.fdopen(stdin_ours, "wb"))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self.socket.close()  # the zygote exits when its socket closes; its children die with it
        if getattr(self, "proc", None) is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
            if self.proc.returncode is None:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)


_zygotes: dict[tuple[str, ...], _Zygote] = {}
_zygotes_lock = threading.Lock()


def _zygote(packages: tuple[str, ...]) -> _Zygote:
    """This grader's zygote for `packages`, started on first use (again if it died)."""
    with _zygotes_lock:
        zygote = _zygotes.get(packages)
        if zygote is not None and zygote.owner != os.getpid():  # we are a fork of its grader (a rank): not ours
            zygote = None
        if zygote is None or not zygote.alive():
            if zygote is not None:
                zygote.close()
            zygote = _zygotes[packages] = _Zygote(packages)
            if len(_zygotes) == 1:
                atexit.register(_close_zygotes)
        return zygote


def _close_zygotes() -> None:
    with _zygotes_lock:
        for zygote in _zygotes.values():
            if zygote.owner == os.getpid():
                zygote.close()
        _zygotes.clear()
