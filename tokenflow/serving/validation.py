"""Request validation: what we support, rates, lengths and SamplingParams; errors as ApiError."""

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
    """A reader rate must be a finite number > 0 tokens/s."""
    if not math.isfinite(value) or value <= 0:
        raise ApiError(
            400, f"{param} must be a finite number > 0 tokens/s, got {value!r}", param=param
        )
    return float(value)


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


def build_sampling_params(
    body: CompletionRequest | ChatCompletionRequest, max_tokens: int
) -> SamplingParams:
    """The engine's SamplingParams; its own checks (e.g. min_tokens <= max_tokens) give 400s."""
    if body.top_k < -1:
        raise ApiError(
            400, f"top_k must be >= -1 (-1 or 0 disable it), got {body.top_k}", param="top_k"
        )
    stop: Sequence[str] = (
        () if body.stop is None else (body.stop,) if isinstance(body.stop, str) else body.stop
    )
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=max(body.top_k, 0),
            seed=body.seed,
            stop=tuple(stop),
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
