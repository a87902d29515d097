"""A request's life in the core: tokens, lifecycle state and the reader's virtual buffer.

Lifecycle::

    WAITING --start--> RUNNING <--preempt/resume--> PREEMPTED
       |                  |  ^                          |
       |                  v  | (load finished)          |
       |               LOADING <------------------------+
       +--------------> FINISHED / ABORTED <------------+

The virtual buffer models the client: the reader starts at the first token and consumes one
token every 1/r seconds, pausing (a stall) when the buffer is empty.  With g_j the time token j
was generated, its consumption time is c_1 = g_1 and c_j = max(g_j, c_(j-1) + 1/r).  Only the last
consumption time needs to be kept: every token still buffered at time t >= g_n satisfies
c_j = c_(j-1) + 1/r, so the buffer is ceil((c_n - t) * r) clipped to [0, n].
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Literal

from tokenflow.core.prefix_cache import extend_chain

# A reader's rate, tokens/s, from any source (a body, a header, a key's class, a default, the
# vLLM bridge): below the floor one token would take over 1,000 s, and 1 / rate stops being a
# time the clocks can add to (1e-309 made it infinite); above the cap it is no reader.
MIN_READER_RATE_TPS = 1e-3
MAX_READER_RATE_TPS = 1000.0
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI allows


def is_reader_rate(rate_tps: float) -> bool:
    """Whether `rate_tps` is a rate a reader may state (the one bound every source checks)."""
    return math.isfinite(rate_tps) and MIN_READER_RATE_TPS <= rate_tps <= MAX_READER_RATE_TPS


def reader_rate_error(rate_tps: object) -> str:
    """The message for a rate `is_reader_rate` refuses."""
    return (
        f"a reader's rate must be a number of tokens/s in "
        f"[{MIN_READER_RATE_TPS:g}, {MAX_READER_RATE_TPS:g}], got {rate_tps!r}"
    )


def lifetime_footprint_tokens(num_prompt_tokens: int, max_tokens: int) -> int:
    """A request's mean footprint over its life: it grows from its prompt to prompt +
    max_tokens, so it holds the prompt and half its output budget on average."""
    return num_prompt_tokens + max_tokens // 2


def end_footprint_tokens(num_prompt_tokens: int, max_tokens: int) -> int:
    """The most a request can hold: its prompt and its whole output budget."""
    return num_prompt_tokens + max_tokens


def reader_dry_s(last_consume_s: float, rate_tps: float) -> float:
    """When a reader who consumed a token at `last_consume_s` asks for the next one."""
    return last_consume_s + 1.0 / rate_tps


def reader_slack_s(is_started: bool, dry_s: float, now_s: float) -> float:
    """Seconds until a reader whose buffer runs dry at `dry_s` asks for a token that does not
    exist yet (<= 0: stalling).  A stream without its first token (`is_started` False) has no
    slack: it counts as an empty buffer."""
    if not is_started:
        return 0.0
    return dry_s - now_s


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued, never started
    RUNNING = "running"  # KV on the device tier; prefilling or decoding
    LOADING = "loading"  # KV being copied host -> device; runs once the load is done
    PREEMPTED = "preempted"  # off the device; KV kept in the host tier or dropped for recompute
    FINISHED = "finished"
    ABORTED = "aborted"


class FinishReason(enum.Enum):
    STOP = "stop"  # a stop token (or, at the engine layer, a stop string)
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled by the client or the server


class Consumption(enum.Enum):
    """How a request's tokens are consumed, which decides what a pause costs it."""

    READER = "reader"  # streamed to a reader at `rate_tps` (a person, a voice)
    EAGER = "eager"  # streamed and used the moment it arrives (an agent, a benchmark client)
    BATCH = "batch"  # not streamed: the whole answer is used at the end (`stream: false`)


class PreemptMode(enum.Enum):
    OFFLOAD = "offload"  # keep the KV in the host tier and load it back later
    RECOMPUTE = "recompute"  # drop the KV; prefill prompt + outputs again on resume


