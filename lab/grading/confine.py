"""How a sandbox is confined, seen from the grader: which paths its Landlock rules open, the pids cgroup
that caps its tasks, and how to find (and kill) every process it started.

The child applies the rules itself (`sandbox_child.py`); this module only decides them. Read access is an
allow-list: system directories and the Python standard library, read-only; never the course checkout (its
solutions, checks and reference code) nor site-packages as a whole, only the packages an exercise needs.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lab

LAB_DIR = Path(lab.__file__).resolve().parent
# How a sandbox may cut itself off from the network, tried in this order (see sandbox_child._own_network): its own
# namespace as root, its own user and network namespaces otherwise, a seccomp filter on internet sockets last.
ALL_NETWORK_LAYERS = ("namespace", "user namespace", "seccomp")
_counter = itertools.count()


# --- what the child may read ---------------------------------------------------------------------------

def _site_dirs() -> list[Path]:
    import site

    base = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_prefix})
    dirs = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")} | set(site.getsitepackages())
    dirs |= {base["purelib"], base["platlib"]}
    return [Path(d).resolve() for d in sorted(dirs) + [site.getusersitepackages()] if os.path.isdir(d)]


def _protected() -> list[Path]:
    """Never readable: the course checkout (solutions, checks, reference code), site-packages as a whole."""
    repo = LAB_DIR.parent
    return [LAB_DIR, *([repo] if (repo / "solutions").is_dir() or (repo / "pyproject.toml").exists() else []),
            *_site_dirs()]


def _inside(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


def _allow(path: Path, mode: str, protected: Sequence[Path], rules: list) -> None:
    """A rule for `path`, or, when a protected path lies inside it, rules for its other entries."""
    if any(_inside(path, p) for p in protected) or not path.exists():
        return
    if not any(_inside(p, path) for p in protected) or not path.is_dir():
        rules.append([str(path), mode])
        return
    for entry in sorted(path.iterdir()):
        _allow(entry.resolve() if entry.is_symlink() else entry, mode, protected, rules)


def _requirements(dist: importlib.metadata.Distribution) -> list[str]:
    names = []
    for req in dist.requires or []:
        if "extra ==" not in req:
            names.append(re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0])
    return names


@functools.cache
def package_paths(packages: tuple[str, ...]) -> tuple[str, ...]:
    """Top-level site-packages entries of `packages` (import names) and of everything they require."""
    by_import = importlib.metadata.packages_distributions()
    todo = [d for p in packages for d in by_import.get(p, [])]
    seen, paths = set(), set()
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen or key == "ultrascale-lab":
            continue
        seen.add(key)
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for file in dist.files or []:
            if file.parts and file.parts[0] != "..":
                paths.add(str(Path(dist.locate_file(file.parts[0])).resolve()))
        todo.extend(_requirements(dist))
    return tuple(sorted(paths))


@functools.cache
def system_rules(extra_protected: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    protected = [*_protected(), *map(Path, extra_protected)]
    rules: list = []
    paths = sysconfig.get_paths()
    roots = ["/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/etc", "/sys/devices/system/cpu",
             paths["stdlib"], paths["platstdlib"], os.path.join(sys.base_prefix, "lib"),
             os.path.dirname(os.path.realpath(sys.executable))]
    for root in dict.fromkeys(roots):
        _allow(Path(root).resolve(), "ro", protected, rules)
    for dev in ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"):
        rules.append([dev, "rw"])
    return tuple(map(tuple, rules))


# --- limits on the number of tasks, even for root -----------------------------------------------------

def make_cgroup(max_tasks: int) -> Path | None:
    """A pids cgroup of our own where the kernel lets us create one (root, cgroup v1 or a delegated v2)."""
    bases = [Path("/sys/fs/cgroup/pids")]
    try:
        own = Path("/proc/self/cgroup").read_text().splitlines()
        bases += [Path("/sys/fs/cgroup") / line[3:].lstrip("/") for line in own if line.startswith("0::")]
    except OSError:
        pass
    for base in bases:
        path = base / f"lab-sandbox-{os.getpid()}-{next(_counter)}"
        try:
            path.mkdir()
        except OSError:
            continue
        try:
            (path / "pids.max").write_text(str(max_tasks))
        except OSError:
            path.rmdir()
            continue
        _reap_stale(base)
        return path
    return None


def _reap_stale(base: Path) -> None:
    """Sandboxes of a grader that was killed (its cgroup names its pid): kill what is left, remove them."""
    for stale in base.glob("lab-sandbox-*-*"):
        owner = stale.name.split("-")[2]
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            kill_all(lambda stale=stale: set(_cgroup_procs(stale)))
            with contextlib.suppress(OSError):
                stale.rmdir()


def isolation() -> dict[str, Any]:
    """Which layers this machine gives the sandbox, for the grader's report. `network` is how a sandbox is cut off
    from the network: "namespace" or "user namespace" (every exercise, ranks included), "seccomp" (exercises
    without ranks only: ranks meet over TCP), or "" (not at all)."""
    from lab.grading.sandbox_child import landlock_abi

    cgroup = make_cgroup(1)
    if cgroup:
        cgroup.rmdir()
    return {"landlock_abi": landlock_abi(), "pids_cgroup": cgroup is not None, "root": os.geteuid() == 0,
            "network": network_layer()}


@functools.cache
def network_layer(layers: tuple[str, ...] = ALL_NETWORK_LAYERS) -> str:
    """The network layer this machine gives a sandbox that may try `layers`, found by trying them in a throw-away
    child started as sandboxes are."""
    from lab.grading.sandbox import _PYTHON, CHILD

    try:
        probe = subprocess.run([*_PYTHON, str(CHILD), "--probe-network", *layers], capture_output=True,
                               text=True, timeout=30, cwd="/", env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
        return str(json.loads(probe.stdout)) if probe.returncode == 0 else ""
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return ""


# --- every process of a sandbox ------------------------------------------------------------------------

def _proc_table() -> dict[int, tuple[int, int, str, int]]:
    """pid -> (ppid, session, state, rss pages) of every process on the machine."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                table[int(name)] = (int(fields[1]), int(fields[3]), fields[0], int(fields[21]))
            except (OSError, IndexError, ValueError):
                pass
    return table


