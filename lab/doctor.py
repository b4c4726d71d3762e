"""`python -m lab doctor`: what this machine can run, and what to do about what it cannot.

Each check really exercises the feature (a 2-rank gloo all-reduce, a Triton kernel launch in the
interpreter, JAX's device list) rather than only importing it, because "installed" and "works" differ:
a CPU torch wheel has no NCCL, Triton needs a GPU or its interpreter, JAX needs a flag for many devices.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    hint: str = ""
    required: bool = False


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _all_reduce_rank(_: int = 0) -> float:
    import torch
    import torch.distributed as dist

    value = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(value)
    return value.item()


def _check_gloo() -> Check:
    from lab import distributed as lab_dist

    start = time.perf_counter()
    try:
        results = lab_dist.run(_all_reduce_rank, 2, timeout_s=60)
    except Exception as err:  # report any failure as a failed check, never crash the report
        return Check("gloo", False, f"2-rank all_reduce failed: {str(err).splitlines()[0]}",
                     "check that 127.0.0.1 is reachable and no firewall blocks loopback ports", required=True)
    ok = results == [3.0, 3.0]
    return Check("gloo", ok, f"2 local ranks, all_reduce -> {results} in {time.perf_counter() - start:.2f} s",
                 "" if ok else "gloo returned a wrong sum: report this", required=True)


def gpu_names() -> list[str]:
    """The GPUs' names, asked of nvidia-smi rather than torch: `torch.cuda.get_device_name` initialises CUDA in
    this process, and a process that has initialised CUDA can no longer fork ranks that use it (a notebook
    that printed its GPU could not then run `lab.distributed.run(..., backend="nccl")`)."""
    import torch

    count = torch.cuda.device_count()  # does not initialise CUDA
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.split("\n")
        names = [line.strip() for line in out if line.strip()]
    except (OSError, subprocess.SubprocessError):
        names = []
    return names[:count] if len(names) >= count else ["GPU"] * count


def _check_gpu() -> list[Check]:
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        return [Check("cuda", False, "no GPU visible: chapters run on CPU ranks with gloo; GPU-only cells "
                      "say so and are skipped", "on a GPU machine install a CUDA build of torch (README)")]
    names = gpu_names()
    gpu = Check("cuda", True, f"{len(names)} GPU(s): {', '.join(sorted(set(names)))}; CUDA {torch.version.cuda}")
    nccl = Check("nccl", dist.is_nccl_available(), "NCCL backend available" if dist.is_nccl_available()
                 else "this torch build has no NCCL", "install a CUDA build of torch with NCCL")
    return [gpu, nccl]


COMPILE_FOR = "LAB_KERNELS_COMPILE_FOR"  # lab.kernels.runtime.COMPILE_FOR, not imported: its import sets the mode
_TRITON_PROBE = """
import torch, triton
from lab import kernels  # decides the mode (compiled on a GPU, Triton's interpreter on CPU) before any kernel
from lab.kernels.add import add

x = torch.arange(100.0, device=kernels.DEVICE)
assert torch.equal(add(x, x), 2 * x), "wrong result"
print(triton.__version__, kernels.MODE)
"""

_COMPILE_PROBE = "from lab.parallel.compile import compile_works; ok, line = compile_works(); print(int(ok), line)"


def _start_compile_probe() -> subprocess.Popen:
    """torch.compile (inductor) of a tiny function, in a fresh interpreter (what `lab.train --compile auto` asks
    on a GPU): C++ built for the CPU, or Triton for the GPU. Apart, so that the report never initialises CUDA in
    this process (which could then no longer fork ranks that use it); started first and read last, because
    inductor's first compile in a process takes seconds to tens of seconds."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, "-c", _COMPILE_PROBE], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": path})


def _check_compile(probe: subprocess.Popen) -> Check:
    try:
        out, err = probe.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        probe.kill()
        out, err = "", "timed out after 300 s"
    works = probe.returncode == 0 and out.startswith("1 ")
    line = out.strip()[2:] if probe.returncode == 0 else \
        f"torch.compile fails (inductor): {(err.strip().splitlines() or ['no output'])[-1]}"
    return Check("compile", works, line, "" if works else "lab.train runs eagerly (--compile eager); inductor "
                 "needs a C++ compiler (gcc) on a CPU, Triton on a GPU")


