"""The one interface the HTTP server depends on, defined on the engine side of the seam.

The server never touches the scheduler, the model or the KV cache: it tokenizes with
`EngineClient.tokenizer`, submits with `generate()`, streams `GenerationDelta`s, and calls
`abort()` when its client goes away; `streams()` is what /v1/tokenflow/streams shows.  The
real implementation wraps the core's step loop in a background thread; tests use a fake with
the same shape.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from tokenflow.core.migration import StreamExport
from tokenflow.core.plan import TokenLogprobs
from tokenflow.core.request import Consumption, SamplingParams
from tokenflow.engine.snapshot import StreamsSnapshot


class EngineOverloaded(Exception):
    """Raised by `generate()` when the waiting queue is at its cap (HTTP 429)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineRequestError(ValueError):
    """Raised by `generate()` for a request the engine cannot serve (HTTP 400)."""


class EngineDead(RuntimeError):
    """Raised by `generate()` (HTTP 503), and delivered to every live request, once the engine
    loop has died or shut down: nothing waits on a loop that will never answer."""


class RequestFailed(RuntimeError):
    """Delivered to one request whose own processing failed (the engine goes on)."""


class StreamMoved(Exception):
    """Delivered to a request that was exported (`AsyncEngine.export_streams`): its deltas end
    here, without a finish reason, after every delta produced before the export; `state` is
    where another engine goes on from (`resume()`)."""

    def __init__(self, state: StreamExport) -> None:
        super().__init__(f"{state.request_id} moved to another engine")
        self.state = state


@dataclass(frozen=True)
class GenerationDelta:
    """New output of one request since its previous delta.

    `text` is already detokenized and cut at a stop string; `finish_reason` is "stop", "length",
    "abort" or "error" on the last delta and None before it.  An "error" delta carries `error`,
    a one-line reason that concerns this request alone (the engine goes on with the others).
    """

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None
    error: str | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()  # of token_ids, when the request asks
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None  # on the first, if asked
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    def followed_by(self, later: GenerationDelta) -> GenerationDelta:
        """This delta and the `later` one of the same request as one (token ids, text and
        logprobs concatenated; the finish and counts are the later one's): what a reader that
        takes both at once is sent."""
        return replace(
            later,
            token_ids=self.token_ids + later.token_ids,
            text=self.text + later.text,
            logprobs=self.logprobs + later.logprobs,
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
        )


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for /metrics; counters are totals since start."""

    num_waiting: int
    num_running: int
    num_preempted: int
    device_kv_usage: float  # fraction of device blocks in use, 0..1
    host_kv_usage: float  # fraction of host blocks in use, 0..1
    num_preemptions_total: int
    num_loads_total: int
    num_recomputes_total: int
    buffer_slack_s: tuple[float, ...]  # per running stream: seconds of reading left in its buffer
    prefix_cache_queries_total: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits_total: int = 0  # of them, found cached on the device (their KV reused)
    prefix_cache_host_hits_total: int = 0  # of them, found cached in the host tier after that
    num_cached_device_blocks: int = 0  # device blocks the prefix cache keys (held or free)
    num_cached_host_blocks: int = 0  # host blocks the prefix cache keys (held or free)


@dataclass(frozen=True)
class EngineHealth:
    """Is the engine loop alive, and how long ago did it last go round."""

    is_alive: bool
    seconds_since_tick: float
    error: str | None  # why it died (None while alive)


class Tokenizer(Protocol):
    eos_token_id: int | None
    renders_tools: bool  # the chat template has a tools section
    eos_token: str | None
    bos_token: str | None
    chat_template: str | None
    max_token_chars: int  # characters of the longest token

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Render OpenAI-style messages with the model's chat template and tokenize them;
        `continue_final_message` leaves the last message open, `chat_template_kwargs` are
        further variables for the template."""
        ...


class EngineClient(Protocol):
    model_name: str
    max_model_len: int  # prompt + output tokens
    vocab_size: int  # token ids are in [0, vocab_size)
    default_rate_tps: float
    max_num_requests: int | None  # unfinished requests it holds; more are refused (None: any)
    tokenizer: Tokenizer
    kernels: str | None  # the CPU kernel plan in one line (model/kernels/); None: not ours

    def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        rate_tps: float,
        consumption: Consumption = Consumption.READER,
        *,
        session_key: str | None = None,
    ) -> AsyncIterator[GenerationDelta]:
        """Submit a request and stream its deltas; `rate_tps` is its reader's tokens/s, or
        math.inf for a client that uses each token at once (`consumption` eager or batch);
        `session_key` is the client's session hint (OpenAI's `prompt_cache_key`, None: none).

        Raises EngineOverloaded, EngineRequestError or EngineDead before the first delta if it
        cannot be accepted; RequestFailed or EngineDead later if it fails mid-way.
        """
        ...

    def resume(self, state: StreamExport) -> AsyncIterator[GenerationDelta]:
        """Go on with a stream another engine exported (`StreamMoved.state`, times relative to
        its export) and stream its deltas: only the tokens and text after those produced there.
        Raises as `generate()`."""
        ...

    async def compile_grammar(self, sampling_params: SamplingParams) -> None:
        """Compile the structured output's grammar (a no-op without one) where no other
        request waits for it, so that `generate()` finds it ready.  Raises EngineRequestError
        for a schema over a bound, one that cannot be compiled or not within the deadline, and
        EngineOverloaded when every compiler stayed busy."""
        ...

    async def abort(self, request_id: str) -> None:
        """Cancel a request and free its KV in both tiers; a no-op if it already ended."""
        ...

    def stats(self) -> EngineStats:
        """A snapshot of queues and tiers for /metrics and admission."""
        ...

    def health(self) -> EngineHealth:
        """Liveness of the engine loop, for /health."""
        ...

    async def streams(self, limit: int) -> StreamsSnapshot:
        """The unfinished streams (the `limit` most urgent) and the scheduler's state, for
        /v1/tokenflow/streams; raises EngineDead once the loop is gone."""
        ...