@dataclass(frozen=True)
class StructuredOutput:
    """What the output's text must be, token by token: the engine compiles it into a grammar.

    `json_schema` is the constraint's text, read as `kind` says: a JSON Schema as JSON text
    (`{"type": "object"}` for any JSON object; the output is its compact serialization, no free
    whitespace), a regular expression the whole output matches, or an EBNF grammar (xgrammar's
    dialect, start rule `root`).  The output ends with an end-of-sequence token where the
    constraint allows one.  `origin` names where the constraint came from in errors.
    """

    json_schema: str
    origin: str = "json_schema"
    kind: Literal["json_schema", "regex", "grammar"] = "json_schema"


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen and when a request stops (the vLLM names and meanings)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0  # subtracted from a logit once its token is in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence of its token in the output
    repetition_penalty: float = 1.0  # divides (or multiplies, < 0) the logits of seen tokens
    min_p: float = 0.0  # drop tokens below min_p times the most likely one's probability
    logprobs: int | None = None  # each output token's logprob and this many alternatives
    prompt_logprobs: int | None = None  # each prompt token's, likewise (the first has none)
    structured_output: StructuredOutput | None = None  # None = free text
    # Detokenization (vLLM's meanings): special tokens left out of the text; when they are
    # kept, whether a space may separate two of them that follow each other.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # a stop string that ends the text is kept in it

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k!r}")
        if not (0 <= self.min_tokens <= self.max_tokens):
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        if self.min_tokens and self.structured_output is not None:
            # The grammar decides where the value ends; forbidding the end before min_tokens
            # could leave no token to sample.
            raise ValueError("min_tokens cannot be combined with a structured output")
        if self.structured_output is not None and self.ignore_eos:
            # The grammar ends the output with an end-of-sequence token once the value is whole.
            raise ValueError("ignore_eos cannot be combined with a structured output")
        self._check_penalties_and_logprobs()
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    def _check_penalties_and_logprobs(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value!r}")

    @property
    def has_penalties(self) -> bool:
        """Whether sampling depends on the tokens seen so far (presence, frequency, repetition)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


@dataclass(eq=False, slots=True)
class Request:
    """One stream: its tokens, where its KV lives, and its reader's buffer.

    `arrival_index` breaks ties between equal arrival times, so every order is deterministic.
    An eager or batch request reads each token at once: its rate is infinite (whatever was
    given), so its buffer is always empty and its reader always wants the next token.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    rate_tps: float  # the reader's tokens/s; fixed once queued (the scheduler sums it on events)
    arrival_s: float
    arrival_index: int = 0
    eos_token_ids: tuple[int, ...] = ()  # the model's end-of-sequence ids
    consumption: Consumption = Consumption.READER
    state: RequestState = RequestState.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    token_times_s: list[float] = field(default_factory=list)
    num_computed_tokens: int = 0  # leading tokens whose KV is valid (device or host copy)
    # Prompt tokens whose KV a device prefix-cache hit gave it at its start (OpenAI's
    # usage.prompt_tokens_details.cached_tokens); 0 without a hit or prefix caching.
    num_cached_tokens: int = 0
    # The client's session hint (OpenAI's prompt_cache_key): a request that names one expects a
    # next turn, so its cached blocks are kept by its reader's clock (prefix_cache.py).
    session_key: str | None = None
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    last_consume_s: float = 0.0  # reader's consumption time of the newest token
    # Kept up to date by append_token (hot paths read them every step, not recomputing):
    num_tokens: int = field(init=False)  # prompt + generated: what the model has seen or will see
    dry_s: float = field(init=False)  # when the reader wants a token not generated yet
    stop_token_set: frozenset[int] = field(init=False)  # tokens that end it (after min_tokens)
    end_tokens: int = field(init=False)  # prompt + max_tokens: the longest it can grow
    lifetime_tokens: int = field(init=False)  # prompt + max_tokens // 2: its mean length
    # The chain keys of the prompt's full blocks (prefix_cache.py), hashed at the first lookup.
    _prompt_hashes: list[int] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: the prompt is empty")
        if self.consumption is not Consumption.READER:
            self.rate_tps = math.inf
        elif not is_reader_rate(self.rate_tps):
            raise ValueError(f"request {self.request_id}: {reader_rate_error(self.rate_tps)}")
        self.num_tokens = len(self.prompt_token_ids) + len(self.output_token_ids)
        self.dry_s = reader_dry_s(self.last_consume_s, self.rate_tps)
        params = self.sampling_params
        self.end_tokens = end_footprint_tokens(len(self.prompt_token_ids), params.max_tokens)
        self.lifetime_tokens = lifetime_footprint_tokens(
            len(self.prompt_token_ids), params.max_tokens
        )
        eos = () if params.ignore_eos else self.eos_token_ids
        self.stop_token_set = frozenset(eos) | frozenset(params.stop_token_ids)

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.state in (RequestState.FINISHED, RequestState.ABORTED)

    @property
    def is_prefilling(self) -> bool:
        """True while some known tokens still need their KV computed before a token is sampled."""
        return self.num_computed_tokens < self.num_tokens - 1 or not self.output_token_ids

    @property
    def computes_whole_prompt(self) -> bool:
        """Whether it must compute every prompt token even where its prefix is cached: prompt
        logprobs need every position's logits, and a repetition penalty's executor learns the
        prompt's tokens from the chunks (tokenflow/model/penalties.py)."""
        params = self.sampling_params
        return params.prompt_logprobs is not None or params.repetition_penalty != 1.0

    def prompt_block_hashes(self, block_size: int) -> list[int]:
        """The chain keys of the prompt's full blocks of `block_size` tokens (one engine, one
        block size: hashed once); read them, never modify them."""
        if self._prompt_hashes is None:
            self._prompt_hashes = []
            extend_chain(self._prompt_hashes, self.prompt_token_ids, block_size)
        return self._prompt_hashes

    @property
    def is_reader(self) -> bool:
        """Read at a pace (`rate_tps`), rather than taken whole as it comes (eager, batch)."""
        return self.consumption is Consumption.READER

    @property
    def num_remaining_output_tokens(self) -> int:
        """Tokens it may still generate (its max_tokens less those generated)."""
        return self.sampling_params.max_tokens - len(self.output_token_ids)

    def is_at_output_limit(self, max_model_len: int) -> bool:
        """It has all the tokens it may have: its max_tokens, or the context is full."""
        return self.num_tokens >= self.end_tokens or self.num_tokens >= max_model_len

    @property
    def is_decoding(self) -> bool:
        """Running past its prefill: a pause frees its blocks with no work under way lost."""
        return self.state is RequestState.RUNNING and not self.is_prefilling

    def token_ids_from(self, position: int, count: int) -> tuple[int, ...]:
        """Tokens [position, position + count) of prompt + outputs."""
        num_prompt = len(self.prompt_token_ids)
        end = position + count
        if end <= num_prompt:
            return self.prompt_token_ids[position:end]
        head = self.prompt_token_ids[position:num_prompt] if position < num_prompt else ()
        tail_start = max(position - num_prompt, 0)
        return tuple(head) + tuple(self.output_token_ids[tail_start : end - num_prompt])

    # -- the reader's buffer --------------------------------------------------------------------
    def append_token(self, token_id: int, now_s: float) -> None:
        """Record a generated token and advance the reader's consumption model."""
        if self.output_token_ids and self.dry_s > now_s:
            self.last_consume_s = self.dry_s  # the previous token's time + 1/r
        else:
            self.last_consume_s = now_s
        self.output_token_ids.append(token_id)
        self.token_times_s.append(now_s)
        self.num_tokens += 1
        self.dry_s = reader_dry_s(self.last_consume_s, self.rate_tps)

    def buffer_tokens(self, now_s: float) -> int:
        """Tokens generated but not yet consumed by the reader at `now_s` (0 before the first)."""
        ahead_s = self.last_consume_s - now_s
        if not self.output_token_ids or ahead_s <= 0:
            return 0
        return min(self.num_output_tokens, math.ceil(ahead_s * self.rate_tps - 1e-9))

    def buffered_s(self, now_s: float) -> float:
        """Seconds of reading the buffer holds at `now_s` (0 when empty or before the first)."""
        if not self.output_token_ids:
            return 0.0
        ahead_s = self.last_consume_s - now_s
        return ahead_s if ahead_s > 0.0 else 0.0

    def slack_s(self, now_s: float) -> float:
        """Seconds until the reader asks for a token that does not exist yet (`reader_slack_s`:
        <= 0 is stalling, and 0 before the first token)."""
        return reader_slack_s(bool(self.output_token_ids), self.dry_s, now_s)

    @property
    def sort_key(self) -> tuple[float, int]:
        """First come, first served: arrival time, then arrival order."""
        return (self.arrival_s, self.arrival_index)
