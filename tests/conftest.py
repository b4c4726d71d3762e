"""Shared pytest fixtures and hooks. Keep this file small: helpers used by one test file live in that file."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Under pytest-xdist two workers share CI's two cores, each often beside a notebook kernel or ranks it started: with
# torch's default of one OpenMP thread per core, the threads of busy processes spin waiting for each other. Measured
# here: chapter 07's notebook took 87 s beside a worker running torch tests (22 s alone), and those tests 72 s; with
# one thread each, 34 s and 21 s. Set before any test module imports torch; kernels and ranks inherit it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
pytest.register_assert_rewrite("grading_support")  # the chapters' shared grading tests: show what was compared


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (tests/gpu; run by make bench-gpu), skipped elsewhere")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The JAX track's tests (tests/test_jaxtrack_*.py) are marked `jax`: `make test` runs them in a lane of their
    own. Why: JAX starts its thread pools in the process that computes, and a pytest worker that later forks ranks
    for a torch test could copy a lock one of those threads holds (JAX warns that fork after it "will likely lead
    to a deadlock"); the rank tests fork from workers where JAX never ran."""
    for item in items:
        if item.path.name.startswith("test_jaxtrack_"):
            item.add_marker(pytest.mark.jax)


@pytest.fixture
def one_thread():
    """One intra-op thread in the test process, as every rank has: on 2 busy cores, torch's two threads beside the
    ranks' made the launcher and fault-injection runs up to 10x slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- Jupyter: an isolated environment for kernels and servers (notebook and browser lanes) -------------

@pytest.fixture(scope="session")
def jupyter_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment variables that give kernels and JupyterLab throwaway config/data/runtime dirs.

    Why: a learner's ~/.jupyter, ~/.ipython or matplotlib settings must not change what the tests see,
    and the tests must not write there. The "python3" kernelspec written here runs *this* interpreter
    (sys.executable, i.e. the venv), so the kernel imports the same `lab` and torch as pytest, however
    pytest was started (venv activated or not) and whatever kernelspecs the machine has: JUPYTER_PATH
    is searched before every other kernel directory.
    """
    home = tmp_path_factory.mktemp("jupyter-home")
    data = home / "data"
    spec_dir = data / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
    }))
    return {
        "JUPYTER_PATH": str(data),
        "JUPYTER_DATA_DIR": str(data),
        "JUPYTER_CONFIG_DIR": str(home / "config"),
        "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
        "JUPYTERLAB_SETTINGS_DIR": str(home / "lab-settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(home / "lab-workspaces"),
        "JUPYTER_PLATFORM_DIRS": "1",  # silences jupyter_core's "migrating to platformdirs" warning
        "IPYTHONDIR": str(home / "ipython"),
        "MPLCONFIGDIR": str(home / "matplotlib"),
        "MPLBACKEND": "Agg",
        "PYDEVD_DISABLE_FILE_VALIDATION": "1",  # silences debugpy's "frozen modules" warning in kernels
        # Kernels run in the notebook's folder: make `import lab` find this checkout even without `pip -e`.
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }


# --- Timing: a table of wall times at the end of the session -----------------------------------------

def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the wall time of every notebook run (tests record it with `record_property("wall_s", ...)`).

    Why: notebooks are the slowest tests and they grow chapter by chapter; the table shows which one to
    trim before the suite outgrows its CI budget. user_properties travel with the reports, so this also
    works under pytest-xdist.
    """
    rows = [
        (*value, outcome)  # value = (label, seconds)
        for outcome in ("passed", "failed")
        for report in terminalreporter.stats.get(outcome, [])
        if report.when == "call"
        for name, value in report.user_properties
        if name == "wall_s"
    ]
    if not rows:
        return
    terminalreporter.write_sep("-", "wall time per notebook")
    for label, seconds, outcome in sorted(rows, key=lambda row: -row[1]):
        terminalreporter.write_line(f"{seconds:7.1f} s  {outcome:6}  {label}")
