"""`python -m lab site`: the course as a static web site, from the chapter notebooks the test suite executed.

    python -m lab site                 build/executed/chapters/*.ipynb -> site/   (`make site` runs this)
    python -m lab site --serve         serve site/ at http://127.0.0.1:8000/      (`make site-serve`)

Nothing is executed here: tests/test_notebooks.py saves every chapter it runs, outputs and widget state included
(nbclient stores the state), under build/executed/chapters/. A missing or stale copy is one line and exit 2.

Why nbconvert's HTMLExporter with one small template (site.html.j2): it comes with JupyterLab (jupyter_server
requires it), renders outputs as JupyterLab's own "lab" template does, embeds plots as PNG data, and writes the
saved widget state into the page, where @jupyter-widgets/html-manager draws the calculators as they were left. A
book builder (Jupyter Book, Sphinx with myst-nb) would bring a second toolchain for the same exporter and the
same html-manager, and a theme to keep.

Offline: the "lab" template fetches require.js, MathJax and the html-manager from CDNs. The site's template loads
none of them: html-manager's standalone dist/embed.js (no require.js needed) and MathJax 3's es5/tex-svg-full.js
(fonts inside the one file) are copied from `--vendor`, which `make site` unpacks from the npm packages
@jupyter-widgets/html-manager and mathjax (versions pinned in the Makefile).

Live calculators: the pages named in LIVE_CALCULATORS get a `<div class="live-calc">` after the calculator's cell,
and site/calculators.html holds all of them on one page (each under its title, with a link to its chapter's section);
static/live.js fills them with controls computed by `window.lab.calc` (static/lab-calc.js): `python -m lab calc`
itself, run by Pyodide (CPython in WebAssembly, the npm package `pyodide`, unpacked by `make site` like the others)
in a Web Worker, from static/lab-calc.zip, which `build` zips from this checkout's lab.calc, lab.config and
lab.layout (pure Python: no torch, no numpy, no package from Pyodide's repository). Browsers refuse workers and
WebAssembly from file://, so the live calculators need the site served over http (`--serve`); opened from disk, a
page keeps its snapshots and says how to serve it.

Cost, measured in headless Chromium (tests/browser/test_site_live.py records it) on a 2-core machine under load:
the runtime is ready 4-8 s after the first call on a page, cold or cached, and a calc then takes 55-115 ms. It adds
13.6 MB to site/: Pyodide's pyodide.asm.wasm 9.6 MB, python_stdlib.zip 2.5 MB, its loader 1.3 MB, lab-calc.zip 0.13 MB.

The site mirrors the repository, so a link between notebooks keeps working once .ipynb becomes .html:
site/index.html (course/syllabus.md and the list of pages), site/calculators.html, site/chapters/*.html,
site/exercises/*.html with the *.ipynb beside them to download (the released stubs of exercises/, never solutions/),
site/static/.
"""

from __future__ import annotations

import argparse
import http.server
import re
import shutil
import sys
import zipfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple
from urllib.parse import quote, unquote

if TYPE_CHECKING:  # imported where pages are built: `--serve` prints its URL without them (nbformat alone takes ~1 s)
    import nbformat
    from nbconvert import HTMLExporter

REPO = Path(__file__).resolve().parents[1]
EXECUTED = REPO / "build" / "executed"
VENDOR = REPO / "build" / "site-vendor"
STATIC = Path(__file__).parent / "site_static"  # the site's own scripts and styles, copied into site/static/
VENDORED = ("html-manager/embed.js", "mathjax/tex-svg-full.js", "pyodide/pyodide.mjs", "pyodide/pyodide.asm.wasm",
            "pyodide/python_stdlib.zip", "pyodide/pyodide-lock.json")
# What `python -m lab calc` imports, zipped into static/lab-calc.zip for the page's Python
# (tests/test_site.py checks the CLI needs nothing else, and that none of it imports torch or numpy).
CALC_SOURCES = ("lab/__init__.py", "lab/calc/*.py", "lab/config.py", "lab/layout.py")
SERVE_PORT = 8000