_JAX_PROBE = "import jax; print(jax.__version__, jax.device_count(), jax.default_backend())"


def _probe(code: str, env: dict[str, str]) -> tuple[bool, str]:
    """Run `code` in a fresh interpreter: Triton's interpreter flag and JAX's device count must be set
    before import, and a crash there must not take the notebook kernel down."""
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "probe.py")  # triton.jit needs its source in a real file
        with open(script, "w") as f:
            f.write(code)
        try:
            done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120,
                                  env={**os.environ, **env})
        except subprocess.TimeoutExpired:
            return False, "timed out after 120 s"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return False, last
    return True, done.stdout.strip()


def _check_triton() -> Check:
    if _version("triton") is None:
        return Check("triton", False, "not installed (chapter 09 kernels fall back to PyTorch)",
                     "pip install -e '.[triton]'")
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # lab, even if not pip-installed
    # the probe runs a kernel, which a compile-only process refuses: it is probed without that mode, and told apart
    ok, out = _probe(_TRITON_PROBE, {"PYTHONPATH": os.pathsep.join(filter(None, [package_root,
                                                                                 os.environ.get("PYTHONPATH")])),
                                     COMPILE_FOR: ""})
    if not ok:
        return Check("triton", False, f"lab.kernels' vector add failed: {out}",
                     "reinstall triton (pip install -e '.[triton]')")
    version, mode = out.split()
    where = "compiled for the GPU" if mode == "compiled" else "in Triton's interpreter on the CPU (TRITON_INTERPRET=1)"
    detail = f"triton {version}: lab.kernels run {where}"
    if arch := os.environ.get(COMPILE_FOR):
        detail += (f"; but {COMPILE_FOR}={arch} is set in this shell, where they are only compiled for {arch}, "
                   f"never run (lab.kernels.cross_compile's mode): unset it to run them")
    return Check("triton", True, detail)


