"""Servers for benchmarks: start one (ours or any OpenAI-compatible server, vLLM's included) on
a loopback port, wait until it answers, stop it with everything it started; and
`tokenflow bench --compare fcfs,tokenflow`, which starts ours once per policy and replays the
same workload against each."""

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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from tokenflow.eval.client import BenchRun, ClientConfig, run_workload
from tokenflow.eval.workload import WorkloadRequest

STARTUP_TIMEOUT_S = 300.0  # model load included
STOP_TIMEOUT_S = 30.0  # SIGTERM to SIGKILL; an idle `tokenflow serve` drains at once
POLL_INTERVAL_S = 0.5


class ServerStartError(RuntimeError):
    """A server did not come up (its log's last lines are in the message)."""


@dataclass(frozen=True)
class RunningServer:
    """A server that answers: its base URL and the first model id its /v1/models lists."""

    url: str
    model_id: str | None  # None when /v1/models does not answer (e.g. behind an API key)


def free_port() -> int:
    """A loopback port no socket listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_port_free(port: int) -> None:
    """Raise ServerStartError when something listens on loopback `port` already."""
    with socket.socket() as sock:
        # As servers bind: only a listening socket makes the port busy, not TIME_WAIT leftovers.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as error:
            raise ServerStartError(
                f"port {port} is busy ({error.strerror}); pick another"
            ) from None


def serve_command(port: int, serve_args: Sequence[str] = ()) -> list[str]:
    """`tokenflow serve` on loopback `port` with `serve_args`, in this Python."""
    return [
        sys.executable, "-m", "tokenflow.cli.main", "serve", "--host", "127.0.0.1",
        "--port", str(port), "--log-level", "warning", *serve_args,
    ]  # fmt: skip


@contextlib.contextmanager
def running_server(
    command: Sequence[str],
    port: int,
    *,
    name: str = "server",
    env: Mapping[str, str] | None = None,
    log_path: Path | None = None,
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
) -> Iterator[RunningServer]:
    """Run `command`, a server that listens on 127.0.0.1:`port`, in its own process group; wait
    until its /health answers 200 and yield it; on exit SIGTERM the group, then SIGKILL what is
    left (e.g. orphaned workers). Its output goes to `log_path` (a temporary file if None); a
    server that exits or stays silent past `startup_timeout_s` raises ServerStartError with the
    log's last lines."""
    check_port_free(port)
    with contextlib.ExitStack() as stack:
        if log_path is None:
            log_path = Path(stack.enter_context(_temporary_log(name)))
        with log_path.open("w") as log:
            process = subprocess.Popen(
                list(command),
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_ready(name, url, process, log_path, startup_timeout_s)
            yield RunningServer(url, _served_model(url))
        finally:
            _stop(process)


@contextlib.contextmanager
def local_server(policy: str, serve_args: Sequence[str]) -> Iterator[str]:
    """Run `tokenflow serve --policy POLICY` on a free loopback port; yield its URL."""
    port = free_port()
    command = serve_command(port, ["--policy", policy, *serve_args])
    with running_server(command, port, name=f"tokenflow-{policy}") as server:
        yield server.url


@contextlib.contextmanager
def _temporary_log(name: str) -> Iterator[str]:
    with tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False) as file:
        path = file.name
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _wait_ready(
    name: str, url: str, process: subprocess.Popen[bytes], log_path: Path, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerStartError(
                f"{name} exited with status {process.returncode}; {_tail(log_path)}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        time.sleep(POLL_INTERVAL_S)
    raise ServerStartError(f"{name} did not answer within {timeout_s:.0f} s; {_tail(log_path)}")


def _served_model(url: str) -> str | None:
    with contextlib.suppress(httpx.HTTPError, KeyError, IndexError, ValueError):
        response = httpx.get(f"{url}/v1/models", timeout=10.0)
        if response.status_code == 200:
            return response.json()["data"][0]["id"]
    return None


def _stop(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=STOP_TIMEOUT_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _tail(path: Path, num_lines: int = 15) -> str:
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    tail = " | ".join(line.strip() for line in lines[-num_lines:] if line.strip())
    return f"last lines of its log: {tail or '(empty)'}"


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
