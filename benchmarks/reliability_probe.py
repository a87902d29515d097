"""Reliability probe: does one bad request ever hurt another on a live TokenFlow server?

Starts `tokenflow serve` itself (embedded SmolLM2 unless --serve-args say otherwise) or probes
--url, then runs four categories and prints one row each:

- hostile:    malformed and out-of-range bodies, oversized bodies; each must get a clear 4xx;
- poison:     valid-but-extreme requests, each beside an innocent greedy stream that must
              produce exactly its solo text;
- disconnect: streams dropped mid-way (and before their first token), then an innocent stream;
- storm:      10x the batch capacity at once; each must complete or get a clear 429.

A request is *lost* when it gets neither a complete answer nor a clear error of its own
(a transport failure, a timeout, a 5xx, a stream without `data: [DONE]`).  After every
category the probe checks /health and that no request is left running in the engine.

    python benchmarks/reliability_probe.py [--url URL] [--serve-args "--policy fcfs ..."]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx

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


async def send(
    http: httpx.AsyncClient, body: dict | bytes, path: str = CHAT, max_frames: int | None = None
) -> Outcome:
    """POST and read the whole answer (or only `max_frames` frames, then hang up)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    try:
        async with http.stream("POST", path, content=content, headers=headers) as response:
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                return await _read_sse(response, max_frames)
            data = json.loads(await response.aread() or b"null")
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        return Outcome(None, error=f"{type(err).__name__}: {err}")
    if response.status_code == 200:
        choice = data["choices"][0]
        text = choice.get("text") or choice.get("message", {}).get("content", "")
        return Outcome(200, text, is_complete=choice["finish_reason"] in ("stop", "length"))
    error = (data or {}).get("error", {}).get("message") if isinstance(data, dict) else None
    return Outcome(response.status_code, error=error)


async def _read_sse(response: httpx.Response, max_frames: int | None) -> Outcome:
    outcome = Outcome(response.status_code)
    finish, done, num_frames = None, False, 0
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        num_frames += 1
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
        {"max_tokens": 10**12}, {"min_tokens": 10**6}, {"n": 5}, {"logit_bias": {"1": 100}},
        {"presence_penalty": 1.5}, {"messages": []}, {"messages": "hi"},
        {"messages": [{"role": "robot", "content": "x"}]}, {"unknown_field": 1},
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


async def probe(url: str, storm_size: int, max_body_bytes: int) -> list[Row]:
    """Run every category against `url`."""
    limits = httpx.Limits(max_connections=storm_size + 16, max_keepalive_connections=32)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        solo = await send(http, INNOCENT)
        if not solo.is_complete:
            raise SystemExit(f"the innocent stream does not complete alone: {solo}")
        rows = []
        for name, category in (
            ("hostile", _hostile(http, max_body_bytes)),
            ("poison", _poison(http, solo.text)),
            ("disconnect", _disconnect(http, solo.text)),
            ("storm", _storm(http, solo.text, storm_size)),
        ):
            started = time.monotonic()
            row = await category
            row.category = name
            row.seconds = time.monotonic() - started
            row.is_healthy_after = await _is_healthy(http)
            rows.append(row)
        return rows


async def _hostile(http: httpx.AsyncClient, max_body_bytes: int) -> Row:
    row = Row("hostile")
    for body in hostile_bodies(max_body_bytes):
        row.add(await send(http, body))
    return row


async def _poison(http: httpx.AsyncClient, solo_text: str) -> Row:
    row = Row("poison")
    for body in poison_bodies():
        innocent, poison = await asyncio.gather(send(http, INNOCENT), send(http, body))
        row.add(poison)
        row.innocent_intact.append(innocent.is_complete and innocent.text == solo_text)
    return row


async def _disconnect(http: httpx.AsyncClient, solo_text: str) -> Row:
    row = Row("disconnect")
    body = {**INNOCENT, "max_tokens": 200, "stream_rate": 2}
    drops = [send(http, body, max_frames=n) for n in (0, 1, 2, 3, 5, 8) * 4]
    outcomes = await asyncio.gather(send(http, INNOCENT), *drops)
    for outcome in outcomes[1:]:
        row.add(outcome)
    row.innocent_intact.append(outcomes[0].is_complete and outcomes[0].text == solo_text)
    row.innocent_intact.append(await _settles(http))
    after = await send(http, INNOCENT)
    row.innocent_intact.append(after.is_complete and after.text == solo_text)
    return row


async def _storm(http: httpx.AsyncClient, solo_text: str, storm_size: int) -> Row:
    row = Row("storm")
    body = {**INNOCENT, "max_tokens": 8, "stream_rate": 4}
    innocent = asyncio.ensure_future(send(http, INNOCENT))
    await asyncio.sleep(0.2)
    outcomes = await asyncio.gather(*(send(http, body) for _ in range(storm_size)))
    for outcome in outcomes:
        row.add(outcome)
    first = await innocent
    row.innocent_intact.append(first.is_complete and first.text == solo_text)
    row.innocent_intact.append(await _settles(http))
    return row


async def _settles(http: httpx.AsyncClient, timeout_s: float = 60) -> bool:
    """True once the engine holds no request (aborted ones freed)."""
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


async def _is_healthy(http: httpx.AsyncClient) -> bool:
    try:
        return (await http.get("/health", timeout=10)).status_code == 200
    except httpx.HTTPError:
        return False


def report(rows: list[Row]) -> str:
    """A markdown table, one row per category."""
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


@contextlib.contextmanager
def local_server(serve_args: str, startup_timeout_s: float = 300) -> Iterator[str]:
    """Start `tokenflow serve` on a free loopback port; stop it (SIGINT) on exit."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "tokenflow.cli.main", "serve", "--port", str(port)]
    command += [*shlex.split(serve_args), "--log-level", "warning"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if process.poll() is not None:
                raise SystemExit(
                    f"the server exited: {process.stderr.read() if process.stderr else ''}"
                )
            if time.monotonic() > deadline:
                raise SystemExit("the server did not start in time")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.5)
        yield url
    finally:
        process.send_signal(2)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="probe this server instead of starting one")
    parser.add_argument("--serve-args", default="", help="options for the server started here")
    parser.add_argument("--storm", type=int, default=320, help="storm size (10x max_num_seqs 32)")
    parser.add_argument("--max-body-bytes", type=int, default=2 << 20, help="the server's limit")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(local_server(args.serve_args))
        rows = asyncio.run(probe(url, args.storm, args.max_body_bytes))
    print(report(rows))
    ok = all(r.num_lost == 0 and r.is_healthy_after and all(r.innocent_intact) for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
