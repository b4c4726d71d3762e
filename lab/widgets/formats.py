"""The number-format explorer: type a value, see what each format of chapter 10 stores for it, bit by bit.

For every ticked format the table gives `lab.calc.formats.encode`'s answer: the bits as coloured sign / exponent
/ mantissa fields, the value they mean, the relative rounding error, the representable neighbours just below
and above, and what happened on the way (exact, rounded, subnormal, underflow to 0, overflow to inf, overflow to
NaN where the format has no inf, or saturated to ±max when "saturate" is ticked, as FP8 recipes clamp). The
chart draws each format's grid of representable magnitudes over two binades either side of the value, on a log
axis: the ticks crowd near the value in fp16 and thin out in FP8, the red band is past the format's max, the
grey band below its smallest positive value. Formats with more than 2^5 values per binade are drawn as a band.

The value box reads Python floats ("0.1", "1e-5", "65504", "-inf", "nan") and powers of two ("2^-24",
"2**-24"); anything else shows one line naming it instead of the table and the chart.
"""

from __future__ import annotations

import html
import math
import re

import ipywidgets as widgets

from lab.calc.formats import FORMATS, Encoding, Format, encode, neighbours, values_between
from lab.widgets.base import Explorer, note, show_figure

DEFAULT_FORMATS = ("fp32", "bf16", "fp16", "e4m3fn", "e5m2")
FIELD_COLOURS = {"sign": "#c62828", "exponent": "#1565c0", "mantissa": "#2e7d32"}
BAND_COLOURS = {"past max": "#ffcdd2", "below the smallest positive": "#e0e0e0"}
DENSE_MANTISSA = 5  # more mantissa bits than this: 2^m ticks a binade would be a solid smear, draw a band
BINADES = 2  # the chart spans 2^-2 .. 2^2 times the value
POWER_OF_TWO = re.compile(r"([+-]?)2\s*(?:\^|\*\*)\s*([+-]?\d+)")


def parse_value(text: str) -> float:
    """A float from what a learner types: anything float() reads, or 2^k / 2**k (exact, also past float's
    normal range, e.g. 2^-149)."""
    stripped = text.strip()
    power = POWER_OF_TWO.fullmatch(stripped)
    if power:  # 2^k past float64's range is inf or 0, as float("1e400") is
        exponent = int(power.group(2))
        magnitude = math.inf if exponent > 1023 else math.ldexp(1.0, max(exponent, -1100))
        return -magnitude if power.group(1) == "-" else magnitude
    try:
        return float(stripped)
    except ValueError:
        raise ValueError(f"value={text!r} is not a number: type e.g. 0.1, 1e-5, 65504, 2^-24, inf or nan") from None


