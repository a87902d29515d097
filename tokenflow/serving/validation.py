"""Request validation that needs the model, support checks and SamplingParams; errors as ApiError.

The bounds that do not depend on the model are pydantic constraints in `protocol.py`; what is
checked here needs the served model: the context length (`resolve_max_tokens`) and the
vocabulary (prompt token ids, `stop_token_ids`).  Fields we accept only at their neutral value
are refused as "not supported" (400, naming the field): each of them would change the answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from starlette.types import Send

from tokenflow.core.request import SamplingParams, StructuredOutput
from tokenflow.serving.protocol import (
    MAX_CHOICES,
    SEED_MAX,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
)

# A temperature below this divides logits into inf/nan; it means "greedy" (as in vLLM).
GREEDY_TEMPERATURE_FLOOR = 1e-5


class ApiError(Exception):
    """An OpenAI-style error answer: status, `{"error": {...}}` body and extra headers."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers or {}

    def body(self) -> ErrorResponse:
        """The `{"error": {...}}` body."""
        return ErrorResponse(error=self.info)

    async def send_raw(self, send: Send, extra_headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
        """Answer with this error straight from an ASGI middleware (no app, no route): its
        status, its JSON body, its own headers and `extra_headers`."""
        content = self.body().model_dump_json().encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(content)).encode()),
            *((k.lower().encode(), v.encode()) for k, v in self.headers.items()),
            *extra_headers,
        ]
        await send({"type": "http.response.start", "status": self.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": content})


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> tuple[int, ...]:
    """Token ids (a prompt's, `stop_token_ids`) must be inside the vocabulary; that they are
    >= 0 is a constraint in protocol.py."""
    if any(token_id >= vocab_size for token_id in token_ids):
        raise ApiError(400, f"{param}: token ids must be in [0, {vocab_size})", param=param)
    return tuple(token_ids)


def check_prompt_chars(num_chars: int, max_model_len: int, longest_token: int) -> None:
    """Refuse, before tokenizing it, a text longer than any prompt the context can hold
    (`longest_token`: the tokenizer's `max_token_chars`): tokenizing megabytes only to say
    "too long" held the server for seconds."""
    limit = max_model_len * longest_token
    if num_chars > limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens; the prompt's "
            f"{num_chars} characters are more than that many tokens can hold ({limit}).",
            param="prompt",
            code="context_length_exceeded",
        )


# A prompt's head of this many characters per context token is tokenized first: text runs at
# about 4 characters a token, so a head this long that overflows the context shows the whole
# prompt cannot fit, without tokenizing the rest (up to 20x more at the character bound).
HEAD_CHARS_PER_TOKEN = 8


def context_head_chars(max_model_len: int) -> int:
    """How many characters of a long prompt are tokenized first (`check_head_tokens`)."""
    return max_model_len * HEAD_CHARS_PER_TOKEN


def check_head_tokens(num_head_tokens: int, max_model_len: int, longest_token: int) -> None:
    """Refuse a prompt whose head (`context_head_chars`) alone holds more tokens than the
    context: cutting a text splits at most one token into pieces of the longest token's
    characters, so past that margin the whole prompt is too long as well."""
    if num_head_tokens > max_model_len + longest_token:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens; the prompt's "
            f"first {context_head_chars(max_model_len)} characters alone hold "
            f"{num_head_tokens} tokens.",
            param="prompt",
            code="context_length_exceeded",
        )


def template_refusal(exc: Exception | None) -> str:
    """What a client is told when the chat template refuses its messages: the template's own
    message (`raise_exception` in the template, written for users), cut; otherwise no internals."""
    if exc is None:
        return "cannot apply the chat template to these messages"
    return f"cannot apply the chat template: {shortened(str(exc))}"


def shortened(text: str, limit: int = 200) -> str:
    """A client's or a library's text as an error shows it: at most `limit` characters."""
    return text if len(text) <= limit else text[:limit] + "..."


def resolve_max_tokens(num_prompt: int, max_tokens: int | None, max_model_len: int) -> int:
    """Default to the rest of the context; refuse what cannot fit."""
    if num_prompt == 0:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if num_prompt >= max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{num_prompt} tokens, leaving no room for output.",
            param="prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return max_model_len - num_prompt
    if num_prompt + max_tokens > max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} "
            "for the completion). Please reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


@dataclass(frozen=True)
class Scores:
    """What an answer shows besides text: logprobs of its outputs (this many alternatives), of
    its prompt, the prompt itself (`echo`), or the prompt alone (`max_tokens: 0` with echo)."""

    logprobs: int | None = None
    prompt_logprobs: int | None = None
    echo: bool = False
    scores_prompt_only: bool = False

    def engine_max_tokens(self, max_tokens: int | None) -> int | None:
        """What the engine is asked for: one token, dropped, when only the prompt is scored."""
        return 1 if self.scores_prompt_only else max_tokens


