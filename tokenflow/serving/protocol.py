"""OpenAI wire format: request, response, chunk and error models for the two text endpoints.

Requests are validated strictly (no type coercion), so a wrong type is a 400, as with OpenAI.
A top-level field neither OpenAI nor vLLM defines is served and ignored, as vLLM does (its
models allow extra fields): `serving.py` logs which were ignored; the parts of a request
(messages, tools, stream_options) still refuse unknown fields.  Besides the standard fields we
accept our extras `stream_rate` (the reader's consumption rate, tokens/s), `stream_class`,
`stream_pacing` (release the tokens at the reader's rate: serving/pacing.py) and vLLM's request
extras (docs/usage.md, "vLLM request extras", says which change the answer and which are
accepted and ignored).  OpenAI's `prompt_cache_key` becomes the engine request's session hint.
Fields OpenAI or vLLM define but we do not implement are accepted only at their neutral value
(checked in `validation.py`, which reports them as "not supported").

Every value bound that does not depend on the model is a pydantic constraint here, so a value out
of range is a 400 naming its field before anything runs; `validation.py` keeps the bounds that
need the model (the context length, the vocabulary).  Whatever reaches a tensor or a per-token
loop is bounded: a hostile value is a 400 for its sender, never an engine failure for everyone.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenflow.core.request import MAX_LOGPROBS, MAX_READER_RATE_TPS, MIN_READER_RATE_TPS

MAX_TEMPERATURE = 2.0  # OpenAI's upper bound
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what a torch generator accepts
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_PROMPTS = 128  # prompts in one /v1/completions request
MAX_CHOICES = 128  # prompts times n: the engine requests one request may start
MAX_PROMPT_CACHE_KEY_CHARS = 1024  # a session hint is an id, not a payload

# A reader's rate in tokens/s: the body's `stream_rate` and the X-Stream-Rate header alike.
RateTps = Annotated[
    float, Field(ge=MIN_READER_RATE_TPS, le=MAX_READER_RATE_TPS, allow_inf_nan=False)
]
TokenId = Annotated[int, Field(ge=0)]  # below the vocabulary size: checked in validation.py
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]  # OpenAI's range
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


def _is_none(value: object) -> bool:
    return value is None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Body(BaseModel):
    """A request's top level: unknown fields are kept in `model_extra` (and logged), not refused."""

    model_config = ConfigDict(extra="allow", strict=True)


class _Response(BaseModel):
    """Responses are built by us; serialized with `model_dump_json()`."""


# -- requests -----------------------------------------------------------------------------------
class StreamOptions(_Strict):
    include_usage: bool = False
    # vLLM extra: a `usage` object on every chunk, so a client can count tokens per chunk.
    continuous_usage_stats: bool = False


# -- structured outputs and tools (requests) ----------------------------------------------------
class ResponseFormatText(_Strict):
    type: Literal["text"]


class ResponseFormatJsonObject(_Strict):
    type: Literal["json_object"]


