"""Every course notebook runs top to bottom in a fresh kernel, and is stored without outputs.

Notebooks are collected at import time from chapters/, solutions/ and exercises/, one test each, so a
new chapter is tested as soon as its file exists. Each runs with nbclient in this process, in a kernel
of this interpreter (see the `jupyter_env` fixture), with its folder as working directory, within a
time budget: 90 s for a chapter (the issues' "runs in CI in < 90 s"), 300 s for an exercise notebook, or
`{"lab": {"timeout": N}}` in the notebook's metadata.

A chapter that runs is saved, outputs and widget state included, under build/executed/chapters/: `make site`
(lab/site.py) converts those copies into the course's web pages, so no notebook is executed twice.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(path for folder in ("chapters", "solutions", "exercises")
                   for path in (REPO / folder).glob("*.ipynb"))
DEFAULT_TIMEOUT_S = {"chapters": 90, "solutions": 300, "exercises": 300}
EXECUTED = REPO / "build" / "executed"  # git-ignored; lab/site.py reads it
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # IPython colours its tracebacks


def _budget_s(path: Path, nb: nbformat.NotebookNode) -> int:
    return int(nb.metadata.get("lab", {}).get("timeout", DEFAULT_TIMEOUT_S[path.parent.name]))


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def _params(marks: list[pytest.MarkDecorator]) -> list:
    """One pytest param per notebook. The pytest-timeout limit leaves a minute over the notebook's own
    budget, so that the notebook's budget, which names the slow cell, is what fires first."""
    return [pytest.param(path, id=_rel(path),
                         marks=[*marks, pytest.mark.timeout(_budget_s(path, nbformat.read(path, as_version=4)) + 60)])
            for path in NOTEBOOKS]


def _first_error(nb: nbformat.NotebookNode, rel: str) -> str | None:
    """The failing cell's source and traceback, which is what one needs to fix a notebook. A cell tagged
    `raises-exception` (an exercise's "try it" cell, run on the released stub) may raise: it is not the one."""
    for index, cell in enumerate(nb.cells):
        if "raises-exception" in cell.get("metadata", {}).get("tags", []):
            continue
        for output in cell.get("outputs", []):
            if output.output_type == "error":
                traceback = _ANSI.sub("", "\n".join(output.traceback))
                return (f"{rel}: cell {index} raised {output.ename}: {output.evalue}\n"
                        f"----- cell {index} source -----\n{cell.source}\n"
                        f"----- traceback -----\n{traceback}")
    return None


def test_kernel_runs_this_interpreter(jupyter_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards the isolation that the notebook tests rely on: "python3" must be the venv's python."""
    for name, value in jupyter_env.items():
        monkeypatch.setenv(name, value)
    assert KernelSpecManager().get_kernel_spec("python3").argv[0] == sys.executable


_NO_KERNEL = "the kernel did not start"


def _execute(nb: nbformat.NotebookNode, path: Path, rel: str) -> str | None:
    """Run every cell within the notebook's budget; the failure, said for a person, or None."""
    budget = _budget_s(path, nb)
    deadline = time.monotonic() + budget
    client = NotebookClient(
        nb,
        kernel_name="python3",  # ours (jupyter_env), whatever the notebook's metadata says
        # A budget for the whole notebook, not per cell: each cell may use what the earlier ones left.
        timeout_func=lambda cell: max(1.0, deadline - time.monotonic()),
        startup_timeout=60,
        resources={"metadata": {"path": str(path.parent)}},  # the kernel's working directory
    )
    ran = lambda: any(cell.get("execution_count") for cell in nb.cells if cell.cell_type == "code")
    try:
        client.execute()
    except CellExecutionError as error:
        return _first_error(nb, rel) or f"{rel}: {error}"
    except CellTimeoutError as error:
        return (f"{rel}: over its {budget} s budget (raise it with metadata "
                f'{{"lab": {{"timeout": N}}}} only if the cell cannot be made faster)\n{error}')
    except (DeadKernelError, RuntimeError) as error:
        if not ran():
            return f"{_NO_KERNEL}: {rel}: {error}"
        if isinstance(error, RuntimeError):
            raise
        return f"{rel}: the kernel died (out of memory, a segfault, os._exit?): {error}"
    return None


@pytest.mark.parametrize("path", _params([pytest.mark.notebooks]))
def test_notebook_runs(path: Path, jupyter_env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
                       record_property) -> None:
    for name, value in jupyter_env.items():
        monkeypatch.setenv(name, value)
    # JupyterLab's backend, not jupyter_env's Agg: plt.show() must leave its PNG in the outputs that `make site` shows
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    rel = _rel(path)
    start = time.perf_counter()
    try:
        for attempt in (1, 2):
            nb = nbformat.read(path, as_version=4)
            failure = _execute(nb, path, rel)
            # A kernel that never started (its random ZMQ ports taken meanwhile by another process: jupyter_client
            # picks them before the kernel binds them) is the machine's race, not the notebook's: start again, once.
            if not (failure and failure.startswith(_NO_KERNEL)) or attempt == 2:
                break
    finally:
        record_property("wall_s", (f"notebook  {rel}", time.perf_counter() - start))
    if path.parent.name == "chapters":
        _save_executed(nb, EXECUTED / rel, keep=not failure)
    if failure:
        pytest.fail(failure, pytrace=False)


def _save_executed(nb: nbformat.NotebookNode, target: Path, keep: bool) -> None:
    """Write the executed chapter (nbclient stored its widget state in metadata.widgets) for `make site`; after a
    failure remove the earlier copy instead, so the site is never built from a chapter older than the tests ran.
    Written to a temporary name first: `make site` must never read a half-written file."""
    if not keep:
        target.unlink(missing_ok=True)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    nbformat.write(nb, partial)
    partial.replace(target)


@pytest.mark.parametrize("path", _params([]))
def test_notebook_is_stored_clean(path: Path) -> None:
    """Outputs and execution counts make every diff noisy and every merge conflict; the tests produce
    them anyway. Saved widget state (metadata.widgets) is an output too."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [index for index, cell in enumerate(nb.cells)
             if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)]
    assert not dirty, (f"{_rel(path)}: cells {dirty} are stored with outputs or execution counts; "
                       f"clear them (JupyterLab: Edit > Clear Outputs of All Cells, then save)")
    assert "widgets" not in nb.metadata, f"{_rel(path)}: saved widget state in metadata.widgets; remove it"
    stored = json.loads(path.read_text(encoding="utf-8"))  # nbformat.read adds missing ids, with a warning
    no_id = [index for index, cell in enumerate(stored["cells"]) if "id" not in cell]
    assert not no_id, f"{_rel(path)}: cells {no_id} have no id (nbformat 4.5 wants one; JupyterLab adds it on save)"