class Live(NamedTuple):
    """A live calculator: after the first code cell of its page whose source contains `marker`, the page gets
    <div class="live-calc" data-calc="name">, which static/live.js fills from static/live/name.js. calculators.html
    shows it under `title`, with `what` (one line: what it computes) and a link to the section of that cell."""

    marker: str
    name: str
    title: str
    what: str


# The live calculators, by page (its notebook): the chapter pages and calculators.html are written from this table.
LIVE_CALCULATORS: dict[str, list[Live]] = {
    "chapters/01_memory_and_compute.ipynb": [Live(
        "memory_calculator()", "memory", "Memory per GPU",
        "What the fullest GPU holds while training (parameters, gradients, optimizer states, activations) for a "
        "model, a layout and a chip, against the chip's memory.")],
    "chapters/02_collectives.ipynb": [Live(  # the cell whose numbers are the calculator's defaults
        'system="h100", algorithm=algorithm)', "comms", "Collective cost",
        "The α–β time of one collective on a cluster, and its time against the message size for the ring, tree "
        "and hierarchical algorithms: where latency bounds it and where bandwidth does.")],
    "chapters/06_pipeline_parallel.ipynb": [Live(
        "pipeline_explorer()", "bubble", "Pipeline bubble",
        "A pipeline schedule (AFAB, 1F1B, interleaved, zero bubble) played op by op: its timeline, bubble ratio "
        "and the activations each rank holds at its peak.")],
    "chapters/08_5d_parallelism.ipynb": [Live(
        "config_explorer(", "search", "Training layout search",
        "The layouts (dp, tp, pp, cp, ep, ZeRO) of a model on a cluster that fit in memory, ranked by modelled "
        "tokens/s, and why the others do not run.")],
    "chapters/11_inference.ipynb": [Live(
        "inference_explorer(", "inference", "Inference step",
        "One decode step's time and tokens/s against the batch on a chip's roofline, the critical batch where "
        "it turns compute-bound, the KV cache per token and the prefill time.")],
}
CALCULATORS_PAGE = "calculators.html"
# What `make course` serves (its default PORT); each page links its notebook there.
LAB_URL = "http://localhost:8888/lab/tree/"
RUN_THE_TESTS = ("run `make test`, or only the chapters: "
                 ".venv/bin/python -m pytest -n 2 tests/test_notebooks.py -k chapters/")
