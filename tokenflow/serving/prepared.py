"""A validated request on its way through the serving layer, and what it has produced so far.

Shared by `serving.py` (which builds them) and `formatting.py` (which renders them), so neither
imports the other for its types.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenflow.core.request import Consumption, SamplingParams
from tokenflow.serving.protocol import UsageInfo


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request, ready for `engine.generate()`."""

    request_id: str
    model: str
    created_s: int  # wall-clock seconds, the OpenAI `created` field
    received_s: float  # monotonic clock, start of TTFT
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    rate_tps: float  # the reader's tokens/s; inf for eager and batch requests
    consumption: Consumption
    stream: bool
    include_usage: bool
    continuous_usage: bool


@dataclass
class Progress:
    """What has been produced so far for one request."""

    num_output_tokens: int = 0
    text_parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    last_delta_s: float | None = None
    has_failed: bool = False  # the engine raised mid-stream


def usage_of(prepared: PreparedRequest, progress: Progress) -> UsageInfo:
    """Token counts so far."""
    num_prompt = len(prepared.prompt_token_ids)
    return UsageInfo(
        prompt_tokens=num_prompt,
        completion_tokens=progress.num_output_tokens,
        total_tokens=num_prompt + progress.num_output_tokens,
    )
