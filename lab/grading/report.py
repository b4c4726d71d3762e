"""Grades as people read them: an HTML table (notebook and feedback), text (terminal), CSV (gradebook) and
Gradescope's results.json. Everything a student's code could have put in a message is escaped."""

from __future__ import annotations

import csv
import html
import io
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from lab.grading.runner import ExerciseResult, StudentResult

_ICON = {"passed": "✓", "failed": "✗", "not attempted": "–", "partial": "◐"}
_COLOR = {"passed": "#1a7f37", "failed": "#cf222e", "not attempted": "#6e7781", "partial": "#9a6700"}
_CELL = "padding:2px 8px;text-align:left;vertical-align:top;border-bottom:1px solid #ddd"
_TIGHT = _CELL + ";white-space:nowrap"


def fmt(points: float) -> str:
    return f"{points:g}"


def score_line(results: Sequence[ExerciseResult], hidden_skipped: float = 0.0, multiplier: float = 1.0,
               late: str = "") -> str:
    """The total; a late one says why it is lower (`late`: `Assignment.late_words`), in words, not as "0 x 0"."""
    got, out_of = sum(r.points for r in results), sum(r.max_points for r in results)
    line = f"Score: {fmt(round(got * multiplier, 4))} / {fmt(out_of)} points"
    if multiplier != 1.0:
        why = late or "late"
        line += f" ({why}: scored 0)" if multiplier == 0 else f" ({why}: {fmt(got)} x {multiplier:g})"
    if hidden_skipped:
        line += f"; hidden checks worth {fmt(hidden_skipped)} more run when your work is graded"
    return line


def _message(check, hidden_details: bool) -> str:
    if check.hidden and not hidden_details and check.status != "passed":
        return "hidden check: details are not shown"
    return check.message


def html_report(results: Sequence[ExerciseResult], title: str, *, hidden_details: bool = True,
                hidden_skipped: float = 0.0, multiplier: float = 1.0, late: str = "", output: bool = False) -> str:
    """One table: a row per exercise, then a row per check (check, points, result, message, hint)."""
    e = html.escape
    rows = []
    for result in results:
        color = _COLOR[result.status]
        rows.append(f'<tr style="background:#f6f8fa"><th style="{_CELL}">{e(result.id)}</th>'
                    f'<th style="{_TIGHT}">{fmt(result.points)}/{fmt(result.max_points)}</th>'
                    f'<th style="{_TIGHT};color:{color}">{_ICON[result.status]} {e(result.status)}</th>'
                    f'<th style="{_CELL};font-weight:normal" colspan="2">{e(result.reason)}</th></tr>')
        for check in result.checks:
            withheld = check.hidden and not hidden_details  # a hidden check's hint would give its test away
            hint = e(check.hint) if check.status != "passed" and not withheld else ""
            message, status = e(_message(check, hidden_details)), f"{_ICON[check.status]} {e(check.status)}"
            name = e(check.name) + (" <i>(hidden)</i>" if check.hidden else "")
            rows.append(f'<tr><td style="{_CELL};padding-left:20px">{name}</td>'
                        f'<td style="{_TIGHT}">{fmt(check.points)}/{fmt(check.max_points)}</td>'
                        f'<td style="{_TIGHT};color:{_COLOR[check.status]}">{status}</td>'
                        f'<td style="{_CELL};font-family:monospace;font-size:90%">{message}</td>'
                        f'<td style="{_CELL};font-style:italic">{hint}</td></tr>')
        if output and result.output.strip():
            rows.append(f'<tr><td colspan="5" style="{_CELL}"><details><summary>what your code printed</summary>'
                        f'<pre>{e(result.output)}</pre></details></td></tr>')
    head = "".join(f'<th style="{_CELL}">{h}</th>' for h in ("check", "points", "result", "message", "hint"))
    return (f'<div class="lab-check"><b>{e(title)}</b><table style="border-collapse:collapse;margin:4px 0">'
            f'<thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
            f'<b>{e(score_line(results, hidden_skipped, multiplier, late))}</b></div>')


