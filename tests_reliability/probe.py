"""What the reliability suite sends and how it tells an answer from a lost request.

A request is *lost* when it gets neither a complete answer nor a clear error of its own (a
transport failure, a timeout, a 5xx, a stream without `data: [DONE]`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

# The suite's server: dense float32 weights on one thread (greedy tokens independent of the
# batch, so the innocent streams are exact) and two API keys.
SERVE_ARGS = "--dtype float32 --num-threads 1 --api-key rel-a --api-key rel-b"
INNOCENT = {
    "messages": [{"role": "user", "content": "Name three colours."}],
    "max_tokens": 24,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
    "stream_rate": 1000,
}
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hello"}]
SETTLE_TIMEOUT_S = 60.0


@dataclass
class Outcome:
    """How one request ended."""

    status: int | None  # None: no HTTP answer at all
    text: str = ""
    is_complete: bool = False  # finish reason + [DONE], no error frame
    error: str | None = None  # an explicit error (body or frame)

    @property
    def is_clear_4xx(self) -> bool:
        return self.status is not None and 400 <= self.status < 500 and bool(self.error)

    @property
    def is_lost(self) -> bool:
        """Neither an answer nor a clear error of its own."""
        if self.status is None or self.status >= 500:
            return True
        if self.status == 200:
            return not self.is_complete and not self.error
        return not self.error


@dataclass
class Row:
    """One category's tally: the row of the report table."""

    category: str
    num_sent: int = 0
    num_clear_4xx: int = 0
    num_complete: int = 0
    num_explicit_errors: int = 0  # 200 streams that ended with their own error frame
    num_lost: int = 0
    innocent_intact: list[bool] = field(default_factory=list)
    is_healthy_after: bool = False
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def add(self, outcome: Outcome) -> None:
        self.num_sent += 1
        self.num_clear_4xx += outcome.is_clear_4xx
        self.num_complete += outcome.is_complete
        self.num_explicit_errors += outcome.status == 200 and bool(outcome.error)
        self.num_lost += outcome.is_lost
        if outcome.is_lost and len(self.notes) < 3:
            self.notes.append(f"lost: status {outcome.status}, {outcome.error or 'no error'}")


@dataclass
class FrameTimes:
    """When each `data:` frame of a stream arrived (monotonic seconds); `first` is set at the
    first one."""

    times_s: list[float] = field(default_factory=list)
    first: asyncio.Event = field(default_factory=asyncio.Event)

    def record(self) -> None:
        self.times_s.append(time.monotonic())
        self.first.set()


def serve_args_keys(serve_args: Sequence[str]) -> tuple[str, ...]:
    """The `--api-key` values of `tokenflow serve` options (empty: an open server)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--api-key", action="append", default=[])
    return tuple(parser.parse_known_args(list(serve_args))[0].api_key)


def client(url: str, max_connections: int, api_key: str | None) -> httpx.AsyncClient:
    """A client of `url` that sends `api_key` as its bearer token (None: no key)."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=32)
    headers = {} if api_key is None else {"authorization": f"Bearer {api_key}"}
    return httpx.AsyncClient(base_url=url, timeout=600, limits=limits, headers=headers)


async def alone(url: str, api_key: str | None, body: dict) -> Outcome:
    """A stream of `body` with nothing else sent: the text it must produce beside anything."""
    async with client(url, 4, api_key) as http:
        return await send(http, body)


