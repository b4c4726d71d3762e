"""The welcome chapter's widget: choose a number of ranks and watch a real gloo job run on them.

Moving the slider starts that many real processes through `lab.distributed.run`. Each rank joins the
process group, all-reduces `rank + 1` and reports back. The table shows three facts that every later chapter
relies on: ranks are separate processes (different pids), they agree on the world size, and a collective
gives every rank the same answer (1 + 2 + ... + n = n(n+1)/2).
"""

from __future__ import annotations

import html
import os
import time

import ipywidgets as widgets

_CELL = 'style="padding: 2px 12px; text-align: right; border-bottom: 1px solid #ccc"'
_COLUMNS = ("rank", "world size", "pid", "all_reduce(rank + 1)")


def hello_rank() -> dict[str, int]:
    """Runs on every rank: who am I, how many are we, and what does an all-reduce of `rank + 1` give?"""
    import torch  # imported here, not at the top, so that `import lab.widgets` stays torch-free
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([rank + 1])
    dist.all_reduce(total)  # the default op is SUM over all ranks, and every rank receives the sum
    return {"rank": rank, "world_size": world_size, "pid": os.getpid(), "all_reduce": int(total.item())}


class HelloRanks(widgets.VBox):
    """A "ranks" slider, and the result of running `hello_rank` on that many processes.

    The slider calls `run(n)`. Tests call it too (or set `slider.value`) to drive the widget without a
    browser, and read `result.value`, the rendered HTML.
    """

    def __init__(self, value: int = 2, max_ranks: int = 4) -> None:
        # continuous_update=False: a drag launches one job when released, not one per intermediate value.
        self.slider = widgets.IntSlider(value=value, min=1, max=max_ranks, description="ranks",
                                        continuous_update=False)
        self.result = widgets.HTML()
        super().__init__([self.slider, self.result])
        self.slider.observe(lambda change: self.run(change["new"]), names="value")
        self.run(value)

    def run(self, world_size: int) -> None:
        """Run `hello_rank` on `world_size` ranks and show a table, or a one-line error."""
        from lab import distributed  # imported here because it imports torch (see hello_rank)

        self.result.value = f"<i>starting {world_size} rank(s)…</i>"
        start = time.perf_counter()
        try:
            reports = distributed.run(hello_rank, world_size=world_size, timeout_s=60.0)
        except Exception as error:  # the learner needs the first line (it names the rank), not a traceback
            first_line = (str(error).splitlines() or [""])[0]
            self.result.value = (f'<p class="lab-error" style="color: #b00">{type(error).__name__}: '
                                 f"{html.escape(first_line)}</p>")
            return
        self.result.value = _table(reports) + _summary(reports, time.perf_counter() - start)


def hello_ranks(value: int = 2, max_ranks: int = 4) -> HelloRanks:
    """The welcome chapter's widget, already showing a run on `value` ranks."""
    return HelloRanks(value=value, max_ranks=max_ranks)


def _table(reports: list[dict[str, int]]) -> str:
    header = "".join(f"<th {_CELL}>{name}</th>" for name in _COLUMNS)
    rows = "".join(
        "<tr>" + "".join(f"<td {_CELL}>{r[key]}</td>" for key in ("rank", "world_size", "pid", "all_reduce"))
        + "</tr>"
        for r in reports
    )
    return (f'<table class="lab-hello-ranks" style="border-collapse: collapse">'
            f"<thead><tr>{header}</tr></thead><tbody>{rows}</tbody></table>")


def _summary(reports: list[dict[str, int]], seconds: float) -> str:
    n = len(reports)
    expected = n * (n + 1) // 2
    agree = all(r["all_reduce"] == expected for r in reports)
    processes = len({r["pid"] for r in reports})
    verdict = (f"= {n}·{n + 1}/2 on every rank ✓" if agree
               else f"✗ expected {expected} = {n}·{n + 1}/2 on every rank")
    return (f'<p class="lab-hello-summary">{n} rank(s) in {processes} separate process(es): '
            f"all_reduce(rank + 1) gave {reports[0]['all_reduce']} {verdict} ({seconds:.2f} s)</p>")
