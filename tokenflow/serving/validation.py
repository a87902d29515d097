"""Request validation: what we support, rates, lengths and SamplingParams; errors as ApiError.

Every field that reaches a tensor or a per-token loop is bounded here, so a hostile value is a
400 for its sender and never an engine failure for everyone else.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tokenflow.core.request import SamplingParams
from tokenflow.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
)

# A temperature below this divides logits into inf/nan; it means "greedy" (as in vLLM).
GREEDY_TEMPERATURE_FLOOR = 1e-5
MAX_TEMPERATURE = 2.0  # OpenAI's upper bound
MAX_RATE_TPS = 1000.0  # a reader rate beyond this is no reader
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what a torch generator accepts
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64


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


def check_rate(value: float, param: str) -> float:
    """A reader rate must be in (0, MAX_RATE_TPS] tokens/s."""
    if not (math.isfinite(value) and 0 < value <= MAX_RATE_TPS):
        raise ApiError(
            400, f"{param} must be in (0, {MAX_RATE_TPS:g}] tokens/s, got {value!r}", param=param
        )
    return float(value)


def check_prompt_token_ids(prompt: list[int], vocab_size: int) -> tuple[int, ...]:
    """Token-id prompts must stay inside the vocabulary."""
    if any(not 0 <= token_id < vocab_size for token_id in prompt):
        raise ApiError(400, f"prompt token ids must be in [0, {vocab_size})", param="prompt")
    return tuple(prompt)


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
    if max_tokens <= 0:
        raise ApiError(400, f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
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


def _check_temperature(value: float) -> float:
    if not (math.isfinite(value) and 0 <= value <= MAX_TEMPERATURE):
        raise ApiError(
            400,
            f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {value!r}",
            param="temperature",
        )
    return 0.0 if value < GREEDY_TEMPERATURE_FLOOR else float(value)


def _check_stops(
    body: CompletionRequest | ChatCompletionRequest, vocab_size: int
) -> tuple[str, ...]:
    stop: Sequence[str] = (
        () if body.stop is None else (body.stop,) if isinstance(body.stop, str) else body.stop
    )
    if len(stop) > MAX_STOP_STRINGS:
        raise ApiError(
            400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", param="stop"
        )
    if any(not 0 < len(s) <= MAX_STOP_STRING_CHARS for s in stop):
        raise ApiError(
            400, f"stop strings must have 1 to {MAX_STOP_STRING_CHARS} characters", param="stop"
        )
    stop_ids = body.stop_token_ids or ()
    if len(stop_ids) > MAX_STOP_TOKEN_IDS or any(not 0 <= t < vocab_size for t in stop_ids):
        raise ApiError(
            400,
            f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, each in [0, {vocab_size})",
            param="stop_token_ids",
        )
    return tuple(stop)


def build_sampling_params(
    body: CompletionRequest | ChatCompletionRequest, max_tokens: int, vocab_size: int
) -> SamplingParams:
    """The engine's SamplingParams; its own checks (e.g. min_tokens <= max_tokens) give 400s."""
    if body.top_k < -1:
        raise ApiError(
            400, f"top_k must be >= -1 (-1 or 0 disable it), got {body.top_k}", param="top_k"
        )
    if body.seed is not None and not SEED_MIN <= body.seed <= SEED_MAX:
        raise ApiError(400, f"seed must be in [{SEED_MIN}, {SEED_MAX}]", param="seed")
    temperature = _check_temperature(body.temperature)
    stop = _check_stops(body, vocab_size)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=body.top_p,
            top_k=max(body.top_k, 0),
            seed=body.seed,
            stop=stop,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
        )
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None


def _unsupported(param: str, value: object) -> ApiError:
    return ApiError(
        400, f"{param}={value!r} is not supported", param=param, code="unsupported_parameter"
    )


def _check_common_support(body: CompletionRequest | ChatCompletionRequest) -> None:
    if body.n != 1:
        raise _unsupported("n", body.n)
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) != 0:
            raise _unsupported(name, getattr(body, name))
    if body.logit_bias:
        raise _unsupported("logit_bias", body.logit_bias)


def check_completion_support(body: CompletionRequest) -> None:
    """Refuse (400) fields we accept only at their neutral value."""
    _check_common_support(body)
    if body.echo:
        raise _unsupported("echo", body.echo)
    if body.suffix is not None:
        raise _unsupported("suffix", body.suffix)
    if body.best_of not in (None, 1):
        raise _unsupported("best_of", body.best_of)
    if body.logprobs is not None:
        raise _unsupported("logprobs", body.logprobs)


def check_chat_support(body: ChatCompletionRequest) -> None:
    """Refuse (400) fields we accept only at their neutral value."""
    _check_common_support(body)
    if body.logprobs:
        raise _unsupported("logprobs", body.logprobs)
    if body.top_logprobs is not None:
        raise _unsupported("top_logprobs", body.top_logprobs)
    if body.tools:
        raise _unsupported("tools", "[...]")
    if body.tool_choice not in (None, "none"):
        raise _unsupported("tool_choice", body.tool_choice)
    if body.response_format is not None and body.response_format.get("type") != "text":
        raise _unsupported("response_format", body.response_format)
