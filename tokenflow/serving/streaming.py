"""The SSE side of a streaming answer: frames per delta, keep-alive comments while waiting, and
the `SseStream` the route sends.

Once a stream is accepted its 200 headers go out at once; from then on, whenever no delta has
come for `keepalive_s` (before the first token, or while the stream is paused by preemption),
a `: keep-alive` comment frame is sent, so proxies with read timeouts keep the connection.
Every exception from the engine becomes one `{"error": ...}` frame, then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

import anyio

from tokenflow.engine.client import GenerationDelta
from tokenflow.serving.formatting import KEEPALIVE_FRAME, ResponseFormat, sse_frame
from tokenflow.serving.prepared import PreparedRequest, Progress, usage_of
from tokenflow.serving.protocol import ErrorInfo, ErrorResponse

Record = Callable[[PreparedRequest, Progress, GenerationDelta], None]


class SseStream:
    """The SSE frames of one streaming answer.

    Iterate it for the frames.  `aclose()` must be called when the response ends however it
    ends (also when the client left before the first frame was pulled): it releases the engine
    request, aborting it if it has not finished.
    """

    def __init__(self, frames: AsyncGenerator[str], release: Callable[[], Awaitable[None]]) -> None:
        self._frames = frames
        self._release = release

    def __aiter__(self) -> AsyncIterator[str]:
        return self._frames

    async def aclose(self) -> None:
        """Stop the frames and release the engine request (idempotent)."""
        with anyio.CancelScope(shield=True):
            await self._frames.aclose()
            await self._release()


async def cancel_pending(progress: Progress) -> None:
    """Cancel an in-flight wait for the next delta and let it unwind (never raises)."""
    pending, progress.pending = progress.pending, None
    if pending is None:
        return
    if not pending.done():
        pending.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.wait((pending,))
    if not pending.cancelled():
        pending.exception()  # retrieved: no "exception never retrieved" warning


async def delta_frames(
    prepared: PreparedRequest,
    fmt: ResponseFormat,
    deltas: AsyncIterator[GenerationDelta],
    progress: Progress,
    keepalive_s: float,
    record: Record,
    on_failure: Callable[[BaseException], str],
) -> AsyncIterator[str]:
    """One chunk per delta (keep-alives between), then the usage chunk; an engine failure
    becomes an error frame (`on_failure` counts it and words it).  `progress.pending` may
    already hold the wait for the first delta."""
    try:
        while True:
            if progress.pending is None:
                progress.pending = asyncio.ensure_future(anext(deltas))
            pending = progress.pending
            done, _ = await asyncio.wait((pending,), timeout=keepalive_s)
            if not done:
                yield KEEPALIVE_FRAME
                continue
            progress.pending = None
            delta: GenerationDelta = pending.result()  # type: ignore[assignment]
            record(prepared, progress, delta)
            usage = usage_of(prepared, progress) if prepared.continuous_usage else None
            yield sse_frame(fmt.delta_chunk(prepared, delta.text, delta.finish_reason, usage))
            if delta.finish_reason is not None:
                break
    except (StopAsyncIteration, Exception) as exc:
        progress.has_failed = True
        error = ErrorInfo(message=on_failure(exc), type="server_error")
        yield sse_frame(ErrorResponse(error=error))
        return
    finally:
        await cancel_pending(progress)
    if prepared.include_usage:
        yield sse_frame(fmt.usage_chunk(prepared, usage_of(prepared, progress)))
