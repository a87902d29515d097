"""`vllm bench serve`, the benchmark client users bring, against `tokenflow serve` with
keep-alives on: a burst over the device tier keeps most streams queued past several keep-alive
periods, and every request must still complete (an SSE comment as keep-alive once made the
client drop the rest of a stream)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests_vllm.test_server import free_port, wait_ready
from tokenflow.integrations.vllm.bench_cli import VLLM_CLI

REPO = Path(__file__).resolve().parents[1]
TOKENFLOW = REPO / ".venv" / "bin" / "tokenflow"  # the main venv's command (make install)
NUM_PROMPTS = 12


@pytest.fixture(scope="module")
def tokenflow_server(tmp_path_factory):
    """A `tokenflow serve` (main venv, embedded SmolLM2) whose tier holds ~2 of the burst."""
    if not TOKENFLOW.exists():
        pytest.fail(f"{TOKENFLOW} is missing: run `make install`")
    port = free_port()
    log_path = Path(tmp_path_factory.mktemp("tokenflow")) / "serve.log"
    cmd = [
        str(TOKENFLOW), "serve", "--port", str(port), "--device-kv-tokens", "256",
        "--keepalive-s", "0.2", "--max-num-seqs", "4",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, log_path)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_vllm_bench_serve_completes_a_burst_through_keepalives(
    tokenflow_server, model_dir, tmp_path
):
    command = [
        sys.executable, "-c", VLLM_CLI, "bench", "serve",
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
        "--base-url", tokenflow_server, "--model", "SmolLM2-135M-Instruct",
        "--tokenizer", model_dir, "--dataset-name", "random", "--random-input-len", "32",
        "--random-output-len", "48", "--random-range-ratio", "0", "--ignore-eos",
        "--num-prompts", str(NUM_PROMPTS), "--request-rate", "inf", "--seed", "0",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "result.json",
        "--disable-tqdm",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["completed"] == NUM_PROMPTS, done.stdout[-3000:]
    assert result["total_output_tokens"] == NUM_PROMPTS * 48
