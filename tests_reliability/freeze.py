"""Requests that could freeze the server or starve the others, and how one is sent: beside an
innocent greedy stream (started first, still streaming when the probe is answered) while
/health is polled every HEALTH_POLL_S.  Each must get its clear 4xx at once: a schema too
costly to compile, work over its key's limit, a prompt past the context, a route without a key.

The live suite asserts on them and reports their times (test_freeze.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import httpx

from tests_reliability.probe import CHAT, INNOCENT, MESSAGES, FrameTimes, Outcome, client, send
from tokenflow.model.schema_limits import (
    MAX_ENUM_VALUES,
    MAX_NESTED_REPEAT,
    MAX_PROPERTIES_PER_OBJECT,
    MAX_SCHEMA_CHARS,
)

KEY_LIMIT = 2  # the per-key probes' server runs --max-requests-per-key KEY_LIMIT
# The innocent stream beside each probe: long enough to outlast a probe that is refused at once.
FREEZE_INNOCENT = {**INNOCENT, "max_tokens": 48}
ONE_TOKEN = {"messages": MESSAGES, "max_tokens": 1}
HEALTH_POLL_S = 0.05
HEALTH_TIMEOUT_S = 10.0
START_TIMEOUT_S = 60.0  # for the innocent stream's first frame
INTERNAL_TEXT = ("Check failed", ".cc:", "Traceback", 'File "')
COMPLETIONS = "/v1/completions"
# Just under the embedded model's character bound (8192 tokens x its longest token's 81 characters):
# refused by the context check on its head, not by its length alone.
MAXIMAL_PROMPT_CHARS = 650_000
WORDS = (
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at",
    "from", "his", "her", "they", "this", "had", "not", "are", "but", "one", "were", "have",
    "which", "their", "said", "all", "when", "there", "been", "more", "into", "time", "some",
    "would", "about", "could", "only", "like", "then", "other", "year", "first",
)  # fmt: skip

# What the server under probe must have: nothing, API keys, or a per-key limit of KEY_LIMIT.
Needs = Literal["nothing", "keys", "key limit"]


@dataclass(frozen=True)
class FreezeProbe:
    """One hostile request and the answer it must get."""

    name: str
    path: str
    body: dict | None  # None: a GET
    status: int
    names: tuple[str, ...]  # the error message names one of these (the limit)
    code: str | None = None  # the error's code, where it must be a given one
    needs: Needs = "nothing"
    has_key: bool = True  # sent with the first key (False: with no key)
    then_other_key_served: bool = False  # the other key's one-token request then gets 200


@dataclass(frozen=True)
class HealthPoll:
    """One /health request: its status (None: no answer within HEALTH_TIMEOUT_S) and latency."""

    status: int | None
    latency_s: float


@dataclass(frozen=True)
class Answer:
    """The answer to a probe."""

    status: int | None  # None: no HTTP answer
    error: dict | None  # the body's "error" object, if it has one
    body_text: str


@dataclass
class ProbeRun:
    """What happened around one probe."""

    answer: Answer
    follow_up: Outcome | None  # the other key's one-token request, where the probe asks for it
    innocent: Outcome
    innocent_frames: FrameTimes
    health_polls: list[HealthPoll]
    is_healthy_after: bool
    started_s: float  # when the probe was sent (monotonic)
    answered_s: float  # when its answer (and the follow-up's) arrived
    notes: list[str] = field(default_factory=list)

    @property
    def probe_s(self) -> float:
        return self.answered_s - self.started_s

    @property
    def worst_health_s(self) -> float:
        return max(poll.latency_s for poll in self.health_polls)

    @property
    def innocent_worst_gap_s(self) -> float:
        """The longest wait between two of the innocent stream's frames while the probe was
        out (the interval around the probe's start and the one around its answer count)."""
        pairs = itertools.pairwise(self.innocent_frames.times_s)
        gaps = [b - a for a, b in pairs if b >= self.started_s and a <= self.answered_s]
        return max(gaps, default=0.0)

    @property
    def has_innocent_outlasted(self) -> bool:
        """Whether the innocent stream still sent a frame after the probe was answered."""
        times = self.innocent_frames.times_s
        return bool(times) and times[-1] > self.answered_s


def ordinary_text(num_chars: int) -> str:
    """Common English words, `num_chars` characters of them."""
    num_words = num_chars // 3
    return " ".join(WORDS[i * 7 % len(WORDS)] for i in range(num_words))[:num_chars]


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "probe", "schema": schema}}


