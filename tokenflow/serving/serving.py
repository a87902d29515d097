"""Serving logic between the routes and the engine: validate, submit, stream or collect.

Flow of one request::

    prepare()      body (+ X-Stream-Rate header) -> PreparedRequest, or ApiError (400/404)
    _start()       engine.generate(), then wait for the first delta while watching the client
                   (EngineOverloaded -> 429, EngineRequestError -> 400: before any byte is sent)
    _stream()      SSE frames, `data: {json}\\n\\n` ... `data: [DONE]\\n\\n`
    _collect()     one JSON body

Whenever the client goes away before the engine finished (a disconnect while waiting, or the
SSE generator being cancelled/closed), the request is aborted in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import anyio

from tokenflow.core.request import SamplingParams
from tokenflow.serving.engine_client import (
    EngineClient,
    EngineOverloaded,
    EngineRequestError,
    GenerationDelta,
)
from tokenflow.serving.formatting import ChatFormat, CompletionFormat, ResponseFormat, sse_frame
from tokenflow.serving.metrics import ServingMetrics
from tokenflow.serving.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
    UsageInfo,
)
from tokenflow.serving.validation import (
    ApiError,
    build_sampling_params,
    check_chat_support,
    check_completion_support,
    check_rate,
    resolve_max_tokens,
)

_T = TypeVar("_T")
WaitForDisconnect = Callable[[], Awaitable[None]]
STREAM_RATE_HEADER = "X-Stream-Rate"


class ClientDisconnected(Exception):
    """The client went away before the answer was ready (the engine request is released)."""


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request, ready for `engine.generate()`."""

    request_id: str
    model: str
    created_s: int  # wall-clock seconds, the OpenAI `created` field
    received_s: float  # monotonic clock, start of TTFT
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    rate_tps: float
    stream: bool
    include_usage: bool
    continuous_usage: bool


@dataclass
class _Progress:
    """What has been produced so far for one request."""

    num_output_tokens: int = 0
    text_parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    last_delta_s: float | None = None
    has_failed: bool = False  # the engine raised mid-stream
    is_released: bool = False  # aborted if needed, delta iterator closed


def _new_hex_id() -> str:
    return uuid.uuid4().hex


