"""The launcher end to end: vLLM's OpenAI server with our scheduler and middleware."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests_vllm.conftest import BLOCK_SIZE, NUM_BLOCKS

STARTUP_S = 600.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """(base url, log path) of a running `python -m tokenflow.integrations.vllm.serve`."""
    port = free_port()
    log_path = Path(tmp_path_factory.mktemp("server")) / "server.log"
    cmd = [
        sys.executable, "-m", "tokenflow.integrations.vllm.serve", "--model", model_dir,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
        "--num-gpu-blocks-override", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
        "--max-model-len", "192", "--kv-cache-memory-bytes", str(64 << 20),
        "--served-model-name", "smollm2", "--default-rate", "4",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, log_path)
        yield url, log_path
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def wait_ready(proc: subprocess.Popen, url: str, log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited ({proc.returncode}): {log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail(f"server not ready in {STARTUP_S:.0f} s: {log_path.read_text()[-3000:]}")


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = [float(m.group(1)) for m in re.finditer(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M)]
    assert values, f"no metric {name}"
    return sum(values)


def complete(url: str, **fields) -> httpx.Response:
    body = {"model": "smollm2", "prompt": "The lighthouse keeper", "max_tokens": 4, **fields}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=300)


def test_stream_rate_reaches_the_scheduler(server):
    url, log_path = server
    assert complete(url, stream_rate=2.5).status_code == 200  # TokenFlow's field
    assert complete(url, vllm_xargs={"stream_rate": 1.5}).status_code == 200  # vLLM's
    assert complete(url).status_code == 200  # the server default (--default-rate 4)
    log = log_path.read_text()
    for rate in ("2.5", "1.5", "4"):
        assert re.search(rf"stream_rate {rate} tok/s", log), f"rate {rate} not seen"


def test_disconnect_frees_kv(server):
    url, _ = server
    body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 180,
            "min_tokens": 180, "ignore_eos": True, "stream": True, "stream_rate": 1.0}  # fmt: skip
    generated_before = metric(url, "vllm:generation_tokens_total")
    with (
        httpx.Client(timeout=300) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as response,
    ):
        # Leave as soon as the stream is accepted: a quiet CPU makes the 180 tokens in under a
        # second, so a client that reads first would leave after the end, testing nothing.
        assert response.status_code == 200
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        idle = metric(url, "vllm:num_requests_running") == 0
        if idle and metric(url, "vllm:kv_cache_usage_perc") == 0:
            generated = metric(url, "vllm:generation_tokens_total") - generated_before
            assert generated < 180, "the stream ran to its end: the disconnect did not abort it"
            return
        time.sleep(0.5)
    pytest.fail("the disconnected stream still holds KV after 120 s")