def freeze_probes() -> list[FreezeProbe]:
    """Every probe, in the order they are sent."""
    return [*_schema_probes(), *_prompt_probes(), *_key_probes()]


def _schema_probes() -> list[FreezeProbe]:
    """Structured outputs too costly to compile, or not enforceable: 400 before compiling."""
    nested = {"type": "string", "pattern": "^([a-z0-9]{1,20}){1,20}$"}  # 63 bytes of JSON
    parameters = {"type": "object", "properties": {"q": nested}, "required": ["q"]}
    tool = {"type": "function", "function": {"name": "lookup", "parameters": parameters}}
    many_properties = {f"p{i}": {"type": "integer"} for i in range(2000)}
    negated = {"type": "object", "properties": {"a": {"type": "string", "not": {"const": "x"}}}}
    nested_bound = (f"at most {MAX_NESTED_REPEAT}",)

    def chat(name: str, extra: dict, names: tuple[str, ...]) -> FreezeProbe:
        body = {"messages": MESSAGES, "max_tokens": 8, **extra}
        return FreezeProbe(name, CHAT, body, status=400, names=names)

    return [
        chat("nested pattern", {"response_format": _json_schema(nested)}, nested_bound),
        chat(
            "nested pattern in a tool", {"tools": [tool], "tool_choice": "required"}, nested_bound
        ),
        chat(
            "2,000 optional properties",
            {"response_format": _json_schema({"type": "object", "properties": many_properties})},
            (f"at most {MAX_PROPERTIES_PER_OBJECT}",),
        ),
        chat(
            "20,000-value enum",
            {"response_format": _json_schema({"enum": [f"v{i}" for i in range(20_000)]})},
            (f"at most {MAX_ENUM_VALUES}", f"at most {MAX_SCHEMA_CHARS}"),
        ),
        chat("schema with not", {"response_format": _json_schema(negated)}, ("'not'",)),
        chat(
            "min_tokens with response_format",
            {"min_tokens": 4, "response_format": {"type": "json_object"}},
            ("min_tokens",),
        ),
    ]


def _prompt_probes() -> list[FreezeProbe]:
    """A maximal prompt, past the context, and routes without a key."""
    maximal = ordinary_text(MAXIMAL_PROMPT_CHARS)
    long_chat = {"messages": [{"role": "user", "content": maximal}], "max_tokens": 8}

    def too_long(name: str, path: str, body: dict) -> FreezeProbe:
        names = ("maximum context length",)
        return FreezeProbe(
            name, path, body, status=400, names=names, code="context_length_exceeded"
        )

    def without_key(name: str, path: str, body: dict | None) -> FreezeProbe:
        return FreezeProbe(
            name, path, body, status=401, names=("API key",), needs="keys", has_key=False
        )

    return [
        too_long("maximal prompt", COMPLETIONS, {"prompt": maximal, "max_tokens": 8}),
        too_long("maximal chat prompt", CHAT, long_chat),
        too_long("/tokenize maximal prompt", "/tokenize", {"prompt": maximal}),
        without_key("/tokenize without a key", "/tokenize", {"prompt": maximal}),
        without_key("/tokenizer_info without a key", "/tokenizer_info", None),
        without_key("/metrics without a key", "/metrics", None),
    ]


def _key_probes() -> list[FreezeProbe]:
    """Work over the first key's limit of KEY_LIMIT completions: 429 at once, and the other key
    is served."""
    over_key = (f"{KEY_LIMIT} completions in flight",)
    echo = {"prompt": ordinary_text(2048), "echo": True, "logprobs": 5, "n": 4, "max_tokens": 8}

    def probe(name: str, path: str, body: dict) -> FreezeProbe:
        return FreezeProbe(
            name,
            path,
            body,
            status=429,
            names=over_key,
            needs="key limit",
            then_other_key_served=True,
        )

    return [
        probe("n=128", CHAT, {"messages": MESSAGES, "max_tokens": 8, "n": 128}),
        probe("128 prompts", COMPLETIONS, {"prompt": ["Hello"] * 128, "max_tokens": 8}),
        probe("2 KB prompt, echo, logprobs, n=4", COMPLETIONS, echo),
    ]


