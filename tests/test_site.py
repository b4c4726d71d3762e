"""`make site` (lab/site.py) writes a page for every chapter, links that all resolve, and no solution; the live
calculators' pieces (the zip of lab.calc the page's Python imports, the containers after their cells) and the
server `python -m lab site --serve` starts.

The site is built once for the module from a small course in a temp folder: three chapters copied from one tiny
notebook executed here the way tests/test_notebooks.py runs them (a plot and a slider, so the page holds a PNG and
saved widget state), chapter 01's real exercise notebook with its solutions beside it, the real syllabus, and
stand-ins for the JavaScript that `make site` unpacks from npm (what the pages load is the browser lane's case).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading
import urllib.request
import zipfile
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import nbformat
import pytest
from test_notebooks import _NO_KERNEL, _execute, _save_executed

from lab import site
from lab.grading.notebook import BEGIN, END

REPO = Path(__file__).resolve().parents[1]
CHAPTERS = ["00_first", "01_memory_and_compute", "02_last"]
EXERCISE = "exercises/01_memory_and_compute.ipynb"
# the small course's live calculator: after the slider's cell of chapter 01
LIVE = {"chapters/01_memory_and_compute.ipynb": [site.Live("widgets.IntSlider(", "memory", "Ranks per GPU",
                                                            "How many ranks share one GPU.")]}
TINY = """import ipywidgets as widgets
import matplotlib.pyplot as plt

plt.plot([0, 1, 2], [2, 0, 1])
plt.show()
widgets.IntSlider(value=3, min=1, max=8, description="ranks")"""


class _Page(HTMLParser):
    """The ids of one page, and every href/src in it (script bodies, e.g. the widget state JSON, are not markup)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.refs: list[tuple[str, str]] = []  # (tag, href or src)
        self.rel: dict[str, str] = {}  # rel="next" -> its href (the first one: the top navigation)
        self.images: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        self.ids.update(value for key, value in attrs if key in ("id", "name") and value)
        self.refs += [(tag, attributes[key]) for key in ("href", "src") if attributes.get(key)]
        if tag == "a" and attributes.get("rel") and attributes.get("href"):
            self.rel.setdefault(attributes["rel"], attributes["href"])
        if tag == "img":
            self.images.append(attributes.get("src") or "")


def broken_links(root: Path) -> list[str]:
    """Every href/src of every page under `root` that names a missing file, or a missing anchor in a page."""
    pages = {path: _Page(path.read_text(encoding="utf-8")) for path in root.rglob("*.html")}
    broken = []
    for path, page in pages.items():
        for _, ref in page.refs:
            url = urlsplit(ref)
            if url.scheme:  # http(s) (the JupyterLab link), data: (the plots): not files of the site
                continue
            target = (path.parent / unquote(url.path)).resolve() if url.path else path
            if not target.exists():
                broken.append(f"{path.relative_to(root)}: {ref} (no such file)")
            # nbconvert writes heading ids percent-encoded; a browser matches the fragment as written, then decoded
            elif url.fragment and target.suffix == ".html" and not {url.fragment, unquote(url.fragment)} & pages[
                    target].ids:
                broken.append(f"{path.relative_to(root)}: {ref} (no such anchor)")
    return broken


def outside_loads(root: Path) -> list[str]:
    """Scripts, styles and images a page would fetch from another host (a CDN)."""
    return [f"{path.relative_to(root)}: <{tag}> {ref}" for path in root.rglob("*.html")
            for tag, ref in _Page(path.read_text(encoding="utf-8")).refs
            if tag in ("script", "link", "img", "iframe") and urlsplit(ref).scheme not in ("", "data")]