class JsonSchemaSpec(_Strict):
    name: str = Field(default="response", min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # None: any object
    strict: bool | None = None  # the output is always held to the schema


class ResponseFormatJsonSchema(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class StructuredOutputsSpec(_Strict):
    """vLLM's `structured_outputs`: one constraint (json, regex, choice, grammar or json_object);
    its whitespace and properties options are accepted and ignored (the JSON output is always
    compact, and a schema's additionalProperties are as it says)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None  # not supported: validation.py refuses it
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False


ResponseFormatSpec = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema,
    Field(discriminator="type"),
]
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # OpenAI's rule


class FunctionDefinition(_Strict):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; None: no arguments
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text


class ToolCall(_Strict):
    """A call the assistant made: in a request's history and in a response's message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _SamplingRequest(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)  # the context bound: validation.py
    temperature: float = Field(default=1.0, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    n: int = Field(default=1, ge=1, le=128)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    # Accepted and ignored: they change nothing this server answers (docs/usage.md lists them).
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    # OpenAI's cache hint: requests naming the same key are one session (a conversation's
    # turns); the engine keeps its cached prefix for the next turn (core Request.session_key).
    prompt_cache_key: str | None = Field(default=None, max_length=MAX_PROMPT_CACHE_KEY_CHARS)
    # Known extras (vLLM's sampling extras).
    stream_rate: RateTps | None = None
    stream_class: Literal["reader", "eager", "batch"] | None = None  # see serving/classes.py
    # A reader's tokens sent at its rate, not as made (serving/pacing.py); None: the server's.
    stream_pacing: bool | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)  # at most max_tokens: SamplingParams checks it
    top_k: int = Field(default=0, ge=-1)  # 0 or -1 = disabled
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0, allow_inf_nan=False)
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    # vLLM's output extras: how tokens become text, and whether a stop string is kept.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's scheduling priority (lower first): accepted, not used for ordering (docs/usage.md).
    priority: int = Field(default=0, ge=-(1 << 63), le=(1 << 63) - 1)
    # vLLM extras accepted at their neutral value only (validation.py): beam search.
    use_beam_search: bool = False
    length_penalty: float = Field(default=1.0, allow_inf_nan=False)  # beam search only
    # Structured outputs: OpenAI's `response_format`, vLLM's `structured_outputs`, or vLLM's
    # earlier `guided_*` fields; at most one constraint per request (structured.py).
    response_format: ResponseFormatSpec | None = None
    structured_outputs: StructuredOutputsSpec | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    # Accepted and ignored: there is one grammar backend (xgrammar), and JSON is always compact.
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None


class CompletionRequest(_SamplingRequest):
    # One text, several texts, one token-id list or several: one choice per prompt (times n).
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    # max_tokens 0 only with echo: score the prompt alone (validation.py checks the pairing).
    max_tokens: int | None = Field(default=None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)
    logprobs: NumLogprobs | None = None


class TextContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # the call a tool message answers

    def text(self) -> str:
        """The message's text, with text parts concatenated."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None  # only with logprobs: validation.py
    tools: Annotated[list[ToolDefinition], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; an answer holds at most one call
    # Accepted and ignored: no model served here reasons.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # vLLM's chat template extras: variables for the template (e.g. `enable_thinking`), the
    # assistant's turn opener, or the last message left open for the model to continue.
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # a client's own template: not supported (validation.py)


# -- responses ----------------------------------------------------------------------------------
class PromptTokensDetails(_Response):
    """OpenAI's `usage.prompt_tokens_details`."""

    cached_tokens: int  # prompt tokens whose KV was reused (the prefix cache), not computed


class UsageInfo(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Response):
    """The legacy shape: per token its text, logprob, alternatives and offset in the text."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None for a prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
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


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=_is_none)


class ChatChoice(_Response):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaFunctionCall(_Response):
    name: str | None = Field(default=None, exclude_if=_is_none)  # on a call's first delta
    arguments: str  # the next fragment of the arguments' JSON text


class DeltaToolCall(_Response):
    """A piece of a streamed tool call: `id`, `type` and the name first, then fragments."""

    index: int
    id: str | None = Field(default=None, exclude_if=_is_none)
    type: Literal["function"] | None = Field(default=None, exclude_if=_is_none)
    function: DeltaFunctionCall


class DeltaMessage(_Response):
    """Only the fields that changed: `role` on the first chunk, `content` when there is text,
    `tool_calls` when a call grows."""

    role: Literal["assistant"] | None = Field(default=None, exclude_if=_is_none)
    content: str | None = Field(default=None, exclude_if=_is_none)
    tool_calls: list[DeltaToolCall] | None = Field(default=None, exclude_if=_is_none)


class ChatChunkChoice(_Response):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
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
    kernels: str | None = Field(default=None, exclude_if=_is_none)  # the CPU kernel choice


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- vLLM's tokenizer routes --------------------------------------------------------------------
class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(_Response):
    prompt: str


class TokenizerInfo(_Response):
    """What lm-eval's remote tokenizer reads: the special tokens and the chat template."""

    tokenizer_class: str = "TokenFlowTokenizer"
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None = None
    chat_template: str | None
    model_max_length: int
    vocab_size: int


# -- errors -------------------------------------------------------------------------------------
class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    """`{"error": {"message", "type", "param", "code"}}`, the body of every non-2xx answer."""

    error: ErrorInfo
