"""The course site's live calculators (issue 38) in headless Chromium, served by `python -m lab site --serve` as a
learner starts it, with every request to another host refused and recorded.

Pyodide's start-up is what costs here (~7 s a page on 2 cores), so the calculators' checks share ONE page load of
site/calculators.html, where all five live; one more page load checks that a chapter's page mounts its calculator in
place of the notebook's snapshot. The rest loads no Pyodide: live.js with a stand-in runtime (a mount that throws).

- `window.lab.calc` (static/lab-calc.js, Pyodide in a Web Worker) gives the text `python -m lab calc ... --json`
  prints, and the CLI's one error line.
- Each calculator opens on its notebook cell's defaults; the test reads the numbers it drew (every drawn number keeps
  its exact JSON value in data-value, lab/site_static/live/ui.js) and compares them with the CLI run here for the argv
  its controls spell; it changes one control and compares again; it gives one input the CLI refuses and checks that
  the CLI's one line shows while the last good drawing stays. The selects offer only what the CLI accepts.
- No request left the local server.

It reads the site/ that `make test` builds after the main suite; skipped when there is none or it has no Pyodide
(`make site` vendors it).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.calc import cli
from lab.config import PRESETS
from lab.site import LIVE_CALCULATORS

from .jupyterlab import chromium, free_port
from .test_lab_browser import _missing

REPO = Path(__file__).resolve().parents[2]
SITE = REPO / "site"
RUNTIME = ("calculators.html", "static/live/ui.js", "static/lab-calc.zip", "static/pyodide/pyodide.asm.wasm")
LIVE_TIMEOUT_MS = 180_000  # Pyodide starts in ~7 s here, more on a loaded CI machine
REL = 1e-12  # Pyodide's libm may round a last bit unlike this CPython's (seen: comms, hierarchical)
NAMES = [calculator.name for entries in LIVE_CALCULATORS.values() for calculator in entries]

pytestmark = [pytest.mark.browser, pytest.mark.skipif(_missing() is not None, reason=str(_missing())),
              pytest.mark.skipif(not all((SITE / path).exists() for path in RUNTIME),
                                 reason="no site/ with the live calculators' runtime: run `make site`")]


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """`python -m lab calc <argv> --json` in this process: its exit status, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main([*argv, "--json"])
        except SystemExit as exit:
            code = exit.code
    return code, out.getvalue(), err.getvalue()


def calc(argv: list[str]) -> tuple[dict | None, str]:
    """The CLI's JSON and "", or None and its one error line."""
    code, out, err = run_cli(argv)
    return (json.loads(out), "") if code == 0 else (None, err.strip())


def choices(sub: str) -> dict[str, list[str]]:
    """The CLI's argparse choices of `python -m lab calc <sub>`, by flag."""
    parser = next(a for a in cli.build_parser()._actions if a.dest == "what").choices[sub]
    return {flag: [str(c) for c in action.choices] for action in parser._actions if action.choices
            for flag in action.option_strings}


def spell(sub: str, values: dict[str, str | bool]) -> list[str]:
    """The argv controls spell, by ui.js's rule: a checked box is its flag alone, an unchecked one nothing."""
    out = [sub]
    for flag, value in values.items():
        out += [flag] if value is True else [] if value is False else [flag, value]
    return out


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


class Tab:
    """A fresh tab whose every request is routed: those to `allowed` go on (or get the stand-in script `stubs` has
    for their path's end), any other is refused and kept; and what the page logged as an error."""

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
            self.refused.append(url)
            route.abort()

    def live(self, name: str) -> None:
        """Wait until the calculator `name` has mounted (drawn its defaults)."""
        self.page.locator(f'.live-calc[data-calc="{name}"][data-state="live"]').wait_for(timeout=LIVE_TIMEOUT_MS)


