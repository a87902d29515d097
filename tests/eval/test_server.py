"""The benchmarks' server helper: a server that answers is yielded and stopped with its
children; one that exits, never answers, or finds its port taken is a clear ServerStartError."""

from __future__ import annotations

import os
import socket
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from tokenflow.eval.local_server import (
    ServerStartError,
    check_port_free,
    free_port,
    running_server,
    serve_command,
)

# A stand-in OpenAI server: /health and /v1/models, and a child process it leaves running.
FAKE_SERVER = textwrap.dedent(
    """
    import http.server, json, subprocess, sys
    port, child_pid_file = int(sys.argv[1]), sys.argv[2]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(child_pid_file, "w").write(str(child.pid))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = {"/health": {}, "/v1/models": {"data": [{"id": "fake-model"}]}}.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(json.dumps(body).encode())

        def log_message(self, *args):
            pass

    print("fake server up", flush=True)
    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its dead parent's reaper) counts as gone.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"


def test_a_server_that_answers_is_yielded_then_stopped_with_its_children(tmp_path: Path) -> None:
    port, child_pid_file = free_port(), tmp_path / "child.pid"
    command = [sys.executable, "-c", FAKE_SERVER, str(port), str(child_pid_file)]
    log = tmp_path / "server.log"
    with running_server(command, port, name="fake", log_path=log) as server:
        assert server.url == f"http://127.0.0.1:{port}"
        assert server.model_id == "fake-model"
        assert httpx.get(f"{server.url}/health").status_code == 200
        child_pid = int(child_pid_file.read_text())
        assert _is_alive(child_pid)
    assert not _is_alive(child_pid)
    check_port_free(port)  # nothing listens any more
    assert "fake server up" in log.read_text()


def test_a_server_that_exits_is_a_clear_error_with_its_log() -> None:
    port = free_port()
    command = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    expected = r"vllm exited with status 3.*no model here"
    with (
        pytest.raises(ServerStartError, match=expected),
        running_server(command, port, name="vllm"),
    ):
        pytest.fail("a server that exited was yielded")


def test_a_server_that_never_answers_is_a_clear_error() -> None:
    port = free_port()
    command = [sys.executable, "-c", "print('loading', flush=True); import time; time.sleep(60)"]
    expected = r"silent did not answer within 0 s.*loading"
    with (
        pytest.raises(ServerStartError, match=expected),
        running_server(command, port, name="silent", startup_timeout_s=0.2),
    ):
        pytest.fail("a silent server was yielded")


def test_a_busy_port_is_a_clear_error_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        marker = tmp_path / "started"
        command = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
        with (
            pytest.raises(ServerStartError, match=f"port {port} is busy"),
            running_server(command, port),
        ):
            pytest.fail("a server on a busy port was yielded")
    assert not marker.exists()


def test_serve_command_runs_tokenflow_serve_on_the_port() -> None:
    command = serve_command(18000, ["--policy", "fcfs"])
    assert command[:4] == [sys.executable, "-m", "tokenflow.cli.main", "serve"]
    assert command[command.index("--port") + 1] == "18000"
    assert command[-2:] == ["--policy", "fcfs"]
