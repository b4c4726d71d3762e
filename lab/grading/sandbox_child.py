"""The student's side of the sandbox: lock this process down, import the exercise cell, answer calls.

Started by `lab.grading.sandbox` as `python -I -S -B sandbox_child.py RESPONSE_FD` in an empty directory,
with the settings as the first line of stdin, or forked in that same state by a zygote that imported torch.
Stdlib only, and it imports nothing from `lab` itself: it is copied into the sandbox next to the few `lab`
modules the exercise may use. Before any student code runs it

1. dies with its parent (PR_SET_PDEATHSIG: the grader, or the zygote that forked it and that itself dies with
   the grader, see `zygote.py`) and joins its own pids cgroup when the grader made one;
2. leaves the grading host's network (`_own_network`): a network namespace of its own whose only device is
   its own loopback, so ranks still meet over gloo on `lo` while the host's loopback services, other hosts,
   UDP and abstract Unix sockets are out of reach; where no namespace can be made, a seccomp filter refuses
   internet sockets to an exercise without ranks (`_refuse_inet_sockets`);
3. sets resource limits (CPU time, memory, file size, open files, tasks) with soft = hard;
4. shuts the file system with Landlock: read-only system and Python directories, read-write only its
   working directory; with Landlock ABI >= 6 it can no longer signal processes outside the sandbox;
5. when running as root (or in a user namespace of its own), drops every capability (so it cannot raise its
   limits back, mount, reboot, bring up a device, ...).

Then each request on stdin ({"id", "fn", "args", "kwargs", "world_size"}) is answered on RESPONSE_FD with
one JSON line of plain data. The grader compares those values itself: nothing printed here counts.
"""

import ast
import ctypes
import faulthandler
import fcntl
import functools
import importlib.machinery
import json
import os
import platform
import re
import resource
import signal
import socket
import struct
import sys
import traceback
from collections.abc import Callable

_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS, _PR_CAPBSET_DROP, _PR_SET_CHILD_SUBREAPER = 1, 38, 24, 36
_LANDLOCK_CREATE, _LANDLOCK_ADD_RULE, _LANDLOCK_RESTRICT = 444, 445, 446  # x86_64 and aarch64 alike
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1, 2, 4, 8
_FS_REFER, _FS_TRUNCATE, _FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1, 2
_NET_BIND_TCP, _NET_CONNECT_TCP = 1, 2  # Landlock ABI >= 4
_CLONE_NEWNET, _CLONE_NEWUSER = 0x40000000, 0x10000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 1
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
# seccomp's view of this machine: (AUDIT_ARCH_*, the socket() syscall's number)
_SECCOMP_ARCH = {"x86_64": (0xC000003E, 41), "aarch64": (0xC00000B7, 198)}
_MAX_DEPTH = 32
_ALLOWED: list = []  # the modules and packages this exercise may import, for error messages
STACK_FILE = "lab-stack.txt"  # in the working directory: where a call that overran its time is dumped
_NETWORK_TRIED: list = []  # what the student's code tried to reach since the last answer ("connect to host:port")


