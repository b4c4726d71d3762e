"""Drive a real JupyterLab in headless Chromium: start a throwaway server, open a notebook, run it, look.

The recipe avoids the pitfalls met while building it:
- A "Run All" sent while the kernel connection is still settling can be lost, and the cells then stay
  `[ ]` forever. So `open()` waits for real readiness (the status bar says "| Idle" *and* the REST API
  shows a kernel connection), and `run_all()` uses "Restart Kernel and Run All Cells…", which queues the
  cells only once the restarted kernel is up.
- JupyterLab reuses a running kernel for a notebook path it has seen: kernels are deleted through the REST
  API before and after every notebook.
- The "get notified about Jupyter news?" toast covers screenshots: its plugin is disabled in the server's
  own temp config dir. Cells outside the viewport may be left out of the DOM: windowing is turned off.
- The browser must never write the tracked notebooks: the server serves a temp copy, and autosave is off.
- Chromium is Debian's (/usr/bin/chromium); Playwright never downloads a browser here.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

if TYPE_CHECKING:  # playwright is optional: the tests that need it skip when it is missing
    from playwright.sync_api import BrowserContext, Locator, Page

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# User settings for the throwaway server (file name -> settings), see the module docstring.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
}
DISABLED_PLUGINS = {"@jupyterlab/apputils-extension:announcements": True}
# Error outputs (tracebacks) are rendered as stderr, like warnings; `error_outputs()` tells them apart.
_STDERR = '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]'


def free_port() -> int:
    """A loopback port that is free now. The server gets port_retries=0, so a lost race fails loudly."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LabServer:
    """A JupyterLab server on a free loopback port, serving `root_dir`, with a random token.

    `env` must point every JUPYTER_* directory somewhere temporary (the `jupyter_env` fixture does):
    the settings and the disabled plugins below are written there, never into the venv or ~.
    """

    def __init__(self, root_dir: Path, env: dict[str, str], log_path: Path) -> None:
        self.root_dir, self.env, self.log_path = root_dir, env, log_path
        self.port, self.token = free_port(), secrets.token_hex(16)
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> None:
        config = Path(self.env["JUPYTER_CONFIG_DIR"]) / "labconfig" / "page_config.json"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(json.dumps({"disabledExtensions": DISABLED_PLUGINS}))
        for name, settings in LAB_SETTINGS.items():
            path = Path(self.env["JUPYTERLAB_SETTINGS_DIR"]) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(settings))
        command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip=127.0.0.1",
                   f"--port={self.port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
                   f"--ServerApp.root_dir={self.root_dir}"]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                            env={**os.environ, **self.env})
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                self.api("GET", "status")
                return
            except OSError:  # not listening yet
                time.sleep(0.25)
        raise TimeoutError(f"jupyter lab did not answer /api/status in {timeout_s} s:\n{self.log_tail()}")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path}?token={self.token}"

    def api(self, method: str, path: str) -> Any:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/api/{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
        return json.loads(body) if body else None

    def kernels(self) -> list[dict]:
        return self.api("GET", "kernels")

    def shutdown_kernels(self) -> None:
        """Delete every session and kernel, so the next notebook gets a fresh kernel."""
        for session in self.api("GET", "sessions"):
            self.api("DELETE", f"sessions/{session['id']}")
        for kernel in self.kernels():
            self.api("DELETE", f"kernels/{kernel['id']}")

    def stop(self) -> None:
        """Shut kernels down, stop the server, then kill by PID whatever it started and left behind
        (kernels and the ranks they forked run in their own sessions, so killing a group is not enough)."""
        if self.process is None or self.process.poll() is not None:
            return
        try:
            self.shutdown_kernels()
        except OSError:  # the server is not answering: the kills below still clean up
            pass
        leftovers = psutil.Process(self.process.pid).children(recursive=True)
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        for process in leftovers:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(leftovers, timeout=10)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@contextmanager
def chromium(profile_dir: Path) -> Iterator[BrowserContext]:
    """Headless Debian Chromium with a fresh profile (Chromium refuses --user-data-dir in `args`), closed on exit."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile_dir), executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 900})
        try:
            yield context
        finally:
            context.close()


# True once every code cell of the visible notebook shows an execution count, e.g. "[3]:" (not "[ ]" or
# "[*]"), or once a cell failed: JupyterLab then stops and the cells after it never get one.
_RUN_ALL_DONE = """() => {
  const notebook = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
  if (!notebook) return false;
  const prompts = [...notebook.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')].map(p => p.textContent.trim());
  const failed = notebook.querySelector('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]');
  return prompts.length > 0 && (prompts.every(p => /^\\[\\d+\\]/.test(p))
                                || (failed !== null && !prompts.some(p => p.startsWith('[*]'))));
}"""


class NotebookPage:
    """One notebook open in JupyterLab. Use through `open_notebook`, which cleans up and screenshots."""

    def __init__(self, page: Page, server: LabServer, path: str) -> None:
        self.page, self.server, self.path = page, server, path
        self.console_errors: list[str] = []
        page.on("console", lambda message: message.type == "error" and self.console_errors.append(message.text))

    def open(self, timeout_s: float = 90.0) -> None:
        """Open the notebook and wait until its kernel is really ready to take requests."""
        # ?reset: a fresh workspace, not the tabs an earlier test left open in JupyterLab's saved layout (whose
        # hidden panels would hold the first cells on the page)
        self.page.goto(self.server.url(f"lab/tree/{self.path}") + "&reset", wait_until="domcontentloaded")
        self.page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell").first.wait_for(timeout=timeout_s * 1000)
        self.page.locator(".jp-StatusBar-TextItem", has_text="| Idle").wait_for(timeout=timeout_s * 1000)
        deadline = time.monotonic() + timeout_s
        while not any(k["connections"] >= 1 and k["execution_state"] == "idle" for k in self.server.kernels()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no idle, connected kernel after {timeout_s} s: {self.server.kernels()}")
            time.sleep(0.2)

    def menu(self, top: str, item: str) -> None:
        self.page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(f"^{re.escape(top)}$")).click()
        self.page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{re.escape(item)}$")).click()

    def run_all(self, timeout_s: float = 120.0) -> None:
        """Restart the kernel, run every cell, and wait until each code cell shows an execution count or
        one has failed (check `error_outputs()`). An empty code cell never gets a count: avoid them."""
        self.menu("Kernel", "Restart Kernel and Run All Cells…")
        self.page.locator(".jp-Dialog .jp-mod-accept").click()
        self.page.wait_for_function(_RUN_ALL_DONE, timeout=timeout_s * 1000)

    def error_outputs(self) -> list[str]:
        """Texts of cell outputs that are errors (tracebacks), which JupyterLab renders as stderr."""
        return [text for text in self.page.locator(_STDERR).all_inner_texts()
                if "Traceback" in text or re.search(r"^\s*\w*(Error|Exception):", text, re.MULTILINE)]

    def assert_no_errors(self) -> None:
        errors = self.error_outputs()
        assert not errors, f"{self.path}: {len(errors)} cell(s) failed in the browser:\n\n" + "\n\n".join(errors)

    def output(self, selector: str, has_text: str | None = None) -> Locator:
        """The cell output area that contains `selector` (e.g. a widget's table), or the one whose `selector`
        element says `has_text` (e.g. `output(".widget-label", "ring step")`: the widget with that control)."""
        return self.page.locator(".jp-OutputArea-output", has=self.page.locator(selector, has_text=has_text))


@contextmanager
def open_notebook(context: BrowserContext, server: LabServer, path: str,
                  artifacts: Path) -> Iterator[NotebookPage]:
    """Open `path` (relative to the server's root) in a fresh kernel and tab. Always leaves a screenshot
    in `artifacts`: `<name>.png` after success, `<name>-FAILED.png` (plus diagnostics printed to the
    captured output) on failure. Kernels are deleted and the tab closed, unsaved, either way."""
    artifacts.mkdir(parents=True, exist_ok=True)
    (artifacts / ".gitignore").write_text("*\n")
    name = Path(path).stem
    (artifacts / f"{name}-FAILED.png").unlink(missing_ok=True)  # a stale one would mislead
    server.shutdown_kernels()
    page = context.new_page()
    page.set_default_timeout(60_000)
    notebook = NotebookPage(page, server, path)
    try:
        notebook.open()
        yield notebook
        page.screenshot(path=str(artifacts / f"{name}.png"))
    except BaseException:
        shot = artifacts / f"{name}-FAILED.png"
        try:
            errors = page.locator(_STDERR)
            if errors.count():  # show the first failed cell rather than wherever the page stopped
                errors.first.scroll_into_view_if_needed(timeout=5_000)
            page.screenshot(path=str(shot))
        except Exception as error:  # a crashed page cannot be photographed; say so and go on
            shot = Path(f"(no screenshot: {error})")
        print(f"screenshot: {shot}\nbrowser console errors: {notebook.console_errors}\n"
              f"server log (tail):\n{server.log_tail()}")
        raise
    finally:
        page.close()  # without running beforeunload: nothing is saved
        server.shutdown_kernels()