@pytest.fixture(scope="module")
def course(tmp_path_factory: pytest.TempPathFactory, jupyter_env: dict[str, str]) -> Path:
    """A small course: repo/ (chapters, exercises, solutions, syllabus), executed/, vendor/; the site in site/."""
    root = tmp_path_factory.mktemp("course")
    repo, executed, vendor = root / "repo", root / "executed", root / "vendor"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(TINY)])
    with pytest.MonkeyPatch.context() as monkeypatch:
        for name, value in {**jupyter_env, "MPLBACKEND": "module://matplotlib_inline.backend_inline"}.items():
            monkeypatch.setenv(name, value)
        (repo / "chapters").mkdir(parents=True)
        path = repo / "chapters" / "tiny.ipynb"
        nbformat.write(nb, path)
        failure = _execute(nb, path, "tiny.ipynb")
        if failure and failure.startswith(_NO_KERNEL):  # the ports race test_notebook_runs also retries once
            failure = _execute(nb, path, "tiny.ipynb")
        assert failure is None, failure
    for i, name in enumerate(CHAPTERS):
        after = f"[the next chapter]({CHAPTERS[i + 1]}.ipynb)" if i + 1 < len(CHAPTERS) else "the end"
        intro = (f"# Chapter {i}: {name}\n\nOn to {after}, or [the exercises](../{EXERCISE}), "
                 "or [down the page](#The-plot), or [the source](../lab/layout.py).\n\n## The plot")
        chapter = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(intro), *nb.cells],
                                           metadata=nb.metadata)
        clean = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(intro),
                                                nbformat.v4.new_code_cell(TINY)])
        nbformat.write(clean, repo / "chapters" / f"{name}.ipynb")
        _save_executed(chapter, executed / "chapters" / f"{name}.ipynb", keep=True)
    path.unlink()
    for folder in ("exercises", "solutions"):
        (repo / folder).mkdir()
        shutil.copy(REPO / folder / Path(EXERCISE).name, repo / folder)
    (repo / "course").mkdir()
    shutil.copy(REPO / "course" / "syllabus.md", repo / "course")
    for stand_in in site.VENDORED:
        (vendor / stand_in).parent.mkdir(parents=True, exist_ok=True)
        (vendor / stand_in).write_text("// a stand-in\n")
    for source in site.CALC_SOURCES:  # what static/lab-calc.zip is made of
        for path in REPO.glob(source):
            (repo / path.relative_to(REPO)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, repo / path.relative_to(REPO))
    site.build(root / "site", repo=repo, executed=executed, vendor=vendor, live=LIVE)
    return root


def test_every_chapter_has_a_page_and_the_index_links_it(course: Path) -> None:
    index = _Page((course / "site" / "index.html").read_text())
    linked = {ref for tag, ref in index.refs if tag == "a"}
    for name in CHAPTERS:
        assert (course / "site" / "chapters" / f"{name}.html").is_file(), name
        assert f"chapters/{name}.html" in linked, name
    assert "Syllabus" in (course / "site" / "index.html").read_text()


def test_every_link_resolves_and_nothing_loads_from_outside(course: Path) -> None:
    assert broken_links(course / "site") == []
    assert outside_loads(course / "site") == []


def test_next_and_prev_walk_the_chapters_in_order(course: Path) -> None:
    def rel(path: Path, name: str) -> str | None:
        href = _Page(path.read_text()).rel.get(name)
        return None if href is None else (path.parent / href).resolve().relative_to(course / "site").as_posix()

    walked, page = [], course / "site" / "index.html"
    while (after := rel(page, "next")) is not None:
        walked.append(after)
        assert rel(course / "site" / after, "prev") == (walked[-2] if len(walked) > 1 else None)
        page = course / "site" / after
        assert len(walked) <= len(CHAPTERS)
    assert walked == [f"chapters/{name}.html" for name in CHAPTERS]


def test_a_chapter_page_holds_its_plot_its_widget_state_and_the_way_to_jupyterlab(course: Path) -> None:
    html = (course / "site" / "chapters" / "00_first.html").read_text()
    assert [src[:22] for src in _Page(html).images] == ["data:image/png;base64,"]
    assert 'type="application/vnd.jupyter.widget-state+json"' in html
    assert 'type="application/vnd.jupyter.widget-view+json"' in html
    assert "live in JupyterLab" in html and "make course" in html
    assert 'href="http://localhost:8888/lab/tree/chapters/00_first.ipynb"' in html


def _solution_only_lines(solution: Path, exercise: Path) -> set[str]:
    """Lines inside a solution region of `solution` that the released `exercise` does not have anywhere."""
    def code(path: Path) -> list[str]:
        return [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]

    released = {line.strip() for source in code(exercise) for line in source.splitlines()}
    inside, lines = False, set()
    for source in code(solution):
        for line in source.splitlines():
            if line.strip() in (BEGIN, END):
                inside = line.strip() == BEGIN
            # a line of brackets alone ("}", "])") gives nothing away, and any page's text has one
            elif inside and re.search(r"\w", line) and line.strip() not in released:
                lines.add(line.strip())
    return lines


class _Text(HTMLParser):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.parts: list[str] = []
        self.feed(text)

    def handle_data(self, data: str) -> None:
        self.parts.append(data)


def leaked_solution_lines(solution: Path, exercise: Path, page: Path) -> list[str]:
    """The solution-only lines of `solution` that the exercise's page shows (as text, whatever the highlighting)."""
    text = "".join(_Text(page.read_text(encoding="utf-8")).parts)
    return sorted(_solution_only_lines(solution, exercise) & {line.strip() for line in text.splitlines()})


