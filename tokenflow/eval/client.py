"""Replay a workload against an OpenAI-compatible server and record when each token arrived.

Every request is sent at its workload arrival time (relative to the start of the run) as a
streaming request with `max_tokens = min_tokens = num_output_tokens`, `ignore_eos`, the
reader's `stream_rate` and `stream_options.include_usage`.  The client-side arrival time of
every token becomes a `RequestTrace`, scored later by `tokenflow.eval.metrics`.

Prompts: `num_prompt_tokens` common English words, each one token (with its leading space) in
the usual BPE vocabularies, so the prompt is *about* that many tokens: exact sizing is
best-effort (tokenizers differ, the chat template adds its own tokens).  Each request starts
the word cycle at a different place so requests do not share a long common prefix.

Conversations (tokenflow/eval/conversation.py) run closed loop: a turn with `after_id` is sent
`think_s` after its reader has read the previous turn's whole answer (the metrics' reader model,
`consumption_times_s`, over the tokens as they arrived; an eager or batch request reads at
once), as a chat request whose messages are the app's system prompt, the earlier user messages
with the assistant answers as received, and the new user message, with `prompt_cache_key` set
to the session id.  A segment's text is its token ids (`segment_token_ids`) as words of the
same vocabulary, one word per token: deterministic, and about that many tokens.  A turn whose
previous turn failed is not sent, nor are its session's later turns (`BenchRun.num_unsent`).

The stream is read with httpx-sse; each event is stamped when it is parsed.  Counting tokens:
a chunk may carry several tokens.  We ask for
`stream_options.continuous_usage_stats` (vLLM/SGLang/TokenFlow), so most chunks carry the
cumulative `usage.completion_tokens`; a chunk then adds the increase in that count, all at the
chunk's arrival time (they arrived together).  A chunk without usage counts one token when it
has non-empty text.  The final usage chunk settles any remainder at its arrival time.

Failures (an HTTP error such as 429 — no retries —, a connection error, an error frame, a
stream cut before `[DONE]`, the overall timeout) give a trace with finish_reason "error" that
keeps the tokens received so far, and a one-line message in `BenchRun.errors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import httpx
from httpx_sse import EventSource
from tqdm import tqdm

from tokenflow.eval.conversation import (
    FIRST_TEXT_TOKEN_ID,
    Segment,
    segment_token_ids,
    turn_name,
)
from tokenflow.eval.metrics import RequestTrace, consumption_times_s
from tokenflow.eval.server_counters import counted_during, read_counters
from tokenflow.eval.workload import WorkloadRequest

ENDPOINTS = {"chat": "/chat/completions", "completions": "/completions"}
# Common words that are single tokens (with a leading space) in GPT-2/Llama/Qwen vocabularies.
_PROMPT_TEXT = (
    "the of and to in is that it for was on are as with his they at be this have from or one "
    "had by word but not what all were we when your can said there use an each which she do how "
    "their if will up other about out many then them these so some her would make like him into "
    "time has look two more write go see number no way could people my than first water been "
    "call who oil its now find long down day did get come made may part"
)
PROMPT_WORDS = tuple(_PROMPT_TEXT.split())
MAX_ERROR_LINES = 20


@dataclass(frozen=True)
class ClientConfig:
    """How to reach the server and how hard to push it."""

    url: str  # base URL (".../v1" optional) or a full ".../completions" URL
    endpoint: str = "chat"  # "chat" | "completions"
    model: str | None = None  # None: the first of GET /v1/models, else omitted
    max_concurrency: int | None = None  # None: unbounded
    timeout_s: float = 3600.0  # the whole run, arrivals included
    api_key: str | None = None
    continuous_usage: bool = True  # ask for usage on every chunk (exact per-chunk counts)
    show_progress: bool = True  # tqdm bar on stderr

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {self.endpoint!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(
                f"timeout must be a finite number of seconds > 0, got {self.timeout_s}"
            )


@dataclass(frozen=True)
class BenchRun:
    """One run against one server: a trace per request (failed ones included)."""

    name: str
    traces: tuple[RequestTrace, ...]
    num_failed: int
    errors: tuple[str, ...]  # "request-id: message", at most MAX_ERROR_LINES
    duration_s: float
    num_unsent: int = 0  # conversation turns not sent: an earlier turn of theirs failed
    # What the server's /metrics counted during the run (`server_counters.COUNTERS`); empty
    # when it exports none of them.
    server_counts: Mapping[str, int] = field(default_factory=dict)
    model: str | None = None  # the model asked for (None: omitted, the server's default)

    @property
    def num_preemptions(self) -> int:
        """Streams the server took off the device during the run: its own count where its
        /metrics has one (a client sees a pause only as a gap between tokens), else the
        traces' count."""
        return self.server_counts.get("preemptions", sum(t.num_preemptions for t in self.traces))


