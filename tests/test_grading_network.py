"""The adversarial battery's network cases: graded code reaches nothing outside its sandbox.

Each case runs a submission against listeners on the grading host's loopback — where a course server, an
instructor's notebook or an "oracle" answering with the course's own calculator would sit. Each has a control:
the same submission with the sandbox's network layers planted away (`NETWORK_LAYERS = ()`) reaches the listener,
which shows the listener works and so that the case would go red on a sandbox without its namespace.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.grading import checks, sandbox
from lab.grading.confine import isolation, network_layer
from lab.grading.notebook import answer_parts, read
from lab.grading.runner import NETWORK_HINT, run_exercise
from lab.grading.sandbox import CallError, Limits, Sandbox

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = isolation()["network"] in ("namespace", "user namespace")
needs_namespace = pytest.mark.skipif(not NAMESPACE, reason="no network namespace can be made on this machine (python "
                                     "-m lab doctor says why): python -m lab grade warns, and refuses with --strict")
SOLO = {"modules": ["lab.config"], "packages": ["tomli_w"]}  # an exercise without ranks (starts cold)
RANKS = {"modules": ["lab.config", "lab.distributed"], "packages": ["tomli_w", "torch"]}  # with ranks (warm)


class Listeners:
    """A TCP and a UDP socket on the grading host's 127.0.0.1 that note whatever reaches them. The TCP side answers
    each line (a JSON [function, args]) with `oracle(function, args)`, as a server outside the sandbox would."""

    def __init__(self, oracle=lambda name, args: None) -> None:
        self.tcp, self.udp = socket.socket(), socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for sock in (self.tcp, self.udp):
            sock.bind(("127.0.0.1", 0))
            sock.settimeout(0.1)
        self.tcp.listen()
        self.tcp_port, self.udp_port = self.tcp.getsockname()[1], self.udp.getsockname()[1]
        self.received: list[bytes] = []
        self.oracle, self.stop = oracle, threading.Event()
        self.threads = [threading.Thread(target=self._serve_tcp, daemon=True),
                        threading.Thread(target=self._serve_udp, daemon=True)]
        for thread in self.threads:
            thread.start()

    def _serve_tcp(self) -> None:
        while not self.stop.is_set():
            try:
                connection, _ = self.tcp.accept()
            except OSError:
                continue
            with connection, connection.makefile("rwb") as stream:
                for line in stream:
                    self.received.append(line)
                    name, args = json.loads(line)
                    stream.write(json.dumps(self.oracle(name, args)).encode() + b"\n")
                    stream.flush()

    def _serve_udp(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(OSError):
                self.received.append(self.udp.recvfrom(1 << 16)[0])

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=5)
        self.tcp.close()
        self.udp.close()


@pytest.fixture
def listeners() -> Iterator[Listeners]:
    server = Listeners()
    try:
        yield server
    finally:
        server.close()


def _leaky_cell(listeners: Listeners) -> str:
    """A cell whose functions send this process's environment to the host's listeners, by TCP and by UDP."""
    return (f"import json, os, socket\n"
            f"def tcp():\n"
            f"    with socket.create_connection(('127.0.0.1', {listeners.tcp_port}), timeout=5) as s:\n"
            f"        s.sendall(json.dumps(['env', dict(os.environ)]).encode() + b'\\n')\n"
            f"        return s.makefile().readline() and 'sent'\n"
            f"def udp():\n"
            f"    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:\n"
            f"        s.sendto(json.dumps(['env', dict(os.environ)]).encode(), ('127.0.0.1', {listeners.udp_port}))\n"
            f"    return 'sent'\n")


def _tries(box: Sandbox, fn: str, **kwargs) -> str:
    try:
        return repr(box.call(fn, **kwargs))
    except CallError as error:
        return str(error)


def _wait_for_udp(listeners: Listeners) -> None:
    for _ in range(20):  # a datagram that got out arrives within a few ms: give it 0.5 s
        if listeners.received:
            return
        threading.Event().wait(0.025)


@needs_namespace
@pytest.mark.parametrize("kind", ["solo", "ranks"])
def test_the_host_loopback_receives_nothing(kind, listeners):
    """TCP and UDP to the grading host's listeners, from one process and from each of two ranks."""
    options, world = (SOLO, {}) if kind == "solo" else (RANKS, {"world_size": 2})
    with Sandbox([("cell", _leaky_cell(listeners))], entry=["tcp", "udp"], limits=Limits(wall_s=60, memory_mb=4096),
                 **options) as box:
        said = {fn: _tries(box, fn, **world) for fn in ("tcp", "udp")}
        assert box.network_layer in ("namespace", "user namespace")
    _wait_for_udp(listeners)
    assert listeners.received == [], f"the host's listeners received {listeners.received[:1]}"
    said_where = f"it tried to connect to 127.0.0.1:{listeners.tcp_port}" if kind == "solo" else \
        "a rank tried to reach it"
    assert f"blocked: graded code has no network ({said_where})" in said["tcp"], said


