"""Run one HTTP request through an in-process ASGI app and stream what it sends.

A replica serves the very app `tokenflow serve` serves (validation, `stream_rate`, SSE frames,
keep-alives, errors), called from a Ray Serve handle instead of a socket.  Closing the stream
early tells the app the client disconnected, so it aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.types import ASGIApp, Message


@dataclass(frozen=True)
class ResponseStart:
    """The status and headers the app answered with."""

    status: int
    headers: list[tuple[str, str]]


async def stream_asgi(
    app: ASGIApp, method: str, path: str, headers: list[tuple[str, str]], body: bytes
) -> AsyncIterator[ResponseStart | bytes]:
    """The app's `ResponseStart`, then its body chunks as they are sent."""
    sent: asyncio.Queue[Message] = asyncio.Queue()
    gone = asyncio.Event()
    request_sent = False

    async def receive() -> Message:
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await sent.put(message)

    task = asyncio.ensure_future(app(_scope(method, path, headers), receive, send))
    try:
        while True:
            message = await _next(sent, task)
            if message is None:
                return
            if message["type"] == "http.response.start":
                pairs = [(k.decode(), v.decode()) for k, v in message.get("headers", [])]
                yield ResponseStart(message["status"], pairs)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(task, timeout=10)


async def _next(sent: asyncio.Queue[Message], task: asyncio.Future) -> Message | None:
    """The app's next message; None once it returned with nothing left to send."""
    if not sent.empty():
        return sent.get_nowait()
    getter = asyncio.ensure_future(sent.get())
    await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
    if getter.done():
        return getter.result()
    getter.cancel()
    task.result()  # (raises what the app raised)
    return sent.get_nowait() if not sent.empty() else None


def _scope(method: str, path: str, headers: list[tuple[str, str]]) -> dict[str, object]:
    raw_path, _, query = path.partition("?")
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": raw_path,
        "raw_path": raw_path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 80),
    }
