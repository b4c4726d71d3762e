"""The site's Python runtime in headless Chromium: `window.lab.calc` (static/lab-calc.js, Pyodide in a Web Worker)
gives the text `python -m lab calc ... --json` prints, and its one error line; nothing is fetched from anywhere but
the local server (`python -m lab site --serve`); opened from file://, a page keeps its snapshot and says in one line
how to serve it.

One page load for all the calc checks: Pyodide's start-up is the lane's cost (recorded as `ready_s`). It reads the
site/ that `make test` builds (skipped without one: `make site`).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from .jupyterlab import chromium, free_port
from .test_lab_browser import _missing

REPO = Path(__file__).resolve().parents[2]
SITE = REPO / "site"
CHAPTER = "chapters/01_memory_and_compute.html"
# One invocation of each calculator the pages show, small enough that the search is quick.
INVOCATIONS = [
    ["memory", "--model", "llama3-8b", "--seq", "4096", "--dp", "8", "--zero", "1", "--tp", "2", "--sp",
     "--recompute", "selective"],
    ["bubble", "--pp-schedule", "interleaved", "--pp", "4", "--grad-accum", "8", "--pp-chunks", "2"],
    ["search", "--model", "llama3-8b", "--gpus", "16", "--gpus-per-node", "8", "--hardware", "h100", "--seq", "4096",
     "--gbs-tokens", "1M"],
    ["inference", "--model", "llama3-8b", "--hardware", "h100", "--tp", "2", "--seq", "4096", "--batch", "8"],
    ["comms", "--op", "all_reduce", "--ranks", "16", "--hardware", "h100", "--bytes", "256MiB"],
    ["params", "--model", "llama3-70b"],
]
BAD = ["memory", "--model", "llama3-8b", "--tp", "3"]
# The search reports its own wall time: the one number two runs of the same command do not share.
_ELAPSED = re.compile(r'"elapsed_s": [0-9.e+-]+')

pytestmark = [pytest.mark.browser, pytest.mark.skipif(_missing() is not None, reason=str(_missing())),
              pytest.mark.skipif(not (SITE / "static" / "lab-calc.zip").exists(), reason="no site/: run `make site`")]


def same_run(text: str) -> str:
    return _ELAPSED.sub('"elapsed_s": "(wall time)"', text)


def cli(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lab", "calc", *argv, "--json"], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    """`python -m lab site --serve` on a free port, as a learner starts it; its base URL. Killed in the end."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "lab", "site", "--serve", "--port", str(port)], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        said = process.stdout.readline()
        assert f"http://127.0.0.1:{port}/" in said, said
        yield f"http://127.0.0.1:{port}/"
    finally:
        process.kill()
        process.wait(timeout=10)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    with chromium(tmp_path_factory.mktemp("chromium-profile")) as context:
        yield context


class Watched:
    """A fresh tab whose every request is routed: those to `allowed` go on (or get the stand-in script `stubs` has
    for their path's end), any other is refused and kept."""

    def __init__(self, context, allowed: str, stubs: dict[str, str] | None = None) -> None:
        self.page = context.new_page()
        self.allowed, self.stubs, self.refused, self.errors = allowed, stubs or {}, [], []
        self.page.route("**/*", self._route)
        self.page.on("console", lambda message: message.type == "error" and self.errors.append(message.text))
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))

    def _route(self, route) -> None:
        url = route.request.url
        stub = next((body for end, body in self.stubs.items() if url.endswith(end)), None)
        if url.startswith(self.allowed) and stub is not None:
            route.fulfill(body=stub, content_type="text/javascript")
        elif url.startswith(self.allowed):
            route.continue_()
        else:
            self.refused.append(route.request.url)
            route.abort()


def stale_sources() -> list[str]:
    """The files of site/static/lab-calc.zip that differ from the checkout's (the CLI below runs the checkout)."""
    with zipfile.ZipFile(SITE / "static" / "lab-calc.zip") as archive:
        return [name for name in archive.namelist()
                if not (REPO / name).exists() or archive.read(name) != (REPO / name).read_bytes()]


