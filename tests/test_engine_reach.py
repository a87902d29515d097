"""The layers above the engine (serving, the replicas, the command line) read it through
`AsyncEngine` and `EngineClient` alone: none reaches for an engine's scheduler, its core or the
`LLMEngine` inside an `AsyncEngine`, whose state only the engine thread may touch."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tokenflow"
ABOVE_THE_ENGINE = ("serving", "replicas", "cli")
# These commands build an `LLMEngine` and drive it themselves, single-threaded, as its owner
# (profiling swaps its executor and reads its KV configuration): there is no engine thread to
# cross, so they are not held to the client's surface.
OWNERS = ("cli/profile.py", "cli/profile_probe.py")
ENGINE_INSIDES = ("scheduler", "core")


def reaches_inside(tree: ast.AST) -> list[str]:
    """Each `x.scheduler`, `x.core` or `x.engine.engine` in `tree`, as 'line: expression'
    (a dotted module path such as `tokenflow.core.routing` is no reach)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        root = node.value
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and root.id == "tokenflow":
            continue
        if node.attr in ENGINE_INSIDES or (node.attr == "engine" and _names_engine(node.value)):
            found.append((node.lineno, node.col_offset, ast.unparse(node)))
    return [f"{line}: {text}" for line, _, text in sorted(found)]


def _names_engine(node: ast.expr) -> bool:
    """`node` is `engine` or `x.engine` (an `AsyncEngine`, whose `.engine` is its LLMEngine)."""
    if isinstance(node, ast.Attribute):
        return node.attr == "engine"
    return isinstance(node, ast.Name) and node.id == "engine"


def reaches_above_the_engine(package: Path) -> dict[str, list[str]]:
    """Per module of the layers above the engine under `package` (owners aside), its reaches
    inside an engine."""
    found = {}
    for layer in ABOVE_THE_ENGINE:
        for path in sorted((package / layer).rglob("*.py")):
            name = path.relative_to(package).as_posix()
            if name in OWNERS:
                continue
            reaches = reaches_inside(ast.parse(path.read_text()))
            if reaches:
                found[name] = reaches
    return found


def test_no_layer_above_the_engine_reaches_inside_it():
    assert reaches_above_the_engine(PACKAGE) == {}


def test_the_scan_finds_the_reaches_it_forbids():
    source = """
kv = engine.engine.scheduler.kv.config
llm = self.engine.engine
report = load_report(llm.scheduler.view(llm.core.clock.now()))
from tokenflow.core.load_report import load_report
import tokenflow.core.load_report
tokenflow.core.load_report.load_report(view)
stats = self.engine.stats()
"""
    found = reaches_inside(ast.parse(source))
    assert [line.split(":")[0] for line in found] == ["2", "2", "3", "4", "4"]