class FormatExplorer(Explorer):
    """The value box, a saturate switch and a checkbox per format on the left; the grid chart, the encoding
    table and the formats' ranges on the right. Tests read `encodings` (format name -> Encoding, or a string
    saying why the format cannot store the value; None while the error line shows), `grids` (format name ->
    the magnitudes drawn as ticks in the chart's `window`, None for a format drawn as a band), `summary.value`
    and `error.value`."""

    def __init__(self, value: str | float = "0.1", formats: tuple[str, ...] = DEFAULT_FORMATS,
                 saturate: bool = False) -> None:
        for name in formats:
            if name not in FORMATS:
                raise ValueError(f"format={name!r} must be one of {', '.join(map(repr, FORMATS))}")
        text = value if isinstance(value, str) else repr(float(value))
        controls = {"value": widgets.Text(value=text, description="value", continuous_update=False,
                                          layout=widgets.Layout(width="240px")),
                    "saturate": widgets.Checkbox(value=saturate, description="saturate (clamp to ±max)")}
        for name in FORMATS:
            controls[name] = widgets.Checkbox(value=name in formats, description=_label(FORMATS[name]))
        super().__init__(controls)
        self.encodings: dict[str, Encoding | str] | None = None
        self.grids: dict[str, list[float] | None] = {}
        self.window = (0.0, 0.0)
        self.children = self.beside([*self.controls.values(), note(
            "Press Enter to apply the value. Try 0.1, 65504, 65520, 1e-5, 3e-8, 448, 464, 465, 1e-40, inf.")],
            width="270px")
        self.update()

    def chosen(self) -> list[Format]:
        return [fmt for name, fmt in FORMATS.items() if self.controls[name].value]

    def update(self) -> None:
        v = self.values()
        try:
            x = parse_value(v["value"])
            if not self.chosen():
                raise ValueError(f"no format ticked: tick at least one of {', '.join(FORMATS)}")
        except ValueError as err:
            self.encodings = None
            self.show_error(str(err))
            return
        self.encodings = {}
        for fmt in self.chosen():
            try:
                self.encodings[fmt.name] = encode(x, fmt, saturate=v["saturate"])
            except ValueError as err:  # a negative value for the unsigned e8m0
                self.encodings[fmt.name] = str(err)
        self.error.value = ""
        self._draw(x)
        self._tabulate(x)

    def _tabulate(self, x: float) -> None:
        head = "".join(f"<th>{h}</th>" for h in ("format", "bits (sign exponent mantissa)", "stored value",
                                                 "relative error", "next below the value", "next above the value",
                                                 "what happened"))
        rows = []
        for name, enc in self.encodings.items():
            if isinstance(enc, str):
                rows.append(f'<tr class="lab-format-row" data-format="{name}"><td>{name}</td>'
                            f'<td colspan="6">{html.escape(enc)}</td></tr>')
                continue
            below, above = neighbours(x, enc.format) if not math.isnan(x) else (None, None)
            cells = (name, _bits_html(enc), _number(enc.value), _ratio(enc.relative_error), _number(below),
                     _number(above), ", ".join(flags(enc)))
            rows.append(f'<tr class="lab-format-row" data-format="{name}">'
                        + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        info = "".join(
            f"<tr><td>{f.name}</td><td>{f.sign_bits}/{f.exponent_bits}/{f.mantissa_bits}</td><td>{_number(f.max)}"
            f"</td><td>{_number(f.min_normal)}</td><td>{_number(f.min_subnormal)}</td><td>{_number(f.epsilon)}</td>"
            f"<td>{f.decades:.1f}</td><td>{'yes' if f.has_inf else 'no'}</td></tr>" for f in self.chosen())
        info_head = "".join(f"<th>{h}</th>" for h in ("format", "s/e/m bits", "max", "min normal", "min subnormal",
                                                      "epsilon", "decades", "inf"))
        self.summary.value = (
            f'<p class="lab-format-input"><b>value = {_number(x)}</b> (the float64 the box reads)</p>'
            f'<table class="lab-format-table" style="font-size:90%"><tr>{head}</tr>{"".join(rows)}</table>'
            f'<table class="lab-format-info" style="font-size:85%;margin-top:6px"><tr>{info_head}</tr>{info}'
            f"</table>")

    def _draw(self, x: float) -> None:
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter

        centre = abs(x) if math.isfinite(x) and x != 0 else 1.0
        lo, hi = self.window = centre * 2.0**-BINADES, centre * 2.0**BINADES
        self.grids = {}
        fmts = self.chosen()
        fig, ax = plt.subplots(figsize=(7, 0.5 * len(fmts) + 1.3))
        labelled = set()  # one legend entry per band
        for row, fmt in enumerate(fmts):
            for band, start, end in (("past max", max(fmt.max, lo), hi),
                                     ("below the smallest positive", lo, min(fmt.min_positive, hi))):
                if start < end:
                    ax.fill_between([start, end], row - 0.4, row + 0.4, color=BAND_COLOURS[band], linewidth=0,
                                    label=None if band in labelled else band)
                    labelled.add(band)
            self.grids[fmt.name] = None
            if fmt.mantissa_bits > DENSE_MANTISSA:
                start, end = max(lo, fmt.min_positive), min(hi, fmt.max)
                if start < end:
                    ax.fill_between([start, end], row - 0.25, row + 0.25, color="#90a4ae", linewidth=0)
                    ax.text(math.sqrt(start * end), row - 0.27, f"{2**fmt.mantissa_bits:,} values per normal binade",
                            ha="center", va="bottom", fontsize=7)
            else:
                self.grids[fmt.name] = [g for g in values_between(lo, hi, fmt) if g > 0]
                ax.vlines(self.grids[fmt.name], row - 0.25, row + 0.25, color="#37474f", linewidth=0.8)
            enc = self.encodings[fmt.name]
            if isinstance(enc, Encoding) and math.isfinite(enc.value) and lo <= abs(enc.value) <= hi:
                ax.plot([abs(enc.value)], [row], "o", color="#2e7d32" if not enc.rounded else "#ef6c00",
                        markersize=7, zorder=3)
        if math.isfinite(x) and x != 0:
            ax.axvline(abs(x), color="#c62828", linewidth=1, linestyle="--", label=f"|value| = {abs(x):.6g}")
            title = "representable magnitudes near the value (dot: what is stored)"
        else:
            title = f"representable magnitudes near 1 (the value {x!r} has no magnitude to zoom on)"
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper right", fontsize=7)
        ax.set_xscale("log", base=2)
        ax.minorticks_off()  # and plain tick labels: a log axis's mathtext labels are most of a redraw's time
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"2^{math.log2(value):g}"))
        ax.set_xlim(lo, hi)
        ax.set_ylim(len(fmts) - 0.4, -0.6)  # the first format on top, as in the table
        ax.set_yticks(range(len(fmts)), [f.name for f in fmts])
        ax.set_xlabel("|value| (log scale, base 2)", fontsize=8)
        ax.set_ylabel("format", fontsize=8)
        ax.set_title(title, fontsize=10)
        show_figure(self.plot, fig)


