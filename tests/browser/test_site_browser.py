"""The course site (`make site`, lab/site.py) in headless Chromium, with every request off this machine refused:
the index lists every chapter (its links all resolve, its exercise pages show no solution), and chapter 01 shows
its plots, its equations, and the memory calculator drawn by the widgets' html-manager from the saved state
(widget DOM, not the state's JSON), which stays, opened from disk, while the live calculator says in one line how to
serve the site.

It reads the site/ that `make test` builds after the main suite (whose notebook tests saved the executed
chapters); skipped when there is none (`make site` builds it).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_site import broken_links, leaked_solution_lines, outside_loads

from .jupyterlab import chromium
from .test_lab_browser import ARTIFACTS, _missing

REPO = Path(__file__).resolve().parents[2]
SITE = REPO / "site"
CHAPTER = "chapters/01_memory_and_compute.html"

pytestmark = [pytest.mark.browser, pytest.mark.skipif(_missing() is not None, reason=str(_missing())),
              pytest.mark.skipif(not (SITE / "index.html").exists(), reason="no site/: run `make site`")]


class SitePage:
    """A page of the site in a fresh tab, opened from file://; what it asked of the network and what it logged."""

    def __init__(self, context, path: str) -> None:
        self.page = context.new_page()
        self.outside: list[str] = []
        self.errors: list[str] = []
        self.page.route("**/*", self._only_files)
        self.page.on("console", lambda message: message.type == "error" and self.errors.append(message.text))
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.goto((SITE / path).as_uri())

    def _only_files(self, route) -> None:
        if route.request.url.startswith("file://"):
            route.continue_()
        else:
            self.outside.append(route.request.url)
            route.abort()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    with chromium(tmp_path_factory.mktemp("chromium-profile")) as context:
        yield context


def test_the_index_links_every_chapter_and_every_link_resolves(browser, record_property) -> None:
    start = time.perf_counter()
    chapters = sorted(path.stem for path in (REPO / "chapters").glob("*.ipynb"))
    assert sorted(path.stem for path in (SITE / "chapters").glob("*.html")) == chapters
    assert broken_links(SITE) == [] and outside_loads(SITE) == []
    for exercise in sorted((REPO / "exercises").glob("*.ipynb")):
        page = SITE / "exercises" / f"{exercise.stem}.html"
        assert leaked_solution_lines(REPO / "solutions" / exercise.name, exercise, page) == [], exercise.name
    site = SitePage(browser, "index.html")
    try:
        for name in chapters:
            assert site.page.locator(f'a[href="chapters/{name}.html"]').first.is_visible(), name
        site.page.locator('a[rel="next"]').first.click()
        site.page.wait_for_url("**/chapters/00_welcome.html")
        assert site.outside == [] and site.errors == []
    finally:
        site.page.close()
    record_property("wall_s", ("browser   site/index.html", time.perf_counter() - start))


def test_a_chapter_shows_its_plots_equations_and_a_widget_snapshot(browser, record_property) -> None:
    start = time.perf_counter()
    site = SitePage(browser, CHAPTER)
    page = site.page
    try:
        # the html-manager replaced the saved view by the calculator's DOM: controls, the summary, its bar chart
        widget = page.locator(".jupyter-widgets", has=page.locator(".lab-memory-total")).first
        widget.wait_for(timeout=30_000)
        total = widget.locator(".lab-memory-total").first
        assert "GiB" in total.inner_text()
        assert widget.locator(".widget-hslider .widget-readout").first.inner_text().strip() == "4096"  # seq
        loaded = "img => img.complete && img.naturalWidth > 0"
        assert widget.locator("img").first.evaluate(loaded)
        assert page.locator(".site-note", has_text="live in JupyterLab").is_visible()
        # opened from disk, the live calculator cannot start: it says in one line how to serve the site, and the
        # snapshot stays
        live = page.locator('.live-calc[data-calc="memory"]')
        page.wait_for_function("() => document.querySelector('.live-calc[data-calc=memory]').dataset.state "
                               "=== 'offline'", timeout=30_000)
        said = live.inner_text().strip()
        assert "\n" not in said and "make site-serve" in said and "python -m lab site --serve" in said
        assert widget.is_visible()
        # the chapter's own matplotlib figures, embedded as PNG
        plots = page.locator('.jp-RenderedImage img[src^="data:image/png"]')
        assert plots.count() >= 2 and plots.first.evaluate(loaded)
        page.locator("mjx-container").first.wait_for(timeout=30_000)  # MathJax typeset, from static/
        body = page.locator("body").inner_text()
        assert "model_id" not in body and "widget-view+json" not in body  # no raw widget JSON on the page
        total.scroll_into_view_if_needed()
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "site-01_memory_and_compute.png"))
        assert site.outside == [], site.outside
        assert site.errors == [], site.errors
    finally:
        page.close()
    record_property("wall_s", ("browser   site/" + CHAPTER, time.perf_counter() - start))
