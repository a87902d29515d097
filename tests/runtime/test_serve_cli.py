"""`tokenflow serve` as a process: start-up failures exit non-zero with one clear line, and
SIGINT lets a live stream finish before the process exits 0 (the drain on SIGTERM, its 503s and
its timeout: test_serve_drain.py)."""

from __future__ import annotations

import json
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tokenflow.cli.main import main


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve(*args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "tokenflow.cli.main", "serve", "--device", "cpu", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture
def quiet(monkeypatch):
    """Run `main()` in-process without reconfiguring the package's loggers."""
    monkeypatch.setattr("tokenflow.cli.serve.configure_logging", lambda level: None)


def test_a_taken_port_exits_non_zero_with_one_line(quiet, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 1  # refused before the model loads
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0]


def test_a_context_the_pool_cannot_hold_is_refused_at_start(quiet, capsys, tiny_model_dir):
    argv = ["serve", "--model", tiny_model_dir, "--device", "cpu", "--port", str(free_port())]
    assert main([*argv, "--max-model-len", "1024", "--device-kv-tokens", "512"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tokenflow serve: error: max_model_len 1024")


def test_sigint_lets_a_live_stream_finish(tiny_model_dir):
    # SIGTERM is handled by the same line (see tokenflow/cli/serve.py).
    port = free_port()
    process = serve(
        "--model", tiny_model_dir, "--port", str(port), "--log-level", "warning",
        "--drain-timeout-s", "300",  # a hang guard: the stream ends on its own
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300  # a hang guard: start-up took over 90 s under load
        while True:
            assert process.poll() is None and time.monotonic() < deadline
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        body = {
            "prompt": "x",
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
            "stream_rate": 1,
            "stream_options": {"include_usage": True},
        }
        frames = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    frames.append(line[len("data: ") :])
                    if len(frames) == 3:
                        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=300) == 0
    finally:
        process.kill()
        process.communicate()
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(frame) for frame in frames[:-1]]
    assert not any("error" in chunk for chunk in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 400


# What a start says, in this order (the tiny float32 checkpoint has one kernel plan: no probe).
START_PHASES = (
    "auth off:",
    "starting the engine: torch executor, policy tokenflow",
    "loading the model ",
    "kernels (checkpoint): float32",
    "loaded the model in ",
    "building the KV tiers: device 8192 tokens (512 blocks of 16, ",
    "built the KV tiers in ",
    "preparing the executor (on CPU a first start compiles its attention kernel)",
    "prepared the executor in ",
    "started the engine in ",
    "KV tiers: device 8192 tokens (512 blocks of 16), host 32768 tokens (2048 blocks)",
    "Application startup complete.",
)


def stderr_until(process: subprocess.Popen, marker: str, timeout_s: float) -> list[str]:
    """The process's stderr lines up to the first that holds `marker` (all of them if it exits
    or `timeout_s` passes first)."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(
        target=lambda: [lines.put(line) for line in process.stderr], daemon=True
    ).start()
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            seen.append(lines.get(timeout=0.5).rstrip("\n"))
        except queue.Empty:
            continue
        if marker in seen[-1]:
            break
    return seen


def test_the_start_says_each_phase_and_ends_with_where_it_listens(tiny_model_dir):
    port = free_port()
    process = serve("--model", tiny_model_dir, "--port", str(port), "--log-level", "info")
    try:
        lines = stderr_until(process, "listening on", timeout_s=300)  # (a hang guard)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        finally:
            process.kill()
            process.wait()
    messages = [line.split(": ", 2)[-1].strip() for line in lines]  # ("INFO: logger: message")
    url = f"http://127.0.0.1:{port}"
    assert messages[-1] == f"listening on {url}, dashboard {url}/dashboard"
    assert [p for p in START_PHASES if not any(p in m for m in messages)] == []
    found = [min(i for i, m in enumerate(messages) if phase in m) for phase in START_PHASES]
    assert found == sorted(found)
    assert sum("auth off:" in m for m in messages) == 1
    assert f"loading the model {tiny_model_dir} (" in "\n".join(messages)
