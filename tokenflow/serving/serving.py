"""Serving logic between the routes and the engine: validate, submit, stream or collect.

Flow of one request::

    prepare()      body (+ X-Stream-Rate header) -> PreparedRequest, or ApiError (400/404):
                   one choice per prompt times `n`, each its own engine request
    _start()       engine.generate() for each choice; refusals (EngineOverloaded -> 429,
                   EngineRequestError -> 400, EngineDead -> 503) are raised before any byte is
                   sent, and the choices already submitted are aborted
    _events()      a stream: the data of each SSE event (chunk JSON ... `[DONE]`), the choices'
                   chunks interleaved as they come; the route frames them, sends its 200
                   headers at once and keep-alives meanwhile
    _collect()     one JSON body

Whenever the client goes away before the engine finished (a disconnect while waiting, or the
event generator being cancelled/closed), every unfinished choice is aborted in the engine.
"""

from __future__ import annotations

import asyncio
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
    StreamMoved,
)
from tokenflow.serving.choices import EventStream, Submitted, merged_deltas
from tokenflow.serving.classes import ClassRules, Stated
from tokenflow.serving.drain import DRAIN_RETRY_AFTER_S
from tokenflow.serving.formatting import (
    DONE,
    AutoToolCallFormat,
    ChatFormat,
    CompletionFormat,
    ResponseFormat,
    ToolCallFormat,
)
from tokenflow.serving.logprobs import TokenTexts
from tokenflow.serving.metrics import ServingMetrics
from tokenflow.serving.moves import (
    MoveTicket,
    StreamHandoff,
    handoff_of,
    is_movable,
    resumed_progress,
    resumed_request,
)
from tokenflow.serving.pieces import delta_piece, record_scores, whole_piece
from tokenflow.serving.prepared import PreparedChoice, PreparedRequest, Progress, usage_of
from tokenflow.serving.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    CompletionRequest,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
    ToolDefinition,
)
from tokenflow.serving.structured import (
    check_tool_messages,
    forced_tool_call,
    is_auto_tool_call,
    structured_output_of,
    template_message,
)
from tokenflow.serving.validation import (
    ApiError,
    Scores,
    build_sampling_params,
    chat_scores,
    check_chat_support,
    check_completion_support,
    check_num_choices,
    check_prompt_chars,
    check_token_ids,
    completion_scores,
    resolve_max_tokens,
    with_seed_offset,
)

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
WaitForDisconnect = Callable[[], Awaitable[None]]
STREAM_RATE_HEADER = "X-Stream-Rate"
STREAM_CLASS_HEADER = "X-Stream-Class"
# How long a new request waits for the engine's answer before its 200 headers go out; refusals
# are raised synchronously by `generate()`, so they always come back as real status codes.
_ADMISSION_GRACE_S = 0.05


