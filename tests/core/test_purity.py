"""The core is pure Python: no torch, numpy, asyncio or web framework, and no wall clock."""

import pathlib
import subprocess
import sys

import tokenflow.core

FORBIDDEN_MODULES = ("torch", "numpy", "asyncio", "fastapi", "starlette", "uvicorn", "aiohttp")
CORE_DIR = pathlib.Path(tokenflow.core.__file__).parent


def test_core_imports_no_heavy_or_async_module():
    modules = [
        "tokenflow.core." + p.relative_to(CORE_DIR).with_suffix("").as_posix().replace("/", ".")
        for p in sorted(CORE_DIR.rglob("*.py"))
        if p.name != "__init__.py"
    ]
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + f"bad = [m for m in {FORBIDDEN_MODULES!r} if m in sys.modules]\n"
        + "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"the core imported {out.stdout.strip()}"


def test_core_never_reads_the_wall_clock():
    offenders = []
    for path in sorted(CORE_DIR.rglob("*.py")):
        text = path.read_text()
        for needle in ("import time", "from time", "datetime", "perf_counter", "monotonic"):
            if needle in text:
                offenders.append(f"{path.name}: {needle}")
    assert offenders == []