def completion_scores(body: CompletionRequest) -> Scores:
    """/v1/completions: `logprobs` alternatives for each token, the prompt's too with echo."""
    if body.max_tokens == 0 and not body.echo:
        raise ApiError(400, "max_tokens: 0 is only allowed with echo=true", param="max_tokens")
    return Scores(
        logprobs=body.logprobs,
        prompt_logprobs=body.logprobs if body.echo else None,
        echo=body.echo,
        scores_prompt_only=body.max_tokens == 0,
    )


def chat_scores(body: ChatCompletionRequest) -> Scores:
    """/v1/chat/completions: `top_logprobs` needs `logprobs`."""
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs is only allowed with logprobs=true", param="top_logprobs")
    return Scores(logprobs=(body.top_logprobs or 0) if body.logprobs else None)


def check_num_choices(num_prompts: int, n: int) -> None:
    """At most MAX_CHOICES engine requests for one request."""
    if num_prompts * n > MAX_CHOICES:
        raise ApiError(
            400,
            f"{num_prompts} prompts times n={n} is more than {MAX_CHOICES} choices",
            param="n",
        )


def _stop_strings(body: CompletionRequest | ChatCompletionRequest) -> tuple[str, ...]:
    if body.stop is None:
        return ()
    return (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)


def build_sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    vocab_size: int,
    scores: Scores,
    structured_output: StructuredOutput | None = None,
) -> SamplingParams:
    """The engine's SamplingParams; its own checks (e.g. min_tokens <= max_tokens) give 400s."""
    stop_token_ids = check_token_ids(body.stop_token_ids or (), vocab_size, "stop_token_ids")
    temperature = 0.0 if body.temperature < GREEDY_TEMPERATURE_FLOOR else body.temperature
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=body.top_p,
            top_k=max(body.top_k, 0),
            seed=body.seed,
            stop=_stop_strings(body),
            stop_token_ids=stop_token_ids,
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            structured_output=structured_output,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            min_p=body.min_p,
            logprobs=scores.logprobs,
            prompt_logprobs=scores.prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens,
            spaces_between_special_tokens=body.spaces_between_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
        )
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None


def with_seed_offset(params: SamplingParams, offset: int) -> SamplingParams:
    """Choice `offset`'s params: a seeded request's choices draw from seeds seed + offset (as
    vLLM's), so its n choices differ and each is reproducible."""
    if params.seed is None:
        return params
    seed = params.seed + offset
    return dataclasses.replace(params, seed=seed if seed <= SEED_MAX else params.seed - offset)


def _unsupported(param: str, value: object) -> ApiError:
    return ApiError(
        400,
        f"{param}={shortened(repr(value), 100)} is not supported",
        param=param,
        code="unsupported_parameter",
    )


# vLLM's fields that would change the answer and that this server does not implement, each
# with the values that change nothing: any other value is refused by name, not served as if
# absent (a field neither API defines is served and logged: `openai_serving._log_ignored`).
_UNHONOURED_VLLM_FIELDS: dict[str, tuple[object, ...]] = {
    "allowed_token_ids": (None, []),
    "bad_words": (None, []),
    "truncate_prompt_tokens": (None,),
    "echo": (None, False),
}


def _check_common_support(body: CompletionRequest | ChatCompletionRequest) -> None:
    extra = body.model_extra or {}
    for name, neutral in _UNHONOURED_VLLM_FIELDS.items():
        if name in extra and not any(extra[name] == value for value in neutral):
            raise _unsupported(name, extra[name])
    if body.logit_bias:
        raise _unsupported("logit_bias", body.logit_bias)
    if body.use_beam_search:
        raise _unsupported("use_beam_search", body.use_beam_search)
    spec = body.structured_outputs
    if spec is not None and spec.structural_tag is not None:
        raise _unsupported("structured_outputs", "structural_tag")


def check_completion_support(body: CompletionRequest) -> None:
    """Refuse (400) fields we accept only at their neutral value."""
    _check_common_support(body)
    if body.suffix is not None:
        raise _unsupported("suffix", body.suffix)
    if body.best_of not in (None, 1, body.n):
        raise _unsupported("best_of", body.best_of)


def check_chat_support(body: ChatCompletionRequest) -> None:
    """Refuse (400) fields we accept only at their neutral value, and vLLM's refused pairing of
    an opened assistant turn with a continued last message."""
    _check_common_support(body)
    if body.chat_template is not None:
        raise _unsupported("chat_template", body.chat_template)
    if body.add_generation_prompt and body.continue_final_message:
        raise ApiError(
            400,
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="continue_final_message",
        )