def _v1_base(url: str) -> str:
    """`url` without an endpoint path, ending in /v1."""
    base = url.rstrip("/")
    for path in ENDPOINTS.values():
        if base.endswith(path):
            base = base.removesuffix(path)
            break
    return base if base.endswith("/v1") else base + "/v1"


def endpoint_url(url: str, endpoint: str) -> str:
    """The request URL: `url` itself if it names an endpoint, else `url` + [/v1] + endpoint."""
    if url.rstrip("/").endswith(ENDPOINTS["completions"]):
        return url.rstrip("/")
    return _v1_base(url) + ENDPOINTS[endpoint]


def synthetic_prompt(num_tokens: int, index: int) -> str:
    """About `num_tokens` tokens of common words, starting the cycle at `index`."""
    words = PROMPT_WORDS
    return " ".join(words[(index * 7 + i) % len(words)] for i in range(num_tokens))


def segment_text(segment: Segment) -> str:
    """A conversation segment's text: its token ids as words, one word per token."""
    words = PROMPT_WORDS
    ids = segment_token_ids(segment)
    return " ".join(words[(token_id - FIRST_TEXT_TOKEN_ID) % len(words)] for token_id in ids)


def chat_messages(request: WorkloadRequest, answers: Mapping[str, str]) -> list[dict[str, str]]:
    """A conversation turn's chat messages: its segments' texts, each assistant segment the
    answer its turn received (`answers`, by turn name) if known, else its own text."""
    messages = []
    for segment in request.segments:
        received = answers.get(segment.name) if segment.role == "assistant" else None
        text = segment_text(segment) if received is None else received
        messages.append({"role": segment.role, "content": text})
    return messages


def request_body(
    request: WorkloadRequest,
    index: int,
    config: ClientConfig,
    model: str | None,
    answers: Mapping[str, str] | None = None,
) -> dict:
    """The JSON body of one streaming request (see the module docstring); `answers` are the
    texts a conversation turn's history repeats."""
    body: dict = {
        "max_tokens": request.num_output_tokens,
        "min_tokens": request.num_output_tokens,
        "ignore_eos": True,
        "stream": request.consumption != "batch",
    }
    if request.consumption == "reader":
        body["stream_rate"] = request.rate_tps
    elif request.consumption == "eager":
        body["stream_class"] = "eager"
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
        if config.continuous_usage:
            body["stream_options"]["continuous_usage_stats"] = True
    if model is not None:
        body["model"] = model
    if request.session_id is not None:
        body["messages"] = chat_messages(request, answers or {})
        body["prompt_cache_key"] = request.session_id
        return body
    prompt = synthetic_prompt(request.num_prompt_tokens, index)
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


