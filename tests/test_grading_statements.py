"""Statements and hints say what must hold, not the answer, and say what graded code may import as the sandbox does.

Two promises a learner relies on before writing a line:

* the statement's "Graded code may import" line is the exercise's sandbox (`Exercise.modules` and `.packages`),
  name for name — a statement that promises `torch` to a sandbox without it costs the whole exercise;
* no line of a solution is printed in its statement or in its checks' hints (`hint=`, `Mistake`, `CheckFailed`):
  a statement that lists the kernel line by line, or a hint that is the formula, turns the exercise into copying.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from lab.grading import checks, release
from lab.grading.notebook import BEGIN, END, IMPORTS, checksum, is_answer, is_locked, meta, read

REPO = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((REPO / "solutions").glob("*.ipynb"))
EXERCISES = sorted((REPO / "exercises").glob("*.ipynb"))
SHORTEST = 20  # characters, whitespace left out: shorter solution lines (`return out`, `)`) say nothing alone
_CLAIM = re.compile(r"may import\s*:?\**\s*(the standard|`)", re.IGNORECASE)  # a list of what may be imported


def _statements(nb, exercise_id: str) -> list[str]:
    return [c.source for c in nb.cells if is_locked(c, exercise_id) and c.cell_type == "markdown"]


def _stated_imports(statement: str) -> set[str]:
    lines = [line for line in statement.splitlines() if line.startswith(IMPORTS)]
    assert len(lines) == 1, f"expected one line starting with {IMPORTS}, found {lines}"
    assert "the standard library" in lines[0], lines[0]
    return set(re.findall(r"`([^`]+)`", lines[0]))


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.stem)
def test_statements_list_exactly_what_the_sandbox_lets_in(path):
    nb, known = read(path), checks.load_all()
    for exercise_id in dict.fromkeys(meta(c)["exercise"] for c in nb.cells if is_answer(c)):
        first, *others = _statements(nb, exercise_id)
        allowed = {*known[exercise_id].modules, *known[exercise_id].packages}
        assert _stated_imports(first) == allowed, f"{exercise_id}: the statement and its sandbox disagree"
        assert not any(IMPORTS in other for other in others), f"{exercise_id}: two import lines"


@pytest.mark.parametrize("folder", ["solutions", "chapters"])
def test_no_hand_written_import_claims(folder):
    for path in sorted((REPO / folder).glob("*.ipynb")):
        for index, cell in enumerate(read(path).cells):
            claim = _CLAIM.search(cell.source) if cell.cell_type == "markdown" else None
            assert claim is None, f"{path.name} cell {index} says what graded code may import ({claim.group(0)!r}): " \
                                  f"the release writes that line from the checks"


def test_the_generated_line_follows_the_checks(monkeypatch):
    """Change an exercise's sandbox and its released statement follows; its checksum does not move."""
    nb = read(REPO / "solutions" / "11_inference.ipynb")
    exercise = checks.get("11.decode_latency")
    monkeypatch.setattr(exercise, "packages", (*exercise.packages, "torch"))
    statement, = (c for c in release.release_notebook(nb, "11").cells if is_locked(c, exercise.id)
                  and c.cell_type == "markdown")
    assert _stated_imports(statement.source) == {"lab.config", "tomli_w", "torch"}
    authored, = (c for c in nb.cells if is_locked(c, exercise.id) and c.cell_type == "markdown")
    assert checksum(statement) == checksum(authored)  # the grader compares submissions with solutions/


def test_release_refuses_a_hand_written_import_line():
    nb = read(REPO / "solutions" / "11_inference.ipynb")
    statement = next(c for c in nb.cells if is_locked(c, "11.decode_latency") and c.cell_type == "markdown")
    statement.source += f"\n\n{IMPORTS} the standard library and `torch`."
    with pytest.raises(ValueError, match="11.decode_latency says what graded code may import"):
        release.release_notebook(nb, "11")


# --- no answer in a statement or a hint ------------------------------------------------------------------------

def _normal(text: str) -> str:
    """Text as a leak is compared: no whitespace, no Markdown code marks, one spelling of a product."""
    return re.sub(r"\s+", "", text).replace("`", "").replace("·", "*").replace("×", "*")


def solution_lines(nb) -> dict[str, list[str]]:
    """Each exercise's solution lines worth hiding: inside the graded regions, code not comments, long enough."""
    out: dict[str, list[str]] = {}
    for cell in (c for c in nb.cells if is_answer(c)):
        inside = False
        for line in cell.source.splitlines():
            inside = (inside or line.strip() == BEGIN) and line.strip() != END
            code = _normal(line)
            if inside and len(code) >= SHORTEST and not code.startswith("#"):
                out.setdefault(meta(cell)["exercise"], []).append(line.strip())
    return out


def _strings(node: ast.AST | None, module) -> list[str]:
    """The text of a hint expression: literals, f-strings' literal parts, module constants."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return ["{}".join(v.value for v in node.values if isinstance(v, ast.Constant))]
    if isinstance(node, ast.Name) and isinstance(getattr(module, node.id, None), str):
        return [getattr(module, node.id)]
    if isinstance(node, (ast.BinOp, ast.IfExp)):
        return [s for child in ast.iter_child_nodes(node) for s in _strings(child, module)]
    return []


def hints(module_name: str) -> list[str]:
    """Every hint a chapter's checks can show: `hint=` of checks, of `Mistake`s and of `CheckFailed`."""
    module = importlib.import_module(f"lab.grading.checks.{module_name}")
    found: list[str] = []
    for node in ast.walk(ast.parse(Path(module.__file__).read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "id", getattr(node.func, "attr", ""))
        position = {"Mistake": 2, "CheckFailed": 1}.get(name)
        if position is not None and len(node.args) > position:
            found += _strings(node.args[position], module)
        found += [s for k in node.keywords if k.arg == "hint" for s in _strings(k.value, module)]
    return found


def leaks(lines: list[str], texts: list[str]) -> list[str]:
    """The solution lines that some text prints, whitespace and Markdown aside."""
    shown = [_normal(text) for text in texts]
    return [line for line in lines if any(_normal(line) in text for text in shown)]


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_statements_do_not_print_the_solution(path):
    nb = read(path)
    for exercise_id, lines in solution_lines(nb).items():
        assert not leaks(lines, _statements(nb, exercise_id)), f"{exercise_id}'s statement prints its solution"


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_hints_do_not_print_the_solution(path):
    chapter = path.stem.split("_")[0]
    shown = hints(f"ch{chapter}")
    assert shown, f"no hints found for chapter {chapter}: has hint= been renamed?"
    for exercise_id, lines in solution_lines(read(path)).items():
        assert not leaks(lines, shown), f"{exercise_id}: a hint of ch{chapter}.py prints its solution"


def test_a_planted_leak_is_found():
    """The detector itself: a solution line copied into a statement, or into a hint, is caught."""
    nb = read(REPO / "solutions" / "11_inference.ipynb")
    line = solution_lines(nb)["11.decode_latency"][0]
    assert leaks([line], [f"Hint: compute `{line}` here"]) == [line]
    assert leaks([line], ["   ".join(line.split())]) == [line]  # rewrapped
    assert leaks([line], ["the memory-bound time of a step"]) == []
