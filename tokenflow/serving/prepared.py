"""A validated request on its way through the serving layer, and what it has produced so far.

One HTTP request is one or more choices (its prompts times `n`), each one engine request with
its own stream.  Shared by `serving.py` (which builds them), `choices.py` (which runs them) and
`formatting.py` (which renders them), so none imports another for its types.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenflow.core.plan import TokenLogprobs
from tokenflow.core.request import Consumption, SamplingParams
from tokenflow.serving.protocol import PromptTokensDetails, UsageInfo
from tokenflow.serving.tenants import Work


@dataclass(frozen=True)
class PreparedChoice:
    """One choice of a request: one engine request."""

    index: int  # the choice's `index` in the answer
    engine_request_id: str
    prompt_token_ids: tuple[int, ...]
    prompt_text: str  # what `echo` repeats ("" without echo)
    sampling_params: SamplingParams
    is_first_of_prompt: bool  # counts its prompt's tokens in the usage (once per prompt)


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request, ready for `engine.generate()`: one entry of `choices` per engine
    request, all read at the same rate."""

    request_id: str
    model: str
    created_s: int  # wall-clock seconds, the OpenAI `created` field
    received_s: float  # monotonic clock, start of TTFT
    choices: tuple[PreparedChoice, ...]
    rate_tps: float  # each choice's reader's tokens/s; inf for eager and batch requests
    consumption: Consumption
    stream: bool
    include_usage: bool
    continuous_usage: bool
    echo: bool = False  # completions: the prompt (and its logprobs) before the output
    has_logprobs: bool = False  # the answer carries logprobs
    scores_prompt_only: bool = False  # max_tokens 0 with echo: the one token sampled is dropped
    session_key: str | None = None  # `prompt_cache_key`: every choice's session hint
    is_paced: bool = False  # each choice's tokens released at `rate_tps` (serving/pacing.py)
    api_key: str | None = field(default=None, repr=False)  # the bearer token (owners.py)

    @property
    def work(self) -> Work:
        """What it starts in the engine, as its key's limits count it (tenants.py)."""
        num_tokens = sum(
            len(c.prompt_token_ids) + c.sampling_params.max_tokens for c in self.choices
        )
        return Work(num_choices=len(self.choices), num_tokens=num_tokens)


@dataclass(frozen=True)
class ShownToken:
    """One token as an answer's logprobs show it."""

    token_id: int
    logprobs: TokenLogprobs | None  # None: a prompt's first token (nothing predicts it)


@dataclass(frozen=True)
class Piece:
    """What one chunk (or the whole answer) says of one choice."""

    text: str
    finish_reason: str | None
    tokens: list[ShownToken] | None  # with logprobs only
    text_offset: int = 0  # characters of this choice's text before `text`


@dataclass
class Progress:
    """What has been produced so far for one choice."""

    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # of its prompt, from the engine's prefix cache
    num_deltas: int = 0
    text_parts: list[str] = field(default_factory=list)
    tokens: list[ShownToken] = field(default_factory=list)  # with logprobs only
    prompt_tokens: list[ShownToken] = field(default_factory=list)  # with echo and logprobs
    finish_reason: str | None = None
    last_delta_s: float | None = None
    has_failed: bool = False  # the engine raised mid-stream
    has_moved: bool = False  # exported mid-stream: another replica goes on (serving/moves.py)
    num_sent_chars: int = 0  # of the text streamed so far (the next chunk's text offset)


def usage_of(prepared: PreparedRequest, progresses: list[Progress]) -> UsageInfo:
    """Token counts so far, summed over the choices (each prompt counted once)."""
    pairs = zip(prepared.choices, progresses, strict=True)
    firsts = [(c, p) for c, p in pairs if c.is_first_of_prompt]
    num_prompt = sum(len(c.prompt_token_ids) for c, _ in firsts)
    num_output = 0 if prepared.scores_prompt_only else sum(p.num_output_tokens for p in progresses)
    return UsageInfo(
        prompt_tokens=num_prompt,
        completion_tokens=num_output,
        total_tokens=num_prompt + num_output,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=sum(p.num_cached_tokens for _, p in firsts)
        ),
    )
