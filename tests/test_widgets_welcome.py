"""The welcome widget runs a real multi-rank job for each slider position and shows one row per rank.

Driven without a browser: setting `slider.value` calls the same observer a learner's drag does.
(tests/browser/ checks the same widget in real JupyterLab.)
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("ipywidgets")

from lab.widgets import hello_ranks, welcome  # noqa: E402  (after the importorskip above)


def _table(html: str) -> list[list[int]]:
    """The table's rows as [rank, world size, pid, all_reduce result]."""
    body = re.search(r"<tbody>(.*)</tbody>", html).group(1)
    return [[int(value) for value in re.findall(r"<td[^>]*>(\d+)</td>", row)]
            for row in re.findall(r"<tr>(.*?)</tr>", body)]


def test_slider_runs_one_rank_per_row() -> None:
    widget = hello_ranks()
    assert len(_table(widget.result.value)) == 2  # it opens with a run on the default 2 ranks
    for n in (1, 3, 4):
        widget.slider.value = n
        rows = _table(widget.result.value)
        total = n * (n + 1) // 2
        assert [row[0] for row in rows] == list(range(n))
        assert all(row[1] == n and row[3] == total for row in rows)
        assert len({row[2] for row in rows}) == n, "each rank is its own process"
        assert f"gave {total} = {n}·{n + 1}/2 on every rank ✓" in widget.result.value


def _fail_on_rank_1() -> dict[str, int]:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom")
    return {}


def test_a_failing_rank_shows_inline_as_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    widget = hello_ranks()
    monkeypatch.setattr(welcome, "hello_rank", _fail_on_rank_1)  # a real rank failure, real RankError
    widget.slider.value = 3
    assert widget.result.value.count("\n") == 0
    assert "RankError: rank 1" in widget.result.value and "boom" in widget.result.value
    assert "Traceback" not in widget.result.value and "<table" not in widget.result.value