# a relative Markdown link to a notebook: [text](../exercises/05_context_parallel.ipynb#part)
_NOTEBOOK_LINK = re.compile(r"\]\((?![a-z]+:)([^)\s#]+)\.ipynb")
_RELATIVE_LINK = re.compile(r"\]\((?![a-z]+:)([^)\s#]+)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.MULTILINE)


@dataclass
class Page:
    source: str  # the notebook's path in the repository, e.g. "chapters/01_memory_and_compute.ipynb"
    nb: nbformat.NotebookNode
    title: str

    @property
    def html(self) -> str:
        return self.source.removesuffix(".ipynb") + ".html"

    @property
    def link(self) -> dict[str, str]:
        """What the navigation of another page shows of this one."""
        return {"html": self.html, "title": self.title}


def _title(nb: nbformat.NotebookNode, fallback: str) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown" and (heading := re.search(r"^#\s+(.+)$", cell.source, re.MULTILINE)):
            return heading.group(1).strip()
    return fallback


def _executed_chapters(repo: Path, executed: Path) -> list[Page]:
    """The executed copy of every chapter in repo/chapters/; ValueError (one line) naming those missing or stale."""
    import nbformat

    pages, missing, stale = [], [], []
    for path in sorted((repo / "chapters").glob("*.ipynb")):
        rel = path.relative_to(repo).as_posix()
        if not (executed / rel).exists():
            missing.append(rel)
            continue
        nb = nbformat.read(executed / rel, as_version=4)
        if [c.source for c in nb.cells] != [c.source for c in nbformat.read(path, as_version=4).cells]:
            stale.append(rel)
        pages.append(Page(rel, nb, _title(nb, path.stem)))
    if missing or stale:
        said = [f"no executed copy of {', '.join(missing)}"] if missing else []
        said += [f"the executed copy of {', '.join(stale)} is older than the notebook"] if stale else []
        raise ValueError(f"{'; '.join(said)} (in {executed}): {RUN_THE_TESTS}")
    if not pages:
        raise ValueError(f"no chapter notebooks in {repo / 'chapters'}")
    return pages


def _exercises(repo: Path) -> list[Page]:
    """The released stubs, as they are (not executed): what a learner downloads."""
    import nbformat

    notebooks = {path: nbformat.read(path, as_version=4) for path in sorted((repo / "exercises").glob("*.ipynb"))}
    return [Page(path.relative_to(repo).as_posix(), nb, _title(nb, path.stem)) for path, nb in notebooks.items()]


def _index(repo: Path, chapters: list[Page], exercises: list[Page]) -> Page:
    """The syllabus, then a link to every page: one markdown notebook, converted like the others."""
    import nbformat

    by_stem = {Path(page.source).stem: page for page in exercises}
    lines = ["## Read the course", "",
             f"[All the calculators on one page]({CALCULATORS_PAGE}): computed in your browser by the code of "
             "`python -m lab calc` when the site is served (`make site-serve`).", ""]
    for page in chapters:
        line = f"- [{page.title}]({page.html})"
        if (exercise := by_stem.get(Path(page.source).stem)) is not None:
            line += f" · exercises: [read]({exercise.html}), [download]({exercise.source})"
        lines.append(line)
    cells = [nbformat.v4.new_markdown_cell((repo / "course" / "syllabus.md").read_text()),
             nbformat.v4.new_markdown_cell("\n".join(lines))]
    return Page("index.ipynb", nbformat.v4.new_notebook(cells=cells), "Ultra-Scale Lab")


def _live_cells(pages: list[Page], live: dict[str, list[Live]]) -> dict[str, dict[int, list[Live]]]:
    """page source -> {index of the cell live calculators follow: those calculators}; ValueError (one line) naming a
    page that is not in the site or a marker that no code cell of its page contains."""
    by_source = {page.source: page for page in pages}
    cells: dict[str, dict[int, list[Live]]] = {}
    for source, entries in live.items():
        if source not in by_source:
            raise ValueError(f"LIVE_CALCULATORS names {source}, which is not a page of the site")
        for calculator in entries:
            index = next((i for i, cell in enumerate(by_source[source].nb.cells)
                          if cell.cell_type == "code" and calculator.marker in cell.source), None)
            if index is None:
                raise ValueError(f"LIVE_CALCULATORS: no code cell of {source} contains {calculator.marker!r} (the "
                                 f"{calculator.name} calculator goes after it): fix the marker in lab/site.py")
            cells.setdefault(source, {}).setdefault(index, []).append(calculator)
    return cells


def _section(nb: nbformat.NotebookNode, index: int) -> str | None:
    """The last Markdown heading above cell `index` (the section a calculator sits in), or None."""
    headings = [heading for cell in nb.cells[:index] if cell.cell_type == "markdown"
                for heading in _HEADING.findall(cell.source)]
    return headings[-1] if headings else None


def _anchor(heading: str) -> str:
    """The id nbconvert gives a Markdown heading (nbconvert/filters/strings.py, add_anchor): its text, spaces as
    dashes, percent-encoded where a URL fragment needs it. Inline code and emphasis marks are not text."""
    text = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", re.sub(r"[`*]", "", heading))
    return quote(text.replace(" ", "-"), safe="?/:@!$&'()*+,;=")


def _calculators(pages: list[Page], cells: dict[str, dict[int, list[Live]]]) -> tuple[Page, dict[int, list[Live]]]:
    """calculators.html: every live calculator under its title, with what it computes and a link to the section of
    its chapter; and the cells the calculators follow (one Markdown cell each)."""
    import nbformat

    intro = ("# All the calculators\n\nThe course's calculators on one page. Each computes in your browser with "
             "`lab.calc`, the code of `python -m lab calc`, once the site is served (`make site-serve`); opened from "
             "disk, it says how to serve the site. Each also sits in its chapter, after the notebook's widget (live "
             "in JupyterLab: `make course`).")
    notebook_cells, live = [nbformat.v4.new_markdown_cell(intro)], {}
    for page in (page for page in pages if page.source in cells):
        for index, calculators in sorted(cells[page.source].items()):
            section = _section(page.nb, index)
            where = page.source + (f"#{_anchor(section)}" if section else "")
            for calculator in calculators:
                live[len(notebook_cells)] = [calculator]
                notebook_cells.append(nbformat.v4.new_markdown_cell(
                    f"## {calculator.title}\n\n{calculator.what} In [{page.title}]({where})"
                    + (f", section “{re.sub(r'[`*]', '', section)}”." if section else ".")))
    return Page("calculators.ipynb", nbformat.v4.new_notebook(cells=notebook_cells), "All the calculators"), live


def _linked_sources(pages: list[Page], repo: Path) -> list[Path]:
    """The repository's files (not notebooks: they become pages; nothing of solutions/) that a page's Markdown links,
    e.g. chapter 09's ../lab/inference/cuda_graph.py: the site holds a copy, so that the link keeps working."""
    repo = repo.resolve()
    found = set()
    for page in pages:
        for cell in (c for c in page.nb.cells if c.cell_type == "markdown"):
            for link in _RELATIVE_LINK.findall(cell.source):
                path = ((repo / page.source).parent / unquote(link)).resolve()
                if (path.is_file() and path.suffix != ".ipynb" and path.is_relative_to(repo)
                        and path.relative_to(repo).parts[0] != "solutions"):
                    found.add(path.relative_to(repo))
    return sorted(found)


def _calc_zip(repo: Path, target: Path) -> None:
    """static/lab-calc.zip: the sources `python -m lab calc` runs, from `repo`, as the page's Python imports them."""
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive:
        for pattern in CALC_SOURCES:
            for path in sorted(repo.glob(pattern)):
                archive.write(path, path.relative_to(repo).as_posix())


def _exporter() -> HTMLExporter:
    from nbconvert import HTMLExporter

    return HTMLExporter(template_name="lab", extra_template_paths=[str(Path(__file__).parent)],
                        template_file="site.html.j2", exclude_input_prompt=True, exclude_output_prompt=True)


def _write(exporter: HTMLExporter, page: Page, out: Path, nav: dict[str, dict | None],
           live: dict[int, list[Live]] | None = None, notebook: bool = True) -> Path:
    """Write `page` into `out`; `notebook`: the page shows a notebook of the repository (else the index or the
    calculators' page: no link to JupyterLab, no note on its calculators)."""
    import nbformat

    nb = nbformat.from_dict(page.nb)  # a copy: links to notebooks become links to their pages
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = _NOTEBOOK_LINK.sub(r"](\1.html", cell.source)
    for index, calculators in (live or {}).items():  # site.html.j2 writes the containers after the cell
        nb.cells[index].metadata["live_calc"] = [calculator.name for calculator in calculators]
    depth = page.source.count("/")
    all_calculators = {calculator.name: f"{CALCULATORS_PAGE}#{_anchor(calculator.title)}"  # from a chapter's
                       for calculators in (live or {}).values() for calculator in calculators if notebook}
    site = {**nav, "root": "../" * depth, "source": page.source, "lab_url": LAB_URL + page.source,
            "widgets": "widgets" in nb.metadata, "download": page.source.startswith("exercises/"),
            "notebook": notebook, "live": bool(live) and notebook, "all_calculators": all_calculators,
            "styles": sorted(path.name for path in STATIC.glob("*.css"))}
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": page.title}, "site": site})
    target = out / page.html
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(body, encoding="utf-8")
    return target


def build(out: Path, repo: Path = REPO, executed: Path = EXECUTED, vendor: Path = VENDOR,
          live: dict[str, list[Live]] | None = None) -> list[Path]:
    """Write the site into `out` (emptied first); return the pages written. ValueError (one line) when an
    input is missing. `live` maps pages to their live calculators (default LIVE_CALCULATORS)."""
    for needed in VENDORED:
        if not (vendor / needed).exists():
            raise ValueError(f"{vendor / needed} is missing: `make site` unpacks it from the npm registry")
    chapters, exercises = _executed_chapters(repo, executed), _exercises(repo)
    index = _index(repo, chapters, exercises)
    live_cells = _live_cells(chapters + exercises, LIVE_CALCULATORS if live is None else live)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(vendor, out / "static", ignore=shutil.ignore_patterns("*.map", ".*"))
    shutil.copytree(STATIC, out / "static", dirs_exist_ok=True, ignore=shutil.ignore_patterns(".*"))
    _calc_zip(repo, out / "static" / "lab-calc.zip")
    exporter = _exporter()
    calculators, calculator_cells = _calculators(chapters + exercises, live_cells)
    pages = [_write(exporter, index, out, {"next": chapters[0].link}, notebook=False),
             _write(exporter, calculators, out, {}, calculator_cells, notebook=False)]
    for i, page in enumerate(chapters):
        before, after = chapters[i - 1] if i else None, chapters[i + 1] if i + 1 < len(chapters) else None
        pages.append(_write(exporter, page, out, {"prev": before and before.link, "next": after and after.link},
                            live_cells.get(page.source)))
    for page in exercises:
        chapter = next((c for c in chapters if Path(c.source).name == Path(page.source).name), None)
        pages.append(_write(exporter, page, out, {"up": chapter and chapter.link}))
        shutil.copy2(repo / page.source, out / page.source)  # the download
    for source in _linked_sources(chapters + exercises, repo):
        (out / source).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / source, out / source)
    return pages