def _check_jax() -> Check:
    if _version("jax") is None:
        return Check("jax", False, "not installed (the JAX cells of chapter 02 are skipped)",
                     "pip install -e '.[jax]'")
    ok, out = _probe(_JAX_PROBE, {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    if not ok:
        return Check("jax", False, f"jax failed to start: {out}", "pip install -e '.[jax]'")
    version, count, backend = out.split()
    return Check("jax", True, f"jax {version}: {count} simulated {backend} devices")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _check_packages(name: str, packages: list[str], extra: str) -> Check:
    missing = [p for p in packages if _version(p) is None]
    found = ", ".join(f"{p} {_version(p)}" for p in packages if p not in missing)
    if missing:
        return Check(name, False, f"missing: {', '.join(missing)}", f"pip install -e '.[{extra}]'")
    return Check(name, True, found)


def _check_browser() -> Check:
    chromium = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
    playwright = _version("playwright")
    ok = bool(chromium and playwright)
    detail = f"chromium at {chromium}, playwright {playwright}" if ok else (
        f"chromium: {chromium or 'not found'}, playwright: {playwright or 'not installed'} "
        "(only the browser test lane needs them)")
    return Check("browser tests", ok, detail, "" if ok else "apt-get install chromium; pip install -e '.[test]'")


def _check_grading() -> list[Check]:
    """What confinement the grading sandbox gets here (`lab.check` and `python -m lab grade` use it): Landlock,
    the network layer, a pids cgroup, and whether a sandboxed child starts and answers at all."""
    from lab.grading.confine import isolation
    from lab.grading.sandbox import ExerciseError, Limits, Sandbox

    layers = isolation()
    abi = layers["landlock_abi"]
    if abi >= 6:
        landlock = Check("landlock", True, f"ABI {abi}: student code reads only system and Python files, writes only "
                         f"its own folder, and cannot signal the grader")
    elif abi:
        landlock = Check("landlock", False, f"ABI {abi}: files are confined, but student code may signal this user's "
                         f"processes (signal scoping needs ABI >= 6)", "grade on Linux >= 6.12")
    else:
        landlock = Check("landlock", False, "not available: student code can read and write every file this user "
                         "can (python -m lab grade warns, and refuses with --strict)",
                         "grade on Linux >= 6.12 with Landlock enabled (the lsm= boot parameter lists landlock)")
    how = layers["network"]
    if how in ("namespace", "user namespace"):
        way = "made as root" if how == "namespace" else "through a user namespace"
        network = Check("network", True, f"each sandbox gets a network namespace of its own ({way}): its ranks meet "
                        f"on its own loopback; this machine's services, other hosts and UDP are out of reach")
    else:
        network = Check("network", False, ("no namespace can be made: a seccomp filter refuses internet sockets to "
                                           "exercises without ranks, but multi-rank exercises' code can reach this "
                                           "machine's loopback and other hosts" if how == "seccomp" else
                                           "neither a namespace nor a seccomp filter can be made: graded code has the "
                                           "network") + " (python -m lab grade warns, and refuses with --strict)",
                        "grade as root, or where unprivileged user namespaces are allowed "
                        "(sysctl kernel.unprivileged_userns_clone=1; on Ubuntu also "
                        "kernel.apparmor_restrict_unprivileged_userns=0)")
    if layers["pids_cgroup"]:
        pids = Check("pids cgroup", True, "the kernel caps each sandbox's tasks (a fork bomb stops at the limit)")
    else:
        pids = Check("pids cgroup", False, "none can be created: a fork bomb is stopped by RLIMIT_NPROC and the "
                     "grader's watchdog" + (" alone (RLIMIT_NPROC does not bind root)" if layers["root"] else ""),
                     "grade as root in a container or VM, or in a delegated cgroup v2 "
                     "(systemd-run --user --scope -p Delegate=yes ...)")
    start = time.perf_counter()
    try:
        with Sandbox([("doctor", "def ping(x):\n    return x + 1\n")], entry=["ping"], modules=["lab.config"],
                     packages=["tomli_w"], limits=Limits(wall_s=30)) as box:
            answer = box.call("ping", 41)
        sandbox = Check("sandbox", answer == 42, f"a sandboxed child started and answered in "
                        f"{time.perf_counter() - start:.2f} s" + (" as root, without capabilities" if layers["root"]
                                                                   else ""),
                        "" if answer == 42 else "the sandbox answered wrongly: report this", required=True)
    except (ExerciseError, OSError) as error:
        sandbox = Check("sandbox", False, f"a sandboxed child failed: {error}",
                        "lab.check and python -m lab grade need it: report this with the output of python -m lab "
                        "doctor", required=True)
    return [landlock, network, pids, sandbox]


GRADING = ("landlock", "network", "pids cgroup", "sandbox")  # the checks of `_check_grading`, in order


def run_checks() -> list[Check]:
    import torch

    compile_probe = _start_compile_probe()
    py_ok = sys.version_info >= (3, 10)
    checks = [
        Check("python", py_ok, f"{platform.python_version()} on {platform.system()} {platform.machine()}",
              "" if py_ok else "use Python 3.10 or newer", required=True),
        Check("torch", True, f"torch {torch.__version__}, numpy {_version('numpy')}, lab {_version('ultrascale-lab')}",
              required=True),
        Check("cpu", True, f"{os.cpu_count()} cores, torch uses {torch.get_num_threads()} threads"),
    ]
    checks.append(_check_gloo())
    checks.extend(_check_gpu())
    checks.append(_check_packages("notebooks", ["jupyterlab", "ipywidgets", "matplotlib", "nbclient"], "course"))
    checks.append(_check_triton())
    checks.append(_check_jax())
    checks.append(_check_browser())
    grading = _check_grading()
    checks.append(_check_compile(compile_probe))  # read last: it ran beside the checks above
    return checks + grading


def format_report(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = ["Ultra-Scale Lab environment report"]
    for c in checks:
        if c.name == GRADING[0]:
            lines.append("  Grading sandbox (lab.check, python -m lab grade): the confinement this machine gives")
        mark = "ok " if c.ok else ("ERR" if c.required else "-- ")
        lines.append(f"  [{mark}] {c.name:<{width}}  {c.detail}")
        if c.hint and not c.ok:
            lines.append(f"        {'':<{width}}  fix: {c.hint}")
    bad = [c.name for c in checks if c.required and not c.ok]
    lines.append("Everything the course needs works." if not bad else f"Not ready: {', '.join(bad)} failed.")
    return "\n".join(lines)


def print_report() -> bool:
    """Print the report; return True when every required check passed."""
    checks = run_checks()
    print(format_report(checks))
    return all(c.ok for c in checks if c.required)


def main(argv: list[str] | None = None) -> int:
    return 0 if print_report() else 1
