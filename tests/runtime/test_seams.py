"""Arrows run one way: serving -> engine -> core; the engine imports nothing from serving or
sim, and serving's modules form no import cycle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "tokenflow"


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n.startswith("tokenflow")}


def test_the_engine_imports_neither_serving_nor_sim():
    for path in (PACKAGE / "engine").glob("*.py"):
        bad = {
            m
            for m in imported_modules(path)
            if m.startswith(("tokenflow.serving", "tokenflow.sim"))
        }
        assert not bad, f"{path.name} imports {bad}"


def test_serving_modules_form_no_cycle():
    graph = {
        f"tokenflow.serving.{p.stem}": {
            m for m in imported_modules(p) if m.startswith("tokenflow.serving.")
        }
        for p in (PACKAGE / "serving").glob("*.py")
    }

    def visit(node: str, trail: tuple[str, ...]) -> None:
        assert node not in trail, " -> ".join((*trail, node))
        for nxt in graph.get(node, ()):
            visit(nxt, (*trail, node))

    for module in graph:
        visit(module, ())


def test_the_engine_imports_no_integration():
    # Executors outside the engine are handed to it as factories (tokenflow.executors).
    for path in (PACKAGE / "engine").glob("*.py"):
        bad = {m for m in imported_modules(path) if m.startswith("tokenflow.integrations")}
        assert not bad, f"{path.name} imports {bad}"