@dataclass(frozen=True)
class _Prompt:
    token_ids: tuple[int, ...]
    text: str  # what `echo` repeats ("" when it is not asked)


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
        tool_call_parser: str | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.class_rules = class_rules or ClassRules()
        # The parser of the model's tool calls under tool_choice "auto" (None: "auto" with
        # tools is a 400); `ServerConfig.auto_tool_call_parser`.
        self.tool_call_parser = tool_call_parser
        self.token_texts = TokenTexts(engine.tokenizer)
        self._clock = clock
        self._wall_clock = wall_clock
        self._new_id = new_id

    # -- entry points ---------------------------------------------------------------------------
    async def create_completion(
        self,
        body: CompletionRequest,
        stated: Stated,
        wait_for_disconnect: WaitForDisconnect,
        ticket: MoveTicket | None = None,
    ) -> ServeResult:
        """Serve /v1/completions: a response model, or an async iterator of SSE frames;
        `ticket` (a fleet's request) makes a stream movable, or continues a moved one."""
        check_completion_support(body)
        model = self._check_model(body.model)
        structured = structured_output_of(body)
        prompts = await self._tokenize_prompts(body.prompt, body.echo)
        wants = completion_scores(body)
        prepared = self.prepare(
            body, model, prompts, "cmpl-", stated, body.max_tokens, wants, structured
        )
        fmt = CompletionFormat(self.token_texts)
        return await self._serve(prepared, fmt, wait_for_disconnect, ticket)

    async def create_chat_completion(
        self,
        body: ChatCompletionRequest,
        stated: Stated,
        wait_for_disconnect: WaitForDisconnect,
        ticket: MoveTicket | None = None,
    ) -> ServeResult:
        """Serve /v1/chat/completions: a response model, or an async iterator of SSE frames;
        `ticket` as for completions."""
        check_chat_support(body)
        model = self._check_model(body.model)
        renders_tools = self.engine.tokenizer.renders_tools
        check_tool_messages(body, renders_tools)
        is_auto = is_auto_tool_call(body, self.tool_call_parser, renders_tools)
        tool_call = forced_tool_call(body)
        structured = tool_call or structured_output_of(body)
        tools = body.tools if body.tools and self.engine.tokenizer.renders_tools else None
        prompt = await self.apply_chat_template(body.messages, True, tools)
        max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = body.max_tokens
        wants = chat_scores(body)
        prompts = [_Prompt(prompt, "")]
        prepared = self.prepare(
            body, model, prompts, "chatcmpl-", stated, max_tokens, wants, structured
        )
        if tool_call is not None:
            fmt: ResponseFormat = ToolCallFormat(self.token_texts, self._new_call_id)
        elif is_auto:
            fmt = AutoToolCallFormat(self.token_texts, self._new_call_id)
        else:
            fmt = ChatFormat(self.token_texts)
        # Under tool_choice "auto" the format reads the text for tool calls as it streams: its
        # parser's state does not move, so neither does the answer.
        return await self._serve(prepared, fmt, wait_for_disconnect, None if is_auto else ticket)

    def _new_call_id(self) -> str:
        return "call_" + self._new_id()

    # -- validation -----------------------------------------------------------------------------
    def prepare(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        model: str,
        prompts: list[_Prompt],
        id_prefix: str,
        stated: Stated,
        max_tokens: int | None,
        wants: Scores,
        structured_output: StructuredOutput | None = None,
    ) -> PreparedRequest:
        """Check lengths; build each choice's SamplingParams; find the class (`classes.py`).
        Raises ApiError.  The rates (body and header) were checked by their pydantic types."""
        consumption, rate_tps = self.class_rules.resolve(
            body.stream, body.stream_class, body.stream_rate, stated, self.engine.default_rate_tps
        )
        if body.stream_options is not None and not body.stream:
            raise ApiError(
                400, "stream_options is only allowed with stream=true", param="stream_options"
            )
        check_num_choices(len(prompts), body.n)
        request_id = id_prefix + self._new_id()
        choices = []
        for prompt_index, prompt in enumerate(prompts):
            num_tokens = resolve_max_tokens(
                len(prompt.token_ids),
                wants.engine_max_tokens(max_tokens),
                self.engine.max_model_len,
            )
            params = build_sampling_params(
                body, num_tokens, self.engine.vocab_size, wants, structured_output
            )
            for j in range(body.n):
                index = prompt_index * body.n + j
                choices.append(
                    PreparedChoice(
                        index=index,
                        engine_request_id=request_id
                        if len(prompts) * body.n == 1
                        else f"{request_id}-{index}",
                        prompt_token_ids=prompt.token_ids,
                        prompt_text=prompt.text,
                        sampling_params=params if j == 0 else with_seed_offset(params, j),
                        is_first_of_prompt=j == 0,
                    )
                )
        options = body.stream_options
        return PreparedRequest(
            request_id=request_id,
            model=model,
            created_s=int(self._wall_clock()),
            received_s=self._clock(),
            choices=tuple(choices),
            rate_tps=rate_tps,
            consumption=consumption,
            stream=body.stream,
            include_usage=options is not None and options.include_usage,
            continuous_usage=options is not None and options.continuous_usage_stats,
            echo=wants.echo,
            has_logprobs=wants.logprobs is not None,
            scores_prompt_only=wants.scores_prompt_only,
        )

    def check_model(self, model: str | None) -> str:
        """The served model's name, or a 404 (OpenAI's shape) naming an unknown `model`."""
        return self._check_model(model)

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
    async def apply_chat_template(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        tools: list[ToolDefinition] | None = None,
    ) -> tuple[int, ...]:
        """The messages (and tools, for a template with a tools section) rendered by the
        model's chat template, as token ids (400 if it fails)."""
        rendered = [template_message(m) for m in messages]
        self._check_chars(sum(len(m["content"]) for m in rendered))
        dumped = None if tools is None else [t.model_dump(exclude_none=True) for t in tools]
        try:
            ids = await anyio.to_thread.run_sync(
                self.engine.tokenizer.apply_chat_template, rendered, dumped, add_generation_prompt
            )
        except Exception as exc:  # a template rejecting these messages (e.g. role order)
            raise ApiError(400, f"cannot apply the chat template: {exc}", param="messages") from exc
        return tuple(ids)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        """`text`'s token ids, off the event loop (400 if no prompt the context holds is it)."""
        self._check_chars(len(text))
        encode = self.engine.tokenizer.encode
        return tuple(await anyio.to_thread.run_sync(encode, text, add_special_tokens))

    async def _tokenize_prompts(
        self, prompt: str | list[str] | list[int] | list[list[int]], echo: bool
    ) -> list[_Prompt]:
        """Each prompt's token ids, and its text where `echo` repeats it."""
        if isinstance(prompt, str):
            return [_Prompt(await self.tokenize(prompt), prompt)]
        if prompt and isinstance(prompt[0], str):
            texts = [p for p in prompt if isinstance(p, str)]
            return [_Prompt(await self.tokenize(text), text) for text in texts]
        id_lists = [prompt] if prompt and isinstance(prompt[0], int) else prompt
        prompts = []
        for ids in id_lists:
            checked = check_token_ids(ids, self.engine.vocab_size, "prompt")  # type: ignore[arg-type]
            text = self.engine.tokenizer.decode(checked) if echo else ""
            prompts.append(_Prompt(checked, text))
        return prompts

    def _check_chars(self, num_chars: int) -> None:
        tokenizer = self.engine.tokenizer
        check_prompt_chars(num_chars, self.engine.max_model_len, tokenizer.max_token_chars)

    # -- running --------------------------------------------------------------------------------
    async def _serve(
        self,
        prepared: PreparedRequest,
        fmt: ResponseFormat,
        wait_for_disconnect: WaitForDisconnect,
        ticket: MoveTicket | None,
    ) -> ServeResult:
        resume = ticket.book.take_resume(ticket.ticket) if ticket is not None else None
        movable = ticket if ticket is not None and is_movable(prepared) else None
        if resume is not None:
            if movable is None:
                raise ApiError(400, "only a streamed answer with one choice can move")
            prepared = resumed_request(prepared, resume)
        progresses = [Progress() for _ in prepared.choices]
        if resume is not None:
            progresses = [resumed_progress(resume, self._clock())]
        submitted = await self._start(prepared, progresses, resume)
        if prepared.stream:
            events = self._events(prepared, fmt, submitted, progresses, movable)
            return EventStream(events, lambda: self._release_all(submitted, progresses))
        try:
            collect = self._collect(prepared, submitted, progresses)
            await self._race_disconnect(collect, wait_for_disconnect)
        finally:
            await self._release_all(submitted, progresses)
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
                    )
                )
                submitted.append(Submitted(choice.engine_request_id, deltas, ensure_first(deltas)))
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
        except Exception as exc:  # failed before its first delta: a 500 naming why
            await self._release_all(submitted, progresses)
            raise ApiError(500, _engine_error_message(exc), type="server_error") from exc
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
                metrics.observe_ttft(now - prepared.received_s, stream_class)
                metrics.observe_inter_token(0.0, num_new - 1, stream_class)
            else:
                metrics.observe_inter_token(now - progress.last_delta_s, num_new, stream_class)
            progress.last_delta_s = now
        progress.num_output_tokens += num_new
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
            message = "the engine failed this request; the server log has the details"
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
        delta, the usage chunk, then `[DONE]`; an engine failure becomes one `{"error": ...}`
        event before `[DONE]`.  A `movable` answer whose engine request is exported meanwhile
        ends at once, without `[DONE]`: its book holds the handoff (serving/moves.py).
        Releases the engine requests however the iteration ends."""
        failed = False
        if movable is not None:
            movable.book.register(movable.ticket, prepared.choices[0].engine_request_id)
        try:
            async for position, item in merged_deltas(submitted):
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
                usage = usage_of(prepared, progresses) if prepared.continuous_usage else None
                piece = delta_piece(prepared, choice, progress, item)
                yield fmt.delta_chunk(prepared, choice.index, piece, usage).model_dump_json()
            if prepared.include_usage and not failed:
                yield fmt.usage_chunk(prepared, usage_of(prepared, progresses)).model_dump_json()
        finally:
            if movable is not None:
                movable.book.forget(movable.ticket)
            await self._release_all(submitted, progresses)
        yield DONE


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