def _prctl(option: int, arg: int = 0) -> None:
    if _libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 where Landlock is missing or disabled."""
    if sys.platform != "linux":
        return 0
    abi = _libc.syscall(_LANDLOCK_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(abi, 0)


def _landlock(rules: list, abi: int, refuse_tcp: bool = False) -> None:
    """Allow only `rules` ([path, "ro" | "rw"]) from now on, for this process and all it starts; with
    `refuse_tcp` (and ABI >= 4), no TCP bind or connect either."""
    handled = (1 << 13) - 1 | (_FS_REFER if abi >= 2 else 0) | (_FS_TRUNCATE if abi >= 3 else 0)
    handled |= _FS_IOCTL_DEV if abi >= 5 else 0
    file_rights = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE | _FS_IOCTL_DEV
    tcp = _NET_BIND_TCP | _NET_CONNECT_TCP if refuse_tcp and abi >= 4 else 0
    if abi >= 6:
        attr = struct.pack("=QQQ", handled, tcp, _SCOPE_SIGNAL | _SCOPE_ABSTRACT_UNIX_SOCKET)
    else:
        attr = struct.pack("=QQ", handled, tcp) if abi >= 4 else struct.pack("=Q", handled)
    ruleset = _libc.syscall(_LANDLOCK_CREATE, attr, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    for path, mode in rules:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # a path this machine does not have
        access = handled if mode == "rw" else _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR
        if not os.path.isdir(path):
            access &= file_rights & handled
        rule = struct.pack("=Qi", access, fd)
        if _libc.syscall(_LANDLOCK_ADD_RULE, ruleset, 1, rule, 0) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule({path!r}) failed")
        os.close(fd)
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    if _libc.syscall(_LANDLOCK_RESTRICT, ruleset, 0) != 0:
        raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    os.close(ruleset)


def _drop_capabilities(last: int) -> None:
    """Root keeps uid 0 (the interpreter may live under /root) but loses every capability, for good."""
    for cap in range(last + 1):
        _prctl(_PR_CAPBSET_DROP, cap)
    header = struct.pack("=Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    if _libc.capset(header, bytes(24)) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")


def _user_tasks(uid: int) -> int:
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                count += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            pass
    return count


def _loopback_up() -> None:
    """A new network namespace has a loopback device that is down: bring it up (ranks meet on 127.0.0.1)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sh22x", b"lo", 0)  # struct ifreq: the name, then the flags
        flags = struct.unpack("16sh22x", fcntl.ioctl(sock, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sh22x", b"lo", flags | _IFF_UP))


def _own_network(layers: list) -> str:
    """Move this process (and all it will start) into a network namespace of its own; return how, or "".

    Root (with CAP_SYS_ADMIN) unshares one directly; anyone else through a user namespace of their own, where the
    kernel allows unprivileged ones (their uid and gid mapped to themselves, so files and limits see the same
    ids). Inside, the only device is a loopback that no one else shares: a listener on the grading host's
    127.0.0.1 is unreachable, as are other hosts, and abstract Unix socket names are per namespace too."""
    uid, gid = os.getuid(), os.getgid()
    if "namespace" in layers and _libc.unshare(_CLONE_NEWNET) == 0:
        how = "namespace"
    elif "user namespace" in layers and _libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) == 0:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        how = "user namespace"
    else:
        return ""
    _loopback_up()
    return how


def _refuse_inet_sockets() -> bool:
    """Where no namespace can be made: a seccomp filter that makes socket() fail with EACCES for IPv4, IPv6 and
    raw packets (TCP and UDP alike), for this process and all it starts. Only for exercises without ranks: gloo's
    ranks need TCP between them. Returns whether the filter is in place (seccomp, and a known architecture)."""
    arch = _SECCOMP_ARCH.get(platform.machine())
    if sys.platform != "linux" or arch is None:
        return False
    audit_arch, nr_socket = arch
    ld_w_abs, jeq, ret = 0x20, 0x15, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K
    jge = 0x35  # BPF_JMP|BPF_JGE|BPF_K
    allow, refuse = 0x7FFF0000, 0x00050000 | 13  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EACCES
    program = [  # (code, jump if true, jump if false, k); seccomp_data: nr at 0, arch at 4, args from 16
        (ld_w_abs, 0, 0, 4), (jeq, 1, 0, audit_arch), (ret, 0, 0, refuse),  # another ABI: refuse everything
        (ld_w_abs, 0, 0, 0), (jge, 0, 1, 0x40000000), (ret, 0, 0, refuse),  # x32's numbers: refused
        (jeq, 0, 5, nr_socket),
        (ld_w_abs, 0, 0, 16),  # socket()'s domain
        (jeq, 2, 0, socket.AF_INET), (jeq, 1, 0, socket.AF_INET6), (jeq, 0, 1, 17),  # AF_PACKET
        (ret, 0, 0, refuse),
        (ret, 0, 0, allow),
    ]
    filters = b"".join(struct.pack("=HBBI", *instruction) for instruction in program)
    buffer = ctypes.create_string_buffer(filters)
    fprog = struct.pack("=HxxxxxxQ", len(program), ctypes.addressof(buffer))
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    return _libc.prctl(_PR_SET_SECCOMP, ctypes.c_ulong(_SECCOMP_MODE_FILTER), ctypes.c_char_p(fprog), 0, 0) == 0


def _address(address) -> str:
    if isinstance(address, tuple) and len(address) >= 2:
        return f"{address[0]}:{address[1]}"
    return repr(address)  # a Unix socket's path, or an abstract name (b"\\0...")


def _watch_network(event: str, args: tuple) -> None:
    """An audit hook (which the student's code cannot remove): note each attempt to reach the network, so that the
    feedback says the network was blocked rather than leaving a bare ConnectionRefusedError to puzzle over."""
    if not event.startswith("socket."):
        return
    if event == "socket.connect" and len(args) > 1:
        _NETWORK_TRIED.append(f"connect to {_address(args[1])}")
    elif event in ("socket.sendto", "socket.sendmsg") and len(args) > 1 and args[1] is not None:
        _NETWORK_TRIED.append(f"send a datagram to {_address(args[1])}")
    elif event == "socket.getaddrinfo" or event.startswith("socket.gethostby"):
        host = args[0].decode(errors="replace") if isinstance(args[0], bytes) else str(args[0])
        if not re.fullmatch(r"[\d.]+|[\da-fA-F:]+", host):  # a name, not an address written out
            _NETWORK_TRIED.append(f"look up {host!r}")
    elif event == "socket.__new__" and len(args) > 1 and args[1] in (socket.AF_INET, socket.AF_INET6):
        _NETWORK_TRIED.append("open an internet socket")


def _keep_listings() -> None:
    """Python's FileFinder lists a directory again whenever the directory's mtime changes, and takes a listing it is
    refused for an empty directory. Under Landlock the standard library's directory cannot be listed (site-packages,
    which may be protected, lies inside it, so it is opened entry by entry): a file another process creates or removes
    there while this sandbox runs would make every standard module not yet imported vanish ("No module named
    'fnmatch'"). So each finder lists its directory now, while it still may, and keeps that listing when a later one
    is refused."""
    for finder in list(sys.path_importer_cache.values()):
        if isinstance(finder, importlib.machinery.FileFinder):
            finder.find_spec("__lab_listing__")  # fills the cache (no such module exists)
            finder._fill_cache = functools.partial(_refill_unless_refused, finder, finder._fill_cache)


def _refill_unless_refused(finder: importlib.machinery.FileFinder, fill: Callable[[], None]) -> None:
    try:
        os.listdir(finder.path or os.getcwd())
    except PermissionError:
        return  # Landlock: the listing made before it is the best there is
    fill()


def lock_down(settings: dict) -> str:
    """Confine this process for good; return how its network is cut off ("namespace", "user namespace",
    "seccomp", or "" where nothing could be done)."""
    linux = sys.platform == "linux"  # elsewhere (a learner's Mac): resource limits and the process group only
    if linux:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != settings["parent_pid"]:  # the grader (or zygote) died before prctl took effect
            os._exit(1)
    if settings["cgroup"]:
        with open(os.path.join(settings["cgroup"], "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    layers = settings["network_layers"]  # what the grader lets us try, in order (a test plants fewer)
    network = _own_network(layers) if linux else ""  # before the limits and Landlock: it writes to /proc/self
    limits = settings["limits"]
    tasks = limits["max_tasks"] + (0 if os.getuid() == 0 or not linux else _user_tasks(os.getuid()))  # per user
    for name, value in (("RLIMIT_CPU", limits["cpu_s"]), ("RLIMIT_AS", limits["memory_bytes"]),
                        ("RLIMIT_FSIZE", limits["output_bytes"]), ("RLIMIT_CORE", 0), ("RLIMIT_NOFILE", 1024),
                        ("RLIMIT_NPROC", tasks)):
        hard = resource.getrlimit(getattr(resource, name))[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        try:
            resource.setrlimit(getattr(resource, name), (value, value))
        except (ValueError, OSError):
            if linux:
                raise  # macOS refuses some limits (RLIMIT_AS); Linux must not
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write fails instead of killing us
    if not linux:
        return ""
    with open("/proc/sys/kernel/cap_last_cap") as f:  # before Landlock hides /proc
        last_cap = int(f.read())
    abi = landlock_abi()
    refuse_tcp = not network and not settings["ranks"] and "seccomp" in layers  # Landlock's TCP rules (ABI >= 4)
    if abi:
        _keep_listings()
        _landlock(settings["landlock"], abi, refuse_tcp)
    if os.geteuid() == 0 or network == "user namespace":
        _drop_capabilities(last_cap)
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)  # orphans of the student's processes stay our descendants
    if not network and not settings["ranks"] and "seccomp" in layers:
        network = "seccomp" if _refuse_inet_sockets() else ""
    return network


# --- answering calls ------------------------------------------------------------------------------------

def _plain(value, depth: int = 0):
    """What may cross back to the grader: JSON data. Tensors and NumPy values become lists and numbers."""
    if depth > _MAX_DEPTH:
        raise ValueError("the value is nested too deeply to be graded")
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) in (list, tuple):
        return [_plain(v, depth + 1) for v in value]
    if type(value) is dict and all(type(k) is str for k in value):
        return {k: _plain(v, depth + 1) for k, v in value.items()}
    if type(value).__module__.split(".")[0] in ("numpy", "torch") and hasattr(value, "tolist"):
        return _plain(value.tolist(), depth + 1)
    raise TypeError(f"returned a {type(value).__module__}.{type(value).__qualname__}, which cannot be graded: "
                    f"return numbers, strings, lists or dicts")


def _decode(value):
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__config__"}:
            from lab.config import ModelConfig

            return ModelConfig(**value["__config__"])
        return {k: _decode(v) for k, v in value.items()}
    return value


def _rank_crash(error: BaseException):
    """The RankError of a rank that raised (not of ranks that hung: they have no line to blame), else None."""
    launcher = sys.modules.get("lab.distributed")  # only there if the exercise ran ranks
    if launcher is None or not isinstance(error, launcher.RankError) or isinstance(error, launcher.RankTimeout):
        return None
    return error if isinstance(error.rank, int) else None  # a list: ranks that never joined a collective


def _qualname(answer: str, line: int, name: str) -> str:
    """The function of the answer file around `line`, with its class ("BucketedDP.finish"), else `name`."""
    try:
        with open(answer) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return name
    found, todo = name, [(node, "") for node in tree.body]
    while todo:
        node, prefix = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
                node.lineno <= line <= (node.end_lineno or node.lineno):
            if not isinstance(node, ast.ClassDef):
                found = prefix + node.name
            todo += [(child, f"{prefix}{node.name}.") for child in node.body]
    return found


def _where(error: BaseException, answer: str) -> list:
    """The student's frames only: [line in the answer file, source line, function]. A rank's frames come from
    the traceback it sent back, so that a crash on a rank is located like one in a single process."""
    crash = _rank_crash(error)
    if crash is not None:
        pattern = r'  File "' + re.escape(answer) + r'", line (\d+), in ([^\n]+)\n(?:    ([^\n]*)\n)?'
        frames = [[int(line), text.strip(), name] for line, name, text in re.findall(pattern, crash.traceback_text)]
    else:
        frames = [[f.lineno, (f.line or "").strip(), f.name] for f in traceback.extract_tb(error.__traceback__)
                  if f.filename == answer]
    if frames:
        frames[-1][2] = _qualname(answer, *frames[-1][::2])
    return frames


def _unattempted_on_ranks(error: BaseException) -> str | None:
    """The stub's error when ranks ran an answer left as released: lab.distributed.run wraps it in a RankError."""
    crash = _rank_crash(error)
    return crash.summary if crash is not None and crash.summary.startswith("NotImplementedError") else None


def _network_error_on_a_rank(error: BaseException) -> bool:
    """Whether a rank died of reaching for the network (what it tried is noted in its own process, not ours)."""
    crash = _rank_crash(error)
    said = crash.summary if crash is not None else ""
    return said.startswith(("ConnectionRefusedError", "ConnectionResetError", "ConnectionAbortedError", "gaierror",
                            "socket.gaierror")) or "Network is unreachable" in said


def _diagnosis(text: str, limit: int = 500) -> str:
    """The flight recorder's lines of a failed multi-rank call ("collectives: rank 0 failed in send #1 to rank 1 on
    world; ..."), at most `limit` characters: which rank was in which operation when the ranks hung, the one thing
    the error's first line ("Timed out waiting 3000ms for send operation") cannot say."""
    lines = [line for line in text.splitlines()[1:] if line.startswith("collectives: ")]
    return "\n".join(lines)[:limit]


def _failure(error: BaseException, answer: str) -> dict:
    text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    stub = _unattempted_on_ranks(error)
    text = stub or text
    if isinstance(error, ModuleNotFoundError):
        text += f" (graded code may import the standard library and {', '.join(_ALLOWED)})"
    if isinstance(error, SystemExit):
        text = f"SystemExit({error.code!r}): the exercise code called sys.exit()"
    if isinstance(error, OSError) and _NETWORK_TRIED:
        text = f"blocked: graded code has no network (it tried to {_NETWORK_TRIED[-1]}): {text}"
    elif _network_error_on_a_rank(error):
        text = f"blocked: graded code has no network (a rank tried to reach it): {text}"
    first, diagnosis = (text.splitlines()[0][:500], _diagnosis(text)) if text else ("error", "")
    return {"error": first + (f"\n{diagnosis}" if diagnosis else ""), "where": _where(error, answer),
            "not_attempted": isinstance(error, NotImplementedError) or stub is not None}


def _call(module, request: dict, answer: str, stack) -> dict:
    """One request's answer. A call in this process that is still running after its `timeout_s` dumps every
    thread's stack to `stack` and ends the process (faulthandler's own thread does it, GIL or not: a lock taken
    twice or a loop in C still gets its line named); the grader reads the dump. Ranks are not armed:
    `lab.distributed.run` stops those that hang and says which operation each waits in."""
    fn = getattr(module, request["fn"], None)
    if not callable(fn):
        return {"error": f"NameError: {request['fn']} is not defined by the exercise cell (was it renamed?)",
                "where": [], "not_attempted": False}
    args, kwargs = _decode(request["args"]), _decode(request["kwargs"])
    try:
        if request.get("world_size"):
            from lab.distributed import run

            value = run(fn, request["world_size"], *args, timeout_s=request["timeout_s"],
                        pg_timeout_s=max(1.0, request["timeout_s"] / 2), **kwargs)
        else:
            faulthandler.dump_traceback_later(request["timeout_s"], exit=True, file=stack)
            try:
                value = fn(*args, **kwargs)
            finally:
                faulthandler.cancel_dump_traceback_later()
        return {"value": _plain(value)}
    except BaseException as error:  # SystemExit and KeyboardInterrupt included: they fail this call only
        return _failure(error, answer)


def main() -> None:
    channel = os.fdopen(int(sys.argv[1]), "w", buffering=1)
    for stream in (sys.stdout, sys.stderr):  # what the student prints reaches the log even if killed
        stream.reconfigure(line_buffering=True)
    settings = json.loads(sys.stdin.readline())
    sys.path[:0] = settings["sys_path"]
    _ALLOWED[:] = settings["importable"]

    def send(message: dict) -> None:
        if _NETWORK_TRIED:  # every answer says what the code behind it tried to reach (and could not)
            message["network"] = list(dict.fromkeys(_NETWORK_TRIED))[:5]
            _NETWORK_TRIED.clear()
        channel.write(json.dumps(message, allow_nan=True) + "\n")

    try:
        network = lock_down(settings)
    except Exception as error:  # our failure, not the student's: say so
        send({"event": "sandbox_error", "error": f"{type(error).__name__}: {error}"})
        os._exit(1)
    sys.addaudithook(_watch_network)

    answer = os.path.join(settings["lib"], "answer.py")
    stack = open(STACK_FILE, "w")  # in the working directory, before any student code runs (or chdirs)
    try:
        import answer as module
    except BaseException as error:
        send({"event": "import_error", **_failure(error, answer)})
        os._exit(0)
    missing = [name for name in settings["entry"] if not callable(getattr(module, name, None))]
    send({"event": "missing", "names": missing} if missing else {"event": "ready", "network_layer": network})
    for line in sys.stdin:
        request = json.loads(line)
        try:
            send({"id": request["id"], **_call(module, request, answer, stack)})
        except BaseException as error:  # e.g. a value that json cannot encode
            send({"id": request["id"], **_failure(error, answer)})
    os._exit(0)  # not sys.exit: threads or atexit hooks the student left must not keep us alive


def probe_network(layers: list) -> str:
    """How a sandbox without ranks is cut off from the network on this machine (`lab doctor`, `lab grade`): tried
    for real in a process that is thrown away afterwards."""
    how = _own_network(layers) if sys.platform == "linux" else ""
    if not how and "seccomp" in layers:
        how = "seccomp" if _refuse_inet_sockets() else ""
    return how


if __name__ == "__main__":
    if sys.argv[1:2] == ["--probe-network"]:
        print(json.dumps(probe_network(sys.argv[2:])))
    else:
        main()