class LiveCalculator:
    """One live calculator of a page: its controls and what it drew."""

    def __init__(self, tab: Tab, name: str) -> None:
        self.page = tab.page
        self.ui = tab.page.locator(f'.live-calc[data-calc="{name}"] .live-ui')

    def values(self) -> dict[str, str | bool]:
        return self.ui.evaluate("""ui => Object.fromEntries([...ui.querySelectorAll("[name]")].map(input =>
            [input.name, input.type === "checkbox" ? input.checked : input.value]))""")

    def argv(self, sub: str) -> list[str]:
        return spell(sub, self.values())

    def drawn(self) -> dict[str, object]:
        """data-key (or data-part) -> the JSON value drawn, for every number the calculator shows."""
        return self.ui.evaluate("""ui => Object.fromEntries([...ui.querySelectorAll("[data-value]")].map(node =>
            [node.dataset.key || node.dataset.part, JSON.parse(node.dataset.value)]))""")

    def timeline(self) -> list[list]:
        return self.ui.evaluate("""ui => [...ui.querySelectorAll(".live-op")].map(op =>
            [Number(op.dataset.rank), op.dataset.op, JSON.parse(op.dataset.start), JSON.parse(op.dataset.end)])""")

    def change(self, flag: str, value: str) -> None:
        """Set one control as a reader would (choose an option; type and leave the field) and wait for its answer."""
        answered = int(self.ui.get_attribute("data-answered"))
        control = self.ui.locator(f'[name="{flag}"]')
        if control.evaluate("input => input.tagName") == "SELECT":
            control.select_option(value)
        else:
            control.fill(value)
            control.press("Tab")
        self.page.wait_for_function("([ui, n]) => Number(ui.dataset.answered) > n && !ui.dataset.busy",
                                    arg=[self.ui.element_handle(), answered])

    def error(self) -> str:
        line = self.ui.locator(".live-error")
        return line.text_content() if line.is_visible() else ""

    def selects(self) -> dict[str, list[str]]:
        return self.ui.evaluate("""ui => Object.fromEntries([...ui.querySelectorAll("select")].map(select =>
            [select.name, [...select.options].map(option => option.value)]))""")


@pytest.fixture(scope="module")
def calculators(browser, served: str) -> Iterator[Tab]:
    """site/calculators.html, once for the module, with all five calculators mounted; `ready_s` (until the runtime
    answered) and `live_s` (until all five drew their defaults) on the tab."""
    tab = Tab(browser, served)
    try:
        start = time.perf_counter()
        tab.page.goto(served + "calculators.html")
        tab.page.evaluate("() => window.lab.ready")
        tab.ready_s = time.perf_counter() - start
        for name in NAMES:
            tab.live(name)
        tab.live_s = time.perf_counter() - start
        yield tab
    finally:
        tab.page.close()


# One invocation of each calculator, small enough that the search is quick, and one the CLI refuses.
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


def same_run(text: str) -> str:
    return _ELAPSED.sub('"elapsed_s": "(wall time)"', text)


def stale_sources() -> list[str]:
    """The files of site/static/lab-calc.zip that differ from the checkout's (the CLI here runs the checkout)."""
    with zipfile.ZipFile(SITE / "static" / "lab-calc.zip") as archive:
        return [name for name in archive.namelist()
                if not (REPO / name).exists() or archive.read(name) != (REPO / name).read_bytes()]


def test_lab_calc_in_the_page_equals_the_cli(calculators: Tab, record_property) -> None:
    assert stale_sources() == [], "site/ is older than these sources: run `make site`"
    expected = [run_cli(argv) for argv in INVOCATIONS]
    assert all(code == 0 for code, _, _ in expected), [err for _, _, err in expected]
    code, _, bad = run_cli(BAD)
    assert code == 2 and bad.count("\n") == 1
    page = calculators.page
    first = page.evaluate("async (argv) => { const t = performance.now(); await window.lab.calc(argv); "
                          "return performance.now() - t; }", INVOCATIONS[-1])
    got = page.evaluate("(calls) => Promise.all(calls.map((argv) => window.lab.calc(argv)))", INVOCATIONS)
    for argv, text, (_, out, _) in zip(INVOCATIONS, got, expected, strict=True):
        assert same_run(text) == same_run(out), argv[0]
        json.loads(text)
    said = page.evaluate("(argv) => window.lab.calc(argv).then(() => 'resolved', (error) => error.message)", BAD)
    assert said == bad.strip()
    assert calculators.refused == [] and calculators.errors == [], (calculators.refused, calculators.errors)
    record_property("wall_s", ("browser   calculators.html: Pyodide, five calculators live", calculators.live_s))
    record_property("ready_s", round(calculators.ready_s, 2))
    record_property("calc_ms", round(first, 1))


def approx(expected: object) -> object:
    return pytest.approx(expected, rel=REL, abs=0)


