"""`tokenflow serve` as a process on SIGTERM: the streams of a burst in flight finish with all
their tokens while /health and new requests get 503, and the process exits 0; past
`--drain-timeout-s` the streams still open end with an error frame.

The drain is held open by a request whose body the test has not finished sending (it counts as
in flight from its headers on, and is answered 503 once its body came), so the checks made
during the drain never race the burst, however fast the machine runs it.  Every wait polls a
condition under a generous hang guard."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import time
from collections.abc import Callable, Iterator

import httpx

from tests.runtime.sse_client import StreamResult, read_stream
from tests.runtime.test_serve_cli import free_port, serve

HANG_GUARD_S = 300  # turns a hang into a failure; no bound on how fast a machine is
GATE_BODY = json.dumps({"prompt": "x", "max_tokens": 1}).encode()


@contextlib.contextmanager
def tiny_server(model_dir: str, *args: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """A `tokenflow serve` process on the tiny model, up and healthy; killed on exit."""
    port = free_port()
    process = serve("--model", model_dir, "--port", str(port), "--log-level", "warning", *args)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _is_up(url, process), "the server to start")
        yield url, process
    finally:
        process.kill()
        process.communicate()


def _is_up(url: str, process: subprocess.Popen) -> bool:
    assert process.poll() is None, "the server exited"
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def wait_for(predicate: Callable[[], object], what: str) -> None:
    """Poll `predicate()` until it holds; fail after the hang guard."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class Gate:
    """A POST /v1/completions whose body is sent only in part until `release()`."""

    async def open(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.reader, self.writer = await asyncio.open_connection(host, int(port))
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(GATE_BODY)}\r\n\r\n"
        )
        self.writer.write(head.encode() + GATE_BODY[:5])
        await self.writer.drain()

    async def release(self) -> tuple[int | None, dict[str, str]]:
        """Send the rest of the body; the status and headers of the answer (None: the server
        closed the connection without one)."""
        with contextlib.suppress(ConnectionError):
            self.writer.write(GATE_BODY[5:])
            await self.writer.drain()
        status_line = (await self.reader.readline()).decode()
        if not status_line:
            return None, {}
        headers = {}
        while (line := (await self.reader.readline()).decode().strip()) != "":
            name, _, value = line.partition(":")
            headers[name.lower()] = value.strip()
        self.writer.close()
        return int(status_line.split()[1]), headers


async def poll(
    http: httpx.AsyncClient, path: str, predicate: Callable[[httpx.Response], bool]
) -> httpx.Response:
    """GET `path` until `predicate(response)` holds; that response."""
    async with asyncio.timeout(HANG_GUARD_S):
        while not predicate(response := await http.get(path)):
            await asyncio.sleep(0.02)
    return response


def in_flight(count: int) -> Callable[[httpx.Response], bool]:
    return lambda response: response.json()["num_in_flight"] == count


async def start_burst(
    http: httpx.AsyncClient, num_streams: int, max_tokens: int
) -> list[asyncio.Task[StreamResult]]:
    """Streams of `max_tokens` tokens each; returns once every one has received a token."""
    body = {
        "prompt": "Once upon a time",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_rate": 1000,
        "stream_options": {"include_usage": True},
    }
    num_chunks = [0] * num_streams

    def counter(index: int) -> Callable[[dict], None]:
        return lambda chunk: num_chunks.__setitem__(index, num_chunks[index] + 1)

    tasks = [
        asyncio.create_task(read_stream(http, "/v1/completions", body, on_chunk=counter(i)))
        for i in range(num_streams)
    ]
    async with asyncio.timeout(HANG_GUARD_S):
        while not (all(num_chunks) or any(task.done() for task in tasks)):
            await asyncio.sleep(0.02)
    return tasks


def test_sigterm_mid_burst_lets_every_stream_finish(tiny_model_dir: str) -> None:
    async def scenario(url: str, process: subprocess.Popen) -> tuple:
        async with httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            gate = Gate()
            await gate.open(url)
            await poll(http, "/health", in_flight(1))
            tasks = await start_burst(http, num_streams=6, max_tokens=200)
            process.send_signal(signal.SIGTERM)
            during = await poll(http, "/health", lambda response: response.status_code == 503)
            refused = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            gated = await gate.release()
            return list(await asyncio.gather(*tasks)), during, refused, gated

    with tiny_server(tiny_model_dir, "--drain-timeout-s", str(HANG_GUARD_S)) as (url, process):
        results, during, refused, gated = asyncio.run(scenario(url, process))
        assert process.wait(timeout=HANG_GUARD_S) == 0
    assert during.json()["status"] == "draining"
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "server_shutting_down"
    assert gated[0] == 503 and gated[1]["retry-after"] == "1"  # it came in after the signal
    for result in results:
        assert result.is_complete, result
        assert result.completion_tokens == 200


def test_past_the_drain_timeout_streams_end_with_an_error_frame(tiny_model_dir: str) -> None:
    async def scenario(url: str, process: subprocess.Popen) -> list[StreamResult]:
        async with httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            gate = Gate()  # not released before the streams ended: no clean drain
            await gate.open(url)
            await poll(http, "/health", in_flight(1))
            tasks = await start_burst(http, num_streams=4, max_tokens=1000)
            process.send_signal(signal.SIGTERM)
            results = list(await asyncio.gather(*tasks))
            await gate.release()  # a 503, or closed if the server's flush time ran out first
            return results

    with tiny_server(tiny_model_dir, "--drain-timeout-s", "1") as (url, process):
        results = asyncio.run(scenario(url, process))
        assert process.wait(timeout=HANG_GUARD_S) == 0
    # 4 x 1000 tokens take seconds on any CPU, so some are cut, the more the slower it runs.
    num_cut = 0
    for result in results:
        assert result.is_done, result  # `data: [DONE]` either way
        if result.is_complete:
            assert result.completion_tokens == 1000
        else:
            num_cut += 1
            assert len(result.errors) == 1 and "shutting down" in result.errors[0], result
    assert num_cut >= 1
