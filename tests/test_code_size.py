"""The code stays in small pieces: no function of 50 lines or more, no file of 500 or more.

Long functions hide phases that deserve a name and a test; long files hide modules.  The
limits are the project's style guide's; this test applies them to every Python file of the
package, the benchmarks and every test suite.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHECKED = ("tokenflow", "benchmarks", "tests", "tests_vllm", "tests_llamacpp")
MAX_FUNCTION_LINES = 49
MAX_FILE_LINES = 499


def python_files() -> list[pathlib.Path]:
    return [
        p for top in CHECKED if (ROOT / top).is_dir() for p in sorted((ROOT / top).rglob("*.py"))
    ]


def long_functions(source: str, max_lines: int) -> list[str]:
    """`name (lines)` of each function or method in `source` longer than `max_lines`
    (decorators excluded, the docstring included)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            num_lines = node.end_lineno - node.lineno + 1
            if num_lines > max_lines:
                found.append(f"{node.name} ({num_lines} lines)")
    return found


def test_the_checker_finds_a_long_function_and_passes_a_short_one() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(60))
    assert long_functions(f"def f():\n{body}", MAX_FUNCTION_LINES) == ["f (61 lines)"]
    assert long_functions("def g():\n    return 1\n", MAX_FUNCTION_LINES) == []


def test_every_python_file_is_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in python_files()}
    assert "tokenflow/core/scheduler.py" in names
    assert "tests/test_code_size.py" in names


def test_no_function_of_50_lines_or_more() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}: {found}"
        for path in python_files()
        for found in long_functions(path.read_text(), MAX_FUNCTION_LINES)
    ]
    assert offenders == []


def test_no_file_of_500_lines_or_more() -> None:
    offenders = [
        f"{path.relative_to(ROOT)} ({num_lines} lines)"
        for path in python_files()
        if (num_lines := len(path.read_text().splitlines())) > MAX_FILE_LINES
    ]
    assert offenders == []


def test_the_tokenflow_policy_reads_in_one_sitting() -> None:
    # The policy's phases and formulas: about 700 lines in all (720 at most), no file over 250.
    names = ("tokenflow", "pricing", "capacity", "admission", "balance", "resume")
    folder = ROOT / "tokenflow" / "core" / "policies"
    sizes = {name: len((folder / f"{name}.py").read_text().splitlines()) for name in names}
    assert max(sizes.values()) <= 250 and sum(sizes.values()) <= 720, sizes
