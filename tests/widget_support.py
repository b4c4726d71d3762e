"""What the widget tests share: matplotlib without a display, and the charts a widget holds.

A widget test file imports `agg_backend` (an autouse fixture: importing it into the module is what applies it)
and, where it looks at a chart, `shown`.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def agg_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Draw with Agg, the backend that needs no display (a test machine has none)."""
    monkeypatch.setenv("MPLBACKEND", "Agg")


def shown(widget) -> list[str]:
    """The PNGs the chart's output widget holds, as the browser receives them (its synced `outputs` state)."""
    return [output["data"]["image/png"] for output in widget.plot.outputs]