class _Handler(http.server.SimpleHTTPRequestHandler):
    """The stdlib's static file handler, with the types a browser insists on: WebAssembly.instantiateStreaming
    wants application/wasm, and a module script (Pyodide's .mjs) a JavaScript type."""

    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map,
                      ".wasm": "application/wasm", ".mjs": "text/javascript", ".js": "text/javascript",
                      ".json": "application/json", ".zip": "application/zip"}


def server(root: Path, port: int = SERVE_PORT) -> http.server.ThreadingHTTPServer:
    """An HTTP server of the files under `root` on 127.0.0.1:`port` (0: a free one), not yet serving: call
    serve_forever(); its server_address holds the port. OSError when the port is taken."""
    return http.server.ThreadingHTTPServer(("127.0.0.1", port), partial(_Handler, directory=str(root)))


def serve(root: Path, port: int = SERVE_PORT) -> int:
    """Serve the site at `root` until Ctrl-C; 2 (and one line) when there is no site or the port is taken."""
    if not (root / "index.html").is_file():
        print(f"python -m lab site: error: no site in {root} (no index.html): run `make site` first", file=sys.stderr)
        return 2
    try:
        httpd = server(root, port)
    except OSError as error:
        print(f"python -m lab site: error: cannot serve on 127.0.0.1:{port} ({error.strerror}): "
              f"pass another --port (1-65535)", file=sys.stderr)
        return 2
    with httpd:
        print(f"serving {root} at http://127.0.0.1:{httpd.server_address[1]}/ (Ctrl-C stops)", flush=True)
        try:
            httpd.serve_forever()
        except KeyboardInterrupt:
            pass
    return 0


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"port={text!r} must be an integer in 1-65535")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    parser = _OneLineParser(prog="python -m lab site", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "site", help="where to write (default site/)")
    parser.add_argument("--executed", type=Path, default=EXECUTED, help="the executed chapters' folder")
    parser.add_argument("--vendor", type=Path, default=VENDOR,
                        help="html-manager/, mathjax/ and pyodide/ (see `make site`)")
    parser.add_argument("--serve", action="store_true", help="serve the site in --out over http instead of building")
    parser.add_argument("--port", type=_port, default=SERVE_PORT, help=f"with --serve (default {SERVE_PORT})")
    args = parser.parse_args(argv)
    if args.serve:
        return serve(args.out, args.port)
    try:
        pages = build(args.out, executed=args.executed, vendor=args.vendor)
    except ValueError as error:
        print(f"python -m lab site: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {len(pages)} pages: open {args.out / 'index.html'}, or serve them with live calculators: "
          f"`make site-serve`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
