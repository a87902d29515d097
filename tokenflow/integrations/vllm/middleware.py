"""ASGI middleware for vLLM's API server: TokenFlow's `stream_rate` request field -> `vllm_xargs`.

TokenFlow's own server takes the reader's rate as a top-level `stream_rate` field; vLLM passes
custom per-request values only through `vllm_xargs` (into `SamplingParams.extra_args`).  This
middleware moves a top-level `stream_rate` of a JSON POST body into `vllm_xargs.stream_rate`
(an explicit `vllm_xargs.stream_rate` wins), so the same client works against either server.
Load it with `--middleware tokenflow.integrations.vllm.middleware.StreamRateMiddleware`.

It buffers at most `MAX_REWRITE_BYTES` of a body: a larger one goes to vLLM unchanged, as it
came (no rate moved), so the middleware never holds more memory than that per request; and a
body it cannot parse (not JSON, invalid UTF-8, nested past the parser's recursion limit) passes
through unchanged for vLLM to answer.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_REWRITE_BYTES = 1 << 20


def move_stream_rate(body: bytes) -> bytes:
    """The body with a top-level `stream_rate` moved into `vllm_xargs` (unchanged otherwise)."""
    if b"stream_rate" not in body:
        return body
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        return body  # not JSON, or nested too deep: vLLM answers it as it would anyway
    if not isinstance(payload, dict) or "stream_rate" not in payload:
        return body
    rate = payload.pop("stream_rate")
    xargs = payload.get("vllm_xargs")
    if xargs is None:
        xargs = payload["vllm_xargs"] = {}
    if isinstance(xargs, dict) and rate is not None:
        xargs.setdefault("stream_rate", rate)
    try:
        return json.dumps(payload).encode()
    except (ValueError, RecursionError):
        return body


class StreamRateMiddleware:
    """Rewrites JSON POST bodies with `move_stream_rate` before vLLM parses them."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Buffer a POST body (up to MAX_REWRITE_BYTES), rewrite it, and replay it to the app
        as one message; a larger body is replayed as it came, and the rest streams through."""
        if scope.get("type") != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        num_bytes = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # a disconnect before the body ended: let the app see it
            num_bytes += len(message.get("body", b""))
            if num_bytes > MAX_REWRITE_BYTES or not message.get("more_body", False):
                break
        if message["type"] != "http.request" or message.get("more_body", False):
            await self.app(scope, _replay(messages, receive), send)
            return
        chunks = [m.get("body", b"") for m in messages]
        body = move_stream_rate(b"".join(chunks))
        first = {"type": "http.request", "body": body, "more_body": False}
        await self.app(scope, _replay([first], receive), send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive() that returns `messages` first, then defers to the real one (disconnects)."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