def members(root_pid: int, cgroup: Path | None) -> list[int]:
    """Live processes of a sandbox: its cgroup's, else the root's session and all their descendants (a
    process that calls setsid() and whose parent exits escapes this; the cgroup has no such hole)."""
    if cgroup:
        return _cgroup_procs(cgroup)
    if not os.path.isdir("/proc"):  # not Linux: the session leader's process group is what we know
        return []
    table = _proc_table()
    found = {pid for pid, (_, sid, state, _) in table.items() if sid == root_pid and state != "Z"}
    grew = True
    while grew:
        more = {pid for pid, (ppid, _, state, _) in table.items() if ppid in found and state != "Z"}
        grew = not more <= found
        found |= more
    return sorted(found)


def _cgroup_procs(cgroup: Path) -> list[int]:
    try:
        return [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def kill_all(find: Callable[[], set[int]], group: int | None = None) -> None:
    """Stop the processes `find()` returns (a few sweeps), then kill them all until none is left. Stopping
    first keeps the tree whole (a stopped process neither forks nor dies, so its children keep it as their
    parent): a process that left the session is still found through its parent. A tight fork loop always
    has forks in flight, so the stop sweeps are bounded and the kill sweeps finish the job."""
    stopped: set[int] = set()
    for _ in range(5):
        fresh = find() - stopped
        if not fresh:
            break
        _signal(fresh, signal.SIGSTOP)
        stopped |= fresh
    for _ in range(100):
        _signal(stopped, signal.SIGKILL)
        if group:  # where /proc is missing, the sandbox's process group is all we know
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
        stopped = find()
        if not stopped:
            return
        time.sleep(0.005)


def _signal(pids: set[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def rss_bytes(pids: Sequence[int]) -> int:
    page, total = os.sysconf("SC_PAGE_SIZE"), 0
    for pid in pids:
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
        except (OSError, IndexError, ValueError):
            pass
    return total
