"""A small SSE reader for tests against a live server: the text, finish and errors of a stream."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx


@dataclass
class StreamResult:
    status: int
    text: str = ""
    finish_reason: str | None = None
    errors: list[str] = field(default_factory=list)
    completion_tokens: int | None = None
    is_done: bool = False  # `data: [DONE]` arrived

    @property
    def is_complete(self) -> bool:
        """Ended normally: a finish reason, no error frame, then [DONE]."""
        return self.is_done and not self.errors and self.finish_reason in ("stop", "length")


async def read_stream(
    http: httpx.AsyncClient,
    path: str,
    body: dict,
    content: str | None = None,
    on_chunk: Callable[[dict], None] | None = None,
) -> StreamResult:
    """POST a streaming request (`body`, or raw JSON `content`) and parse every frame
    (keep-alive comments are skipped); `on_chunk` sees each JSON chunk as it arrives."""
    kwargs = {"json": body} if content is None else {"content": content}
    headers = {"content-type": "application/json"}
    async with http.stream("POST", path, headers=headers, **kwargs) as response:
        if response.status_code != 200:
            await response.aread()
            return StreamResult(response.status_code, errors=[response.text])
        result = StreamResult(200)
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: ") :]
            if payload == "[DONE]":
                result.is_done = True
                continue
            chunk = json.loads(payload)
            if on_chunk is not None:
                on_chunk(chunk)
            if "error" in chunk:
                result.errors.append(chunk["error"]["message"])
                continue
            if chunk.get("usage"):
                result.completion_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                result.text += choice.get("text") or choice.get("delta", {}).get("content") or ""
                result.finish_reason = choice["finish_reason"] or result.finish_reason
        return result
