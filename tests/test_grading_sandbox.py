"""Adversarial submissions: each tampers with the exercise 01.mfu (nothing builds on it) of an otherwise perfect
notebook. Every one must score 0 on 01.mfu with a clear reason, full marks elsewhere, the whole class must
still be graded, and no process of any sandbox may outlive the grading."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat
import psutil
import pytest

from lab.grading import checks
from lab.grading.assignments import Assignment
from lab.grading.confine import isolation
from lab.grading.grade import grade_all, reference_checksums
from lab.grading.notebook import is_answer, is_locked
from lab.grading.runner import run_exercise

REPO = Path(__file__).resolve().parents[1]
SOLUTION = REPO / "solutions" / "01_memory_and_compute.ipynb"
CHECK_SOURCE = REPO / "lab" / "grading" / "checks" / "ch01.py"
RIGHT = ("def mfu(cfg, seq_len, tokens, step_time_s, n_gpus, peak):\n"
         "    return (6 * param_count(cfg) + 12 * cfg.n_layers * cfg.d_model * seq_len) * tokens / "
         "(step_time_s * n_gpus * peak)\n")
WRONG = "def mfu(*args):\n    return 0.0\n"

# Chapter 01's torch-free exercises: every case of the class grades them all, and its torch exercises would only
# make the class slower to grade, not the attacks harder to catch.
TORCH_FREE = ("01.param_count", "01.state_bytes", "01.activation_bytes", "01.max_micro_batch", "01.mfu")

CASES = {  # name: (mfu cell source, words the reason or message must contain)
    "reads_a_solution_file": (f"import json\nnb = json.load(open({str(SOLUTION)!r}))\n"
                              "exec(''.join(c['source'] for c in nb['cells'] if 'mfu' in c['metadata'].get('lab', {})"
                              ".get('exercise', '') and 'points' in c['metadata']['lab']))\n", "Permission denied"),
    "imports_the_checks": ("import lab.grading.checks.ch01 as ch01\n" + RIGHT, "No module named 'lab.grading'"),
    "patches_the_checker_file": (f"try:\n    open({str(CHECK_SOURCE)!r}, 'a').write('\\nexpect_close = print\\n')\n"
                                 "except OSError:\n    pass\n" + WRONG, "returned 0.0"),
    "monkeypatches_builtins": ("import builtins, json\nbuiltins.isinstance = lambda *a: True\n"
                               "json.dumps = lambda *a, **k: '{\"id\": 0, \"value\": 1}'\n"
                               "class Anything(float):\n    def __eq__(self, other): return True\n"
                               "def mfu(*args):\n    return Anything(0.0)\n", "tampered"),
    "returns_an_object_equal_to_everything": ("class Anything:\n    def __eq__(self, other): return True\n"
                                              "def mfu(*args):\n    return Anything()\n", "cannot be graded"),
    "prints_a_fake_score": ("print('Score: 16 / 16 points')\nprint('{\"score\": 16}')\n" + WRONG, "returned 0.0"),
    "writes_a_fake_results_file": ("import json, os\nfor path in ('results.json', '/autograder/results/results.json',"
                                   " os.path.expanduser('~/grades.csv')):\n    try:\n"
                                   "        open(path, 'w').write(json.dumps({'score': 16}))\n"
                                   "    except OSError:\n        pass\n" + WRONG, "returned 0.0"),
    "forges_channel_answers": ("import os\nfor fd in range(3, 64):\n    try:\n"
                               "        os.write(fd, b'{\"id\": 0, \"value\": 0.5}\\n{\"id\": 1, \"value\": 0.5}\\n')\n"
                               "    except OSError:\n        pass\n" + WRONG, "tampered"),
    "renamed_the_function": (RIGHT.replace("def mfu(", "def model_flops_utilisation("), "does not define mfu"),
    "calls_sys_exit": ("import sys\nsys.exit(0)\n" + RIGHT, "sys.exit"),
    "exits_the_process": ("import os\n" + RIGHT.replace("    return", "    os._exit(3)\n    return"), "exited"),
    "crashes_the_interpreter": ("import ctypes\n" + RIGHT.replace("    return", "    ctypes.string_at(0)\n    return"),
                                "SIGSEGV"),
    "loops_forever": ("def mfu(*args):\n    while True:\n        pass\n", "within|CPU time"),
    "forks_without_end": ("import os\ndef mfu(*args):\n    while True:\n        try:\n            os.fork()\n"
                          "        except OSError:\n            pass\n", "fork bomb"),
    "eats_memory": ("hog = []\nwhile True:\n    hog.append(bytearray(50 << 20))\n" + RIGHT, "MemoryError"),
    "kills_the_grader": ("import os, signal\n" + RIGHT.replace("    return", "    os.kill(os.getppid(), signal.SIGKILL)"
                                                                "\n    return"), "Operation not permitted"),
    "leaves_an_orphan": ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                         "        time.sleep(600)\n    os._exit(0)\n" + WRONG, "returned 0.0"),
}


def _notebook(case: str) -> dict:
    nb = nbformat.read(SOLUTION, as_version=4)
    if case == "edits_a_locked_cell":
        next(c for c in nb.cells if is_locked(c, "01.mfu")).source += "\nAnswers are optional."
    elif case == "deletes_the_cell":
        nb.cells = [c for c in nb.cells if not is_answer(c, "01.mfu")]
    elif case == "strips_the_metadata":
        for cell in nb.cells:
            if is_answer(cell, "01.mfu"):
                del cell.metadata["lab"]
    elif case != "honest":
        next(c for c in nb.cells if is_answer(c, "01.mfu")).source = CASES[case][0]
    return nb


needs_landlock = pytest.mark.skipif(
    isolation()["landlock_abi"] < 6, reason="tamper-proof grading needs Landlock ABI >= 6 (Linux >= 6.12); this "
    f"kernel has ABI {isolation()['landlock_abi']}, and python -m lab grade warns that it cannot confine files")

STRUCTURAL = {"edits_a_locked_cell": "locked cell", "deletes_the_cell": "no cell with metadata",
              "strips_the_metadata": "no cell with metadata"}


@needs_landlock
def test_adversarial_class(tmp_path):
    """The whole class is graded in one run (2 jobs), as an instructor would; then each case is judged."""
    for case in ["honest", *CASES, *STRUCTURAL]:
        nbformat.write(_notebook(case), tmp_path / f"{case}.ipynb")
    (tmp_path / "not_json.ipynb").write_text("{ this is not a notebook")
    old_tempdir, check_source = tempfile.tempdir, CHECK_SOURCE.read_bytes()
    tempfile.tempdir = str(tmp_path)  # every sandbox directory (so every sandbox's command line) is under tmp_path
    try:
        work = Assignment("adversarial", "chapter 01 without torch", TORCH_FREE)  # attacks on 01.mfu; the rest whole
        plan = sorted((p.stem, p, work) for p in tmp_path.glob("*.ipynb"))
        results = {r.student: r for r in grade_all(plan, jobs=2, progress=False, wall_s=10,
                                                    locked=reference_checksums(REPO / "solutions"),
                                                    protect=[str(tmp_path)])}
    finally:
        tempfile.tempdir = old_tempdir
    survivors = [p.info for p in psutil.process_iter(["pid", "cmdline", "status"])
                 if str(tmp_path) in " ".join(p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE]
    assert not survivors, f"processes left behind: {survivors}"
    assert CHECK_SOURCE.read_bytes() == check_source and not (REPO / "results.json").exists()
    assert results["honest"].total == results["honest"].max_points == 14
    broken = results["not_json"]
    assert broken.total == 0 and all("not valid JSON" in e.reason for e in broken.exercises)
    wrong = []
    for case in [*CASES, *STRUCTURAL]:
        by_id = {e.id: e for e in results[case].exercises}
        mfu = by_id.pop("01.mfu")
        words = CASES[case][1] if case in CASES else STRUCTURAL[case]
        text = " | ".join([mfu.reason, *(c.message for c in mfu.checks)])
        if mfu.points != 0 or not any(w in text for w in words.split("|")):
            wrong.append(f"{case}: {mfu.points} points on 01.mfu; expected {words!r} in: {text}")
        lost = {e.id: e.reason or [c.message for c in e.checks if c.status != "passed"]
                for e in by_id.values() if e.points != e.max_points}
        if lost:
            wrong.append(f"{case}: cost other exercises points: {lost}")
    assert not wrong, "\n".join(wrong)


@needs_landlock
def test_isolation_layers_of_this_machine():
    """The layers the instructor guide promises, all present (a pids cgroup needs root or a delegated one)."""
    layers = isolation()
    assert layers["landlock_abi"] >= 6 and (layers["pids_cgroup"] or not layers["root"]), layers


def test_a_hung_collective_names_the_rank_and_a_good_one_passes():
    """Multi-rank exercises run their ranks through lab.distributed.run inside the sandbox."""
    ex = checks.load_file(REPO / "tests" / "fixtures" / "grading" / "checks_ranks.py")[0]
    good = ("import torch\nimport torch.distributed as dist\n\ndef rank_sum(x):\n"
            "    t = torch.tensor([float(x * (dist.get_rank() + 1))])\n"
            "    dist.all_reduce(t)\n    return int(t.item())\n")
    hang = good.replace("    dist.all_reduce(t)\n",  # rank 1 never joins the collective
                        "    if dist.get_rank() == 1:\n        __import__('time').sleep(600)\n    dist.all_reduce(t)\n")
    assert run_exercise(ex, [("99.rank_sum", good)], wall_s=60).points == 2
    hung = run_exercise(ex, [("99.rank_sum", hang)], wall_s=15)
    message = hung.checks[0].message
    assert hung.points == 0 and ("never joined" in message or "did not finish" in message) and "[1]" in message


def test_a_deadlock_on_ranks_says_which_rank_waits_in_which_operation():
    """The sandbox keeps an error's first line, plus the flight recorder's "collectives:" lines (bounded), so that
    a check can say which rank hung in which send or receive (ch06's 1F1B deadlock) and not only that one timed out.
    In process: `_failure` is what the sandbox child answers a failed call with."""
    from lab.distributed import RankError, RankTimeout
    from lab.grading import sandbox_child

    gloo = "RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 3000ms for send operation"
    diagnosis = ("collectives: rank 0 failed in send #2 to rank 1 on world; rank 1 failed in send #1 to rank 0 on "
                 "world")
    crash = RankError(f"rank 0 failed: {gloo}\n{diagnosis}", 0, "Traceback (most recent call last):\n  File ...\n"
                      "rank 0's last collectives:\n  send #2 to rank 1 on world: failed float32 [2, 3]\n")
    error = sandbox_child._failure(crash, "answer.py")["error"]
    assert error == f"RankError: rank 0 failed: {gloo}\n{diagnosis}", error  # nothing of the traceback
    stuck = RankTimeout("rank(s) [0, 1] did not finish within timeout_s=8 s\n" + "\n".join(
        f"collectives: rank {r} is in send #{r + 1} to rank {1 - r} on world {'x' * 300}" for r in range(2)), [0, 1])
    error = sandbox_child._failure(stuck, "answer.py")["error"]
    first, rest = error.split("\n", 1)
    assert first.endswith("timeout_s=8 s") and rest.startswith("collectives: rank 0 is in send #1") and len(rest) == 500
    assert sandbox_child._failure(ValueError("bad\nsecond line"), "answer.py")["error"] == "ValueError: bad"


def test_a_crash_on_a_rank_is_located_like_one_in_a_single_process():
    """A rank that raises names its cell and line, as a single-process exercise does; the check's fixed hint (written
    for a wrong answer) gives way to one about the crash."""
    from lab.grading.checks import CRASH_HINT

    ex = checks.load_file(REPO / "tests" / "fixtures" / "grading" / "checks_ranks.py")[0]
    crash = ("import torch\nimport torch.distributed as dist\n\ndef rank_sum(x):\n"
             "    t = torch.tensor([float(x * (dist.get_rank() + 1))])\n"
             "    if dist.get_rank() == 1:\n        t.main_grad += 1\n"
             "    dist.all_reduce(t)\n    return int(t.item())\n")
    ranks, = run_exercise(ex, [("99.rank_sum (cell 3)", crash)], wall_s=30).checks
    assert "rank 1 failed: AttributeError" in ranks.message, ranks.message
    assert ranks.message.endswith("(in 99.rank_sum (cell 3) line 7: t.main_grad += 1)"), ranks.message
    assert ranks.hint == CRASH_HINT
    single, = run_exercise(checks.get("01.param_count"), [("01.param_count (cell 3)", "def param_count(cfg):\n"
                                                           "    return cfg.n_kv_head\n")]).checks[:1]
    assert single.message.endswith("(in 01.param_count (cell 3) line 2: return cfg.n_kv_head)"), single.message
    assert single.hint == CRASH_HINT


def test_student_output_is_kept_for_the_learner_but_never_graded():
    ex = checks.get("01.state_bytes")
    source = "print('Score: 3 / 3 points')\ndef model_state_bytes(n, precision='mixed', fp32_grad_accum=False):\n" \
             "    print('computing', n)\n    return 0\n"
    result = run_exercise(ex, [("cell", source)])
    assert result.points == 0 and "Score: 3 / 3 points" in result.output and "computing" in result.output


def test_without_a_pids_cgroup_the_process_tree_is_still_found(tmp_path, monkeypatch):
    """On machines where no pids cgroup can be made, the sandbox is its session and its descendants (the
    child is a subreaper): a fork bomb and a process that left the session both die with the sandbox."""
    from lab.grading import sandbox

    monkeypatch.setattr(sandbox, "make_cgroup", lambda max_tasks: None)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ex = checks.get("01.state_bytes")
    bomb = "import os\ndef model_state_bytes(*args):\n    while True:\n        try:\n            os.fork()\n" \
           "        except OSError:\n            pass\n"
    escape = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(600)\n" \
             "    os._exit(0)\ntime.sleep(0.3)\ndef model_state_bytes(*args):\n    return 0\n"
    assert "fork bomb" in run_exercise(ex, [("bomb", bomb)], wall_s=10).checks[0].message  # the call's verdict
    assert run_exercise(ex, [("escape", escape)], wall_s=10).points == 0
    survivors = [p.info for p in psutil.process_iter(["pid", "cmdline", "status"])
                 if str(tmp_path) in " ".join(p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE]
    assert not survivors, f"processes left behind: {survivors}"


def test_sandboxes_of_a_killed_grader_are_reaped_by_the_next_one():
    from lab.grading.confine import make_cgroup

    fresh = make_cgroup(8)
    if fresh is None:
        return  # no pids cgroup on this machine: nothing is left in one either
    fresh.rmdir()
    stale = fresh.parent / "lab-sandbox-999999999-0"  # a grader pid that does not exist
    stale.mkdir()
    orphan = subprocess.Popen(["sleep", "600"])
    (stale / "cgroup.procs").write_text(str(orphan.pid))
    make_cgroup(8).rmdir()
    assert orphan.wait(timeout=10) == -9 and not stale.exists()


# --- what Landlock's read-only rules really forbid -----------------------------------------------------------

PROBE = '''import errno, os


def _errno(action):
    try:
        action()
    except OSError as error:
        return errno.errorcode.get(error.errno, str(error.errno))
    return "allowed"


def probe(targets):
    """For each read-only place: try to write, truncate, create, make a folder, delete and rename there."""
    import lab.config

    targets = {"the answer module": [__file__, __file__], "the copied lab": [lab.config.__file__] * 2, **targets}
    out = {}
    for place, (existing, victim) in targets.items():
        folder = os.path.dirname(existing)
        size = os.path.getsize(existing)
        out[place] = {
            "write": _errno(lambda: open(existing, "a").close()),  # opening for writing is the test: nothing is written
            "truncate": _errno(lambda: os.truncate(existing, size)),  # to its own size: no change if it were allowed
            "create": _errno(lambda: open(os.path.join(folder, "planted.py"), "x").close()),
            "mkdir": _errno(lambda: os.mkdir(os.path.join(folder, "planted"))),
            "delete": _errno(lambda: os.unlink(victim)),
            "rename": _errno(lambda: os.rename(victim, victim + ".moved")),
        }
    return out
'''


@pytest.mark.skipif(isolation()["landlock_abi"] < 1, reason="Landlock is not available on this kernel: the sandbox "
                    "cannot make any path read-only here (python -m lab grade warns so)")
def test_read_only_paths_refuse_every_write(tmp_path):
    """Every path the sandbox may only read — the answer module, the copied `lab`, the interpreter's standard
    library, an allowed package — refuses writing, truncating, creating, making a folder, deleting and renaming
    with EACCES: a student who could write there could rewrite code that the sandbox itself runs."""
    import sysconfig

    import tomli_w

    from lab.grading.sandbox import Limits, Sandbox

    victims = {}  # files we may lose if a rule is wrong: made for the purpose, removed afterwards
    for place, folder in (("the interpreter's library", sysconfig.get_paths()["stdlib"]),
                          ("an allowed package", os.path.dirname(tomli_w.__file__))):
        victims[place] = Path(folder) / f"lab-landlock-probe-{os.getpid()}.txt"
        victims[place].write_text("probe\n")
    targets = {"the interpreter's library": [os.__file__, str(victims["the interpreter's library"])],
               "an allowed package": [tomli_w.__file__, str(victims["an allowed package"])]}
    try:
        with Sandbox([("probe", PROBE)], entry=["probe"], modules=["lab.config"], packages=["tomli_w"],
                     limits=Limits(wall_s=30)) as box:
            got = box.call("probe", targets)
    finally:
        for victim in victims.values():
            for path in (victim, victim.with_name(victim.name + ".moved")):
                path.unlink(missing_ok=True)
        planted = [p for v in victims.values() for p in (v.parent / "planted.py", v.parent / "planted") if p.exists()]
        for path in planted:
            path.rmdir() if path.is_dir() else path.unlink()
    assert not planted, f"the sandbox created {planted}"
    assert set(got) == {"the answer module", "the copied lab", *targets}
    wrong = {f"{place}: {action}": result for place, actions in got.items() for action, result in actions.items()
             if result != "EACCES"}
    assert not wrong, f"expected EACCES everywhere, got {wrong}"


# --- warm start: sandboxes forked by a zygote behave as cold-started ones ----------------------------------------

WARM_PROBE = '''import os, signal


def probe(secret_path):
    open_fds = []
    stack = os.stat("lab-stack.txt").st_ino  # the file the child dumps a call that overran its time to
    for fd in range(1024):
        try:
            if os.fstat(fd).st_ino != stack:
                open_fds.append(fd)
        except OSError:
            pass
    try:
        open(secret_path).read()
        secret = "read"
    except OSError as error:
        secret = type(error).__name__
    try:
        os.kill(os.getppid(), 0)  # the grader (cold) or the zygote (warm): outside the sandbox's Landlock domain
        parent = "reachable"
    except OSError as error:
        parent = type(error).__name__
    return {"fds": open_fds, "secret": secret, "parent": parent, "own_session": os.getsid(0) == os.getpid(),
            "cwd": os.path.basename(os.getcwd()), "env": sorted(os.environ)}


def spin():
    while True:
        pass


def leave(code):
    os._exit(code)


def stdlib():
    import wave  # not imported by the zygote: found by listing the standard library's directory

    return wave.__name__
'''


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_a_warm_sandbox_is_confined_and_judged_like_a_cold_one(warm):
    """A child forked by a zygote holds only its stdio, its answer pipe and its stack file (not the zygote's socket
    or pidfds), is locked down (a protected file cannot be read, its parent cannot be signalled), and the grader
    still learns its exit status and CPU time: a CPU-time overrun is reported as such. Warm sandboxes here use a
    cheap package (tomli_w) instead of torch: the zygote does the same for any package set."""
    from lab.grading.sandbox import ExerciseError, Limits, Sandbox

    def box(limits: Limits) -> Sandbox:
        return Sandbox([("probe", WARM_PROBE)], entry=["probe"], modules=["lab.config"], packages=["tomli_w"],
                       limits=limits, warm=warm)

    landlock = isolation()["landlock_abi"]
    with box(Limits(wall_s=30)) as sandbox:
        got = sandbox.call("probe", str(CHECK_SOURCE))
        assert len(got["fds"]) == 4 and got["fds"][:3] == [0, 1, 2], got["fds"]
        assert got["own_session"] and got["cwd"] == "work" and "PATH" in got["env"] and len(got["env"]) == 6
        assert got["secret"] == ("PermissionError" if landlock else "read"), got
        assert got["parent"] == ("PermissionError" if landlock >= 6 else "reachable"), got
        with pytest.raises(ExerciseError, match="status 3"):
            sandbox.call("leave", 3)
        assert sandbox.proc.returncode == 3
    touched = Path(os.__file__).parent / f"lab-zygote-probe-{os.getpid()}"  # the stdlib directory changes
    touched.write_text("")
    touched.unlink()
    with box(Limits(wall_s=30, cpu_s=1)) as sandbox:
        assert sandbox.call("stdlib") == "wave"
        with pytest.raises(ExerciseError, match="more than 1 s of CPU"):
            sandbox.call("spin")


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_the_standard_library_stays_importable_when_its_directory_changes_under_a_running_sandbox(warm):
    """Landlock lets a sandbox open the standard library's files but not list its directory. Python lists a directory
    again when its mtime changes, so a file created and removed there by another process (another sandbox's test,
    a package install) once made every standard module the student had not yet imported vanish mid-run."""
    from lab.grading.sandbox import Limits, Sandbox

    with Sandbox([("probe", WARM_PROBE)], entry=["probe"], modules=["lab.config"], packages=["tomli_w"],
                 limits=Limits(wall_s=30), warm=warm) as sandbox:
        sandbox.call("probe", str(CHECK_SOURCE))  # locked down, answering
        touched = Path(os.__file__).parent / f"lab-listing-probe-{os.getpid()}"
        touched.write_text("")
        touched.unlink()
        assert sandbox.call("stdlib") == "wave"


GRADER = '''import os, sys, time
from lab.grading.sandbox import Limits, Sandbox

cell = "import os, time\\ndef pids():\\n    kid = os.fork()\\n    if kid == 0:\\n        time.sleep(600)\\n" \\
       "        os._exit(0)\\n    return [os.getpid(), os.getppid(), kid]\\n"
box = Sandbox([("cell", cell)], entry=["pids"], modules=["lab.config"], packages=["tomli_w"], limits=Limits(),
              warm=True)
box.start()
print(*box.call("pids"), box.root, box.proc.zygote.root, flush=True)  # the directories: a killed grader leaves them
time.sleep(600)
'''


def test_a_killed_grader_leaves_no_warm_sandbox_behind():
    """SIGKILL the grader: its zygote dies with it (PR_SET_PDEATHSIG on the thread that started it), the
    sandbox child dies with the zygote, and the child's own children with the child's cgroup or session."""
    grader = subprocess.Popen([sys.executable, "-c", GRADER], stdout=subprocess.PIPE, text=True, cwd=REPO)
    *pids, sandbox_root, zygote_root = grader.stdout.readline().split()
    child, zygote, kid = map(int, pids)
    grader.kill()
    grader.wait()
    for root in (sandbox_root, zygote_root):
        shutil.rmtree(root)
    from lab.grading.confine import make_cgroup

    fresh = make_cgroup(8)  # as the next grader does: kill what is left in the killed grader's cgroups
    if fresh is not None:
        fresh.rmdir()
    gone = []
    for pid in (zygote, child, kid):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.TimeoutExpired):
            psutil.Process(pid).wait(timeout=10)
        gone.append(not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    assert gone[:2] == [True, True], f"zygote {zygote} or sandbox {child} outlived the killed grader"
    if fresh is not None:  # the sandbox's own children: the next grader reaps the killed one's cgroups
        assert gone[2], f"sandbox child {kid} outlived the killed grader"


def test_the_zygote_outlives_the_thread_that_started_it():
    """PR_SET_PDEATHSIG fires when the thread that started the zygote ends: grade_all's pool threads end, the
    grader goes on, so the zygote must not be started from them (a zygote of its own: psutil, cheap to import)."""
    from concurrent.futures import ThreadPoolExecutor

    from lab.grading.sandbox import _zygote

    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(lambda: _zygote(("psutil", "tomli_w")).proc.pid).result()
    with contextlib.suppress(psutil.TimeoutExpired):  # a SIGKILL from PR_SET_PDEATHSIG would land now
        psutil.Process(first).wait(timeout=0.5)
    assert _zygote(("psutil", "tomli_w")).proc.pid == first, "the zygote died with its starting thread"


def test_a_failed_check_names_where_each_hung_rank_waited():
    """Any chapter's check that reports ranks which raised (`checks.explain`) keeps the recorder's diagnosis: which
    rank waited in which send or receive — not only the first rank's timeout."""
    from lab.grading.checks import explain
    from lab.grading.sandbox import CallError

    hung = CallError("RankError rank 0 failed: RuntimeError: Timed out waiting 3000ms for send operation to complete\n"
                     "collectives: rank 0 failed in send #1 to rank 1 on world; rank 1 failed in send #1 to rank 0 on "
                     "world\ncollectives: rank 1 failed in send #1 to rank 0 on world", "", False, "")
    message = str(explain(hung, "run(...) on 2 ranks", "every rank to finish"))
    assert "rank 0 failed in send #1 to rank 1" in message and message.count("rank 1 failed in send #1") == 1
    assert message.endswith("expected every rank to finish")