def test_exercise_pages_hold_the_stubs_and_no_solution(course: Path) -> None:
    name = Path(EXERCISE).name
    solution, exercise = course / "repo" / "solutions" / name, course / "repo" / EXERCISE
    assert len(_solution_only_lines(solution, exercise)) > 5  # the check below has something to find
    page = course / "site" / EXERCISE.replace(".ipynb", ".html")
    assert "NotImplementedError" in page.read_text()
    assert leaked_solution_lines(solution, exercise, page) == []
    assert (course / "site" / EXERCISE).read_bytes() == exercise.read_bytes()


def test_a_missing_or_stale_executed_chapter_is_one_line_naming_it(course: Path, tmp_path: Path) -> None:
    executed = tmp_path / "executed"
    shutil.copytree(course / "executed", executed)
    (executed / "chapters" / "02_last.ipynb").unlink()
    stale = nbformat.read(executed / "chapters" / "00_first.ipynb", as_version=4)
    stale.cells[0].source += "\nAn older sentence."
    nbformat.write(stale, executed / "chapters" / "00_first.ipynb")
    with pytest.raises(ValueError) as error:
        site.build(tmp_path / "site", repo=course / "repo", executed=executed, vendor=course / "vendor")
    said = str(error.value)
    assert "\n" not in said and "make test" in said
    assert "no executed copy of chapters/02_last.ipynb" in said
    assert "chapters/00_first.ipynb is older than the notebook" in said
    assert not (tmp_path / "site").exists()


def test_the_command_says_what_is_missing_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert site.main(["--out", str(tmp_path / "site"), "--executed", str(tmp_path / "none"),
                      "--vendor", str(tmp_path / "none")]) == 2
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and "make site" in said


# A fresh interpreter with no site-packages (so no torch, numpy, nor the checkout's lab) and only the zip on its path,
# as Pyodide's is: it runs the CLI and lists where each lab module it loaded came from.
_FROM_THE_ZIP = """
import contextlib, io, sys
sys.path.insert(0, sys.argv[1])
import lab.calc.cli
out = io.StringIO()
with contextlib.redirect_stdout(out):
    lab.calc.cli.main(["memory", "--model", "llama3-8b", "--tp", "2", "--json"])
print(out.getvalue().strip())
for name, module in sorted(sys.modules.items()):
    if name == "lab" or name.startswith("lab."):
        print(name, module.__file__)
"""