def text_report(results: Sequence[ExerciseResult], title: str, *, hidden_skipped: float = 0.0,
                multiplier: float = 1.0, late: str = "") -> str:
    lines = [title]
    for result in results:
        reason = f"  {result.reason}" if result.reason else ""
        lines.append(f"{result.id:<24} {fmt(result.points):>5}/{fmt(result.max_points):<4} {result.status}{reason}")
        for check in result.checks:
            hidden = " (hidden)" if check.hidden else ""
            lines.append(f"  {_ICON[check.status]} {fmt(check.points)}/{fmt(check.max_points)}  {check.name}{hidden}")
            if check.status != "passed" and check.message and check.message != result.reason:
                lines.append(f"      {check.message}")
            if check.status != "passed" and check.hint:
                lines.append(f"      hint: {check.hint}")
    lines.append(score_line(results, hidden_skipped, multiplier, late))
    return "\n".join(lines)


def csv_text(students: Sequence[StudentResult], exercise_ids: Sequence[str]) -> str:
    """A row per student and assignment (in the order given, by student), a column per exercise (empty where
    the row's assignment has no such exercise), then the raw points, the late policy's days and multiplier, the
    total and the assignment's max: the columns a gradebook needs to show its work. Byte-identical for
    identical grades."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["student", "assignment", *exercise_ids, "raw", "late_days", "multiplier", "total", "max"])
    for student in sorted(students, key=lambda s: s.student):
        points = {r.id: fmt(r.points) for r in student.exercises}
        writer.writerow([student.student, student.assignment, *(points.get(i, "") for i in exercise_ids),
                         fmt(student.raw), str(student.late_days), f"{student.multiplier:g}", fmt(student.total),
                         fmt(student.max_points)])
    return out.getvalue()


def totals_csv(students: Sequence[StudentResult], owner: Callable[[str], str]) -> str:
    """The course gradebook: a row per student (`owner` of each result), a column per assignment (its total
    after the late policy; 0 where the student handed nothing in), then the course total and max, the same max
    for everyone. Of two notebooks of one student for one assignment (a warning when grading), the better counts."""
    names = list(dict.fromkeys(s.assignment for s in students))
    maxima = {s.assignment: s.max_points for s in students}
    best: dict[tuple[str, str], float] = {}
    for s in students:
        key = (owner(s.student), s.assignment)
        best[key] = max(best.get(key, 0.0), s.total)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["student", *names, "total", "max"])
    for who in sorted({who for who, _ in best}):
        scores = [best.get((who, name), 0.0) for name in names]
        writer.writerow([who, *map(fmt, scores), fmt(round(sum(scores), 4)), fmt(sum(maxima.values()))])
    return out.getvalue()


def gradescope(student: StudentResult, late: str = "", note: str = "") -> dict:
    """Gradescope's results.json: a test per check; hidden checks are shown once grades are published. `note`
    (which notebook was graded, which ignored, or why none was) follows the total in the output."""
    tests = []
    for number, result in enumerate(student.exercises, 1):
        for sub, check in enumerate(result.checks, 1):
            failed = check.status != "passed"
            reason = result.reason if failed and result.reason not in check.message else ""  # e.g. "not attempted"
            text = "\n".join(filter(None, [reason, check.message, f"hint: {check.hint}" if failed and check.hint
                                           else ""]))
            tests.append({"name": f"{result.id}: {check.name}", "number": f"{number}.{sub}",
                          "score": check.points, "max_score": check.max_points, "status":
                          "passed" if check.status == "passed" else "failed", "output": text,
                          "visibility": "after_published" if check.hidden else "visible"})
    title = f"Assignment {student.assignment}: " if student.assignment else ""
    total = score_line(student.exercises, multiplier=student.multiplier, late=late).removeprefix("Score: ")
    return {"score": student.total, "output": "\n".join(filter(None, [f"{title}{total}", note])),
            "visibility": "visible", "stdout_visibility": "hidden", "tests": tests}


def write_feedback(directory: Path, student: StudentResult, late: str = "", *, by_assignment: bool = False) -> Path:
    """A self-contained HTML page per student (per student and assignment with `by_assignment`, when a course
    is graded at once: ada-A1.html, ada-A3.html); hidden checks say only whether they passed."""
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"{student.student}-{student.assignment}" if by_assignment else student.student
    name = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in stem)
    title = f"{student.student}{' - ' + student.assignment if student.assignment else ''}"
    body = html_report(student.exercises, f"Feedback for {title}", hidden_details=False,
                       multiplier=student.multiplier, late=late)
    page = (f'<!doctype html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title></head>'
            f'<body style="font-family:sans-serif">{body}</body></html>\n')
    path = directory / f"{name}.html"
    path.write_text(page, encoding="utf-8")
    return path


def results_json(student: StudentResult, late: str = "", note: str = "") -> str:
    return json.dumps(gradescope(student, late, note), indent=1, sort_keys=True) + "\n"
