"""What the calculator widgets share: controls that redraw a chart, a summary and a one-line error.

A calculator (the memory calculator, the ZeRO ladder, the ring attention, pipeline and capacity explorers) is
an `Explorer`: it builds its controls, hands them to `Explorer.__init__`, lays itself out and calls its own
`update()`, which reads `values()`, computes, and ends in `show_figure` (the chart) or `show_error` (one
line instead of it). Every change of a control calls `update()` again, except inside `batched()`.

Like the widgets, this module does not import torch (nor matplotlib until a figure is shown).
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Iterator
from contextlib import contextmanager

import ipywidgets as widgets

CONTROL_WIDTH = "320px"  # a slider or a note in a column of controls


class Explorer(widgets.VBox):
    """Controls (`controls`: name -> control) feeding a chart (`plot`), an HTML `summary` and an HTML `error`.

    Subclasses write `update()`. Tests drive a widget through `controls[name].value` and read `summary.value`
    and `error.value`."""

    def __init__(self, controls: dict[str, widgets.Widget]) -> None:
        super().__init__()
        self.controls = controls
        self.summary, self.error, self.plot = widgets.HTML(), widgets.HTML(), widgets.Output()
        self._holding = False  # True inside `batched()`: control changes do not redraw
        for control in controls.values():
            control.observe(self._on_change, names="value")

    def update(self) -> None:
        raise NotImplementedError

    def values(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    def _on_change(self, change: dict) -> None:
        """Any control moved: redraw (a subclass may first adjust other controls, inside `batched()`)."""
        if not self._holding:
            self.update()

    @contextmanager
    def batched(self) -> Iterator[None]:
        """Change several controls without a redraw for each: the caller redraws once, after."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False

    def beside(self, left: list[widgets.Widget], width: str) -> list[widgets.Widget]:
        """The widget's children: a column of `left` (kept `width` wide: JupyterLab would squeeze its labels)
        beside the chart, the summary and the error."""
        column = widgets.VBox(left, layout=widgets.Layout(width=width, flex="0 0 auto"))
        return [widgets.HBox([column, widgets.VBox([self.plot, self.summary, self.error])])]

    def show_error(self, message: str) -> None:
        """One line naming what is wrong, instead of the chart and the summary."""
        self.error.value = f'<p class="lab-error" style="color:#b00">{html.escape(message)}</p>'
        self.summary.value = ""
        self.plot.outputs = ()  # a state change, as in show_figure


def show_figure(output: widgets.Output, fig) -> None:
    """Show `fig` in `output` in place of what it showed, then close it (pyplot keeps every figure open).

    The PNG becomes the output widget's state (`outputs`, one assignment: no flicker) instead of being shown
    inside `with output:`. Capturing relies on the browser applying the widget's new msg_id before the kernel's
    display message arrives, and in JupyterLab a chart redrawn from a control's callback was sometimes never
    shown (the summary moved on, the chart did not: seen in the browser lane); a state change cannot be lost."""
    import matplotlib.pyplot as plt

    png = io.BytesIO()
    fig.savefig(png, format="png", bbox_inches="tight")  # what the inline backend shows
    plt.close(fig)
    output.outputs = ({"output_type": "display_data", "metadata": {},
                       "data": {"image/png": base64.b64encode(png.getvalue()).decode("ascii"),
                                "text/plain": repr(fig)}},)


def slider(kind: type, value: float, low: float, high: float, step: float, description: str) -> widgets.Widget:
    """An `IntSlider` or `FloatSlider` for a column of controls. It reports on release, not at every step of
    a drag, so a drag redraws once."""
    return kind(value=value, min=low, max=high, step=step, description=description, continuous_update=False,
                layout=widgets.Layout(width=CONTROL_WIDTH), style={"description_width": "110px"})


def check_choices(*choices: tuple[str, object, list]) -> None:
    """One clear line for a constructor argument that is not among its control's options: (name, value, options)."""
    for name, value, options in choices:
        if value not in options:
            raise ValueError(f"{name}={value!r} must be one of {', '.join(map(repr, options))}")


def selection(options: list, value: object, description: str, layout: widgets.Layout) -> widgets.SelectionSlider:
    """A slider over a list of values (batch sizes, sequence lengths) that reports on release, as `slider`."""
    return widgets.SelectionSlider(options=options, value=value, description=description, continuous_update=False,
                                   layout=layout)


def note(text: str) -> widgets.HTML:
    """A small paragraph under the controls (`text` is HTML)."""
    return widgets.HTML(f'<p style="font-size:85%">{text}</p>', layout=widgets.Layout(width=CONTROL_WIDTH))
