"""The number-format explorer: every row is lab.calc.formats' answer, chart and table follow each change, errors
inline."""

import html
import math
import re
import subprocess
import sys

import pytest
from widget_support import agg_backend, shown  # noqa: F401 (agg_backend: an autouse fixture, applied by importing it)

pytest.importorskip("ipywidgets")

from lab.calc.formats import FORMATS, encode, neighbours, values_between  # noqa: E402
from lab.widgets.formats import DEFAULT_FORMATS, flags, format_explorer, parse_value  # noqa: E402


@pytest.fixture(scope="module")
def widget():
    """One explorer shared by the tests that put it back as they found it (a redraw costs ~0.3 s)."""
    return format_explorer()


def _row(widget, name: str) -> list[str]:
    """The cells of one format's row of the table, tags stripped."""
    row = re.search(rf'<tr class="lab-format-row" data-format="{name}">(.*?)</tr>', widget.summary.value).group(1)
    return [html.unescape(re.sub(r"<[^>]+>", "", cell)) for cell in re.findall(r"<td[^>]*>(.*?)</td>", row)]


def test_default_view_is_calc_formats_encode_for_every_ticked_format(widget):
    assert list(widget.encodings) == ["fp32", "fp16", "bf16", "e4m3fn", "e5m2"]  # ticked, in FORMATS' order
    for name in DEFAULT_FORMATS:
        assert widget.encodings[name] == encode(0.1, name)
        below, above = neighbours(0.1, name)
        assert _row(widget, name)[4:6] == [repr(below), repr(above)]
    # bf16 stores 0.1 as 0 01111011 1001101 = 0.10009765625, 9.77e-4 too high; e5m2 as 0.09375
    assert _row(widget, "bf16") == ["bf16", "0 01111011 1001101", "0.10009765625", "0.000977", "0.099609375",
                                    "0.10009765625", "rounded"]
    assert _row(widget, "e5m2")[2:4] == ["0.09375", "0.0625"]
    # the fields are coloured spans: sign, exponent, mantissa
    assert ('<span class="lab-bits-sign" style="color:#c62828">0</span> <span class="lab-bits-exponent" '
            'style="color:#1565c0">01011</span> <span class="lab-bits-mantissa" style="color:#2e7d32">10</span>'
            ) in widget.summary.value
    # the chart: e4m3fn's and e5m2's grids over 0.1 / 4 .. 0.1 x 4 as ticks, the 16-bit and 32-bit ones as bands
    assert widget.window == (0.025, 0.4)
    assert widget.grids == {"fp32": None, "fp16": None, "bf16": None, "e4m3fn": values_between(0.025, 0.4, "e4m3fn"),
                            "e5m2": values_between(0.025, 0.4, "e5m2")}
    assert [len(widget.grids[name]) for name in ("e4m3fn", "e5m2")] == [32, 16]  # 8 and 4 values a binade
    assert '<table class="lab-format-info"' in widget.summary.value and "<td>e4m3fn</td><td>1/4/3</td><td>448.0" \
        in widget.summary.value


def test_fp16_at_65504_exact_then_rounded_then_overflowing_or_saturated():
    widget = format_explorer("65504", formats=("fp16", "bf16", "e4m3fn", "e5m2"))
    assert _row(widget, "fp16")[1:4] == ["0 11110 1111111111", "65504.0", "0"] and _row(widget, "fp16")[6] == "exact"
    assert _row(widget, "fp16")[5] == "inf"  # the next value above fp16's max is inf
    assert _row(widget, "e4m3fn")[6] == "overflow → NaN (e4m3fn has no inf)"
    assert _row(widget, "e5m2")[2:4] == ["inf", "∞"] and _row(widget, "e5m2")[6] == "overflow → inf"
    widget.controls["value"].value = "65519"  # less than half an ulp (32) above: back to max
    assert _row(widget, "fp16")[2] == "65504.0" and _row(widget, "fp16")[6] == "rounded"
    widget.controls["value"].value = "65520"  # halfway to 65536: ties to even, overflows
    assert _row(widget, "fp16")[1:3] == ["0 11111 0000000000", "inf"] and _row(widget, "fp16")[6] == "overflow → inf"
    widget.controls["saturate"].value = True
    assert _row(widget, "fp16")[1:3] == ["0 11110 1111111111", "65504.0"]
    assert _row(widget, "fp16")[6] == "saturated to +max" and _row(widget, "e4m3fn")[2] == "448.0"
    assert widget.encodings["fp16"] == encode(65520, "fp16", saturate=True)


