"""OpenAI wire format: request, response, chunk and error models for the two text endpoints.

Requests are validated strictly (`extra="forbid"`, no type coercion), so an unknown field or a
wrong type is a 400, as with OpenAI.  Besides the standard fields we accept a few known extras:
`stream_rate` (the reader's consumption rate, tokens/s) and the vLLM sampling extras
`ignore_eos`, `min_tokens`, `top_k`, `stop_token_ids` and `stream_options.continuous_usage_stats`.
Fields OpenAI defines but we do not implement are accepted only at their neutral value
(checked in `serving.py`, which reports them as "not supported").
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


def _is_none(value: object) -> bool:
    return value is None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Response(BaseModel):
    """Responses are built by us; serialized with `model_dump_json()`."""


# -- requests -----------------------------------------------------------------------------------
class StreamOptions(_Strict):
    include_usage: bool = False
    # vLLM extra: a `usage` object on every chunk, so a client can count tokens per chunk.
    continuous_usage_stats: bool = False


class _SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # Known extras.
    stream_rate: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    top_k: int = 0  # 0 or -1 = disabled
    stop_token_ids: list[int] | None = None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None


class TextContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's text, with text parts concatenated."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None


# -- responses ----------------------------------------------------------------------------------
class UsageInfo(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(_Response):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionChunk(_Response):
    """One SSE chunk of /v1/completions (the same object name as the full response)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = Field(default=None, exclude_if=_is_none)


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Response):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(_Response):
    """Only the fields that changed: `role` on the first chunk, `content` when there is text."""

    role: Literal["assistant"] | None = Field(default=None, exclude_if=_is_none)
    content: str | None = Field(default=None, exclude_if=_is_none)


class ChatChunkChoice(_Response):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = Field(default=None, exclude_if=_is_none)


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tokenflow"
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- errors -------------------------------------------------------------------------------------
class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    """`{"error": {"message", "type", "param", "code"}}`, the body of every non-2xx answer."""

    error: ErrorInfo
