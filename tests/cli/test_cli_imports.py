"""`tokenflow --help`, each command's `--help` and an argument error answer without importing
what the commands run: torch, xgrammar, matplotlib (seconds of imports).  Checked by the
modules a fresh interpreter holds afterwards, not by time."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "xgrammar", "matplotlib", "transformers", "uvicorn", "tokenflow.model")

_PROBE = """
import contextlib, io, json, sys
from tokenflow.cli.main import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    try:
        main(sys.argv[1:])
    except SystemExit:
        pass
print(json.dumps(sorted(m for m in sys.modules)))
"""


def _modules_after(argv: list[str]) -> set[str]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, check=True
    )
    return set(json.loads(done.stdout))


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["serve", "--help"],
        ["simulate", "--help"],
        ["bench", "--help"],
        ["profile", "--help"],
        ["tune", "--help"],
        ["serve", "--no-such-flag"],
        ["serve", "--max-num-seqs", "many"],
    ],
)
def test_help_and_argument_errors_import_nothing_heavy(argv: list[str]) -> None:
    loaded = _modules_after(argv)
    heavy = sorted(m for m in loaded for h in HEAVY if m == h or m.startswith(h + "."))
    assert heavy == []