@pytest.mark.parametrize(("value", "name", "saturate", "what"), [
    (3e-8, "fp16", False, ["rounded", "subnormal"]), (1e-9, "fp16", False, ["rounded", "underflow → 0"]),
    (2.0**-24, "fp16", False, ["exact", "subnormal"]), (math.nan, "e4m3fn", False, ["NaN stays NaN"]),
    (-math.inf, "fp16", False, ["inf stays inf"]), (-math.inf, "e4m3fn", False, ["inf → NaN (e4m3fn has no inf)"]),
    (-math.inf, "e5m2", True, ["saturated to −max"]), (465, "e4m3fn", False, ["overflow → NaN (e4m3fn has no inf)"]),
    (464, "e4m3fn", False, ["rounded"]), (2.0**20, "bf16", False, ["exact"]),
])
def test_flags_name_what_happened(value, name, saturate, what):
    assert flags(encode(value, name, saturate=saturate)) == what


def test_e8m0_is_unsigned_and_says_so(widget):
    with widget.batched():
        widget.controls["e8m0"].value = True
        widget.controls["value"].value = "-3"
    widget.update()
    assert _row(widget, "e8m0") == ["e8m0", "value=-3.0 has no e8m0 encoding: e8m0 is unsigned (a scale), values "
                                    "must be >= 0"]
    assert _row(widget, "fp32")[2] == "-3.0" and len(shown(widget)) == 1
    with widget.batched():
        widget.controls["e8m0"].value = False
        widget.controls["value"].value = "0.1"
    widget.update()


def test_the_chart_and_the_table_follow_every_change(widget):
    """One PNG each time (set as the output's state, see lab.widgets.base.show_figure), a new one per change."""
    seen = [(shown(widget), widget.summary.value)]
    assert len(seen[0][0]) == 1 and seen[0][0][0].startswith("iVBORw0KGgo")  # base64 of the PNG signature
    for name, value in (("value", "1e5"), ("tf32", True), ("saturate", True)):
        widget.controls[name].value = value
        now = (shown(widget), widget.summary.value)
        assert len(now[0]) == 1 and now[0] != seen[-1][0] and now[1] != seen[-1][1], name
        seen.append(now)
    assert list(widget.encodings) == ["fp32", "tf32", "fp16", "bf16", "e4m3fn", "e5m2"]  # FORMATS' order
    assert _row(widget, "fp16")[2] == "65504.0" and _row(widget, "e4m3fn")[2] == "448.0"
    assert widget.window == (25000.0, 400000.0) and widget.grids["e5m2"] == [28672, 32768, 40960, 49152, 57344]
    assert widget.grids["e4m3fn"] == []  # all of the window is past 448
    with widget.batched():
        for name, value in (("value", "0.1"), ("tf32", False), ("saturate", False)):
            widget.controls[name].value = value
    widget.update()
    assert widget.summary.value == seen[0][1]


def test_a_bad_value_shows_one_line_naming_it_instead_of_chart_and_table(widget):
    message = "value='abc' is not a number: type e.g. 0.1, 1e-5, 65504, 2^-24, inf or nan"
    widget.controls["value"].value = "abc"
    assert widget.encodings is None and widget.summary.value == "" and shown(widget) == []
    assert html.escape(message) in widget.error.value and widget.error.value.count("<p") == 1
    widget.controls["fp32"].value = False  # other controls keep showing the error while the value is bad
    assert widget.encodings is None and html.escape(message) in widget.error.value
    widget.controls["fp32"].value = True
    widget.controls["value"].value = "0.1"
    assert widget.error.value == "" and len(shown(widget)) == 1 and widget.encodings["fp32"] == encode(0.1, "fp32")


def test_no_format_ticked_is_one_line(widget):
    with widget.batched():
        for name in FORMATS:
            widget.controls[name].value = False
    widget.update()
    assert widget.encodings is None and "no format ticked: tick at least one of fp32, tf32" in widget.error.value
    widget.controls["e5m2"].value = True
    assert list(widget.encodings) == ["e5m2"] and widget.error.value == ""
    with widget.batched():
        for name in DEFAULT_FORMATS:
            widget.controls[name].value = True
    widget.update()


@pytest.mark.parametrize(("text", "value"), [
    ("1e-5", 1e-5), ("65504", 65504.0), (" 0.1 ", 0.1), ("inf", math.inf), ("-inf", -math.inf), ("2^-24", 2.0**-24),
    ("2**-149", 2.0**-149), ("-2^3", -8.0), ("2^1024", math.inf), ("1e400", math.inf),
])
def test_parse_value_reads_floats_and_powers_of_two(text, value):
    assert parse_value(text) == value
    assert math.isnan(parse_value("nan"))


@pytest.mark.parametrize("text", ["1e", "", "0x10", "2^x", "one"])
def test_parse_value_names_what_it_cannot_read(text):
    with pytest.raises(ValueError, match=re.escape(f"value={text!r} is not a number")):
        parse_value(text)


def test_bad_arguments_raise_one_clear_line():
    with pytest.raises(ValueError, match="format='fp4' must be one of 'fp32', 'tf32', 'fp16'"):
        format_explorer(formats=("fp16", "fp4"))


def test_importing_the_widget_imports_no_torch():
    code = "import sys, lab.widgets.formats; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