def flags(enc: Encoding) -> list[str]:
    """What happened to the value on its way into the format, in words."""
    if math.isnan(enc.input):
        return ["NaN stays NaN"]
    if enc.saturated:
        return [f"saturated to {'−' if enc.value < 0 else '+'}max"]
    if enc.overflowed:
        return ["overflow → " + ("inf" if math.isinf(enc.value) else f"NaN ({enc.format.name} has no inf)")]
    if math.isinf(enc.input):
        return ["inf stays inf"] if math.isinf(enc.value) else [f"inf → NaN ({enc.format.name} has no inf)"]
    out = ["rounded" if enc.rounded else "exact"]
    if enc.underflowed:
        out.append("underflow → 0")
    if enc.subnormal:
        out.append("subnormal")
    return out


def _label(fmt: Format) -> str:
    return f"{fmt.name} ({fmt.sign_bits}/{fmt.exponent_bits}/{fmt.mantissa_bits})"


def _bits_html(enc: Encoding) -> str:
    spans = [f'<span class="lab-bits-{field}" style="color:{FIELD_COLOURS[field]}">{bits}</span>'
             for field, bits in zip(FIELD_COLOURS, enc.fields, strict=True) if bits]
    return f'<code style="font-weight:bold">{" ".join(spans)}</code>'


def _number(value: float | None) -> str:
    """The shortest decimal that reads back as the same float64: every stored value here is one exactly."""
    return "—" if value is None else repr(value)


def _ratio(error: float) -> str:
    return "—" if math.isnan(error) else "∞" if math.isinf(error) else f"{error:.3g}"


def format_explorer(value: str | float = "0.1", formats: tuple[str, ...] = DEFAULT_FORMATS,
                    saturate: bool = False) -> FormatExplorer:
    """The chapter 10 number-format explorer."""
    return FormatExplorer(value=value, formats=formats, saturate=saturate)