async def send(
    http: httpx.AsyncClient,
    body: dict | bytes,
    path: str = CHAT,
    max_frames: int | None = None,
    answered: asyncio.Event | None = None,
    frames: FrameTimes | None = None,
) -> Outcome:
    """POST and read the whole answer (or only `max_frames` frames, then hang up); `answered`
    is set once the response's status line has arrived, `frames` records a stream's frames."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    try:
        async with http.stream("POST", path, content=content, headers=headers) as response:
            if answered is not None:
                answered.set()
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                return await _read_sse(response, max_frames, frames)
            data = json.loads(await response.aread() or b"null")
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        return Outcome(None, error=f"{type(err).__name__}: {err}")
    if response.status_code == 200:
        choice = data["choices"][0]
        text = choice.get("text") or choice.get("message", {}).get("content", "")
        return Outcome(200, text, is_complete=choice["finish_reason"] in ("stop", "length"))
    error = (data or {}).get("error", {}).get("message") if isinstance(data, dict) else None
    return Outcome(response.status_code, error=error)


async def _read_sse(
    response: httpx.Response, max_frames: int | None, frames: FrameTimes | None
) -> Outcome:
    outcome = Outcome(response.status_code)
    finish, done, num_frames = None, False, 0
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        num_frames += 1
        if frames is not None:
            frames.record()
        if max_frames is not None and num_frames > max_frames:
            return Outcome(200, outcome.text, is_complete=True)  # we hung up on purpose
        if line == "data: [DONE]":
            done = True
            continue
        chunk = json.loads(line[len("data: ") :])
        if "error" in chunk:
            outcome.error = chunk["error"]["message"]
            continue
        for choice in chunk.get("choices", []):
            outcome.text += choice.get("delta", {}).get("content") or choice.get("text") or ""
            finish = choice.get("finish_reason") or finish
    outcome.is_complete = done and outcome.error is None and finish in ("stop", "length")
    return outcome


def hostile_bodies(max_body_bytes: int) -> list[dict | bytes]:
    """Bodies a server must refuse with a clear 4xx."""
    base = {"messages": MESSAGES, "max_tokens": 8}
    bad_values = [
        {"temperature": 1e308}, {"temperature": -1}, {"temperature": float("nan")},
        {"top_p": 0}, {"top_p": float("inf")}, {"top_k": -5}, {"seed": 1 << 80},
        {"stream_rate": 1e308}, {"stream_rate": 0}, {"stream_rate": float("nan")},
        {"stop": ["x"] * 100}, {"stop": "y" * 10_000}, {"stop": [""]},
        {"stop_token_ids": [10**9]}, {"stop_token_ids": [-1]}, {"max_tokens": -1},
        {"max_tokens": 10**12}, {"min_tokens": 10**6}, {"n": 0}, {"n": 10**6},
        {"logit_bias": {"1": 100}}, {"presence_penalty": 3.0}, {"frequency_penalty": -2.5},
        {"logprobs": True, "top_logprobs": 21}, {"top_logprobs": 2},
        {"messages": []}, {"messages": "hi"},
        {"messages": [{"role": "robot", "content": "x"}]},
        {"messages": [{"role": "user", "content": "x", "unknown_field": 1}]},
        {"stream_options": {"include_usage": True}}, {"model": "no-such-model"},
        {"max_tokens": "8"}, {"temperature": "hot"}, {"stream": "yes"},
    ]  # fmt: skip
    bodies: list[dict | bytes] = [{**base, **extra} for extra in bad_values]
    bodies += [b"{not json", b"", b"[1, 2]", b'{"messages": [}', b"\xff\xfe"]
    bodies.append(json.dumps({**base, "padding": "x" * (max_body_bytes + 1)}).encode())
    return bodies


def poison_bodies() -> list[dict]:
    """Valid but extreme requests, each sent beside an innocent stream."""
    base = {"messages": MESSAGES, "max_tokens": 16, "stream": True, "stream_rate": 1000}
    extremes = [
        {"temperature": 1e-40}, {"temperature": 1e-6, "top_p": 1e-9}, {"temperature": 2.0},
        {"seed": -(1 << 63)}, {"seed": (1 << 64) - 1}, {"top_k": 1 << 40},
        {"stop": ["a" * 256] * 16}, {"stop": ["e", " ", "\n"]}, {"min_tokens": 16},
        {"stop_token_ids": [0, 1, 2]}, {"stream_rate": 1e-3}, {"ignore_eos": True},
        {"messages": [{"role": "user", "content": "\u0000\ud7ff\uffff" * 50}]},
        {"messages": [{"role": "user", "content": "word " * 1500}]},
    ]  # fmt: skip
    return [{**base, **extra} for extra in extremes]


async def settles(http: httpx.AsyncClient, timeout_s: float = SETTLE_TIMEOUT_S) -> bool:
    """True once the engine holds no request (aborted ones freed), polling its /metrics."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = (await http.get("/metrics")).text
        values = [
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith(("tokenflow_num_requests_running", "tokenflow_num_requests_waiting"))
        ]
        if values and not any(values):
            return True
        await asyncio.sleep(0.2)
    return False


async def is_healthy(http: httpx.AsyncClient) -> bool:
    try:
        return (await http.get("/health", timeout=10)).status_code == 200
    except httpx.HTTPError:
        return False


def report(rows: list[Row]) -> str:
    """A markdown table, one row per category, and the notes on lost requests."""
    lines = [
        "| category | sent | clear 4xx | complete | own error | lost | innocent intact | healthy "
        "after | s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        intact = f"{sum(r.innocent_intact)}/{len(r.innocent_intact)}" if r.innocent_intact else "-"
        lines.append(
            f"| {r.category} | {r.num_sent} | {r.num_clear_4xx} | {r.num_complete} | "
            f"{r.num_explicit_errors} | {r.num_lost} | {intact} | "
            f"{'yes' if r.is_healthy_after else 'NO'} | {r.seconds:.1f} |"
        )
    notes = [f"- {r.category}: {n}" for r in rows for n in r.notes]
    return "\n".join(lines + notes)
