"""Running a prepared request on the engine and answering it: submit, stream or collect.

    _start()       engine.generate() for each choice (engine.resume() for a moved one);
                   refusals (EngineOverloaded -> 429, EngineRequestError -> 400, EngineDead ->
                   503) are raised before any byte is sent, and the choices already submitted
                   are aborted
    _events()      a stream: the data of each SSE event (chunk JSON ... `[DONE]`), the choices'
                   chunks interleaved as they come, or, for a paced stream, as its reader's
                   schedule releases them (pacing.py); the route frames them, sends its 200
                   headers at once and keep-alives meanwhile
    _collect()     one JSON body

Whenever the client goes away before the engine finished (a disconnect while waiting, or the
event generator being cancelled/closed), every unfinished choice is aborted in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio

from tokenflow.engine.client import (
    EngineClient,
    EngineDead,
    EngineOverloaded,
    EngineRequestError,
    GenerationDelta,
    StreamMoved,
)
from tokenflow.serving.choices import DeltaOrFailure, EventStream, Submitted, merged_deltas
from tokenflow.serving.drain import DRAIN_RETRY_AFTER_S
from tokenflow.serving.formatting import DONE, ResponseFormat
from tokenflow.serving.metrics import ServingMetrics
from tokenflow.serving.moves import (
    MoveTicket,
    StreamHandoff,
    handoff_of,
    is_movable,
    resumed_progress,
    resumed_request,
)
from tokenflow.serving.owners import StreamOwners
from tokenflow.serving.pacing import PaceClock, ReaderSchedule, paced
from tokenflow.serving.pieces import delta_piece, record_scores, whole_piece
from tokenflow.serving.prepared import PreparedChoice, PreparedRequest, Progress, usage_of
from tokenflow.serving.protocol import (
    ChatCompletionResponse,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
)
from tokenflow.serving.tenants import Admission, KeyGate, KeyLimits
from tokenflow.serving.validation import ApiError

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
WaitForDisconnect = Callable[[], Awaitable[None]]
# Returns when paced streams must send what they hold at once (the server began to drain).
FlushWhen = Callable[[], Awaitable[None]]
# How long a new request waits for the engine's answer before its 200 headers go out; refusals
# are raised synchronously by `generate()`, so they always come back as real status codes.
_ADMISSION_GRACE_S = 0.05
# What a client is told of a failure inside the engine (the why goes to the server log only).
_FAILED_MESSAGE = "the engine failed this request; the server log has the details"


def _end(
    admission: Admission | None, prepared: PreparedRequest, progresses: list[Progress]
) -> None:
    """Give back a request's share of its key's limits, charged with what it used."""
    if admission is not None:
        used = sum(len(c.prompt_token_ids) for c in prepared.choices)
        admission.release(used + sum(p.num_output_tokens for p in progresses))


class ClientDisconnected(Exception):
    """The client went away before the answer was ready (the engine request is released)."""


class Responder:
    """Runs prepared requests on `engine`, counting them in `metrics`; `clock` (monotonic
    seconds) times TTFT and inter-token gaps (for a paced stream, as its client gets them);
    paced streams wait on `pace_clock` and send all they hold once `flush_when()` returns."""

    def __init__(
        self,
        engine: EngineClient,
        metrics: ServingMetrics,
        clock: Callable[[], float] = time.monotonic,
        owners: StreamOwners | None = None,
        gate: KeyGate | None = None,
        pace_clock: PaceClock | None = None,
        flush_when: FlushWhen | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self._clock = clock
        self._owners = owners or StreamOwners()
        self.gate = gate or KeyGate(KeyLimits())  # each API key's share (tenants.py)
        self._pace_clock = pace_clock or PaceClock()
        self._flush_when = flush_when

    async def serve(
        self,
        prepared: PreparedRequest,
        fmt: ResponseFormat,
        wait_for_disconnect: WaitForDisconnect,
        ticket: MoveTicket | None,
    ) -> ServeResult:
        """Run `prepared` on the engine and answer it in `fmt`: the response model, or the SSE
        events of a stream; `ticket` (a fleet's request) makes a stream movable, or continues
        a moved one.  Refusals raise ApiError before any byte is sent; a client that leaves
        while a non-streamed answer is collected raises ClientDisconnected."""
        resume = ticket.book.take_resume(ticket.ticket) if ticket is not None else None
        movable = ticket if ticket is not None and is_movable(prepared) else None
        if resume is not None:
            if movable is None:
                raise ApiError(400, "only a streamed answer with one choice can move")
            prepared = resumed_request(prepared, resume)
        progresses = [Progress() for _ in prepared.choices]
        if resume is not None:
            progresses = [resumed_progress(resume, self._clock())]
        # A moved stream's continuation is the same request: its key's share was taken where
        # it started (the fleet's ingress holds the limits), so it is never refused here.
        admission = (
            None if resume is not None else await self.gate.admit(prepared.api_key, prepared.work)
        )
        try:
            submitted = await self._start(prepared, progresses, resume)
        except BaseException:
            _end(admission, prepared, progresses)
            raise

        async def release() -> None:
            await self._release_all(submitted, progresses)
            _end(admission, prepared, progresses)

        if prepared.stream:
            events = self._events(prepared, fmt, submitted, progresses, movable)
            return EventStream(events, release)
        try:
            collect = self._collect(prepared, submitted, progresses)
            await self._race_disconnect(collect, wait_for_disconnect)
        finally:
            await release()
        choices = zip(prepared.choices, progresses, strict=True)
        pieces = [whole_piece(prepared, choice, progress) for choice, progress in choices]
        return fmt.response(prepared, pieces, usage_of(prepared, progresses))

    async def _start(
        self,
        prepared: PreparedRequest,
        progresses: list[Progress],
        resume: StreamHandoff | None = None,
    ) -> list[Submitted]:
        """Submit every choice (or go on with the one `resume` hands over), and wait
        `_ADMISSION_GRACE_S` for their first deltas: a refusal or an early failure of any is
        raised here, before any byte is sent (and the others are aborted)."""
        submitted: list[Submitted] = []
        try:
            first_params = prepared.choices[0].sampling_params
            if resume is None and first_params.structured_output is not None:
                # Off the event loop, before any byte: a schema that does not compile in time
                # is a 400, and the choices (which share it) find it compiled.
                await self.engine.compile_grammar(first_params)
            for choice in prepared.choices:
                deltas = aiter(
                    self.engine.resume(resume.state)
                    if resume is not None
                    else self.engine.generate(
                        choice.engine_request_id,
                        choice.prompt_token_ids,
                        choice.sampling_params,
                        prepared.rate_tps,
                        prepared.consumption,
                        session_key=prepared.session_key,
                    )
                )
                submitted.append(Submitted(choice.engine_request_id, deltas, ensure_first(deltas)))
                self._owners.claim(choice.engine_request_id, prepared.api_key)
            await asyncio.wait([s.first for s in submitted], timeout=_ADMISSION_GRACE_S)
            for sub, progress in zip(submitted, progresses, strict=True):
                if sub.first.done():
                    progress.has_failed = True  # until it turns out fine: a refusal is no abort
                    sub.first.result()  # raises a refusal or an early failure
                    progress.has_failed = False
        except (EngineOverloaded, EngineRequestError, EngineDead) as exc:
            await self._release_all(submitted, progresses)
            raise _refusal(exc) from exc
        except StopAsyncIteration:
            await self._release_all(submitted, progresses)
            message = "the engine ended the request without output"
            raise ApiError(500, message, type="server_error") from None
        except Exception as exc:  # failed before its first delta: a 500, the why in the log
            await self._release_all(submitted, progresses)
            logger.warning(
                "a request failed before its first token: %s", _engine_error_message(exc)
            )
            raise ApiError(500, _FAILED_MESSAGE, type="server_error") from exc
        except BaseException:  # cancelled: free the requests
            await self._release_all(submitted, progresses)
            raise
        return submitted

    async def _race_disconnect(
        self, awaitable: Awaitable[_T], wait_for_disconnect: WaitForDisconnect
    ) -> _T:
        """Await `awaitable` unless the client disconnects first (then raise ClientDisconnected)."""
        work = asyncio.ensure_future(awaitable)
        watcher = asyncio.ensure_future(wait_for_disconnect())
        try:
            await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not work.done():
                work.cancel()
                with anyio.CancelScope(shield=True):
                    await asyncio.wait((work,))  # let it unwind; does not raise
        if work.cancelled():
            raise ClientDisconnected()
        return work.result()

    async def _release_all(self, submitted: list[Submitted], progresses: list[Progress]) -> None:
        """Abort every choice the engine has not finished, and close its delta iterator.

        Idempotent, and runs to completion even while our own task is being cancelled.
        """
        with anyio.CancelScope(shield=True):
            for sub, progress in zip(submitted, progresses, strict=False):  # (all submitted)
                if sub.is_released:
                    continue
                sub.is_released = True
                await sub.close()
                if progress.finish_reason is None and not progress.has_moved:
                    if not progress.has_failed:
                        self.metrics.count_finished("abort")
                    await self.engine.abort(sub.request_id)
                self._owners.forget(sub.request_id)

    def _record(
        self,
        prepared: PreparedRequest,
        choice: PreparedChoice,
        progress: Progress,
        delta: GenerationDelta,
    ) -> None:
        now, metrics = self._clock(), self.metrics
        num_new, stream_class = len(delta.token_ids), prepared.consumption.value
        if num_new:
            if progress.last_delta_s is None:
                metrics.observe_ttft(
                    now - prepared.received_s,
                    stream_class,
                    num_prompt_tokens=delta.num_prompt_tokens,
                    num_cached_tokens=delta.num_cached_tokens,
                )
                metrics.observe_inter_token(0.0, num_new - 1, stream_class)
            else:
                metrics.observe_inter_token(now - progress.last_delta_s, num_new, stream_class)
            progress.last_delta_s = now
        progress.num_output_tokens += num_new
        progress.num_cached_tokens = max(progress.num_cached_tokens, delta.num_cached_tokens)
        progress.text_parts.append(delta.text)
        record_scores(prepared, choice, progress, delta)
        if delta.finish_reason is not None:
            progress.finish_reason = delta.finish_reason
            metrics.count_finished(delta.finish_reason)
            if progress.last_delta_s is not None:
                metrics.observe_e2e(progress.last_delta_s - prepared.received_s, stream_class)

    def _on_failure(self, exc: BaseException) -> ErrorInfo:
        """Count a request the engine failed mid-way; log why; what its client is told (no
        internal text: a stopped engine says so, anything else is "see the server log")."""
        self.metrics.count_finished("error")
        logger.warning("a request failed: %s", _engine_error_message(exc))
        if isinstance(exc, EngineDead):
            return ErrorInfo(
                message="the engine stopped (the server is shutting down, or failed); retry",
                type="server_error",
                code="engine_stopped",
            )
        if isinstance(exc, StopAsyncIteration):
            message = "the engine ended the request without a finish reason"
        else:
            message = _FAILED_MESSAGE
        return ErrorInfo(message=message, type="server_error")

    async def _collect(
        self, prepared: PreparedRequest, submitted: list[Submitted], progresses: list[Progress]
    ) -> None:
        """Record every choice's deltas until their finish; an engine failure becomes a 500, an
        engine that stopped (a drain past its timeout) a 503 with Retry-After."""
        async for position, item in merged_deltas(submitted):
            progress = progresses[position]
            if isinstance(item, BaseException):
                progress.has_failed = True
                info = self._on_failure(item)
                if isinstance(item, EngineDead):
                    retry = {"Retry-After": str(DRAIN_RETRY_AFTER_S)}
                    raise ApiError(
                        503, info.message, type=info.type, code=info.code, headers=retry
                    ) from None
                raise ApiError(500, info.message, type=info.type) from None
            self._record(prepared, prepared.choices[position], progress, item)

    async def _events(
        self,
        prepared: PreparedRequest,
        fmt: ResponseFormat,
        submitted: list[Submitted],
        progresses: list[Progress],
        movable: MoveTicket | None = None,
    ) -> AsyncGenerator[str]:
        """The data of each SSE event: a choice's opening chunks with its first delta's (as
        vLLM sends them, so that a client's time to first chunk is its TTFT), one chunk per
        delta (a paced stream's: per release, pacing.py), the usage chunk, then `[DONE]`; an
        engine failure becomes one `{"error": ...}` event before `[DONE]`.  A `movable` answer
        whose engine request is exported meanwhile ends at once, without `[DONE]`: its book
        holds the handoff (serving/moves.py).  Releases the engine requests however the
        iteration ends."""
        failed = False
        if movable is not None:
            movable.book.register(movable.ticket, prepared.choices[0].engine_request_id)
        try:
            async with contextlib.aclosing(self._releases(prepared, submitted)) as releases:
                async for position, item in releases:
                    progress, choice = progresses[position], prepared.choices[position]
                    if isinstance(item, StreamMoved) and movable is not None:
                        progress.has_moved = True
                        movable.book.handed_off(
                            movable.ticket, handoff_of(prepared, progress, item.state)
                        )
                        return  # (another replica sends the rest, and the [DONE])
                    if isinstance(item, BaseException):
                        progress.has_failed = failed = True
                        yield ErrorResponse(error=self._on_failure(item)).model_dump_json()
                        break
                    if progress.num_deltas == 0:
                        for chunk in fmt.opening_chunks(prepared, choice.index):
                            yield chunk.model_dump_json()
                    self._record(prepared, choice, progress, item)
                    continuous = prepared.continuous_usage
                    usage = usage_of(prepared, progresses) if continuous else None
                    piece = delta_piece(prepared, choice, progress, item)
                    yield fmt.delta_chunk(prepared, choice.index, piece, usage).model_dump_json()
            if prepared.include_usage and not failed:
                yield fmt.usage_chunk(prepared, usage_of(prepared, progresses)).model_dump_json()
        finally:
            if movable is not None:
                movable.book.forget(movable.ticket)
            await self._release_all(submitted, progresses)
        yield DONE

    def _releases(
        self, prepared: PreparedRequest, submitted: list[Submitted]
    ) -> AsyncGenerator[tuple[int, DeltaOrFailure]]:
        """The choices' deltas as they come, or, for a paced stream, as each choice's reader
        takes them (pacing.py)."""
        deltas = merged_deltas(submitted)
        if not prepared.is_paced:
            return deltas
        schedules = [ReaderSchedule(choice, prepared.rate_tps) for choice in prepared.choices]
        return paced(deltas, schedules, self._pace_clock, self._flush_when)


def ensure_first(deltas: AsyncIterator[GenerationDelta]) -> asyncio.Future[GenerationDelta]:
    """The first delta, awaited from now on."""
    return asyncio.ensure_future(anext(deltas))


# A non-streaming body, or the SSE events of a streaming one.
ServeResult = CompletionResponse | ChatCompletionResponse | EventStream


def _refusal(exc: EngineOverloaded | EngineRequestError | EngineDead) -> ApiError:
    """The status a refused request gets: 429 with Retry-After when the engine is full, 400
    for a request it cannot take, 503 when it is down."""
    if isinstance(exc, EngineOverloaded):
        retry_after = str(max(1, math.ceil(exc.retry_after_s)))
        return ApiError(
            429,
            str(exc),
            type="server_overloaded",
            code="rate_limit_exceeded",
            headers={"Retry-After": retry_after},
        )
    if isinstance(exc, EngineRequestError):
        return ApiError(400, str(exc))
    logger.warning("a request was refused: %s", exc)
    return ApiError(
        503,
        "the engine is not running; retry on another replica",
        type="server_error",
        headers={"Retry-After": str(DRAIN_RETRY_AFTER_S)},
    )


def _engine_error_message(exc: BaseException) -> str:
    if isinstance(exc, StopAsyncIteration):
        return "the engine ended the stream without a finish reason"
    return f"engine error: {type(exc).__name__}: {exc}"
