"""Serving logic between the routes and the engine: a request body becomes a prepared request,
which `responder.Responder` runs.

Flow of one request::

    prepare()          body (+ X-Stream-* headers) -> PreparedRequest, or ApiError (400/404):
                       one choice per prompt times `n`, each its own engine request
    Responder.serve()  submit, then stream the SSE events or collect one JSON body
                       (tokenflow/serving/responder.py)
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
from jinja2.exceptions import TemplateError

from tokenflow.core.request import StructuredOutput
from tokenflow.engine.client import (
    EngineClient,
)
from tokenflow.serving.classes import ClassRules, Stated
from tokenflow.serving.drain import Drain
from tokenflow.serving.formatting import (
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
)
from tokenflow.serving.owners import StreamOwners
from tokenflow.serving.pacing import PaceClock
from tokenflow.serving.prepared import PreparedChoice, PreparedRequest
from tokenflow.serving.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ToolDefinition,
)
from tokenflow.serving.responder import Responder, ServeResult, WaitForDisconnect
from tokenflow.serving.structured import (
    check_tool_messages,
    forced_tool_call,
    is_auto_tool_call,
    structured_output_of,
    template_message,
)
from tokenflow.serving.tenants import KeyGate
from tokenflow.serving.validation import (
    ApiError,
    Scores,
    build_sampling_params,
    chat_scores,
    check_chat_support,
    check_completion_support,
    check_head_tokens,
    check_num_choices,
    check_prompt_chars,
    check_token_ids,
    completion_scores,
    context_head_chars,
    resolve_max_tokens,
    shortened,
    template_refusal,
    with_seed_offset,
)

logger = logging.getLogger(__name__)

STREAM_RATE_HEADER = "X-Stream-Rate"
STREAM_CLASS_HEADER = "X-Stream-Class"
STREAM_PACING_HEADER = "X-Stream-Pacing"


@dataclass(frozen=True)
class _Prompt:
    token_ids: tuple[int, ...]
    text: str  # what `echo` repeats ("" when it is not asked)


def _new_hex_id() -> str:
    return uuid.uuid4().hex


class OpenAIServing:
    """The logic behind /v1/completions and /v1/chat/completions, independent of the web framework.

    `clock` (monotonic seconds) times TTFT and inter-token gaps (`Responder`); `wall_clock`
    stamps `created`; `new_id` makes request ids.  All three are injectable for tests.  Paced
    streams (pacing.py) wait on `pace_clock` and send what they hold once `drain` begins.
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
        key_gate: KeyGate | None = None,
        pace_clock: PaceClock | None = None,
        drain: Drain | None = None,
        model_names: tuple[str, ...] = (),
    ) -> None:
        self.engine = engine
        # The names a request's `model` may give, the one responses report first
        # (`ServerConfig.served_model_names`; (): the engine's own).
        self.model_names = model_names or (engine.model_name,)
        self.metrics = metrics
        self.class_rules = class_rules or ClassRules()
        # The parser of the model's tool calls under tool_choice "auto" (None: "auto" with
        # tools is a 400); `ServerConfig.auto_tool_call_parser`.
        self.tool_call_parser = tool_call_parser
        self.token_texts = TokenTexts(engine.tokenizer)
        self._clock = clock
        self._wall_clock = wall_clock
        self._new_id = new_id
        self.stream_owners = StreamOwners()  # whose each engine request is: streams.py
        self._responder = Responder(
            engine,
            metrics,
            clock,
            self.stream_owners,
            key_gate,
            pace_clock,
            None if drain is None else drain.begun,
        )

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
        _log_ignored(body)
        model = self._check_model(body.model)
        structured = structured_output_of(body)
        prompts = await self._tokenize_prompts(body.prompt, body.echo)
        wants = completion_scores(body)
        prepared = self.prepare(
            body, model, prompts, "cmpl-", stated, body.max_tokens, wants, structured
        )
        fmt = CompletionFormat(self.token_texts)
        return await self._responder.serve(prepared, fmt, wait_for_disconnect, ticket)

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
        _log_ignored(body)
        model = self._check_model(body.model)
        renders_tools = self.engine.tokenizer.renders_tools
        check_tool_messages(body, renders_tools)
        is_auto = is_auto_tool_call(body, self.tool_call_parser, renders_tools)
        tool_call = forced_tool_call(body)
        structured = _one_constraint(tool_call, structured_output_of(body))
        tools = body.tools if body.tools and renders_tools else None
        prompt = await self.apply_chat_template(
            body.messages, body.add_generation_prompt, tools, _template_options(body)
        )
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
            names = [tool.function.name for tool in body.tools or ()]
            fmt = AutoToolCallFormat(self.token_texts, self._new_call_id, names)
        else:
            fmt = ChatFormat(self.token_texts)
        # Under a forced tool call or tool_choice "auto" the format reads the text into tool
        # calls as it streams: its parser's state does not move, so neither does the answer.
        ticket = None if is_auto or tool_call is not None else ticket
        return await self._responder.serve(prepared, fmt, wait_for_disconnect, ticket)

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
        rules = self.class_rules
        consumption, rate_tps = rules.resolve(
            body.stream, body.stream_class, body.stream_rate, stated, self.engine.default_rate_tps
        )
        is_paced = rules.is_paced(consumption, body.stream_pacing, stated)
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
            session_key=body.prompt_cache_key,
            is_paced=is_paced,
            api_key=stated.api_key,
        )

    def check_model(self, model: str | None) -> str:
        """The name responses report (the first served name), or a 404 (OpenAI's shape)
        naming a `model` served under no name."""
        return self._check_model(model)

    def _check_model(self, model: str | None) -> str:
        if model is None or model in self.model_names:
            return self.model_names[0]
        raise ApiError(
            404,
            f"The model `{shortened(model, 100)}` does not exist.",
            param="model",
            code="model_not_found",
        )

    # Tokenizing runs in a worker thread, through the tokenizer's GIL-free path: a long prompt
    # on the event loop held every other request, /health included, for seconds.  A text no
    # context could hold is refused before it is tokenized (`check_prompt_chars`), and a long
    # one whose head alone overflows the context is refused after tokenizing only that head.
    async def apply_chat_template(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        tools: list[ToolDefinition] | None = None,
        options: TemplateOptions | None = None,
    ) -> tuple[int, ...]:
        """The messages (and tools, for a template with a tools section) rendered by the
        model's chat template, as token ids (400 if it fails); `options`: vLLM's extras."""
        rendered = [template_message(m) for m in messages]
        self._check_chars(sum(len(m["content"]) for m in rendered))
        await self._check_head("".join(m["content"] for m in rendered))
        dumped = None if tools is None else [t.model_dump(exclude_none=True) for t in tools]
        render = functools.partial(
            self.engine.tokenizer.apply_chat_template,
            rendered,
            dumped,
            add_generation_prompt,
            **({} if options is None else dataclasses.asdict(options)),
        )
        try:
            ids = await anyio.to_thread.run_sync(render)
        except TemplateError as exc:  # the template refusing these messages (e.g. role order)
            raise ApiError(400, template_refusal(exc), param="messages") from None
        except Exception as exc:  # anything else is ours: logged, not shown
            logger.warning("the chat template failed: %r", exc)
            raise ApiError(400, template_refusal(None), param="messages") from None
        return tuple(ids)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        """`text`'s token ids, off the event loop (400 if no prompt the context holds is it)."""
        self._check_chars(len(text))
        await self._check_head(text)
        encode = self.engine.tokenizer.encode
        return tuple(await anyio.to_thread.run_sync(encode, text, add_special_tokens))

    async def _check_head(self, text: str) -> None:
        """A 400 when `text`'s head alone overflows the context (`check_head_tokens`), from
        tokenizing that head only."""
        tokenizer, max_model_len = self.engine.tokenizer, self.engine.max_model_len
        head_chars = context_head_chars(max_model_len)
        if len(text) > head_chars:
            head = await anyio.to_thread.run_sync(tokenizer.encode, text[:head_chars], False)
            check_head_tokens(len(head), max_model_len, tokenizer.max_token_chars)

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


