"""A fork server for sandboxes ("zygote"): imports the exercise's packages (torch: ~2.4 s of CPU) once, then
forks one sandbox child per request, so that each sandbox starts in milliseconds instead of seconds.

Started by `lab.grading.sandbox` exactly as a sandbox child is (`python -I -S -B zygote.py SOCKET_FD PARENT_PID
PACKAGE...` with the scrubbed environment, in a directory of its own whose `site` links only the allowed
packages), once per grader process and allowed-packages set. Stdlib only; it never imports `lab` and never runs
student code: every student process is a fresh fork of this clean state. It serves two requests, one at a time,
on a SOCK_SEQPACKET socket (one JSON object per message):

* {"spawn": {cwd, env, argv}} with four file descriptors (stdin, stdout, stderr, the answer pipe) passed with
  SCM_RIGHTS: fork a child that becomes that sandbox — new session, those fds as 0, 1, 2 and 3 and no other,
  that directory and environment, sys.path without the zygote's own entries — and runs `sandbox_child.main()`,
  which locks itself down exactly as a cold-started child does. The child always ends in os._exit: it never
  returns into this loop. The answer is {"pid"} with a pidfd of the child (SCM_RIGHTS), through which the
  grader learns whether the child still runs without reaping it.
* {"reap": pid}: wait4 the child and answer {"status", "cpu_s"}. Only the parent can read a child's exit status
  and CPU time (a pidfd of another's child cannot: waitid(P_PIDFD) wants a child of the caller), so the zygote
  reads them for the grader. It reaps only when the grader asks: as with a cold child, the pid stays a zombie,
  never reused, until the grader is done signalling it and has read how it ended.

Lifetime: the zygote dies with the grader (PR_SET_PDEATHSIG), and each child sets its own PR_SET_PDEATHSIG on
the zygote, so a killed grader leaves no sandbox behind; it exits when the grader closes the socket.
"""

import importlib
import json
import os
import signal
import socket
import sys


def _become_sandbox(control: socket.socket, request: dict, fds: list) -> None:
    """In the forked child: take on the sandbox's process state, then run the child's main. Never returns."""
    try:
        control.close()
        os.setsid()
        for target, fd in enumerate(fds):  # stdin, stdout, stderr, the answer pipe -> 0, 1, 2, 3
            os.dup2(fd, target)
        os.closerange(len(fds), os.sysconf("SC_OPEN_MAX"))  # every other fd: the socket, pidfds, torch's
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if "tempfile" in sys.modules:
            sys.modules["tempfile"].tempdir = None  # computed from this sandbox's TMPDIR on first use
        sys.path[:] = [p for p in sys.path if p not in _OWN_PATH]  # main() puts the sandbox's [lib, site] first
        importlib.invalidate_caches()  # list every directory again now, as a fresh process does: under Landlock
        for finder in list(sys.path_importer_cache.values()):  # some (the stdlib, home of site-packages) can
            if hasattr(finder, "find_spec"):  # no longer be listed, so a directory that changed since the
                finder.find_spec("__lab_zygote__")  # zygote started would look empty
        sys.argv[:] = request["argv"]
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import sandbox_child

        sandbox_child.main()
    finally:
        os._exit(1)


def serve(control: socket.socket) -> None:
    while True:
        message, fds, _, _ = socket.recv_fds(control, 1 << 16, 4)
        if not message:
            os._exit(0)  # the grader closed its end
        request = json.loads(message)
        if "spawn" in request:
            pid = os.fork()
            if pid == 0:
                _become_sandbox(control, request["spawn"], fds)
            for fd in fds:
                os.close(fd)
            pidfd = os.pidfd_open(pid)
            socket.send_fds(control, [json.dumps({"pid": pid}).encode()], [pidfd])
            os.close(pidfd)
        else:
            _, status, usage = os.wait4(int(request["reap"]), 0)
            control.send(json.dumps({"status": status, "cpu_s": usage.ru_utime + usage.ru_stime}).encode())


_OWN_PATH: list = []


def main() -> None:
    lib = os.path.dirname(os.path.abspath(__file__))  # -I leaves it off sys.path
    _OWN_PATH[:] = [lib, os.path.join(lib, "site")]
    sys.path[:0] = _OWN_PATH
    import sandbox_child

    fd, parent, packages = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    sandbox_child._prctl(sandbox_child._PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the grader died before prctl took effect
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the grader decides when we stop
    for package in packages:
        __import__(package)
    control = socket.socket(fileno=fd)
    control.send(b'{"ready": true}')
    serve(control)


if __name__ == "__main__":
    main()