@dataclass
class _StreamState:
    """What one request received so far (times relative to the start of the run)."""

    request: WorkloadRequest
    arrival_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    num_prompt_tokens: int | None = None
    finish_reason: str | None = None
    is_done: bool = False  # saw `data: [DONE]`
    error: str | None = None
    text_parts: list[str] = field(default_factory=list)  # the answer's text as it came
    unsent: str | None = None  # why a conversation turn was not sent (None: it was)
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # set once it was or was not

    def on_data(self, data: str, now_s: float) -> None:
        """Account one SSE `data` payload that arrived at `now_s`."""
        if data == "[DONE]":
            self.is_done = True
            return
        payload = json.loads(data)
        if "error" in payload:
            self.error = str(payload["error"].get("message", payload["error"]))
            return
        choices = payload.get("choices") or []
        choice = choices[0] if choices else {}
        text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        self.text_parts.append(text)
        usage = payload.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            num_new = usage["completion_tokens"] - len(self.token_times_s)
            self.num_prompt_tokens = usage.get("prompt_tokens", self.num_prompt_tokens)
        else:
            num_new = 1 if text else 0
        self.token_times_s.extend([now_s] * max(num_new, 0))
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]

    def trace(self) -> RequestTrace:
        """The request as scored: finish_reason "error" unless it ended cleanly with [DONE]."""
        failed = self.error is not None or not self.is_done or self.finish_reason is None
        arrival_s = self.arrival_s if self.arrival_s is not None else self.request.arrival_s
        return RequestTrace(
            request_id=self.request.request_id,
            arrival_s=arrival_s,
            rate_tps=self.request.rate_tps,
            num_prompt_tokens=self.num_prompt_tokens or self.request.num_prompt_tokens,
            token_times_s=tuple(self.token_times_s),
            finish_reason="error" if failed else self.finish_reason,
            consumption=self.request.consumption,
        )

    def on_response(self, payload: dict, now_s: float) -> None:
        """Account a whole (non-streamed) answer that arrived at `now_s`: every token then."""
        usage = payload.get("usage") or {}
        self.num_prompt_tokens = usage.get("prompt_tokens", self.num_prompt_tokens)
        self.token_times_s.extend([now_s] * int(usage.get("completion_tokens", 0)))
        choices = payload.get("choices") or [{}]
        self.finish_reason = choices[0].get("finish_reason")
        message = choices[0].get("message") or {}
        self.text_parts.append(choices[0].get("text") or message.get("content") or "")
        self.is_done = True

    def read_end_s(self) -> float | None:
        """When the reader had read the whole answer (None unless it ended with tokens): the
        consumption time of its last token (an eager or batch request's: its arrival)."""
        trace = self.trace()
        if not trace.is_completed:
            return None
        if not trace.is_reader:
            return trace.token_times_s[-1]
        return consumption_times_s(trace.token_times_s, trace.rate_tps)[-1]


class _Replayer:
    """Sends each request at its arrival time (a conversation's later turn: after its reader
    has read the previous answer and thought) and fills its `_StreamState`."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        config: ClientConfig,
        model: str | None,
        clock: Callable[[], float],
        states: Sequence[_StreamState] = (),
        on_tokens: Callable[[int], object] = lambda _: None,
    ) -> None:
        self._states = {state.request.request_id: state for state in states}
        self._on_tokens = on_tokens  # told how many tokens each answer or event brought
        self._http = http
        self._config = config
        self._model = model
        self._clock = clock
        self._url = endpoint_url(config.url, config.endpoint)
        limit = config.max_concurrency
        self._slots = asyncio.Semaphore(limit) if limit else None
        self.start_s = clock()

    def now_s(self) -> float:
        """Seconds since the start of the run."""
        return self._clock() - self.start_s

    async def replay(self, state: _StreamState, index: int) -> None:
        """Wait for the request's send time and a concurrency slot, then stream it."""
        try:
            send_s = await self._send_time_s(state)
            if send_s is None:
                return
            await asyncio.sleep(max(0.0, send_s - self.now_s()))
            slot = self._slots if self._slots is not None else contextlib.nullcontext()
            async with slot:
                state.arrival_s = self.now_s()
                try:
                    await self._stream(state, index)
                except Exception as exc:  # any failure of one request is recorded, never raised
                    state.error = f"{type(exc).__name__}: {exc}".strip()
            if state.error is None and not state.is_done:
                state.error = "the stream ended before data: [DONE]"
        finally:
            state.ended.set()

    async def _send_time_s(self, state: _StreamState) -> float | None:
        """When to send it: its arrival time, or a turn's previous turn's read end + think
        time (None: that turn failed or was not sent, so this one is not sent either)."""
        request = state.request
        if request.after_id is None:
            return request.arrival_s
        previous = self._states[request.after_id]
        await previous.ended.wait()
        read_end_s = previous.read_end_s()
        if read_end_s is None:
            state.unsent = f"not sent: {request.after_id}, its session's previous turn, failed"
            if previous.unsent is not None:
                state.unsent = previous.unsent
            return None
        return read_end_s + request.think_s

    def _answers(self, request: WorkloadRequest) -> dict[str, str]:
        """The texts a turn's history repeats: each earlier turn's answer as received."""
        answers: dict[str, str] = {}
        after_id = request.after_id
        while after_id is not None:
            previous = self._states[after_id]
            turn = previous.request
            answers[turn_name(str(turn.session_id), turn.turn)] = "".join(previous.text_parts)
            after_id = turn.after_id
        return answers

    async def _stream(self, state: _StreamState, index: int) -> None:
        answers = self._answers(state.request)
        body = request_body(state.request, index, self._config, self._model, answers)
        if not body["stream"]:
            response = await self._http.post(self._url, json=body)
            if response.status_code != 200:
                state.error = f"HTTP {response.status_code}: {_error_message(response)}"
                return
            state.on_response(response.json(), self.now_s())
            self._on_tokens(len(state.token_times_s))
            return
        async with self._http.stream("POST", self._url, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                state.error = f"HTTP {response.status_code}: {_error_message(response)}"
                return
            # httpx-sse: SSE framing (LF, CRLF or CR lines, comments such as keep-alives skipped);
            # an answer that is not text/event-stream raises SSEError (a failed request).
            async for event in EventSource(response).aiter_sse():
                num_before = len(state.token_times_s)
                state.on_data(event.data, self.now_s())
                self._on_tokens(len(state.token_times_s) - num_before)


def _error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200].replace("\n", " ")