@dataclass(frozen=True)
class TemplateOptions:
    """vLLM's chat template extras, as keyword arguments of `Tokenizer.apply_chat_template`."""

    continue_final_message: bool = False  # the last message left open, to be continued
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template


def _template_options(body: ChatCompletionRequest) -> TemplateOptions | None:
    """The request's template extras; None at their defaults (the plain call)."""
    if not body.continue_final_message and not body.chat_template_kwargs:
        return None
    return TemplateOptions(body.continue_final_message, body.chat_template_kwargs)


def _one_constraint(
    tool_call: StructuredOutput | None, structured: StructuredOutput | None
) -> StructuredOutput | None:
    """A forced tool call is the answer's one constraint: another one with it is a 400."""
    if tool_call is not None and structured is not None:
        raise ApiError(
            400,
            f"{structured.origin} cannot be combined with a forced tool call",
            param="tool_choice",
        )
    return tool_call or structured


def _log_ignored(body: CompletionRequest | ChatCompletionRequest) -> None:
    """Log what a request gives that changes nothing here: fields no API we follow defines
    (served, as vLLM serves them), and a vLLM `priority`, which does not order the service."""
    if body.model_extra:
        logger.warning(
            "The following fields were present in the request but ignored: %s",
            sorted(body.model_extra),
        )
    if body.priority != 0:
        logger.debug("priority=%d accepted; the scheduler's policy orders service", body.priority)