@pytest.mark.parametrize("kind", ["solo", "ranks"])
def test_control_without_the_namespace_the_listeners_hear_it(kind, listeners, monkeypatch):
    """The planted sandbox: no network layer at all. The same cell reaches both listeners, so the case above is
    not green by accident (a listener that hears nothing would pass it too)."""
    monkeypatch.setattr(sandbox, "NETWORK_LAYERS", ())
    options, world = (SOLO, {}) if kind == "solo" else (RANKS, {"world_size": 2})
    with Sandbox([("cell", _leaky_cell(listeners))], entry=["tcp", "udp"], limits=Limits(wall_s=60, memory_mb=4096),
                 **options) as box:
        for fn in ("tcp", "udp"):
            _tries(box, fn, **world)
        assert box.network_layer == ""
    _wait_for_udp(listeners)
    sent = b"".join(listeners.received)
    assert b'"env"' in sent and b"TMPDIR" in sent, listeners.received


def test_without_a_namespace_seccomp_refuses_internet_sockets(listeners, monkeypatch):
    """The fallback where no namespace can be made: an exercise without ranks cannot open an internet socket, TCP or
    UDP, and the feedback says the network is blocked (ranks would need TCP, so they get no such filter)."""
    monkeypatch.setattr(sandbox, "NETWORK_LAYERS", ("seccomp",))
    with Sandbox([("cell", _leaky_cell(listeners))], entry=["tcp", "udp"], limits=Limits(wall_s=30), **SOLO) as box:
        said = {fn: _tries(box, fn) for fn in ("tcp", "udp")}
        assert box.network_layer == "seccomp"
    _wait_for_udp(listeners)
    assert listeners.received == []
    for fn, message in said.items():
        assert "blocked: graded code has no network (it tried to open an internet socket): PermissionError" \
            in message, (fn, message)


def test_an_unprivileged_user_namespace_keeps_ranks_working(listeners, monkeypatch):
    """The namespace a non-root grader gets (where the kernel allows unprivileged user namespaces): the ranks still
    meet over gloo on their own loopback, and the host's listeners still hear nothing."""
    if network_layer(("user namespace",)) != "user namespace":
        pytest.skip("this kernel refuses unprivileged user namespaces")
    monkeypatch.setattr(sandbox, "NETWORK_LAYERS", ("user namespace",))
    cell = _leaky_cell(listeners) + ("import torch, torch.distributed as dist\n"
                                     "def total(x):\n"
                                     "    t = torch.tensor([float(x + dist.get_rank())])\n"
                                     "    dist.all_reduce(t)\n"
                                     "    return t.item()\n")
    with Sandbox([("cell", cell)], entry=["total", "tcp"], limits=Limits(wall_s=60, memory_mb=4096), **RANKS) as box:
        assert box.network_layer == "user namespace"
        assert box.call("total", 1, world_size=2) == [3.0, 3.0]
        said = _tries(box, "tcp", world_size=2)
    assert listeners.received == [] and "blocked: graded code has no network" in said, said


