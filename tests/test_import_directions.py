"""Imports run one way (DESIGN.md, "Which way imports run"): every module under `lab/` is parsed, and each
import it makes is checked against the directions the design forbids.

Imports under `if TYPE_CHECKING:` do not count: they never run (lab.layout names lab.config's ParallelConfig in
a type hint that way). Deferred imports (inside a function) count like module-level ones: a function that imports
`widgets` from `grading` ties the two together as surely as a top-level import, it only delays the cost. The one
exception the design grants is written out in `WIDGET_DEFERRED`: a widget may, inside a function, import what a
live demonstration runs (ranks started through `lab.distributed`, the collectives or the model they execute). Nothing
else is exempt.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

LAB = Path(__file__).resolve().parents[1] / "lab"
RULE_SOURCE = "DESIGN.md, 'Which way imports run'"

IMPLEMENTATION = ("lab.parallel", "lab.distributed", "lab.model", "lab.loss", "lab.calc", "lab.collectives",
                  "lab.config", "lab.layout", "lab.data", "lab.kernels", "lab.precision", "lab.inference")
TORCH_FREE = ("lab.calc", "lab.config", "lab.layout")  # they run in a browser kernel and make widgets instant
WIDGET_MODULE_LEVEL = ("lab.calc", "lab.config", "lab.layout", "lab.widgets")  # widgets ─► calc: instant to import
PROGRAMS = ("lab.train", "lab.trainer", "lab.sweep")  # the CLI, the loop it runs, the sweep that runs it
# The exception, each entry for a demonstration that runs the real code: ranks started through lab.distributed
# (welcome, collectives, ring, sharding), the ring all-reduce those ranks execute (ring), the MoE router (moe).
WIDGET_DEFERRED = ("lab.distributed", "lab.collectives", "lab.model")

# (importer, imported it must not reach, the rule as DESIGN.md states it)
FORBIDDEN = [
    (("lab.model",), ("lab.parallel", "lab.distributed", "lab.kernels"),
     "model imports nothing from parallel or dist (nor kernels: they are swapped into its seams)"),
    (("lab.kernels", "lab.precision", "lab.inference"), ("lab.parallel", "lab.distributed", "lab.checkpoint"),
     "inference, precision, kernels ─► model, never the techniques above it"),
    (("lab.distributed",), ("lab.parallel",), "dist knows nothing of the techniques above it"),
    (("lab.parallel",), (*PROGRAMS, "lab.widgets", "lab.grading"), "parallel imports no train, widgets or grading"),
    (("lab.grading",), ("lab.widgets",), "grading imports no widgets (a reference both need lives in calc)"),
    (IMPLEMENTATION, ("lab.widgets", "lab.grading", *PROGRAMS),
     "no implementation imports widgets, grading or train"),
    (IMPLEMENTATION, ("lab.measure",), "lesson instruments (lab.measure) serve lessons, never an implementation"),
    (("lab.loss",), ("lab.parallel", "lab.distributed"), "the loss lives beside the model: model ─► config only"),
    (("lab.layout",), ("lab",), "config ─► layout, which imports nothing of lab (every sandbox carries it)"),
]


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str  # a module name (`from a.b import c` gives a.b.c when that is a module, else a.b)
    line: int
    deferred: bool  # inside a function: runs when it is called, not on import

    def __str__(self) -> str:
        return f"{self.importer} imports {self.imported} (line {self.line}{', deferred' if self.deferred else ''})"


def within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def module_name(path: Path) -> str:
    parts = path.relative_to(LAB.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def find_imports(source: str, module: str, is_package: bool, known: set[str]) -> list[Import]:
    """Every import of `source` (relative ones resolved against `module`), module-level or deferred."""
    found: list[Import] = []
    package = module.split(".") if is_package else module.split(".")[:-1]

    def visit(node: ast.AST, deferred: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                visit(ast.Module(body=child.orelse, type_ignores=[]), deferred)  # the body never runs
                continue
            inner = deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend(Import(module, alias.name, child.lineno, inner) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(package[:len(package) - child.level + 1] + ([base] if base else []))
                for alias in child.names:
                    target = f"{base}.{alias.name}"
                    found.append(Import(module, target if target in known else base, child.lineno, inner))
            visit(child, inner)

    visit(ast.parse(source), False)
    return found


def lab_imports() -> dict[str, list[Import]]:
    paths = sorted(LAB.rglob("*.py"))
    known = {module_name(p) for p in paths}
    return {module_name(p): find_imports(p.read_text(), module_name(p), p.name == "__init__.py", known)
            for p in paths}


def executed_on_import(name: str) -> list[str]:
    """Importing `a.b.c` runs the inits of `a` and `a.b` first."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def torch_path(start: str, graph: dict[str, list[Import]], follow_deferred: tuple[str, ...]) -> list[Import] | None:
    """A chain of imports from `start` that reaches torch, or None. Deferred imports are followed only out of
    modules within `follow_deferred` (calling their functions runs them); any other lab module a chain
    reaches contributes what runs when it is imported: its module-level imports and its packages' inits."""
    seen, stack = {start}, [(start, [])]
    while stack:
        module, chain = stack.pop()
        for imp in graph.get(module, []):
            if imp.deferred and not within(module, follow_deferred):
                continue
            if within(imp.imported, ("torch",)):
                return [*chain, imp]
            for reached in executed_on_import(imp.imported):
                if reached in graph and reached not in seen:
                    seen.add(reached)
                    stack.append((reached, [*chain, imp]))
    return None


