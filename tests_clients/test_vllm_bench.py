"""`vllm bench serve`, vLLM's benchmark client, against the live server: a burst of requests on
its random dataset, through the chat endpoint, all completed.  It runs from the vLLM venv with
the converted model's tokenizer (`make test-vllm` makes both); skipped where they are missing."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests_clients.conftest import DEVICE_KV_TOKENS
from tokenflow.eval.local_server import RunningServer
from tokenflow.integrations.vllm.bench_serve import Scenario, bench_serve
from tokenflow.integrations.vllm.peer_setup import CACHE_DIR

VLLM_VENV = Path(os.environ.get("TOKENFLOW_VLLM_VENV", CACHE_DIR / "vllm-venv"))
VLLM_MODEL_DIR = Path(os.environ.get("TOKENFLOW_VLLM_MODEL_DIR", CACHE_DIR / "smollm2-hf"))
BURST = Scenario("clients-burst", DEVICE_KV_TOKENS, num_prompts=8, request_rate="inf",
                 input_len=32, output_len=16)  # fmt: skip


HAS_VLLM = "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)"


@pytest.fixture(scope="session")  # session-wide, as the server, so it comes first
def vllm_python() -> Path:
    """The vLLM venv's python; skips the test (before the server starts) where there is none
    with vLLM in it, or no converted model."""
    python = VLLM_VENV / "bin" / "python"
    if not python.exists() or subprocess.run([str(python), "-c", HAS_VLLM]).returncode != 0:
        pytest.skip(f"no vLLM venv at {VLLM_VENV} (`make test-vllm` builds it)")
    if not (VLLM_MODEL_DIR / "tokenizer.json").exists():
        pytest.skip(f"no converted model at {VLLM_MODEL_DIR} (`make test-vllm` makes it)")
    return python


@pytest.mark.timeout(600)  # vLLM's imports alone take a minute on 2 busy cores
def test_vllm_bench_serve_completes_a_burst(
    vllm_python: Path, server: RunningServer, model_id: str
) -> None:
    result = bench_serve(vllm_python, server.url, model_id, BURST, VLLM_MODEL_DIR, seed=0)
    assert result["completed"] == BURST.num_prompts
    assert result["output_throughput"] > 0 and result["mean_ttft_ms"] > 0
