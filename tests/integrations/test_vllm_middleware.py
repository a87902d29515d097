"""The vLLM server's body rewrite (`stream_rate` -> `vllm_xargs`): bounded in memory and never
raising on what it cannot parse (it imports no vLLM, so it runs in the main suite)."""

from __future__ import annotations

import asyncio
import json

from tokenflow.integrations.vllm.middleware import (
    MAX_REWRITE_BYTES,
    StreamRateMiddleware,
    move_stream_rate,
)


def run_middleware(chunks: list[bytes]) -> tuple[bytes, int]:
    """(The body the app read, how many messages the middleware pulled before the app ran)."""
    pulled = 0
    pending = [
        {"type": "http.request", "body": c, "more_body": i + 1 < len(chunks)}
        for i, c in enumerate(chunks)
    ]
    seen: list[int] = []

    async def receive() -> dict:
        nonlocal pulled
        pulled += 1
        return pending.pop(0)

    async def app(scope, receive, send) -> None:
        seen.append(pulled)
        parts = []
        while True:
            message = await receive()
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        app.body = b"".join(parts)

    middleware = StreamRateMiddleware(app)
    asyncio.run(middleware({"type": "http", "method": "POST"}, receive, lambda m: None))
    return app.body, seen[0]


def test_a_small_body_has_its_rate_moved():
    body, _ = run_middleware([b'{"prompt": "x", ', b'"stream_rate": 4}'])
    assert json.loads(body) == {"prompt": "x", "vllm_xargs": {"stream_rate": 4}}


def test_a_body_past_the_bound_passes_unchanged_without_being_held_whole():
    chunk = b" " * (256 << 10)
    chunks = [b'{"stream_rate": 4, "prompt": "', *[chunk] * 16, b'"}']  # 4 MiB
    body, pulled_first = run_middleware(chunks)
    assert body == b"".join(chunks)  # as it came: no rate moved
    # the app started once the bound was passed, not after the whole body was read
    assert pulled_first <= MAX_REWRITE_BYTES // len(chunk) + 2 < len(chunks)


def test_bodies_it_cannot_parse_pass_through_unchanged():
    deep = b'{"stream_rate": 4, "x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    for body in (deep, b'{"stream_rate": \xff}', b'["stream_rate"]', b"stream_rate"):
        assert move_stream_rate(body) == body
