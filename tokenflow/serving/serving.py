"""Serving logic between the routes and the engine: validate, submit, stream or collect.

Flow of one request::

    prepare()      body (+ X-Stream-Rate header) -> PreparedRequest, or ApiError (400/404)
    _start()       engine.generate(); refusals (EngineOverloaded -> 429, EngineRequestError ->
                   400, EngineDead -> 503) are raised before any byte is sent
    _events()      a stream: the data of each SSE event (chunk JSON ... `[DONE]`); the route
                   frames them, sends its 200 headers at once and keep-alives meanwhile
    _collect()     one JSON body

Whenever the client goes away before the engine finished (a disconnect while waiting, or the
event generator being cancelled/closed), the request is aborted in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import anyio

from tokenflow.core.request import StructuredOutput
from tokenflow.engine.client import (
    EngineClient,
    EngineDead,
    EngineOverloaded,
    EngineRequestError,
    GenerationDelta,
)
from tokenflow.serving.classes import ClassRules, Stated
from tokenflow.serving.drain import DRAIN_RETRY_AFTER_S
from tokenflow.serving.formatting import (
    DONE,
    ChatFormat,
    CompletionFormat,
    ResponseFormat,
    ToolCallFormat,
)
from tokenflow.serving.metrics import ServingMetrics
from tokenflow.serving.prepared import PreparedRequest, Progress, usage_of
from tokenflow.serving.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
)
from tokenflow.serving.structured import (
    check_tool_messages,
    forced_tool_call,
    structured_output_of,
    template_message,
)
from tokenflow.serving.validation import (
    ApiError,
    build_sampling_params,
    check_chat_support,
    check_completion_support,
    check_prompt_chars,
    check_token_ids,
    resolve_max_tokens,
)

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
WaitForDisconnect = Callable[[], Awaitable[None]]
STREAM_RATE_HEADER = "X-Stream-Rate"
STREAM_CLASS_HEADER = "X-Stream-Class"
# How long a new request waits for the engine's answer before its 200 headers go out; refusals
# are raised synchronously by `generate()`, so they always come back as real status codes.
_ADMISSION_GRACE_S = 0.05


class ClientDisconnected(Exception):
    """The client went away before the answer was ready (the engine request is released)."""


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
        class_rules: ClassRules | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.class_rules = class_rules or ClassRules()
        self._clock = clock
        self._wall_clock = wall_clock
        self._new_id = new_id

    # -- entry points ---------------------------------------------------------------------------
    async def create_completion(
        self,
        body: CompletionRequest,
        stated: Stated,
        wait_for_disconnect: WaitForDisconnect,
    ) -> ServeResult:
        """Serve /v1/completions: a response model, or an async iterator of SSE frames."""
        check_completion_support(body)
        model = self._check_model(body.model)
        structured = structured_output_of(body)
        prompt = await self._tokenize_prompt(body.prompt)
        prepared = self.prepare(body, model, prompt, "cmpl-", stated, body.max_tokens, structured)
        return await self._serve(prepared, CompletionFormat(), wait_for_disconnect)

    async def create_chat_completion(
        self,
        body: ChatCompletionRequest,
        stated: Stated,
        wait_for_disconnect: WaitForDisconnect,
    ) -> ServeResult:
        """Serve /v1/chat/completions: a response model, or an async iterator of SSE frames."""
        check_chat_support(body)
        model = self._check_model(body.model)
        check_tool_messages(body, self.engine.tokenizer.renders_tools)
        tool_call = forced_tool_call(body)
        structured = tool_call or structured_output_of(body)
        prompt = await self._apply_chat_template(body)
        max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = body.max_tokens
        prepared = self.prepare(body, model, prompt, "chatcmpl-", stated, max_tokens, structured)
        fmt = ChatFormat() if tool_call is None else ToolCallFormat("call_" + self._new_id())
        return await self._serve(prepared, fmt, wait_for_disconnect)

    # -- validation -----------------------------------------------------------------------------
    def prepare(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        model: str,
        prompt_token_ids: tuple[int, ...],
        id_prefix: str,
        stated: Stated,
        max_tokens: int | None,
        structured_output: StructuredOutput | None = None,
    ) -> PreparedRequest:
        """Check lengths; build the SamplingParams; find the class (`classes.py`).  Raises
        ApiError.  The rates (body and header) were checked by their pydantic types."""
        consumption, rate_tps = self.class_rules.resolve(
            body.stream, body.stream_class, body.stream_rate, stated, self.engine.default_rate_tps
        )
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
            sampling_params=build_sampling_params(
                body, max_tokens, self.engine.vocab_size, structured_output
            ),
            rate_tps=rate_tps,
            consumption=consumption,
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

    # Tokenizing runs in a worker thread: a long prompt on the event loop held every other
    # request, /health included, for seconds.  A text no context could hold is refused first.
    async def _apply_chat_template(self, body: ChatCompletionRequest) -> tuple[int, ...]:
        tokenizer = self.engine.tokenizer
        messages = [template_message(m) for m in body.messages]
        self._check_chars(sum(len(m["content"]) for m in messages))
        tools = None
        if body.tools and tokenizer.renders_tools:
            tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
        try:
            ids = await anyio.to_thread.run_sync(tokenizer.apply_chat_template, messages, tools)
        except Exception as exc:  # a template rejecting these messages (e.g. role order)
            raise ApiError(400, f"cannot apply the chat template: {exc}", param="messages") from exc
        return tuple(ids)

    async def _tokenize_prompt(self, prompt: str | list[int]) -> tuple[int, ...]:
        if isinstance(prompt, str):
            self._check_chars(len(prompt))
            return tuple(await anyio.to_thread.run_sync(self.engine.tokenizer.encode, prompt))
        return check_token_ids(prompt, self.engine.vocab_size, "prompt")

    def _check_chars(self, num_chars: int) -> None:
        tokenizer = self.engine.tokenizer
        check_prompt_chars(num_chars, self.engine.max_model_len, tokenizer.max_token_chars)

    # -- running --------------------------------------------------------------------------------
    async def _serve(
        self, prepared: PreparedRequest, fmt: ResponseFormat, wait_for_disconnect: WaitForDisconnect
    ) -> ServeResult:
        progress = Progress()
        submitted = await self._start(prepared, progress)
        if prepared.stream:
            events = self._events(prepared, fmt, submitted, progress)
            return EventStream(events, lambda: self._release(submitted, progress))
        try:
            collect = self._collect(prepared, submitted, progress)
            await self._race_disconnect(collect, wait_for_disconnect)
        finally:
            await self._release(submitted, progress)
        text = "".join(progress.text_parts)
        return fmt.response(prepared, text, progress.finish_reason, usage_of(prepared, progress))

    async def _start(self, prepared: PreparedRequest, progress: Progress) -> _Submitted:
        """Submit, and wait `_ADMISSION_GRACE_S` for the first delta: a refusal or an early
        failure is raised here, before any byte is sent."""
        deltas = aiter(
            self.engine.generate(
                prepared.request_id,
                prepared.prompt_token_ids,
                prepared.sampling_params,
                prepared.rate_tps,
                prepared.consumption,
            )
        )
        submitted = _Submitted(prepared.request_id, deltas, asyncio.ensure_future(anext(deltas)))
        try:
            await asyncio.wait((submitted.first,), timeout=_ADMISSION_GRACE_S)
            if submitted.first.done():
                submitted.first.result()  # raises a refusal or an early failure
        except (EngineOverloaded, EngineRequestError, EngineDead) as exc:
            raise _refusal(exc) from exc
        except StopAsyncIteration:
            message = "the engine ended the request without output"
            raise ApiError(500, message, type="server_error") from None
        except Exception as exc:  # failed before its first delta: a 500 naming why
            progress.has_failed = True
            await self._release(submitted, progress)
            raise ApiError(500, _engine_error_message(exc), type="server_error") from exc
        except BaseException:  # cancelled: free the request
            await self._release(submitted, progress)
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

    async def _release(self, submitted: _Submitted, progress: Progress) -> None:
        """Abort the request unless the engine finished it, and close its delta iterator.

        Idempotent, and runs to completion even while our own task is being cancelled.
        """
        if submitted.is_released:
            return
        submitted.is_released = True
        with anyio.CancelScope(shield=True):
            first = submitted.first
            if not first.done():
                first.cancel()
                await asyncio.wait((first,))  # let it unwind; does not raise
            if not first.cancelled():
                first.exception()  # retrieved: no "exception never retrieved" warning
            if progress.finish_reason is None:
                if not progress.has_failed:
                    self.metrics.count_finished("abort")
                await self.engine.abort(submitted.request_id)
            aclose = getattr(submitted.deltas, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    def _record(
        self, prepared: PreparedRequest, progress: Progress, delta: GenerationDelta
    ) -> None:
        now, metrics = self._clock(), self.metrics
        num_new, stream_class = len(delta.token_ids), prepared.consumption.value
        if num_new:
            if progress.last_delta_s is None:
                metrics.observe_ttft(now - prepared.received_s, stream_class)
                metrics.observe_inter_token(0.0, num_new - 1, stream_class)
            else:
                metrics.observe_inter_token(now - progress.last_delta_s, num_new, stream_class)
            progress.last_delta_s = now
        progress.num_output_tokens += num_new
        progress.text_parts.append(delta.text)
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
            message = "the engine failed this request; the server log has the details"
        return ErrorInfo(message=message, type="server_error")

    async def _collect(
        self, prepared: PreparedRequest, submitted: _Submitted, progress: Progress
    ) -> None:
        """Record deltas until the finish; an engine failure becomes a 500, an engine that
        stopped (a drain past its timeout) a 503 with Retry-After."""
        try:
            while progress.finish_reason is None:
                self._record(prepared, progress, await submitted.next_delta())
        except (StopAsyncIteration, Exception) as exc:
            progress.has_failed = True
            info = self._on_failure(exc)
            if isinstance(exc, EngineDead):
                retry = {"Retry-After": str(DRAIN_RETRY_AFTER_S)}
                raise ApiError(
                    503, info.message, type=info.type, code=info.code, headers=retry
                ) from None
            raise ApiError(500, info.message, type=info.type) from None

    async def _events(
        self,
        prepared: PreparedRequest,
        fmt: ResponseFormat,
        submitted: _Submitted,
        progress: Progress,
    ) -> AsyncGenerator[str]:
        """The data of each SSE event: the opening chunks with the first delta's (as vLLM
        sends them, so that a client's time to first chunk is its TTFT), one chunk per delta,
        the usage chunk, then `[DONE]`; an engine failure becomes one `{"error": ...}` event
        before `[DONE]`.  Releases the engine request however the iteration ends."""
        opening = fmt.opening_chunks(prepared)
        try:
            while progress.finish_reason is None:
                try:
                    delta = await submitted.next_delta()
                except (StopAsyncIteration, Exception) as exc:
                    progress.has_failed = True
                    yield ErrorResponse(error=self._on_failure(exc)).model_dump_json()
                    break
                for chunk in opening:
                    yield chunk.model_dump_json()
                opening = []
                self._record(prepared, progress, delta)
                usage = usage_of(prepared, progress) if prepared.continuous_usage else None
                chunk = fmt.delta_chunk(prepared, delta.text, delta.finish_reason, usage)
                yield chunk.model_dump_json()
            if prepared.include_usage and not progress.has_failed:
                yield fmt.usage_chunk(prepared, usage_of(prepared, progress)).model_dump_json()
        finally:
            await self._release(submitted, progress)
        yield DONE


@dataclass
class _Submitted:
    """One request in the engine: its deltas, the first of them awaited since submission (so
    that a refusal comes back before any byte is sent)."""

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


class EventStream:
    """The data of each SSE event of one streaming answer (the route frames them).

    Iterate it for the data.  `aclose()` must be called when the response ends however it ends
    (also when the client left before the first event was pulled): it releases the engine
    request, aborting it if it has not finished.
    """

    def __init__(self, events: AsyncGenerator[str], release: Callable[[], Awaitable[None]]) -> None:
        self._events = events
        self._release = release

    def __aiter__(self) -> AsyncIterator[str]:
        return self._events

    async def aclose(self) -> None:
        """Stop the events and release the engine request (idempotent)."""
        with anyio.CancelScope(shield=True):
            await self._events.aclose()
            await self._release()


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