class OpenAIServing:
    """The logic behind /v1/completions and /v1/chat/completions, independent of the web framework.

    `clock` (monotonic seconds) times TTFT and inter-token gaps; `wall_clock` stamps `created`;
    `new_id` makes request ids.  All three are injectable for tests.
    """

    def __init__(
        self,
        engine: EngineClient,
        metrics: ServingMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        new_id: Callable[[], str] = _new_hex_id,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
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
            sampling_params=build_sampling_params(body, max_tokens),
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
        if any(token_id < 0 for token_id in prompt):
            raise ApiError(400, "prompt token ids must be >= 0", param="prompt")
        return tuple(prompt)

    # -- running --------------------------------------------------------------------------------
    async def _serve(
        self, prepared: PreparedRequest, fmt: ResponseFormat, wait_for_disconnect: WaitForDisconnect
    ) -> ServeResult:
        progress = _Progress()
        deltas, first = await self._start(prepared, progress, wait_for_disconnect)
        if prepared.stream:
            frames = self._stream(prepared, fmt, first, deltas, progress)
            return SseStream(frames, lambda: self._release(prepared.request_id, deltas, progress))
        try:
            collect = self._collect(prepared, first, deltas, progress)
            await self._race_disconnect(collect, wait_for_disconnect)
        finally:
            await self._release(prepared.request_id, deltas, progress)
        text = "".join(progress.text_parts)
        return fmt.response(prepared, text, progress.finish_reason, _usage(prepared, progress))

    async def _start(
        self, prepared: PreparedRequest, progress: _Progress, wait_for_disconnect: WaitForDisconnect
    ) -> tuple[AsyncIterator[GenerationDelta], GenerationDelta]:
        """Submit and wait for the first delta, so refusals become proper HTTP errors."""
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
            first = await self._race_disconnect(anext(deltas), wait_for_disconnect)
        except EngineOverloaded as exc:
            retry_after = str(max(1, math.ceil(exc.retry_after_s)))
            raise ApiError(
                429,
                str(exc),
                type="server_overloaded",
                code="rate_limit_exceeded",
                headers={"Retry-After": retry_after},
            ) from exc
        except EngineRequestError as exc:
            raise ApiError(400, str(exc)) from exc
        except StopAsyncIteration:
            message = "the engine ended the request without output"
            raise ApiError(500, message, type="server_error") from None
        except BaseException:  # the client is gone (or the engine broke): free the request
            if deltas is not None:
                await self._release(prepared.request_id, deltas, progress)
            raise
        return deltas, first

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
        self, request_id: str, deltas: AsyncIterator[GenerationDelta], progress: _Progress
    ) -> None:
        """Abort the request unless the engine finished it, and close its delta iterator.

        Idempotent, and runs to completion even while our own task is being cancelled.
        """
        if progress.is_released:
            return
        progress.is_released = True
        with anyio.CancelScope(shield=True):
            if progress.finish_reason is None:
                if not progress.has_failed:
                    self.metrics.count_finished("abort")
                await self.engine.abort(request_id)
            aclose = getattr(deltas, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    def _record(
        self, prepared: PreparedRequest, progress: _Progress, delta: GenerationDelta
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

    async def _collect(
        self,
        prepared: PreparedRequest,
        first: GenerationDelta,
        deltas: AsyncIterator[GenerationDelta],
        progress: _Progress,
    ) -> None:
        """Record deltas until the finish; an engine failure becomes a 500."""
        delta = first
        try:
            while True:
                self._record(prepared, progress, delta)
                if delta.finish_reason is not None:
                    return
                delta = await anext(deltas)
        except (StopAsyncIteration, Exception) as exc:
            progress.has_failed = True
            self.metrics.count_finished("error")
            raise ApiError(500, _engine_error_message(exc), type="server_error") from None

    async def _stream(
        self,
        prepared: PreparedRequest,
        fmt: ResponseFormat,
        first: GenerationDelta,
        deltas: AsyncIterator[GenerationDelta],
        progress: _Progress,
    ) -> AsyncIterator[str]:
        """SSE frames; releases the engine request however the iteration ends."""
        frames = self._delta_frames(prepared, fmt, first, deltas, progress)
        try:
            for chunk in fmt.opening_chunks(prepared):
                yield sse_frame(chunk)
            async for frame in frames:
                yield frame
        finally:
            with anyio.CancelScope(shield=True):
                await frames.aclose()
            await self._release(prepared.request_id, deltas, progress)
        yield "data: [DONE]\n\n"

    async def _delta_frames(
        self,
        prepared: PreparedRequest,
        fmt: ResponseFormat,
        first: GenerationDelta,
        deltas: AsyncIterator[GenerationDelta],
        progress: _Progress,
    ) -> AsyncIterator[str]:
        """One chunk per delta, then the usage chunk; an engine failure becomes an error frame."""
        delta = first
        try:
            while True:
                self._record(prepared, progress, delta)
                usage = _usage(prepared, progress) if prepared.continuous_usage else None
                yield sse_frame(fmt.delta_chunk(prepared, delta.text, delta.finish_reason, usage))
                if delta.finish_reason is not None:
                    break
                delta = await anext(deltas)
        except (StopAsyncIteration, Exception) as exc:
            progress.has_failed = True
            self.metrics.count_finished("error")
            error = ErrorInfo(message=_engine_error_message(exc), type="server_error")
            yield sse_frame(ErrorResponse(error=error))
            return
        if prepared.include_usage:
            yield sse_frame(fmt.usage_chunk(prepared, _usage(prepared, progress)))


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


# A non-streaming body, or the SSE frames of a streaming one.
ServeResult = CompletionResponse | ChatCompletionResponse | SseStream


# -- helpers ------------------------------------------------------------------------------------
def _engine_error_message(exc: BaseException) -> str:
    if isinstance(exc, StopAsyncIteration):
        return "the engine ended the stream without a finish reason"
    return f"engine error: {type(exc).__name__}: {exc}"


def _usage(prepared: PreparedRequest, progress: _Progress) -> UsageInfo:
    num_prompt = len(prepared.prompt_token_ids)
    return UsageInfo(
        prompt_tokens=num_prompt,
        completion_tokens=progress.num_output_tokens,
        total_tokens=num_prompt + progress.num_output_tokens,
    )
