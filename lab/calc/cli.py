"""`python -m lab calc ...`: the cost models on the command line (table or --json)."""

from __future__ import annotations

import argparse
import json
import sys

from lab.calc.params import param_breakdown
from lab.config import PRESETS, ModelConfig


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="python -m lab calc")
    sub = parser.add_subparsers(dest="what", required=True, parser_class=_OneLineParser)
    params = sub.add_parser("params", help="parameter count of a preset, by component")
    params.add_argument("--model", required=True, help=f"preset: {', '.join(PRESETS)}")
    params.add_argument("--json", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = ModelConfig.from_preset(args.model)
    except ValueError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    parts = param_breakdown(cfg)
    if args.json:
        print(json.dumps({"model": cfg.name, **parts}))
        return 0
    print(f"{cfg.name}: {parts['total']:,} parameters ({parts['total'] / 1e9:.3f} B)")
    for name, value in parts.items():
        if name != "total" and value:
            print(f"  {name:<15} {value:>18,}")
    return 0
