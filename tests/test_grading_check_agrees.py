"""`python -m lab check` is the grade: on a saved notebook it gives the verdict `python -m lab grade` gives —
locked cells included, from the checksums the release recorded in `lab` (a learner has no solutions/)."""

from __future__ import annotations

import re

import nbformat
import pytest
from test_grading_sandbox import REPO, SOLUTION, _notebook

from lab.grading import checks, learner, locked
from lab.grading.grade import grade_notebook, reference_checksums
from lab.grading.notebook import is_locked, locked_checksums


def _locked(nb, cell_type: str):
    return next(c for c in nb.cells if is_locked(c, "01.mfu") and c.cell_type == cell_type)


def _edit(case: str) -> nbformat.NotebookNode:
    """The solution notebook with one edit of 01.mfu's locked cells (or none)."""
    nb = _notebook("honest")
    if case == "edits_the_statement":
        _locked(nb, "markdown").source += "\nAnswers are optional."
    elif case == "edits_the_check_cell":
        _locked(nb, "code").source = "print('Score: 3 / 3')"
    elif case == "deletes_the_check_cell":
        nb.cells.remove(_locked(nb, "code"))
    elif case == "deletes_the_statement":
        nb.cells.remove(_locked(nb, "markdown"))
    elif case == "unlocks_the_check_cell":
        del _locked(nb, "code").metadata["lab"]["locked"]
    elif case == "adds_a_locked_cell":
        nb.cells.append(nbformat.v4.new_markdown_cell("Nothing to see.", metadata={"lab": {"exercise": "01.mfu",
                                                                                           "locked": True}}))
    elif case == "trailing_whitespace":  # editors add and strip it: not an edit
        _locked(nb, "markdown").source += "   \n\n"
    return nb


EDITED = ["edits_a_locked_cell", "edits_the_statement", "edits_the_check_cell", "deletes_the_check_cell",
          "deletes_the_statement", "unlocks_the_check_cell", "adds_a_locked_cell"]


def test_the_recorded_checksums_are_those_of_solutions():
    """What lab check compares with is solutions/ as it is (release --check fails otherwise)."""
    assert locked.released() == locked.from_notebooks(REPO / "solutions")
    assert locked.record(REPO / "solutions", check_only=True) == []
    assert locked.record(SOLUTION.parent.parent / "exercises", check_only=True) == []  # only solutions/ is recorded


@pytest.mark.parametrize("case", [*EDITED, "honest", "trailing_whitespace"])
def test_lab_check_and_lab_grade_agree_on_locked_cells(case, tmp_path, capsys):
    """Each locked-cell case of the adversarial battery: `python -m lab check NOTEBOOK 01.mfu` prints the score and
    the reason that `python -m lab grade` (no --solutions: the record) and a grade against solutions/ give."""
    path = tmp_path / "01_memory_and_compute.ipynb"
    nb = _notebook(case) if case == "edits_a_locked_cell" else _edit(case)
    nbformat.write(nb, path)
    mfu = checks.get("01.mfu")
    assert learner.main([str(path), "01.mfu"]) == 0
    shown = capsys.readouterr().out
    row = re.search(r"^01\.mfu\s+(\S+)/(\S+)\s+(.*)$", shown, re.M)
    verdicts = [grade_notebook(path, [mfu], locked=reference_checksums(), hidden=False).exercises[0],
                grade_notebook(path, [mfu], locked=reference_checksums(REPO / "solutions"),
                               hidden=False).exercises[0]]
    for graded in verdicts:
        assert (float(row[1]), row[3]) == (graded.points, f"{graded.status}  {graded.reason}".strip()), shown
    expected = 0 if case in EDITED else mfu.points
    assert verdicts[0].points == expected and ("locked cell" in verdicts[0].reason) == (case in EDITED), verdicts[0]


def test_a_copy_handed_out_before_an_erratum_is_not_an_edited_one():
    """07.problems' statement was corrected after release (DeepSeek-V3's §2 and §3.4 became §4.2 and §3.2): a
    learner's copy with the first wording holds the course's own locked cells, and both commands accept it; the
    same copy with a word of its own is still an edit."""
    nb = nbformat.read(REPO / "exercises" / "07_expert_parallel.ipynb", as_version=4)
    statement = next(c for c in nb.cells if is_locked(c, "07.problems") and "arXiv:2412.19437" in c.source)
    statement.source = statement.source.replace("§4.2 for the layer, §3.2 for the parallelism", "§2 and §3.4")
    versions = reference_checksums()["07.problems"]
    assert locked_checksums(nb, "07.problems") == versions[1] != versions[0]  # the earlier release's, not today's
    statement.source = statement.source.replace("§2 and §3.4", "§2 and §3.4, or not")
    assert locked_checksums(nb, "07.problems") not in versions


def test_a_release_keeps_the_checksums_it_replaces():
    old, new = {"a": ["1"], "b": ["2"]}, {"a": ["1"], "b": ["3"]}
    assert locked.with_history(new, old, {}) == {"b": [["2"]]}  # b's erratum: its first release stays accepted
    assert locked.with_history(new, new, {"b": [["2"]]}) == {"b": [["2"]]}  # nothing changed: nothing moves
    assert locked.with_history({"a": ["1"], "b": ["4"]}, new, {"b": [["2"]]}) == {"b": [["2"], ["3"]]}
    assert locked.with_history(old, new, {"b": [["2"]]}) == {"b": [["3"]]}  # reverted: "2" is current again
    assert set(locked.accepted()) == set(locked.released())
    assert all(versions[0] == locked.released()[key] for key, versions in locked.accepted().items())
