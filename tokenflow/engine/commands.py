"""What other threads send the engine thread (`AsyncEngine`), and how its answers go back.

Every command is applied by the engine thread between two steps.  Its answer goes back to the
asker's event loop with `loop.call_soon_threadsafe`: a request's deltas through its
`DeltaSink` (`send`), a snapshot through an asyncio future (`settle`); a `CallEngine` answers
through a thread-safe future instead, so an asker without an event loop can wait on it.  An
asker whose loop has closed is nobody to answer: the answer is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from tokenflow.core.migration import StreamExport
from tokenflow.core.request import Consumption, SamplingParams
from tokenflow.engine.client import GenerationDelta
from tokenflow.engine.llm_engine import LLMEngine
from tokenflow.engine.snapshot import StreamsSnapshot
from tokenflow.model.grammar import CompiledGrammar


@dataclass
class DeltaSink:
    """One request's output queue, bounded: deltas the reader has not taken yet are merged into
    one (token ids and text concatenated), so a slow reader holds one pending delta, not one per
    token.  Touched only on its event loop's thread."""

    pending: GenerationDelta | None = None
    error: BaseException | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def put(self, item: GenerationDelta | BaseException) -> None:
        """Queue a delta (merged into the pending one) or the error that ends the stream."""
        if isinstance(item, BaseException):
            self.error = item
        elif self.pending is None:
            self.pending = item
        else:
            self.pending = self.pending.followed_by(item)
        self.ready.set()

    async def get(self) -> GenerationDelta:
        """The next (merged) delta; raises the delivered error once no delta is pending."""
        await self.ready.wait()
        if self.pending is not None:
            item, self.pending = self.pending, None
            if self.error is None:
                self.ready.clear()
            return item
        assert self.error is not None
        raise self.error


@dataclass(frozen=True)
class AddRequest:
    """A new request (`AsyncEngine.generate()`)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    rate_tps: float
    consumption: Consumption
    sink: DeltaSink
    loop: asyncio.AbstractEventLoop
    grammar: CompiledGrammar | None  # its structured output's, compiled off the engine thread
    session_key: str | None  # the client's session hint (OpenAI's prompt_cache_key)


@dataclass(frozen=True)
class ImportStream:
    """A stream another engine exported, to go on here (`AsyncEngine.resume()`)."""

    state: StreamExport
    sink: DeltaSink
    loop: asyncio.AbstractEventLoop
    grammar: CompiledGrammar | None

    @property
    def request_id(self) -> str:
        return self.state.request_id


@dataclass(frozen=True)
class AbortRequest:
    """Cancel a request (a no-op if it already ended)."""

    request_id: str


@dataclass(frozen=True)
class SnapshotStreams:
    """Take a `StreamsSnapshot` of the `limit` most urgent streams (`AsyncEngine.streams()`)."""

    limit: int
    future: asyncio.Future[StreamsSnapshot]
    loop: asyncio.AbstractEventLoop


@dataclass(frozen=True)
class CallEngine:
    """Call `fn(engine)` on the engine thread (`AsyncEngine.between_steps()`)."""

    fn: Callable[[LLMEngine], Any]
    future: Future[Any]  # thread-safe: settled on the engine thread


Submission = AddRequest | ImportStream  # a request that gets deltas through its sink
Command = AddRequest | ImportStream | AbortRequest | SnapshotStreams | CallEngine


def send(submission: Submission, item: GenerationDelta | BaseException) -> None:
    """Hand a delta (or the error that ends the stream) to a request's sink, on its loop."""
    # RuntimeError: its event loop is closed, nobody is listening any more.
    with contextlib.suppress(RuntimeError):
        submission.loop.call_soon_threadsafe(submission.sink.put, item)


def settle(command: SnapshotStreams, item: StreamsSnapshot | BaseException) -> None:
    """Hand a snapshot (or why there is none) to its asker's event loop."""

    def settle_on_loop() -> None:
        if command.future.done():  # (the asker gave up waiting)
            return
        if isinstance(item, BaseException):
            command.future.set_exception(item)
        else:
            command.future.set_result(item)

    with contextlib.suppress(RuntimeError):  # its event loop is closed
        command.loop.call_soon_threadsafe(settle_on_loop)
