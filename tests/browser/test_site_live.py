"""The five live calculators of the course's site (issue 38) in headless Chromium, served over http by lab.site's own
server, with every request to another host refused and recorded.

Each page opens on the notebook cell's defaults; the test reads the numbers the calculator drew (every drawn number
keeps its exact JSON value in data-value, lab/site_static/live/ui.js) and compares them with `python -m lab calc ...
--json` run here for the argv the page's controls spell; then it changes one control and compares again; then it
gives one input the CLI refuses and checks that the CLI's one error line shows while the last good drawing stays.
The selects offer only what the CLI accepts (its argparse choices). No request left the local server.

It reads the site/ that `make test` builds after the main suite; skipped when there is none or it has no Pyodide
(`make site` vendors it).
"""

from __future__ import annotations

import contextlib
import io
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.calc import cli
from lab.config import PRESETS
from lab.site import server

from .jupyterlab import chromium
from .test_lab_browser import _missing

REPO = Path(__file__).resolve().parents[2]
SITE = REPO / "site"
RUNTIME = ("static/live/ui.js", "static/lab-calc.zip", "static/pyodide/pyodide.asm.wasm")
LIVE_TIMEOUT_MS = 180_000  # the first page starts Pyodide: ~10 s here, more on a loaded CI machine
REL = 1e-12  # Pyodide's libm may round a last bit unlike this CPython's (seen: comms, hierarchical)

pytestmark = [pytest.mark.browser, pytest.mark.skipif(_missing() is not None, reason=str(_missing())),
              pytest.mark.skipif(not all((SITE / path).exists() for path in RUNTIME),
                                 reason="no site/ with the live calculators' runtime: run `make site`")]


def calc(argv: list[str]) -> tuple[dict | None, str]:
    """`python -m lab calc <argv> --json` in this process: (its JSON, None) or (None, its one error line)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main([*argv, "--json"])
        except SystemExit as exit:
            code = exit.code
    return (json.loads(out.getvalue()), "") if code == 0 else (None, err.getvalue().strip())


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


class LiveCalculator:
    """One live calculator on its page: its controls, what it drew, and what the page asked of the network."""

    def __init__(self, context, base: str, page: str, name: str) -> None:
        self.page = context.new_page()
        self.outside: list[str] = []
        self.errors: list[str] = []
        self.page.route("**/*", lambda route: route.continue_() if route.request.url.startswith(base)
                        else (self.outside.append(route.request.url), route.abort()))
        self.page.on("console", lambda message: message.type == "error" and self.errors.append(message.text))
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        start = time.perf_counter()
        self.page.goto(base + page)
        self.root = self.page.locator(f'.live-calc[data-calc="{name}"]')
        self.root.and_(self.page.locator('[data-state="live"]')).wait_for(timeout=LIVE_TIMEOUT_MS)
        self.live_s = time.perf_counter() - start
        self.ui = self.root.locator(".live-ui")

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
def base() -> Iterator[str]:
    """lab.site's server (what `python -m lab site --serve` runs) on a free port, serving site/."""
    httpd = server(SITE, 0)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    with chromium(tmp_path_factory.mktemp("chromium-profile")) as context:
        yield context


def approx(expected: object) -> object:
    return pytest.approx(expected, rel=REL, abs=0)


# name: (page, sub, the notebook call's arguments, one control changed, one input the CLI refuses)
CALCULATORS = {
    "memory": ("chapters/01_memory_and_compute.html", "memory", {"--model": "llama3-8b", "--seq": "4096"},
               ("--tp", "2"), ("--tp", "64")),
    "bubble": ("chapters/06_pipeline_parallel.html", "bubble",
               {"--pp-schedule": "1f1b", "--pp": "4", "--grad-accum": "8", "--tf": "1", "--tb": "2", "--tw": "1"},
               ("--pp", "6"), ("--tw", "3")),
    "search": ("chapters/08_5d_parallelism.html", "search",
               {"--model": "llama3-70b", "--gpus": "256", "--gpus-per-node": "8", "--seq": "8192",
                "--gbs-tokens": "4M"}, ("--hardware", "h200"), ("--gpus", "100")),
    "inference": ("chapters/11_inference.html", "inference",
                  {"--model": "llama3-8b", "--hardware": "h100", "--batch": "1", "--seq": "4096"},
                  ("--batch", "32"), ("--model", "smollm-135m")),
    "comms": ("chapters/02_collectives.html", "comms",
              {"--op": "all_reduce", "--bytes": "1GiB", "--ranks": "16", "--hardware": "h100"},
              ("--ranks", "64"), ("--bytes", "1XB")),
}


def expected(name: str, live: LiveCalculator) -> dict[str, object]:
    """What `name` must have drawn for its controls' argv, from the CLI here (keys as in drawn())."""
    values = live.values()
    argv = spell(CALCULATORS[name][1], values)
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


@pytest.mark.parametrize("name", list(CALCULATORS))
def test_a_live_calculator_draws_the_clis_numbers_and_its_one_line_errors(browser, base, name, record_property):
    page, sub, defaults, (flag, value), (bad_flag, bad_value) = CALCULATORS[name]
    start = time.perf_counter()
    live = LiveCalculator(browser, base, page, name)
    try:
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
        assert live.outside == [] and live.errors == []
    finally:
        live.page.close()
    record_property("wall_s", (f"browser   live {name}", time.perf_counter() - start))
    record_property("live_s", live.live_s)