def test_the_calc_zip_holds_what_the_cli_imports_and_runs_without_torch_or_numpy(course: Path) -> None:
    archive = course / "site" / "static" / "lab-calc.zip"
    with zipfile.ZipFile(archive) as opened:
        sources = {name: opened.read(name).decode() for name in opened.namelist()}
    assert "lab/calc/cli.py" in sources and "lab/config.py" in sources
    assert not any("test" in name or not name.endswith(".py") for name in sources)
    # not even inside a function of the calculators (lab/__init__.py's setup() is the notebooks', never called here)
    heavy = re.compile(r"^\s*(import|from) (torch|numpy|jax)\b", re.MULTILINE)
    assert [name for name, text in sources.items() if heavy.search(text)] == ["lab/__init__.py"]
    done = subprocess.run([sys.executable, "-S", "-I", "-c", _FROM_THE_ZIP, str(archive)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    answer, *modules = done.stdout.splitlines()
    expected = subprocess.run([sys.executable, "-m", "lab", "calc", "memory", "--model", "llama3-8b", "--tp", "2",
                               "--json"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert answer == expected.stdout.strip()
    assert len(modules) > 10 and all(f"{archive}/lab/" in line for line in modules), modules


def _live_containers(html: str) -> list[str]:
    return re.findall(r'<div class="live-calc" data-calc="(\w+)"></div>', html)


def test_a_live_calculator_container_follows_its_cell_and_every_page_loads_the_runtime(course: Path) -> None:
    html = (course / "site" / "chapters" / "01_memory_and_compute.html").read_text()
    assert _live_containers(html) == ["memory"]
    cell, after = html.split('<div class="live-calc"')
    assert "IntSlider" in cell[cell.rindex('<div class="jp-Cell '):]  # the container follows the marker's cell
    assert 'class="jp-Cell ' not in after[:after.index("</div>")]
    assert "compute in your browser" in html
    for name in ("00_first", "02_last"):
        other = (course / "site" / "chapters" / f"{name}.html").read_text()
        assert _live_containers(other) == [] and "compute in your browser" not in other
    for page in (course / "site").rglob("*.html"):
        scripts = [ref for tag, ref in _Page(page.read_text()).refs if tag == "script"]
        assert {ref.rsplit("/", 1)[-1] for ref in scripts} >= {"lab-calc.js", "live.js"}, page


def test_calculators_html_holds_every_live_calculator_under_its_title_with_a_link_to_its_section(
        course: Path) -> None:
    html = (course / "site" / "calculators.html").read_text()
    assert _live_containers(html) == ["memory"]
    _, after = html.split('<div class="live-calc"')[0].rsplit("<h2", 1)
    assert 'id="Ranks-per-GPU"' in after and "How many ranks share one GPU." in after
    # the section of the slider's cell in chapter 01 (test_every_link_resolves checks the anchor is on that page)
    assert 'href="chapters/01_memory_and_compute.html#The-plot"' in after and "“The plot”" in after
    assert "make site-serve" in html and "Open in JupyterLab" not in html and "static snapshots" not in html
    assert "calculators.html" in {ref for tag, ref in _Page((course / "site" / "index.html").read_text()).refs}
    chapter = (course / "site" / "chapters" / "01_memory_and_compute.html").read_text()
    assert chapter.count('<a href="../calculators.html#Ranks-per-GPU">All the calculators on one page</a>') == 1
    assert "live-calc-all" not in (course / "site" / "chapters" / "00_first.html").read_text()


def test_every_live_calculator_of_the_course_finds_its_cell_and_its_section() -> None:
    pages = [site.Page(source, nbformat.read(REPO / source, as_version=4), source) for source in site.LIVE_CALCULATORS]
    cells = site._live_cells(pages, site.LIVE_CALCULATORS)
    found = [(page, index, calculator) for page in pages for index, live in cells[page.source].items()
             for calculator in live]
    assert sorted(calculator.name for _, _, calculator in found) == sorted(
        ["memory", "comms", "bubble", "search", "inference"])
    assert all(site._section(page.nb, index) for page, index, _ in found)  # calculators.html links each one
    assert len({site._anchor(calculator.title) for _, _, calculator in found}) == len(found)


def test_serve_starts_without_the_page_builders() -> None:
    """`python -m lab site --serve` prints its URL without importing nbformat or nbconvert (seconds on a busy
    machine): only `build` needs them."""
    done = subprocess.run([sys.executable, "-c", "import sys; from lab import site; site.main(['--serve', '--out', "
                           "'/nonexistent']); print(sorted({m.split('.')[0] for m in sys.modules} & "
                           "{'nbformat', 'nbconvert', 'jsonschema'}))"], capture_output=True, text=True, timeout=60,
                          cwd=REPO)
    assert done.stdout.strip() == "[]" and "no site in /nonexistent" in done.stderr, (done.stdout, done.stderr)


@pytest.mark.parametrize(("live", "said"), [
    ({"chapters/01_memory_and_compute.ipynb": [site.Live("memory_calculator()", "memory", "Memory", "What it holds.")]},
     "no code cell of chapters/01_memory_and_compute.ipynb contains 'memory_calculator()'"),
    ({"chapters/99_gone.ipynb": [site.Live("x", "memory", "Memory", "What it holds.")]},
     "names chapters/99_gone.ipynb, which is not a page")],
    ids=["marker", "page"])
def test_a_missing_marker_or_page_is_one_line_naming_it(course: Path, tmp_path: Path, live: dict, said: str) -> None:
    with pytest.raises(ValueError) as error:
        site.build(tmp_path / "site", repo=course / "repo", executed=course / "executed", vendor=course / "vendor",
                   live=live)
    assert said in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "site").exists()


def test_the_server_gives_webassembly_and_modules_the_types_browsers_insist_on(tmp_path: Path) -> None:
    files = {"index.html": "text/html", "a.wasm": "application/wasm", "b.mjs": "text/javascript",
             "c.js": "text/javascript", "d.zip": "application/zip", "e.json": "application/json"}
    for name in files:
        (tmp_path / name).write_text("x")
    server = site.server(tmp_path, port=0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        assert host == "127.0.0.1"
        for name, kind in files.items():
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/{name}", timeout=10) as response:
                assert response.headers.get_content_type() == kind, name
    finally:
        server.shutdown()
        server.server_close()


def test_serve_says_in_one_line_what_is_wrong(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert site.main(["--serve", "--out", str(tmp_path)]) == 2  # no site built there
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and "make site" in said
    (tmp_path / "index.html").write_text("x")
    with site.server(tmp_path, port=0) as taken:
        assert site.main(["--serve", "--out", str(tmp_path), "--port", str(taken.server_address[1])]) == 2
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and f"127.0.0.1:{taken.server_address[1]}" in said and "--port" in said
    for bad in ("0", "65536", "http"):
        with pytest.raises(SystemExit) as exit:
            site.main(["--serve", "--out", str(tmp_path / "none"), "--port", bad])
        said = capsys.readouterr().err
        assert exit.value.code == 2 and said.count("\n") == 1 and f"port={bad!r} must be an integer in 1-65535" in said