def violations(graph: dict[str, list[Import]]) -> list[str]:
    problems = []
    for module, imports in graph.items():
        for imp in imports:
            for importers, targets, rule in FORBIDDEN:
                if within(module, importers) and within(imp.imported, targets):
                    problems.append(f"{imp}: {rule}")
            if within(module, ("lab.widgets",)) and within(imp.imported, ("lab",)):
                allowed = WIDGET_MODULE_LEVEL + (WIDGET_DEFERRED if imp.deferred else ())
                if not within(imp.imported, allowed):
                    problems.append(f"{imp}: widgets import calc, config and widgets (layout math comes from "
                                    f"calc); only inside a function {', '.join(WIDGET_DEFERRED)} (live "
                                    "demonstrations)")
        for packages, follow, rule in ((TORCH_FREE, TORCH_FREE, "calc and config import no torch, not even "
                                        "through another module"),
                                       (("lab.widgets",), (), "importing a widget imports no torch")):
            if within(module, packages):
                chain = torch_path(module, graph, follow)
                if chain:
                    problems.append(f"{' -> '.join(map(str, chain))}: {rule}")
    return [f"{p} [{RULE_SOURCE}]" for p in dict.fromkeys(problems)]  # two names from one line: one entry


def test_finder_sees_deferred_relative_and_from_imports():
    source = ("import os\nfrom . import memory\nfrom .. import config\n"
              "def f():\n    from lab.widgets.sharding import x\n    import torch\n")
    known = {"lab.calc.memory", "lab.config", "lab.widgets.sharding"}
    got = [(i.imported, i.deferred) for i in find_imports(source, "lab.calc.x", False, known)]
    assert got == [("os", False), ("lab.calc.memory", False), ("lab.config", False),
                   ("lab.widgets.sharding", True), ("torch", True)]


def test_finder_skips_what_only_type_checkers_read():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\nelse:\n    import os\n"
    assert [i.imported for i in find_imports(source, "lab.layout", False, set())] == ["typing", "os"]


def test_rules_catch_a_planted_import():
    graph = {"lab.grading.checks.ch04": [Import("lab.grading.checks.ch04", "lab.widgets.sharding", 9, True)],
             "lab.calc.cp": [Import("lab.calc.cp", "lab.model", 3, False)],
             "lab.model": [Import("lab.model", "torch", 1, False)]}
    found = violations(graph)
    assert any("lab.grading.checks.ch04 imports lab.widgets.sharding" in p and "grading imports no widgets" in p
               for p in found), found
    assert any(p.startswith("lab.calc.cp imports lab.model (line 3) -> lab.model imports torch") for p in found), found


def test_lab_imports_run_the_way_the_design_says():
    graph = lab_imports()
    assert len(graph) > 50 and "lab.calc.memory" in graph  # the walk found the package
    problems = violations(graph)
    assert not problems, "forbidden import directions:\n" + "\n".join(problems)
