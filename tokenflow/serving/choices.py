"""The engine requests behind one answer: one per choice, each its own stream.

`Submitted` is one engine request whose first delta has been awaited since submission (so a
refusal comes back before any byte is sent); `merged_deltas` interleaves several of them in
the order their deltas come; `EventStream` is what a streaming route sends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import anyio

from tokenflow.engine.client import GenerationDelta


@dataclass
class Submitted:
    """One engine request: its deltas, the first of them awaited since submission."""

    request_id: str
    deltas: AsyncIterator[GenerationDelta]
    first: asyncio.Future[GenerationDelta]
    is_first_taken: bool = False
    is_released: bool = False  # aborted if needed, delta iterator closed

    async def next_delta(self) -> GenerationDelta:
        """The next delta; StopAsyncIteration if the engine ended without a finish reason."""
        if not self.is_first_taken:
            self.is_first_taken = True
            return await self.first
        return await anext(self.deltas)

    async def close(self) -> None:
        """Let the first delta's wait unwind and close the delta iterator (no abort)."""
        first = self.first
        if not first.done():
            first.cancel()
            await asyncio.wait((first,))  # let it unwind; does not raise
        if not first.cancelled():
            first.exception()  # retrieved: no "exception never retrieved" warning
        aclose = getattr(self.deltas, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()


# A choice's delta, or what its stream raised instead (the last item for that choice).
DeltaOrFailure = GenerationDelta | BaseException


async def merged_deltas(
    submitted: Sequence[Submitted],
) -> AsyncGenerator[tuple[int, DeltaOrFailure]]:
    """(position in `submitted`, delta) as each choice's deltas come, until every choice has
    its finish; a failure is yielded in place of a delta, and ends that choice's stream.  One
    choice is awaited directly; several through one task each, cancelled when the iteration
    ends early."""
    if len(submitted) == 1:
        while True:
            try:
                delta = await submitted[0].next_delta()
            except (StopAsyncIteration, Exception) as exc:
                yield 0, exc
                return
            yield 0, delta
            if delta.finish_reason is not None:
                return
    pending: dict[asyncio.Future[GenerationDelta], int] = {}
    for position, sub in enumerate(submitted):
        pending[asyncio.ensure_future(sub.next_delta())] = position
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=pending.__getitem__):  # ties: in choice order
                position = pending.pop(future)
                exc = future.exception()
                if exc is not None:
                    yield position, exc
                    continue
                delta = future.result()
                yield position, delta
                if delta.finish_reason is None:
                    pending[asyncio.ensure_future(submitted[position].next_delta())] = position
    finally:
        with anyio.CancelScope(shield=True):
            for future in pending:
                future.cancel()
            if pending:
                await asyncio.wait(pending)  # let them unwind; does not raise
            for future in pending:
                if not future.cancelled():
                    future.exception()


class EventStream:
    """The data of each SSE event of one streaming answer (the route frames them).

    Iterate it for the data.  `aclose()` must be called when the response ends however it ends
    (also when the client left before the first event was pulled): it releases the engine
    requests, aborting those that have not finished.
    """

    def __init__(self, events: AsyncGenerator[str], release: Callable[[], Awaitable[None]]) -> None:
        self._events = events
        self._release = release

    def __aiter__(self) -> AsyncIterator[str]:
        return self._events

    async def aclose(self) -> None:
        """Stop the events and release the engine requests (idempotent)."""
        with anyio.CancelScope(shield=True):
            await self._events.aclose()
            await self._release()
