"""The course's widgets work for a learner: in real JupyterLab, in a real browser, against a real kernel.

The notebook lane (tests/test_notebooks.py) proves the cells run; only a browser proves that a widget
renders and that moving it reaches the kernel and comes back. One short test per widget: open a notebook with
`open_notebook`, `run_all()`, check there are no errors, drive the widget, check its output. The welcome chapter
runs whole, as a learner's first "Run All"; every other chapter's widget runs in a notebook of its own made by
`widget_notebook` from the chapter's own cell, since re-running the whole chapter here (up to a minute each)
would only check again what the notebook lane checks: that no cell raises.

Needs Debian's /usr/bin/chromium and the playwright package (no `playwright install`); skipped otherwise.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest

from .jupyterlab import CHROMIUM, LabServer, NotebookPage, chromium, open_notebook

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"


def _missing() -> str | None:
    if not CHROMIUM.exists():
        return f"{CHROMIUM} not found (apt-get install chromium)"
    for module in ("playwright", "jupyterlab", "ipywidgets"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install -e '.[course,test]')"
    return None


pytestmark = [pytest.mark.browser, pytest.mark.skipif(_missing() is not None, reason=str(_missing()))]


@pytest.fixture(scope="module")
def lab_server(jupyter_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabServer]:
    """JupyterLab serving a temp copy of the notebook folders, so the browser cannot touch tracked files (and of
    configs/ and benchmarks/results/, which notebooks read as ../configs/tiny.toml and ../benchmarks/results)."""
    root = tmp_path_factory.mktemp("lab-root")
    for folder in ("chapters", "solutions", "exercises", "configs", "benchmarks/results"):
        if (REPO / folder).is_dir():
            shutil.copytree(REPO / folder, root / folder, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    # the learner's plotting backend (inline), not the notebook lane's Agg: plots must really be drawn here
    env = {key: value for key, value in jupyter_env.items() if key != "MPLBACKEND"}
    server = LabServer(root, env, log_path=root.with_name(f"{root.name}.log"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser(lab_server: LabServer, tmp_path_factory: pytest.TempPathFactory):
    with chromium(tmp_path_factory.mktemp("chromium-profile")) as context:
        yield context


KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def widget_notebook(server: LabServer, chapter: str, cell: str, imports: str | None = None) -> str:
    """A notebook beside `chapter` in the server's root holding `imports` (what the chapter imported for the
    widget in an earlier cell, if anything) and then the chapter's own widget cell `cell`, which the chapter
    must hold verbatim: the browser drives exactly what a learner runs. Its path relative to the root."""
    sources = [c.source for c in nbformat.read(REPO / chapter, as_version=4).cells if c.cell_type == "code"]
    assert cell in sources, f"{chapter} has no code cell that is exactly {cell!r}"
    cells = [nbformat.v4.new_code_cell(source) for source in (imports, cell) if source is not None]
    path = Path(chapter).with_name(f"{Path(chapter).stem}-widget.ipynb")  # the chapter's folder: its working dir
    nbformat.write(nbformat.v4.new_notebook(cells=cells, metadata={"kernelspec": KERNELSPEC}), server.root_dir / path)
    return path.as_posix()


def _rows(notebook: NotebookPage) -> int:
    return notebook.page.locator("table.lab-hello-ranks tbody tr").count()


def test_welcome_hello_ranks_widget(browser, lab_server: LabServer, record_property) -> None:
    start = time.perf_counter()
    with open_notebook(browser, lab_server, "chapters/00_welcome.ipynb", ARTIFACTS) as notebook:
        notebook.run_all()
        notebook.assert_no_errors()

        widget = notebook.output("table.lab-hello-ranks")
        summary = widget.locator(".lab-hello-summary")
        assert _rows(notebook) == 2 and "gave 3 " in summary.inner_text()  # the default: 2 ranks

        handle = widget.locator(".widget-slider .noUi-handle")
        handle.focus()
        # Each key press runs a new job in the kernel; wait for its table before pressing the next key.
        for key, ranks in [("ArrowRight", 3), ("ArrowRight", 4), ("ArrowLeft", 3), ("ArrowLeft", 2),
                           ("ArrowLeft", 1)]:
            handle.press(key)
            total = ranks * (ranks + 1) // 2
            summary.filter(has_text=f"gave {total} ").wait_for(timeout=30_000)
            assert _rows(notebook) == ranks
            assert widget.locator(".widget-readout").inner_text().strip() == str(ranks)
        handle.press("ArrowRight")  # end on 2 ranks, so the saved screenshot shows a table
        summary.filter(has_text="gave 3 ").wait_for(timeout=30_000)
        notebook.assert_no_errors()
    record_property("wall_s", ("browser   chapters/00_welcome.ipynb", time.perf_counter() - start))


def test_memory_calculator_reacts_to_the_sequence_slider(browser, lab_server: LabServer, record_property) -> None:
    start = time.perf_counter()
    chapter = widget_notebook(lab_server, "chapters/01_memory_and_compute.ipynb",
                              "from lab.widgets.memory import memory_calculator\n\nmemory_calculator()")
    with open_notebook(browser, lab_server, chapter, ARTIFACTS) as notebook:
        notebook.run_all()
        notebook.assert_no_errors()
        widget = notebook.output(".lab-memory-total")
        total = widget.locator(".lab-memory-total")
        before = total.inner_text()
        assert "GiB" in before and widget.locator("img").count() >= 1  # the bar chart was drawn
        seq = widget.locator(".widget-hslider", has=notebook.page.locator(".widget-label", has_text="seq"))
        assert seq.locator(".widget-readout").inner_text().strip() == "4096"
        handle = seq.locator(".noUi-handle")
        handle.focus()
        handle.press("ArrowRight")  # 4096 -> 8192: activations grow with s², the total must grow
        seq.locator(".widget-readout", has_text="8192").wait_for(timeout=30_000)
        deadline = time.monotonic() + 30  # the HTML widget re-renders its element: poll the text
        while (after := total.inner_text()) == before and time.monotonic() < deadline:
            time.sleep(0.2)
        gib = lambda text: float(text.split(" GiB")[0].replace(",", ""))  # noqa: E731
        assert gib(after) > gib(before), (before, after)
        notebook.assert_no_errors()
    record_property("wall_s", (f"browser   {chapter}", time.perf_counter() - start))


def _wait_for_change(locator, before: str, timeout_s: float = 30.0, attribute: str | None = None) -> str:
    """Poll until the element's text (or `attribute`) differs from `before`: output widgets re-render their
    elements, so a handle taken before the change may point at a replaced node."""
    read = (lambda: locator.get_attribute(attribute)) if attribute else locator.inner_text
    deadline = time.monotonic() + timeout_s
    while (after := read()) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    return after


def test_ring_attention_explorer_follows_the_step_slider_and_the_layout(browser, lab_server: LabServer,
                                                                        record_property) -> None:
    start = time.perf_counter()
    chapter = widget_notebook(lab_server, "chapters/05_context_parallel.ipynb", "ring_attention_explorer()",
                              imports="from lab.widgets.cp import ring_attention_explorer")
    with open_notebook(browser, lab_server, chapter, ARTIFACTS) as notebook:
        notebook.run_all()
        notebook.assert_no_errors()
        # the output area holding the widget, found by a control's label (the summary vanishes on an error)
        widget = notebook.output(".widget-label", "ring step")
        step_line, balance = widget.locator(".lab-cp-step"), widget.locator(".lab-cp-balance")
        assert step_line.inner_text().startswith("step 0 of 3:")  # the default: cp=4, contiguous, causal
        assert "max/mean work per rank: 1.750" in balance.inner_text()
        image = widget.locator(".widget-output img")
        assert image.count() == 1  # the matrix and the bars were drawn
        drawn = image.get_attribute("src")

        slider = widget.locator(".widget-hslider", has=notebook.page.locator(".widget-label", has_text="ring step"))
        handle = slider.locator(".noUi-handle")
        handle.focus()
        handle.press("ArrowRight")  # step 0 -> 1: other blocks are computed, rank 0 now holds rank 3's K/V
        step_line.filter(has_text="step 1 of 3:").wait_for(timeout=30_000)
        assert "rank 0 ← K/V of rank 3" in step_line.inner_text()
        drawn = _wait_for_change(widget.locator(".widget-output img"), drawn, attribute="src")
        assert drawn and drawn.startswith("data:image/png")

        widget.locator(".widget-toggle-button", has_text="zigzag").click()  # zig-zag: every rank the same work
        balance.filter(has_text="max/mean work per rank: 1.000").wait_for(timeout=30_000)
        assert "chunk 3+4" in step_line.inner_text()  # at step 1 rank 0 holds rank 3's chunks 3 and 4
        assert _wait_for_change(widget.locator(".widget-output img"), drawn, attribute="src") != drawn

        seq = widget.locator(".widget-text", has=notebook.page.locator(".widget-label", has_text="seq"))
        seq = seq.locator("input")
        seq.fill("1001")
        seq.press("Enter")  # not divisible by 2*cp = 8: one line instead of the chart
        error = widget.locator(".lab-error")
        error.filter(has_text="seq_len=1001 must be divisible by 2*cp = 8").wait_for(timeout=30_000)
        widget.locator(".widget-output img").wait_for(state="detached", timeout=30_000)
        assert step_line.count() == 0
        seq.fill("1680")
        seq.press("Enter")
        widget.locator(".widget-output img").wait_for(timeout=30_000)
        assert error.count() == 0
        notebook.assert_no_errors()
    record_property("wall_s", (f"browser   {chapter}", time.perf_counter() - start))


def test_zero_ladder_follows_the_stage_and_the_number_of_ranks(browser, lab_server: LabServer,
                                                               record_property) -> None:
    start = time.perf_counter()
    chapter = widget_notebook(lab_server, "chapters/03_data_parallel_zero.ipynb",
                              "from lab.widgets.zero import zero_ladder\n\nzero_ladder()")
    with open_notebook(browser, lab_server, chapter, ARTIFACTS) as notebook:
        notebook.run_all()
        notebook.assert_no_errors()
        widget = notebook.output(".widget-label", "ZeRO stage")
        total = widget.locator(".lab-zero-total")
        # the ZeRO paper's Figure 1: Ψ = 7.5 B on N_d = 64 GPUs, stage 3
        assert total.inner_text().startswith("ZeRO-3 (P_os+g+p): 1.88 GB per GPU")
        image = widget.locator(".widget-output img")
        assert image.count() == 1
        drawn = image.get_attribute("src")

        # ZeRO-1: only the optimizer states are sharded
        widget.locator(".widget-toggle-button", has_text=re.compile(r"^\s*1\s*$")).click()
        total.filter(has_text="ZeRO-1 (P_os): 31.41 GB per GPU").wait_for(timeout=30_000)
        drawn = _wait_for_change(widget.locator(".widget-output img"), drawn, attribute="src")  # the outline moved

        dp = widget.locator(".widget-text", has=notebook.page.locator(".widget-label", has_text="N_d")).locator("input")
        dp.fill("8")
        dp.press("Enter")  # 16 + 12/8 = 17.5 bytes per parameter: 7.5 B x 5.5 = 41.25 GB
        total.filter(has_text="ZeRO-1 (P_os): 41.25 GB per GPU").wait_for(timeout=30_000)
        assert _wait_for_change(widget.locator(".widget-output img"), drawn, attribute="src") != drawn

        dp.fill("0")
        dp.press("Enter")
        widget.locator(".lab-error", has_text="N_d=0 must be an integer from 1 to").wait_for(timeout=30_000)
        widget.locator(".widget-output img").wait_for(state="detached", timeout=30_000)
        assert total.count() == 0
        dp.fill("64")
        dp.press("Enter")
        total.filter(has_text="ZeRO-1 (P_os): 31.41 GB per GPU").wait_for(timeout=30_000)
        widget.locator(".widget-output img").wait_for(timeout=30_000)
        assert widget.locator(".lab-error").count() == 0
        notebook.assert_no_errors()
    record_property("wall_s", (f"browser   {chapter}", time.perf_counter() - start))


def test_pipeline_explorer_redraws_for_each_schedule(browser, lab_server: LabServer, record_property) -> None:
    start = time.perf_counter()
    chapter = widget_notebook(lab_server, "chapters/06_pipeline_parallel.ipynb", "pipeline_explorer()",
                              imports="from lab.widgets.pipeline import pipeline_explorer")
    with open_notebook(browser, lab_server, chapter, ARTIFACTS) as notebook:
        notebook.run_all()
        notebook.assert_no_errors()
        # the chapter's first explorer opens on the playbook's exercise: 1F1B, p = 4, m = 8
        widget = notebook.output(".widget-label", "pp (ranks)")
        bubble, activations = widget.locator(".lab-pp-bubble"), widget.locator(".lab-pp-activations")
        assert "bubble ratio (idle / useful) 0.375" in bubble.inner_text()  # (p-1)/m
        assert "rank 0: 4, rank 1: 3, rank 2: 2, rank 3: 1" in activations.inner_text()
        image = widget.locator(".widget-output img")
        assert image.count() == 1  # the timeline and the activations per rank were drawn
        drawn = image.get_attribute("src")

        def choose(schedule: str) -> None:
            widget.locator(".widget-toggle-button", has_text=re.compile(f"^\\s*{re.escape(schedule)}\\s*$")).click()

        choose("afab")  # the same bubble, but every rank holds all m micro-batches
        activations.filter(has_text="rank 0: 8, rank 1: 8, rank 2: 8, rank 3: 8").wait_for(timeout=30_000)
        assert "bubble ratio (idle / useful) 0.375" in bubble.inner_text()
        drawn = _wait_for_change(widget.locator(".widget-output img"), drawn, attribute="src")
        assert drawn and drawn.startswith("data:image/png")

        choose("zb-h1")  # W's fill the cool-down: (p-1)(t_f + t_b - 2 t_w) / (m (t_f + t_b)) = 3/24
        bubble.filter(has_text="bubble ratio (idle / useful) 0.125").wait_for(timeout=30_000)
        drawn = _wait_for_change(widget.locator(".widget-output img"), drawn, attribute="src")

        choose("interleaved")  # brings v = 2 along: (p-1)/(v m) = 3/16
        bubble.filter(has_text="bubble ratio (idle / useful) 0.1875").wait_for(timeout=30_000)
        chunks = widget.locator(".widget-hslider", has=notebook.page.locator(".widget-label", has_text="chunks"))
        assert chunks.locator(".widget-readout").inner_text().strip() == "2"
        assert _wait_for_change(widget.locator(".widget-output img"), drawn, attribute="src") != drawn

        microbatches = widget.locator(".widget-hslider",
                                      has=notebook.page.locator(".widget-label", has_text="micro-batches"))
        handle = microbatches.locator(".noUi-handle")
        handle.focus()
        handle.press("ArrowLeft")  # m = 7 is not a multiple of p = 4: one line instead of the chart
        error = widget.locator(".lab-error")
        error.filter(has_text="microbatches=7 must be a multiple of pp=4").wait_for(timeout=30_000)
        widget.locator(".widget-output img").wait_for(state="detached", timeout=30_000)
        assert bubble.count() == 0
        handle.press("ArrowRight")
        bubble.filter(has_text="bubble ratio (idle / useful) 0.1875").wait_for(timeout=30_000)
        widget.locator(".widget-output img").wait_for(timeout=30_000)
        assert error.count() == 0
        notebook.assert_no_errors()
    record_property("wall_s", (f"browser   {chapter}", time.perf_counter() - start))


def test_capacity_explorer_drops_more_as_the_capacity_shrinks(browser, lab_server: LabServer,
                                                             record_property) -> None:
    start = time.perf_counter()
    chapter = widget_notebook(lab_server, "chapters/07_expert_parallel.ipynb", "moe_explorer()",
                              imports="from lab.widgets.moe import moe_explorer")
    with open_notebook(browser, lab_server, chapter, ARTIFACTS) as notebook:
        notebook.run_all()
        notebook.assert_no_errors()
        widget = notebook.output(".widget-label", "capacity factor")
        dropped = widget.locator(".lab-moe-dropped")

        def count() -> int:
            return int(re.search(r"dropped ([\d,]+) of", dropped.inner_text()).group(1).replace(",", ""))

        before, text, drawn = count(), dropped.inner_text(), widget.locator(".widget-output img").get_attribute("src")
        slider = widget.locator(".widget-hslider", has=notebook.page.locator(".widget-label",
                                                                             has_text="capacity factor"))
        handle = slider.locator(".noUi-handle")
        handle.focus()
        for _ in range(5):  # 1.25 -> 1.0: every expert takes fewer assignments
            handle.press("ArrowLeft")
        slider.locator(".widget-readout").filter(has_text=re.compile(r"^\s*1\.0+\s*$")).wait_for(timeout=30_000)
        _wait_for_change(dropped, text)
        assert count() > before, (before, count())
        assert _wait_for_change(widget.locator(".widget-output img"), drawn, attribute="src") != drawn
        notebook.assert_no_errors()
    record_property("wall_s", (f"browser   {chapter}", time.perf_counter() - start))


def test_config_explorer_reranks_when_the_gpu_count_changes(browser, lab_server: LabServer, record_property) -> None:
    """The chapter 08 explorer, alone in a one-cell notebook (the chapter also trains on 8 ranks: slow to run
    here): it renders the search's ranking, and 256 GPUs instead of 8 put another layout on top."""
    from lab.calc.search import search

    start = time.perf_counter()
    cell = nbformat.v4.new_code_cell("from lab.widgets.search import config_explorer\n\nconfig_explorer()")
    notebook_file = nbformat.v4.new_notebook(cells=[cell], metadata={"kernelspec": KERNELSPEC})
    nbformat.write(notebook_file, lab_server.root_dir / "config_explorer.ipynb")
    on_8, on_256 = (search("llama3-8b", gpus).top(1)[0].layout for gpus in (8, 256))
    assert on_8 != on_256
    with open_notebook(browser, lab_server, "config_explorer.ipynb", ARTIFACTS) as notebook:
        notebook.run_all()
        notebook.assert_no_errors()
        widget = notebook.output(".widget-label", "global batch (tokens)")
        best = widget.locator(".lab-search-best")
        assert best.inner_text().startswith(f"Best: {on_8},")  # llama3-8b on one node of 8 H100s
        assert widget.locator("table.lab-search-table tbody tr").count() == 10
        image = widget.locator(".widget-output img")
        assert image.count() == 1  # the memory bars and the time split were drawn
        drawn = image.get_attribute("src")

        label = notebook.page.locator(".widget-label", has_text=re.compile(r"^GPUs$"))
        gpus = widget.locator(".widget-text", has=label).locator("input")
        gpus.fill("256")
        gpus.press("Enter")
        best.filter(has_text=f"Best: {on_256},").wait_for(timeout=30_000)
        assert _wait_for_change(widget.locator(".widget-output img"), drawn, attribute="src") != drawn

        gpus.fill("12")  # not whole nodes of 8: one line instead of the results
        gpus.press("Enter")
        error = widget.locator(".lab-error")
        error.filter(has_text="gpus=12 must be a multiple of gpus_per_node=8").wait_for(timeout=30_000)
        widget.locator(".widget-output img").wait_for(state="detached", timeout=30_000)
        assert best.count() == 0 and widget.locator("table.lab-search-table").count() == 0
        gpus.fill("8")
        gpus.press("Enter")
        best.filter(has_text=f"Best: {on_8},").wait_for(timeout=30_000)
        widget.locator(".widget-output img").wait_for(timeout=30_000)
        assert error.count() == 0
        notebook.assert_no_errors()
    record_property("wall_s", ("browser   config_explorer.ipynb", time.perf_counter() - start))
