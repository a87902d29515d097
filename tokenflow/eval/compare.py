"""`tokenflow bench --compare fcfs,tokenflow`: start our server once per policy, replay the same
workload against each, and report them side by side."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace

import httpx

from tokenflow.eval.client import BenchRun, ClientConfig, run_workload
from tokenflow.eval.workload import WorkloadRequest

STARTUP_TIMEOUT_S = 300.0  # model load included


class ServerStartError(RuntimeError):
    """Our server did not come up (its log's last lines are in the message)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def local_server(policy: str, serve_args: Sequence[str]) -> Iterator[str]:
    """Run `tokenflow serve --policy POLICY` on a free loopback port; yield its URL."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "tokenflow.cli.main",
        "serve",
        "--policy",
        policy,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        *serve_args,
    ]
    with tempfile.NamedTemporaryFile("w+", prefix=f"tokenflow-{policy}-", suffix=".log") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_ready(url, process, log.name)
            yield url
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _wait_ready(url: str, process: subprocess.Popen[bytes], log_path: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerStartError(f"the server exited ({process.returncode}): {_tail(log_path)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        time.sleep(0.5)
    raise ServerStartError(f"the server did not answer within {STARTUP_TIMEOUT_S:.0f} s")


def _tail(path: str, lines: int = 3) -> str:
    with open(path, encoding="utf-8", errors="replace") as file:
        return " | ".join(file.read().strip().splitlines()[-lines:])


def compare_policies(
    policies: Sequence[str],
    serve_args: Sequence[str],
    requests: Sequence[WorkloadRequest],
    config: ClientConfig,
) -> dict[str, BenchRun]:
    """One server per policy, one after the other, the same workload for each."""
    runs: dict[str, BenchRun] = {}
    for policy in policies:
        with local_server(policy, serve_args) as url:
            print(f"benchmarking policy {policy} at {url}", file=sys.stderr)
            runs[policy] = asyncio.run(
                run_workload(requests, replace(config, url=url), name=policy)
            )
    return runs
