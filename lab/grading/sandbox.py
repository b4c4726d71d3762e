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
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lab.grading.confine import LAB_DIR, kill_all, make_cgroup, members, package_paths, rss_bytes, system_rules

CHILD = Path(__file__).with_name("sandbox_child.py")
_MAX_LINE = 1 << 20  # bytes of one answer: more is a protocol violation


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
                 packages: Sequence[str], limits: Limits, protect: Sequence[str] = ()) -> None:
        self.parts, self.entry, self.modules, self.limits = list(parts), list(entry), list(modules), limits
        self.packages, self.protect = tuple(sorted(packages)), tuple(sorted(str(Path(p).resolve())
                                                                             for p in protect))
        self.proc: subprocess.Popen | None = None
        self.violation, self.printed = "", ""
        self._buffer, self._ids = b"", itertools.count()
        self._stop = threading.Event()

    # life cycle
    def start(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="lab-sandbox-"))
        lib, work = self.root / "lib", self.root / "work"
        self._copy_code(lib)
        work.mkdir()
        self.cgroup = make_cgroup(self.limits.max_tasks)
        site = lib / "site"  # links to the allowed packages only: site-packages itself stays unreadable
        site.mkdir()
        for path in package_paths(self.packages):
            (site / Path(path).name).symlink_to(path)
        sys_path = [str(lib), str(site)]
        rules = [*map(list, system_rules(self.protect)), [str(lib), "ro"], [str(work), "rw"],
                 *[[p, "ro"] for p in package_paths(self.packages)],
                 *([["/dev/shm", "rw"], ["/sys", "ro"]] if "torch" in self.packages else [])]  # gloo lists NICs
        settings = {"sys_path": sys_path, "lib": str(lib), "entry": self.entry, "grader_pid": os.getpid(),
                    "importable": [*self.modules, *self.packages],
                    "cgroup": str(self.cgroup) if self.cgroup else None, "landlock": rules,
                    "limits": {"cpu_s": int(self.limits.cpu_s), "memory_bytes": self.limits.memory_mb << 20,
                               "output_bytes": self.limits.output_mb << 20, "max_tasks": self.limits.max_tasks}}
        read_end, self._write_end = os.pipe()
        self._read_end = read_end
        env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
        self.log = open(self.root / "output.txt", "wb")
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", str(lib / CHILD.name), str(self._write_end)],
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

    def call(self, fn: str, *args: Any, world_size: int | None = None, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) in the child (on `world_size` ranks through lab.distributed.run if given)."""
        request_id = next(self._ids)
        remaining = max(1.0, self.deadline - time.monotonic() - max(2.0, self.limits.wall_s / 5))  # to report
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
        for module in self.modules:
            relative = Path(*module.split(".")[1:])
            source = LAB_DIR / relative
            if source.is_dir():
                shutil.copytree(source, lib / "lab" / relative, ignore=shutil.ignore_patterns("__pycache__"))
            else:
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
            raise ExerciseError(self._death()) from None

    def _receive(self) -> dict:
        while b"\n" not in self._buffer:
            timeout = self.deadline - time.monotonic()
            ready = select.select([self._read_end], [], [], max(0.0, timeout))[0] if timeout > 0 else []
            if not ready:
                self._kill(f"did not finish within {self.limits.wall_s:g} s (an endless loop or a hang?)")
                raise ExerciseError(self._death())
            chunk = os.read(self._read_end, 1 << 16)
            if not chunk:
                raise ExerciseError(self._death())
            self._buffer += chunk
            if len(self._buffer) > _MAX_LINE:
                self._kill("sent more than 1 MiB in one answer")
                raise ExerciseError(self._death())
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):
            message = None
        if not isinstance(message, dict):
            raise ExerciseError("the sandbox's channel was tampered with (not a JSON object)")
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
        code = self.proc.returncode
        if code in (-signal.SIGXCPU, -signal.SIGKILL) and cpu_s >= self.limits.cpu_s - 0.5:
            return f"used more than {self.limits.cpu_s} s of CPU time"
        if code is not None and code < 0:
            return f"the process crashed (killed by {signal.Signals(-code).name})"
        return f"the process exited (status {code}) before answering: sys.exit, os._exit or a crash in the cell"

    def _alive(self) -> bool:
        """Whether the child still runs, without reaping it (so that wait4 can still read its CPU time)."""
        if self.proc is None or self.proc.returncode is not None:
            return False
        try:
            return os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
        except ChildProcessError:
            return False

    def _reap(self) -> float:
        """Wait for the child; return the CPU seconds it used (wait4 knows, Popen.wait does not)."""
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