def test_lab_calc_in_the_page_equals_the_cli(served: str, browser, record_property) -> None:
    assert stale_sources() == [], "site/ is older than these sources: run `make site`"
    expected = [cli(argv) for argv in INVOCATIONS]
    assert all(done.returncode == 0 for done in expected), [done.stderr for done in expected]
    bad = cli(BAD)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    tab = Watched(browser, served)
    try:
        start = time.perf_counter()
        tab.page.goto(served + CHAPTER)
        tab.page.evaluate("() => window.lab.ready")
        ready_s = time.perf_counter() - start
        first = tab.page.evaluate("async (argv) => { const t = performance.now(); await window.lab.calc(argv); "
                                  "return performance.now() - t; }", INVOCATIONS[-1])
        got = tab.page.evaluate("(calls) => Promise.all(calls.map((argv) => window.lab.calc(argv)))", INVOCATIONS)
        for argv, text, done in zip(INVOCATIONS, got, expected, strict=True):
            assert same_run(text) == same_run(done.stdout), argv[0]
            json.loads(text)
        said = tab.page.evaluate("(argv) => window.lab.calc(argv).then(() => 'resolved', (error) => error.message)",
                                 BAD)
        assert said == bad.stderr.strip()
        assert tab.refused == [], tab.refused
        assert tab.errors == [], tab.errors
    finally:
        tab.page.close()
    record_property("ready_s", round(ready_s, 2))
    record_property("first_calc_ms", round(first, 1))


# live.js alone, with stand-ins: a runtime that is ready at once, a calculator that mounts and one that throws (the
# real calculators, static/live/*.js, are tests/browser/test_site_live.py's).
FAKE_RUNTIME = "window.lab = {ready: Promise.resolve(), calc: async (argv) => JSON.stringify(argv)};"
MOUNTS = 'export async function mount(element, calc) { element.textContent = await calc(["params"]); }'
THROWS = 'export function mount() { throw new Error("no such control\\nsecond line"); }'


@pytest.mark.parametrize(("chapter", "name", "module", "state"),
                         [("01_memory_and_compute", "memory", MOUNTS, "live"),
                          ("02_collectives", "comms", THROWS, "error")], ids=["mounts", "throws"])
def test_live_js_hides_the_snapshot_once_mounted_and_keeps_it_when_a_mount_throws(
        served: str, browser, chapter: str, name: str, module: str, state: str) -> None:
    tab = Watched(browser, served, {"static/lab-calc.js": FAKE_RUNTIME, f"static/live/{name}.js": module})
    try:
        tab.page.goto(f"{served}chapters/{chapter}.html")
        live = tab.page.locator(f'.live-calc[data-calc="{name}"]')
        tab.page.wait_for_function("(name) => ['live', 'error'].includes("
                                   "document.querySelector(`.live-calc[data-calc=${name}]`).dataset.state)", arg=name)
        assert live.get_attribute("data-state") == state
        snapshot = tab.page.locator(".jp-Cell", has=tab.page.locator(".jupyter-widgets")).filter(
            has=tab.page.locator(f"xpath=following-sibling::*[1][@data-calc='{name}']"))
        outputs = snapshot.locator(".jp-OutputArea-child", has=tab.page.locator(".jupyter-widgets"))
        assert outputs.count() == 1
        if state == "live":
            assert live.inner_text() == '["params"]'  # what the stand-in runtime made of the calculator's call
            assert outputs.first.is_hidden()
        else:
            assert live.inner_text().strip() == f"the live {name} calculator failed: no such control"
            assert outputs.first.is_visible()
        assert tab.refused == [] and tab.errors == [], (tab.refused, tab.errors)
    finally:
        tab.page.close()


def test_opened_from_disk_the_page_keeps_its_snapshot_and_says_how_to_serve_it(browser) -> None:
    tab = Watched(browser, "file://")
    try:
        tab.page.goto((SITE / CHAPTER).as_uri())
        live = tab.page.locator('.live-calc[data-calc="memory"]')
        live.locator(".live-calc-note").wait_for(timeout=30_000)
        tab.page.wait_for_function("() => document.querySelector('.live-calc').dataset.state === 'offline'")
        said = live.inner_text().strip()
        assert "\n" not in said and "make site-serve" in said and "python -m lab site --serve" in said
        snapshot = tab.page.locator(".jupyter-widgets", has=tab.page.locator(".lab-memory-total")).first
        snapshot.wait_for(timeout=30_000)
        assert snapshot.is_visible()
        assert tab.refused == [] and tab.errors == [], (tab.refused, tab.errors)
    finally:
        tab.page.close()