# name: (sub, the notebook call's arguments, one control changed, one input the CLI refuses)
CALCULATORS = {
    "memory": ("memory", {"--model": "llama3-8b", "--seq": "4096"}, ("--tp", "2"), ("--tp", "64")),
    "bubble": ("bubble", {"--pp-schedule": "1f1b", "--pp": "4", "--grad-accum": "8", "--tf": "1", "--tb": "2",
                          "--tw": "1"}, ("--pp", "6"), ("--tw", "3")),
    "search": ("search", {"--model": "llama3-70b", "--gpus": "256", "--gpus-per-node": "8", "--seq": "8192",
                          "--gbs-tokens": "4M"}, ("--hardware", "h200"), ("--gpus", "100")),
    "inference": ("inference", {"--model": "llama3-8b", "--hardware": "h100", "--batch": "1", "--seq": "4096"},
                  ("--batch", "32"), ("--model", "smollm-135m")),
    "comms": ("comms", {"--op": "all_reduce", "--bytes": "1GiB", "--ranks": "16", "--hardware": "h100"},
              ("--ranks", "64"), ("--bytes", "1XB")),
}


def expected(name: str, live: LiveCalculator) -> dict[str, object]:
    """What `name` must have drawn for its controls' argv, from the CLI here (keys as in drawn())."""
    values = live.values()
    argv = spell(CALCULATORS[name][0], values)
    if name == "inference":  # the sweep's point at the chosen batch, prefill at its roof (--mfu 1) as the widget
        argv += ["--mfu", "1"]
    data, error = calc(argv)
    assert error == "", (argv, error)
    return EXPECTED[name](data, values)


def _memory(d: dict, values: dict) -> dict:
    parts = d["per_gpu_bytes"]
    return {**{part: parts[part] for part in ("params", "grads", "optimizer", "activations", "loss")},
            "capacity": d["hardware_memory_bytes"], "total": parts["total"], "fits": d["fits"],
            "num_params": d["num_params"]}


def _bubble(d: dict, values: dict) -> dict:
    peaks = {f"peak_activations.{rank}": peak for rank, peak in enumerate(d["peak_activations"])}
    keys = ("bubble_ratio", "bubble_ratio_closed_form", "idle_fraction", "makespan", "p2p_messages")
    ops = [[rank, f"{kind}{mb}{f'.{chunk}' if chunk else ''}", start, end]
           for rank, kind, mb, chunk, start, end in d["timeline"]]
    return {**{key: d[key] for key in keys}, **peaks, "ops": ops}


def _search(d: dict, values: dict) -> dict:
    out = {"layouts_kept": d["layouts_kept"], "tokens_per_s.0": d["candidates"][0]["tokens_per_s"]}
    for i, c in enumerate(d["candidates"]):
        out |= {f"bar.{i}": c["tokens_per_s"], f"tokens_per_s.{i}": c["tokens_per_s"],
                f"memory_bytes.{i}": c["memory_bytes"]}
    return out


def _inference(d: dict, values: dict) -> dict:
    s = d["step"]  # and the sweep the curves draw: every batch, as the page asks it
    sweep = [calc([*spell("inference", {**values, "--batch": str(2 ** k)}), "--mfu", "1"])[0] for k in range(13)]
    curves = {f"curve.{key}": [row["step"][key] for row in sweep]
              for key in ("latency_bound_s", "compute_s", "time_s", "weights_s", "linear_s")}
    return curves | {"curve.tokens_per_s": [row["tokens_per_s"] for row in sweep], "time_s": s["time_s"],
                     "marker.time_s": s["time_s"], "tokens_per_s": d["tokens_per_s"],
                     "marker.tokens_per_s": d["tokens_per_s"], "critical_batch": d["critical_batch"],
                     "kv_bytes_per_token": d["kv_bytes_per_token"], "max_sequences": d["max_sequences"],
                     "prefill_s": d["prefill_s"]}


def _comms(d: dict, values: dict) -> dict:
    out = {key: d[key] for key in ("time_s", "steps", "bytes_sent_per_rank", "algbw", "busbw")}
    out["marker.time_s"] = d["time_s"]  # and the curves: every algorithm the model prices apart, at 13 sizes
    others = spell("comms", {flag: v for flag, v in values.items() if flag not in ("--bytes", "--algorithm")})
    curves = {}
    for algorithm in ("ring", "tree", "hierarchical"):
        points = [calc([*others, "--bytes", str(2 ** (8 + 2 * k)), "--algorithm", algorithm])[0] for k in range(13)]
        if None not in points and points[0]["algorithm"] not in {p[0]["algorithm"] for p in curves.values()}:
            curves[algorithm] = points
    return out | {f"curve.{points[0]['algorithm']}": [p["time_s"] for p in points] for points in curves.values()}