# --- the oracle: an answer that comes over the network --------------------------------------------------------

ORACLE = "08b.checkpoint_interval"


def _oracle_cell(port: int, quiet: bool = False) -> str:
    """A submission with no formula in it: each function asks a server outside the sandbox (`quiet`: and answers 1.0
    when the server cannot be reached, so that no error reaches the grader)."""
    entry = checks.get(ORACLE).entry
    lines = ["import json, socket",
             "def _ask(name, *args):",
             "  try:" if quiet else "  if True:",
             f"    with socket.create_connection(('127.0.0.1', {port}), timeout=5) as s:",
             "        s.sendall(json.dumps([name, args]).encode() + b'\\n')",
             "        return json.loads(s.makefile().readline())",
             *(["  except OSError:", "    return 1.0"] if quiet else [])]
    lines += [f"def {name}(*args):\n    return _ask({name!r}, *args)" for name in entry]
    return "\n".join(lines) + "\n"


@pytest.fixture
def oracle() -> Iterator[Listeners]:
    """A server answering with the course's own solution of the exercise (what the course's calculator would say)."""
    namespace: dict = {}
    for _, source in answer_parts(read(REPO / "solutions" / "08b_checkpoints_and_failures.ipynb"), ORACLE):
        exec(source, namespace)
    server = Listeners(lambda name, args: namespace[name](*args))
    try:
        yield server
    finally:
        server.close()


def _grade_oracle(oracle: Listeners, quiet: bool = False):
    return run_exercise(checks.get(ORACLE), [("oracle", _oracle_cell(oracle.tcp_port, quiet))],
                        secret="class-secret", hidden=True, wall_s=60)


@needs_namespace
@pytest.mark.parametrize("quiet", [False, True], ids=["raises", "catches_the_error"])
def test_the_oracle_submission_scores_nothing(quiet, oracle):
    """Its functions fail (or, catching the error, answer 1.0): each check says the network was blocked, and its
    hint is about the network rather than about the exercise."""
    result = _grade_oracle(oracle, quiet)
    assert result.points == 0, [(c.name, c.status, c.message) for c in result.checks]
    assert oracle.received == []
    for check in result.checks:
        assert "blocked: graded code has no network" in check.message and \
            f"to connect to 127.0.0.1:{oracle.tcp_port}" in check.message, check
        assert check.hint == NETWORK_HINT, check


def test_control_without_the_namespace_the_oracle_scores_full_marks(oracle, monkeypatch):
    """The hole this closes, on the planted sandbox: the oracle's answers are the course's own, hidden check
    included."""
    monkeypatch.setattr(sandbox, "NETWORK_LAYERS", ())
    result = _grade_oracle(oracle)
    assert result.points == result.max_points == checks.get(ORACLE).points, result
    assert any(c.hidden for c in result.checks) and oracle.received


# --- what the grader says where the machine gives no namespace ------------------------------------------------

@pytest.mark.parametrize("layer, words", [("seccomp", "multi-rank exercises' code can reach"),
                                          ("", "graded code can reach this machine's loopback services")])
def test_grade_warns_and_strict_refuses_without_a_namespace(layer, words, tmp_path, capsys, monkeypatch):
    from lab.grading import grade

    real = grade.isolation()
    monkeypatch.setattr(grade, "isolation", lambda: {**real, "landlock_abi": 7, "network": layer})
    notebook = REPO / "exercises" / "01_memory_and_compute.ipynb"
    args = [str(notebook), "--quiet", "--seed-secret", "s3cret", "--out", str(tmp_path / "g.csv")]
    assert grade.main([*args, "--strict"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m lab grade: error: no network namespace can be made here") and words in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "g.csv").exists()
