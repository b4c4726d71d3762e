"""Exercise cells in course notebooks: which cells answer which exercise, and which cells are locked.

Conventions (nbgrader's markers and checksums, Otter's single source):

* an *answer cell* has metadata `{"lab": {"exercise": "01.param_count", "points": 4}}`; in `solutions/` its
  graded region sits between `### BEGIN SOLUTION` and `### END SOLUTION`;
* a *locked cell* has `{"lab": {"exercise": "01.param_count", "locked": true}}`: the statement and any given
  code. Its checksum in a submission must match the released notebook's, or the exercise scores 0.
* the release ends each exercise's first statement with a line that starts with `IMPORTS` and lists what its
  graded code may import, rendered from the exercise's checks (`release.imports_line`): the author never
  writes it, and checksums leave it out, so a statement in `solutions/` and its released copy agree.

Other cells may carry `{"lab": {"exercise": ...}}` alone (a "try it" cell): they belong to the exercise (an
assignment's hand-out keeps or drops them with it) but are neither graded nor locked. An exercise's answer
is all its answer cells, in order, run as one module (so a learner may split a cell).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import nbformat

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
IMPORTS = "**Graded code may import:**"
_MAGIC = re.compile(r"^(\s*)([%!].*)$", re.MULTILINE)


class NotebookError(ValueError):
    """A notebook that cannot be read as one: the message names the file and the problem."""


def read(path: str | Path) -> nbformat.NotebookNode:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        json.loads(text)  # for its precise message
        nb = nbformat.reads(text, as_version=4, capture_validation_error={})  # lenient, and quiet
        if not isinstance(nb.get("cells"), list) or not all(isinstance(c, dict) for c in nb.cells):
            raise ValueError("it has no list of cells")
        return nb
    except (OSError, UnicodeDecodeError) as error:
        raise NotebookError(f"{path.name}: cannot be read ({error})") from None
    except json.JSONDecodeError as error:
        raise NotebookError(f"{path.name}: not a valid notebook (not valid JSON: {error})") from None
    except Exception as error:  # nbformat's own validation and reader errors
        raise NotebookError(f"{path.name}: not a valid notebook ({str(error).splitlines()[0]})") from None


def meta(cell: Any) -> dict:
    """The cell's `lab` metadata, {} when absent or not a mapping (a student may have mangled it)."""
    value = cell.get("metadata", {}).get("lab", {}) if isinstance(cell, dict) else {}
    return value if isinstance(value, dict) else {}


def is_answer(cell: Any, exercise_id: str | None = None) -> bool:
    m = meta(cell)
    return (cell.get("cell_type") == "code" and isinstance(m.get("exercise"), str) and "points" in m
            and not m.get("locked") and (exercise_id is None or m["exercise"] == exercise_id))


def is_locked(cell: Any, exercise_id: str | None = None) -> bool:
    m = meta(cell)
    return bool(m.get("locked")) and isinstance(m.get("exercise"), str) and \
        (exercise_id is None or m["exercise"] == exercise_id)


def exercise_ids(nb: nbformat.NotebookNode) -> list[str]:
    """Exercises answered in `nb`, in notebook order."""
    return list(dict.fromkeys(meta(c)["exercise"] for c in nb.cells if is_answer(c)))


def authored(source: str) -> str:
    """A cell's source without the line the release generates (`IMPORTS` ...): what the author wrote."""
    return "\n".join(line for line in source.splitlines() if not line.startswith(IMPORTS))


def checksum(cell: Any) -> str:
    """sha256 of a cell's type and authored source, blind to trailing whitespace (editors add and strip it) and
    to the generated imports line (the grader compares a submission with `solutions/`, which lacks it)."""
    source = "\n".join(line.rstrip() for line in authored(str(cell.get("source", ""))).strip().splitlines())
    return hashlib.sha256(f"{cell.get('cell_type')}\n{source}".encode()).hexdigest()


def locked_checksums(nb: nbformat.NotebookNode, exercise_id: str) -> list[str]:
    return [checksum(c) for c in nb.cells if is_locked(c, exercise_id)]


def python_source(source: str) -> str:
    """A cell as a module: IPython magics and shell lines (`%time`, `!ls`) become comments, same line numbers."""
    return _MAGIC.sub(r"\1# \2  (notebook magic: not run when graded)", source)


def answer_parts(nb: nbformat.NotebookNode, exercise_id: str) -> list[tuple[str, str]]:
    """(label, source) of the exercise's answer cells; the label names the cell in error messages."""
    return [(f"{exercise_id} (cell {index})", python_source(str(cell.source)))
            for index, cell in enumerate(nb.cells) if is_answer(cell, exercise_id)]


def write(nb: nbformat.NotebookNode, path: Path) -> bool:
    """Write `nb` as nbformat does; return whether the file changed (the release is deterministic)."""
    text = nbformat.writes(nb) + "\n"
    if path.exists() and path.read_text(encoding="utf-8") == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return True