EXPECTED = {"memory": _memory, "bubble": _bubble, "search": _search, "inference": _inference, "comms": _comms}


def check_drawn(name: str, live: LiveCalculator) -> None:
    want = expected(name, live)
    got = live.drawn()
    if name == "bubble":
        got["ops"] = live.timeline()
        assert sorted(got["ops"]) == sorted(want["ops"])
        del got["ops"], want["ops"]
    assert set(want) <= set(got), sorted(set(want) - set(got))
    for key, value in want.items():  # one by one: approx compares no list inside a dict
        assert got[key] == approx(value), (name, key)


@pytest.mark.parametrize("name", NAMES)
def test_a_live_calculator_draws_the_clis_numbers_and_its_one_line_errors(calculators: Tab, name: str,
                                                                          record_property) -> None:
    sub, defaults, (flag, value), (bad_flag, bad_value) = CALCULATORS[name]
    start = time.perf_counter()
    live = LiveCalculator(calculators, name)
    values = live.values()
    assert {flag: values[flag] for flag in defaults} == defaults  # the notebook cell's call
    allowed = choices(sub) | {"--model": list(PRESETS)}  # presets are checked by the CLI, not by argparse
    assert all(set(options) <= set(allowed.get(flag, options)) for flag, options in live.selects().items())
    assert live.error() == ""
    check_drawn(name, live)

    live.change(flag, value)
    assert live.values()[flag] == value and live.error() == ""
    check_drawn(name, live)
    good = live.drawn()

    live.change(bad_flag, bad_value)
    refused, line = calc(live.argv(sub))
    assert refused is None and line.count("\n") == 0 and line
    assert live.error() == line
    assert live.drawn() == good  # the last good answer stays drawn
    assert calculators.refused == [] and calculators.errors == [], (calculators.refused, calculators.errors)
    record_property("wall_s", (f"browser   live {name}", time.perf_counter() - start))


def widget_outputs(tab: Tab, name: str):
    """The outputs holding a widget in the cell just before the calculator `name` (its snapshot)."""
    cell = tab.page.locator(".jp-Cell", has=tab.page.locator(".jupyter-widgets")).filter(
        has=tab.page.locator(f"xpath=following-sibling::*[1][@data-calc='{name}']"))
    return cell.locator(".jp-OutputArea-child", has=tab.page.locator(".jupyter-widgets"))


def test_a_chapter_page_mounts_its_calculator_in_place_of_the_snapshot(browser, served: str, record_property) -> None:
    start = time.perf_counter()
    tab = Tab(browser, served)
    try:
        tab.page.goto(served + "chapters/06_pipeline_parallel.html")
        tab.live("bubble")
        snapshot = widget_outputs(tab, "bubble")
        assert snapshot.count() == 1 and snapshot.first.is_hidden()
        check_drawn("bubble", LiveCalculator(tab, "bubble"))
        link = tab.page.locator(".live-calc-all a")
        assert link.count() == 1 and link.get_attribute("href") == "../calculators.html#Pipeline-bubble"
        assert tab.refused == [] and tab.errors == [], (tab.refused, tab.errors)
    finally:
        tab.page.close()
    record_property("wall_s", ("browser   chapters/06_pipeline_parallel.html, live", time.perf_counter() - start))


# live.js alone, with stand-ins: a runtime that is ready at once and a calculator whose mount throws.
FAKE_RUNTIME = "window.lab = {ready: Promise.resolve(), calc: async (argv) => JSON.stringify(argv)};"
THROWS = 'export function mount() { throw new Error("no such control\\nsecond line"); }'


def test_live_js_keeps_the_snapshot_when_a_mount_throws(browser, served: str) -> None:
    tab = Tab(browser, served, {"static/lab-calc.js": FAKE_RUNTIME, "static/live/bubble.js": THROWS})
    try:
        tab.page.goto(served + "chapters/06_pipeline_parallel.html")
        live = tab.page.locator('.live-calc[data-calc="bubble"]')
        tab.page.wait_for_function("() => ['live', 'error'].includes("
                                   "document.querySelector('.live-calc[data-calc=bubble]').dataset.state)")
        assert live.get_attribute("data-state") == "error"
        assert live.inner_text().strip() == "the live bubble calculator failed: no such control"
        snapshot = widget_outputs(tab, "bubble")
        assert snapshot.count() == 1 and snapshot.first.is_visible()
        assert tab.refused == [] and tab.errors == [], (tab.refused, tab.errors)
    finally:
        tab.page.close()