async def run_probe(url: str, api_keys: Sequence[str], probe: FreezeProbe) -> ProbeRun:
    """Send `probe` to `url` (whose keys are `api_keys`, empty for an open server) beside an
    innocent stream of the other key, polling /health until it is answered."""
    first_key = api_keys[0] if api_keys else None
    other_key = api_keys[-1] if api_keys else None
    async with (
        client(url, 4, first_key if probe.has_key else None) as http,
        client(url, 4, other_key) as other,
        client(url, 2, None) as health,
    ):
        frames = FrameTimes()
        innocent = asyncio.ensure_future(send(other, FREEZE_INNOCENT, frames=frames))
        await _first_frame(frames, innocent)
        stop = asyncio.Event()
        polls = asyncio.ensure_future(_poll_health(health, stop))
        started_s = time.monotonic()
        answer = await _ask(http, probe)
        follow_up = await send(other, ONE_TOKEN) if probe.then_other_key_served else None
        answered_s = time.monotonic()
        stop.set()
        run = ProbeRun(
            answer=answer,
            follow_up=follow_up,
            innocent=await innocent,
            innocent_frames=frames,
            health_polls=await polls,
            is_healthy_after=(await _poll_once(health)).status == 200,
            started_s=started_s,
            answered_s=answered_s,
        )
    if not run.has_innocent_outlasted:
        run.notes.append("the innocent stream ended before the probe was answered")
    return run


def problems(probe: FreezeProbe, run: ProbeRun, solo_text: str) -> list[str]:
    """What is wrong with the answer to `probe` and around it (empty: nothing)."""
    found = _answer_problems(probe, run.answer)
    follow_up = run.follow_up
    if probe.then_other_key_served and not (follow_up and follow_up.is_complete):
        found.append(f"the other key's one-token request was not served: {follow_up}")
    if not (run.innocent.is_complete and run.innocent.text == solo_text):
        found.append(f"the innocent stream is not exact: {run.innocent}")
    failed_polls = [poll for poll in run.health_polls if poll.status != 200]
    if failed_polls:
        found.append(f"/health failed during the probe: {failed_polls[:3]}")
    if not run.is_healthy_after:
        found.append("/health failed after the probe")
    return found


def _answer_problems(probe: FreezeProbe, answer: Answer) -> list[str]:
    found = []
    text = answer.body_text
    if answer.status != probe.status:
        found.append(f"status {answer.status}, expected {probe.status}: {text[:300]}")
    error = answer.error or {}
    message = error.get("message")
    if not (isinstance(message, str) and message and isinstance(error.get("type"), str)):
        found.append(f"no OpenAI-shaped error (message, type): {text[:300]}")
    elif not any(name in message for name in probe.names):
        found.append(f"the message names none of {probe.names}: {message!r}")
    if probe.code is not None and error.get("code") != probe.code:
        found.append(f"code {error.get('code')!r}, expected {probe.code!r}")
    found += [f"internal text {t!r} in the answer" for t in INTERNAL_TEXT if t in text]
    return found


async def _ask(http: httpx.AsyncClient, probe: FreezeProbe) -> Answer:
    method = "GET" if probe.body is None else "POST"
    try:
        response = await http.request(method, probe.path, json=probe.body)
    except httpx.HTTPError as err:
        return Answer(status=None, error=None, body_text=f"{type(err).__name__}: {err}")
    try:
        data = response.json()
    except ValueError:
        data = None
    error = data.get("error") if isinstance(data, dict) else None
    return Answer(
        status=response.status_code,
        error=error if isinstance(error, dict) else None,
        body_text=response.text,
    )


async def _first_frame(frames: FrameTimes, innocent: asyncio.Future[Outcome]) -> None:
    """Wait until the innocent stream sends its first frame (or ends, or START_TIMEOUT_S)."""
    first = asyncio.ensure_future(frames.first.wait())
    await asyncio.wait({first, innocent}, timeout=START_TIMEOUT_S, return_when="FIRST_COMPLETED")
    first.cancel()


async def _poll_once(http: httpx.AsyncClient) -> HealthPoll:
    started = time.monotonic()
    try:
        status = (await http.get("/health", timeout=HEALTH_TIMEOUT_S)).status_code
    except httpx.HTTPError:
        status = None
    return HealthPoll(status=status, latency_s=time.monotonic() - started)


async def _poll_health(http: httpx.AsyncClient, stop: asyncio.Event) -> list[HealthPoll]:
    """/health every HEALTH_POLL_S until `stop` (at least once, and once after `stop`)."""
    polls = []
    while True:
        is_last = stop.is_set()
        polls.append(await _poll_once(http))
        if is_last:
            return polls
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), HEALTH_POLL_S)
