"""The package's layers, in the order docs/design.md draws them: a module imports only from its
own layer or the ones below, modules import one another in no circle, and no module imports a
private name of another.  Every import counts, also those inside functions (lazy imports only
defer a dependency, they do not remove it)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tokenflow"

# Lowest first.  core is pure Python (tests/core/test_purity.py); model is torch; engine runs
# the model through the core; integrations plug other engines in (llama.cpp, vLLM); eval scores
# runs and plays readers; calibrate fits costs to measurements; sim runs the core on costs;
# serving is the HTTP face of an engine; cli holds the commands; replicas deploys them on Ray.
# benchmarks/ (outside the package) may import any of them; none imports it.
LAYERS = (
    "core",
    "model",
    "engine",
    "integrations",
    "eval",
    "calibrate",
    "sim",
    "serving",
    "cli",
    "replicas",
)


def module_name(path: Path) -> str:
    parts = ("tokenflow", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def resolve(name: str) -> str:
    """The module `name` is, or lies in (a name imported from a module)."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def imports_of(module: str) -> list[tuple[str, str]]:
    """(imported module, imported name or '') for every tokenflow import of `module`."""
    found = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tokenflow"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in MODULES:
                    found.append((full, ""))
                else:
                    found.append((resolve(node.module), alias.name))
        elif isinstance(node, ast.Import):
            found += [(resolve(a.name), "") for a in node.names if a.name.startswith("tokenflow")]
    return [(m, name) for m, name in found if m != module]


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_every_subpackage_has_a_layer():
    subpackages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert subpackages == set(LAYERS)


def test_nothing_imports_from_a_layer_above_its_own():
    upward = [
        f"{module} -> {target}"
        for module in MODULES
        if (own := layer_of(module)) is not None
        for target, _ in imports_of(module)
        if (layer := layer_of(target)) is not None and layer > own
    ]
    assert upward == []


def test_modules_import_one_another_in_no_circle():
    graph = {m: {t for t, _ in imports_of(m) if t != "tokenflow"} for m in MODULES}
    done: set[str] = set()

    def visit(node: str, trail: tuple[str, ...]) -> None:
        assert node not in trail, " -> ".join((*trail[trail.index(node) :], node))
        if node in done:
            return
        for nxt in graph[node]:
            visit(nxt, (*trail, node))
        done.add(node)

    for module in graph:
        visit(module, ())


def top_level_imports(module: str) -> set[str]:
    """The top-level package of every absolute import of `module`."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.partition(".")[0])
        elif isinstance(node, ast.Import):
            found |= {alias.name.partition(".")[0] for alias in node.names}
    return found


def test_the_package_never_imports_the_benchmarks():
    """benchmarks/ (its lib/ included) sits above the whole package: it is not installed."""
    importing = sorted(m for m in MODULES if "benchmarks" in top_level_imports(m))
    assert importing == []


def test_no_test_suite_imports_the_benchmarks():
    """The test suites test the package; benchmarks/ may be deleted without breaking one
    (its own helpers are tested under benchmarks/tests/)."""
    root = PACKAGE.parent
    suites = [root / "tests", *sorted(root.glob("tests_*"))]
    importing = []
    for path in (p for suite in suites for p in suite.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            if any(name.partition(".")[0] == "benchmarks" for name in names):
                importing.append(str(path.relative_to(root)))
    assert importing == []


def test_no_module_imports_a_private_name_of_another():
    private = [
        f"{module} imports {target}.{name}"
        for module in MODULES
        for target, name in imports_of(module)
        if name.startswith("_") and not name.startswith("__")
    ]
    assert private == []
