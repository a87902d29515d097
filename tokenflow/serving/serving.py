"""Serving logic between the routes and the engine: validate, submit, stream or collect.

Flow of one request::

    prepare()      body (+ X-Stream-Rate header) -> PreparedRequest, or ApiError (400/404)
    _start()       engine.generate(); refusals (EngineOverloaded -> 429, EngineRequestError ->
                   400, EngineDead -> 503) are raised before any byte is sent.  A stream then
                   goes out at once (200 headers, keep-alives until its first token); a
                   non-streaming answer waits for its first delta while watching the client
    _stream()      SSE frames, `data: {json}\\n\\n` ... `data: [DONE]\\n\\n` (see streaming.py)
    _collect()     one JSON body

Whenever the client goes away before the engine finished (a disconnect while waiting, or the
SSE generator being cancelled/closed), the request is aborted in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio

from tokenflow.engine.client import (
    EngineClient,
    EngineDead,
    EngineOverloaded,
    EngineRequestError,
    GenerationDelta,
)
from tokenflow.serving.formatting import (
    DONE_FRAME,
    KEEPALIVE_FRAME,
    ChatFormat,
    CompletionFormat,
    ResponseFormat,
    sse_frame,
)
from tokenflow.serving.metrics import ServingMetrics
from tokenflow.serving.prepared import PreparedRequest, Progress, usage_of
from tokenflow.serving.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
)
from tokenflow.serving.streaming import SseStream, cancel_pending, delta_frames
from tokenflow.serving.validation import (
    ApiError,
    build_sampling_params,
    check_chat_support,
    check_completion_support,
    check_prompt_token_ids,
    check_rate,
    resolve_max_tokens,
)

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
WaitForDisconnect = Callable[[], Awaitable[None]]
STREAM_RATE_HEADER = "X-Stream-Rate"
# How long a new stream waits for the engine's answer before its 200 headers go out; refusals
# are raised synchronously by `generate()`, so they always come back as real status codes.
_ADMISSION_GRACE_S = 0.05


class ClientDisconnected(Exception):
    """The client went away before the answer was ready (the engine request is released)."""


def _new_hex_id() -> str:
    return uuid.uuid4().hex


class OpenAIServing:
    """The logic behind /v1/completions and /v1/chat/completions, independent of the web framework.

    `clock` (monotonic seconds) times TTFT and inter-token gaps; `wall_clock` stamps `created`;
    `new_id` makes request ids.  All three are injectable for tests.  `keepalive_s` is the
    longest silence of an accepted stream (SSE comment frames fill it).
    """

    def __init__(
        self,
        engine: EngineClient,
        metrics: ServingMetrics,
        *,
        keepalive_s: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        new_id: Callable[[], str] = _new_hex_id,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.keepalive_s = keepalive_s
        self._clock = clock
        self._wall_clock = wall_clock
        self._new_id = new_id

    # -- entry points ---------------------------------------------------------------------------
    async def create_completion(
        self,
        body: CompletionRequest,
        rate_header: str | None,
        wait_for_disconnect: WaitForDisconnect,
    ) -> ServeResult:
        """Serve /v1/completions: a response model, or an async iterator of SSE frames."""
        check_completion_support(body)
        model = self._check_model(body.model)
        prompt = self._tokenize_prompt(body.prompt)
        prepared = self.prepare(body, model, prompt, "cmpl-", rate_header, body.max_tokens)
        return await self._serve(prepared, CompletionFormat(), wait_for_disconnect)

    async def create_chat_completion(
        self,
        body: ChatCompletionRequest,
        rate_header: str | None,
        wait_for_disconnect: WaitForDisconnect,
    ) -> ServeResult:
        """Serve /v1/chat/completions: a response model, or an async iterator of SSE frames."""
        check_chat_support(body)
        model = self._check_model(body.model)
        prompt = self._apply_chat_template(body)
        max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = body.max_tokens
        prepared = self.prepare(body, model, prompt, "chatcmpl-", rate_header, max_tokens)
        return await self._serve(prepared, ChatFormat(), wait_for_disconnect)

    # -- validation -----------------------------------------------------------------------------
    def prepare(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        model: str,
        prompt_token_ids: tuple[int, ...],
        id_prefix: str,
        rate_header: str | None,
        max_tokens: int | None,
    ) -> PreparedRequest:
        """Check rate and lengths; build the SamplingParams.  Raises ApiError."""
        rate_tps = self._resolve_rate(body.stream_rate, rate_header)
        max_tokens = resolve_max_tokens(
            len(prompt_token_ids), max_tokens, self.engine.max_model_len
        )
        if body.stream_options is not None and not body.stream:
            raise ApiError(
                400, "stream_options is only allowed with stream=true", param="stream_options"
            )
        options = body.stream_options
        return PreparedRequest(
            request_id=id_prefix + self._new_id(),
            model=model,
            created_s=int(self._wall_clock()),
            received_s=self._clock(),
            prompt_token_ids=prompt_token_ids,
            sampling_params=build_sampling_params(body, max_tokens, self.engine.vocab_size),
            rate_tps=rate_tps,
            stream=body.stream,
            include_usage=options is not None and options.include_usage,
            continuous_usage=options is not None and options.continuous_usage_stats,
        )

    def _check_model(self, model: str | None) -> str:
        if model is None or model == self.engine.model_name:
            return self.engine.model_name
        raise ApiError(
            404,
            f"The model `{model}` does not exist.",
            param="model",
            code="model_not_found",
        )

    def _resolve_rate(self, body_rate: float | None, header: str | None) -> float:
        """Body `stream_rate` > `X-Stream-Rate` header > the engine's default."""
        if body_rate is not None:
            return check_rate(body_rate, "stream_rate")
        if header is not None:
            try:
                value = float(header)
            except ValueError:
                raise ApiError(
                    400,
                    f"{STREAM_RATE_HEADER} must be a number, got {header!r}",
                    param=STREAM_RATE_HEADER,
                ) from None
            return check_rate(value, STREAM_RATE_HEADER)
        return self.engine.default_rate_tps

    def _apply_chat_template(self, body: ChatCompletionRequest) -> tuple[int, ...]:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            return tuple(self.engine.tokenizer.apply_chat_template(messages))
        except Exception as exc:  # a template rejecting these messages (e.g. role order)
            raise ApiError(400, f"cannot apply the chat template: {exc}", param="messages") from exc

    def _tokenize_prompt(self, prompt: str | list[int]) -> tuple[int, ...]:
        if isinstance(prompt, str):
            return tuple(self.engine.tokenizer.encode(prompt))
        return check_prompt_token_ids(prompt, self.engine.vocab_size)

    # -- running --------------------------------------------------------------------------------
    async def _serve(
        self, prepared: PreparedRequest, fmt: ResponseFormat, wait_for_disconnect: WaitForDisconnect
    ) -> ServeResult:
        progress = Progress()
        deltas = await self._start(prepared, progress, wait_for_disconnect)
        if prepared.stream:
            frames = self._stream(prepared, fmt, deltas, progress)
            return SseStream(frames, lambda: self._release(prepared.request_id, deltas, progress))
        try:
            collect = self._collect(prepared, deltas, progress)
            await self._race_disconnect(collect, wait_for_disconnect)
        finally:
            await self._release(prepared.request_id, deltas, progress)
        text = "".join(progress.text_parts)
        return fmt.response(prepared, text, progress.finish_reason, usage_of(prepared, progress))

    async def _start(
        self, prepared: PreparedRequest, progress: Progress, wait_for_disconnect: WaitForDisconnect
    ) -> AsyncIterator[GenerationDelta]:
        """Submit; leave the wait for the first delta in `progress.pending`.

        A stream waits only `_ADMISSION_GRACE_S` (refusals come back at once); a non-streaming
        request waits for its first delta while watching the client.  Either way a refusal or
        an early failure is raised here, before any byte is sent.
        """
        deltas: AsyncIterator[GenerationDelta] | None = None
        try:
            deltas = aiter(
                self.engine.generate(
                    prepared.request_id,
                    prepared.prompt_token_ids,
                    prepared.sampling_params,
                    prepared.rate_tps,
                )
            )
            progress.pending = asyncio.ensure_future(anext(deltas))
            if prepared.stream:
                await asyncio.wait((progress.pending,), timeout=_ADMISSION_GRACE_S)
            else:
                await self._race_disconnect(asyncio.shield(progress.pending), wait_for_disconnect)
            if progress.pending.done():
                progress.pending.result()  # raises a refusal or an early failure
        except (EngineOverloaded, EngineRequestError, EngineDead) as exc:
            raise _refusal(exc) from exc
        except StopAsyncIteration:
            message = "the engine ended the request without output"
            raise ApiError(500, message, type="server_error") from None
        except ClientDisconnected:
            if deltas is not None:
                await self._release(prepared.request_id, deltas, progress)
            raise
        except Exception as exc:  # failed before its first delta: a 500 naming why
            progress.has_failed = True
            if deltas is not None:
                await self._release(prepared.request_id, deltas, progress)
            raise ApiError(500, _engine_error_message(exc), type="server_error") from exc
        except BaseException:  # cancelled: free the request
            if deltas is not None:
                await self._release(prepared.request_id, deltas, progress)
            raise
        return deltas

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

    async def _release(
        self, request_id: str, deltas: AsyncIterator[GenerationDelta], progress: Progress
    ) -> None:
        """Abort the request unless the engine finished it, and close its delta iterator.

        Idempotent, and runs to completion even while our own task is being cancelled.
        """
        if progress.is_released:
            return
        progress.is_released = True
        with anyio.CancelScope(shield=True):
            await cancel_pending(progress)
            if progress.finish_reason is None:
                if not progress.has_failed:
                    self.metrics.count_finished("abort")
                await self.engine.abort(request_id)
            aclose = getattr(deltas, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    def _record(
        self, prepared: PreparedRequest, progress: Progress, delta: GenerationDelta
    ) -> None:
        now = self._clock()
        num_new = len(delta.token_ids)
        if num_new:
            if progress.last_delta_s is None:
                self.metrics.observe_ttft(now - prepared.received_s)
                self.metrics.observe_inter_token(0.0, num_new - 1)
            else:
                self.metrics.observe_inter_token(now - progress.last_delta_s, num_new)
            progress.last_delta_s = now
        progress.num_output_tokens += num_new
        progress.text_parts.append(delta.text)
        if delta.finish_reason is not None:
            progress.finish_reason = delta.finish_reason
            self.metrics.count_finished(delta.finish_reason)

    def _on_failure(self, exc: BaseException) -> str:
        """Count a request the engine failed mid-way; the message for its client."""
        self.metrics.count_finished("error")
        logger.warning("a request failed: %s", _engine_error_message(exc))
        return _engine_error_message(exc)

    async def _collect(
        self, prepared: PreparedRequest, deltas: AsyncIterator[GenerationDelta], progress: Progress
    ) -> None:
        """Record deltas until the finish; an engine failure becomes a 500."""
        try:
            while True:
                pending, progress.pending = progress.pending, None
                delta = await pending if pending is not None else await anext(deltas)
                self._record(prepared, progress, delta)  # type: ignore[arg-type]
                if delta.finish_reason is not None:  # type: ignore[union-attr]
                    return
        except (StopAsyncIteration, Exception) as exc:
            progress.has_failed = True
            raise ApiError(500, self._on_failure(exc), type="server_error") from None

    async def _stream(
        self,
        prepared: PreparedRequest,
        fmt: ResponseFormat,
        deltas: AsyncIterator[GenerationDelta],
        progress: Progress,
    ) -> AsyncIterator[str]:
        """SSE frames; releases the engine request however the iteration ends."""
        frames = delta_frames(
            prepared, fmt, deltas, progress, self.keepalive_s, self._record, self._on_failure
        )
        try:
            opening = fmt.opening_chunks(prepared)
            for chunk in opening:
                yield sse_frame(chunk)
            if not opening and progress.pending is not None and not progress.pending.done():
                yield KEEPALIVE_FRAME  # the server sends the 200 headers with the first bytes
            async for frame in frames:
                yield frame
        finally:
            with anyio.CancelScope(shield=True):
                await frames.aclose()
            await self._release(prepared.request_id, deltas, progress)
        yield DONE_FRAME


# A non-streaming body, or the SSE frames of a streaming one.
ServeResult = CompletionResponse | ChatCompletionResponse | SseStream


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
    return ApiError(503, f"the engine is not running: {exc}", type="server_error")


def _engine_error_message(exc: BaseException) -> str:
    if isinstance(exc, StopAsyncIteration):
        return "the engine ended the stream without a finish reason"
    return f"engine error: {type(exc).__name__}: {exc}"