async def resolve_model(http: httpx.AsyncClient, config: ClientConfig) -> str | None:
    """The configured model, else the first model the server lists, else None (omitted)."""
    if config.model is not None:
        return config.model
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        response = await http.get(_v1_base(config.url) + "/models")
        if response.status_code == 200:
            return str(response.json()["data"][0]["id"])
    return None


async def run_workload(
    requests: Sequence[WorkloadRequest],
    config: ClientConfig,
    *,
    name: str = "run",
    clock: Callable[[], float] = time.perf_counter,
) -> BenchRun:
    """Replay `requests` against `config.url`; never raises for a failed request."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(None, connect=min(30.0, config.timeout_s))
    check_conversations(requests, config)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as http:
        model = await resolve_model(http, config)
        root = _v1_base(config.url).removesuffix("/v1")
        counters_before = await read_counters(http, root)
        states = [_StreamState(request) for request in requests]
        with _progress_bar(requests, config, name) as bar:
            replayer = _Replayer(http, config, model, clock, states, on_tokens=bar.update)
            await _replay_all(replayer, states, config)
        duration_s = replayer.now_s()
        counts = counted_during(counters_before, await read_counters(http, root))
    sent = [state for state in states if state.unsent is None]
    traces = tuple(state.trace() for state in sent)
    failed = [s for s, t in zip(sent, traces, strict=True) if t.finish_reason == "error"]
    unsent = [state for state in states if state.unsent is not None]
    lines = [f"{s.request.request_id}: {s.error}" for s in failed]
    lines += [f"{s.request.request_id}: {s.unsent}" for s in unsent]
    errors = tuple(lines[:MAX_ERROR_LINES])
    return BenchRun(
        name,
        traces,
        len(failed),
        errors,
        duration_s,
        num_unsent=len(unsent),
        server_counts=counts,
        model=model,
    )


def check_conversations(requests: Sequence[WorkloadRequest], config: ClientConfig) -> None:
    """ValueError unless every turn's previous turn is in the workload and the endpoint is
    chat (a conversation is chat messages)."""
    ids = {request.request_id for request in requests}
    for request in requests:
        if request.session_id is not None and config.endpoint != "chat":
            raise ValueError("a conversation workload needs the chat endpoint (--endpoint chat)")
        if request.after_id is not None and request.after_id not in ids:
            raise ValueError(
                f"request {request.request_id}: after_id {request.after_id!r} is not in the "
                "workload"
            )


def _progress_bar(requests: Sequence[WorkloadRequest], config: ClientConfig, name: str) -> tqdm:
    """A bar on stderr over the tokens the workload asks for, moved as they arrive: a burst
    of readers finishes together after minutes, so a bar over finished requests would sit at
    0% until then.  (A request that stops early leaves the bar short of its total.)"""
    total = sum(request.num_output_tokens for request in requests)
    return tqdm(
        total=total, desc=name, unit="tok", file=sys.stderr, disable=not config.show_progress
    )


async def _replay_all(
    replayer: _Replayer, states: list[_StreamState], config: ClientConfig
) -> None:
    """Run every request under the overall timeout."""
    tasks = [asyncio.create_task(replayer.replay(s, i)) for i, s in enumerate(states)]
    try:
        _, pending = await asyncio.wait(tasks, timeout=config.timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        for state in states:
            if state.error is None and state.unsent is None and not state.is_done:
                state.error = f"timed out after {config.timeout_s:g} s"
    finally:
        for task in tasks:
            task.cancel()
