"""Server-side pacing (serving/pacing.py): a paced reader's tokens go out on the schedule the
core's reader model assumes, and nothing else changes.

Every test runs on an event loop with virtual time (virtual_time.py): the fake engine's token
delays, the pacing waits and a slow client's reads all take virtual seconds, so each chunk's
time is exact on any machine and no test waits on the wall clock.  The expected schedule comes
from the metrics module's closed form (`consumption_times_s`), not from the core's recurrence
that the server runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serving.fake_engine import FakeEngine
from tests.serving.virtual_time import run_in_virtual_time
from tokenflow.cli.config_file import apply_config_file, write_config
from tokenflow.cli.server_options import add_server_options, server_config_from
from tokenflow.core.request import Consumption
from tokenflow.eval.metrics import TIME_TOLERANCE_S, consumption_times_s
from tokenflow.serving.app import build_app
from tokenflow.serving.choices import EventStream
from tokenflow.serving.classes import ClassRules, Stated
from tokenflow.serving.config import ServerConfig
from tokenflow.serving.drain import Drain
from tokenflow.serving.metrics import ServingMetrics
from tokenflow.serving.openai_serving import OpenAIServing
from tokenflow.serving.protocol import CompletionRequest

RATE_TPS = 4.0  # the reader takes a token every 0.25 s
TOKEN_DELAY_S = 0.05  # the fake engine makes one every 0.05 s: five times the reader's rate
PROMPT = [1, 2, 3]  # token ids: nothing is tokenized in a worker thread (virtual_time.py)
PACED_READER = {"stream": True, "stream_rate": RATE_TPS, "stream_pacing": True}


@dataclass(frozen=True)
class Sent:
    """One SSE event's data, and the virtual time its answer yielded it."""

    at_s: float
    data: str

    @property
    def texts(self) -> dict[int, str]:
        """Each choice's text in this chunk, by its index (none for usage and [DONE])."""
        if self.data == "[DONE]":
            return {}
        return {c["index"]: c["text"] for c in json.loads(self.data).get("choices", [])}


def make_serving(engine: FakeEngine, **options: Any) -> OpenAIServing:
    ids = iter(range(100))
    return OpenAIServing(engine, ServingMetrics(engine), new_id=lambda: str(next(ids)), **options)


async def never_disconnects() -> None:
    await asyncio.Event().wait()


async def sent_events(
    serving: OpenAIServing,
    body: dict[str, Any],
    stated: Stated | None = None,
    after_each: Callable[[Sent], Awaitable[None]] | None = None,
) -> list[Sent]:
    """Every event of the streamed completion `body` (prompt: PROMPT), timed as the answer
    yields it; `after_each` runs before the next one is asked for (a client reading slowly)."""
    loop = asyncio.get_running_loop()
    request = CompletionRequest.model_validate_json(json.dumps({"prompt": PROMPT, **body}))
    stream = await serving.create_completion(request, stated or Stated(), never_disconnects)
    assert isinstance(stream, EventStream)
    sent: list[Sent] = []
    try:
        async for data in stream:
            sent.append(Sent(loop.time(), data))
            if after_each is not None:
                await after_each(sent[-1])
    finally:
        await stream.aclose()
    return sent


def token_chunks(sent: list[Sent], index: int = 0) -> list[Sent]:
    """The chunks that carry text of choice `index`."""
    return [s for s in sent if s.texts.get(index)]


def made_s(num_tokens: int, delay_s: float = TOKEN_DELAY_S) -> list[float]:
    """When the fake engine makes each token: the first at once, then one every `delay_s`."""
    return [j * delay_s for j in range(num_tokens)]


def assert_sent_when_due(chunks: list[Sent], due_s: list[float]) -> None:
    """Each chunk no earlier than its token's due time, and no later (virtual time is exact)."""
    assert len(chunks) == len(due_s)
    for chunk, due in zip(chunks, due_s, strict=True):
        assert chunk.at_s >= due - TIME_TOLERANCE_S, (chunk, due)
        assert chunk.at_s == pytest.approx(due, abs=1e-6), (chunk, due)


def test_a_paced_stream_sends_each_token_when_its_reader_takes_it() -> None:
    engine = FakeEngine(token_delay_s=TOKEN_DELAY_S)
    body = {**PACED_READER, "max_tokens": 6, "stream_options": {"include_usage": True}}
    sent = run_in_virtual_time(sent_events(make_serving(engine), body))
    due_s = consumption_times_s(made_s(6), RATE_TPS)  # 0, 0.25, ..., 1.25
    tokens = token_chunks(sent)
    assert [c.texts[0] for c in tokens] == [f" t{j}" for j in range(6)]  # a chunk per token
    assert_sent_when_due(tokens, due_s)
    assert json.loads(tokens[-1].data)["choices"][0]["finish_reason"] == "length"
    usage, done = sent[-2:]  # after the last token, not when the engine finished (0.25 s)
    assert json.loads(usage.data)["usage"]["completion_tokens"] == 6
    assert done.data == "[DONE]" and usage.at_s == done.at_s == tokens[-1].at_s
    assert engine.aborted_ids == []


def test_tokens_due_together_go_out_in_one_chunk() -> None:
    engine = FakeEngine()  # every token made at once: all are held from the start

    async def read_slowly_after_t1(sent: Sent) -> None:
        if sent.texts.get(0) == " t1":
            await asyncio.sleep(1.05)  # virtual: a client that reads nothing for a while

    body = {**PACED_READER, "max_tokens": 8}
    sent = run_in_virtual_time(
        sent_events(make_serving(engine), body, after_each=read_slowly_after_t1)
    )
    tokens = token_chunks(sent)
    assert [c.texts[0] for c in tokens] == [" t0", " t1", " t2 t3 t4 t5", " t6", " t7"]
    assert [c.at_s for c in tokens] == pytest.approx([0.0, 0.25, 1.3, 1.5, 1.75])


def test_an_unpaced_reader_and_eager_streams_get_each_token_as_it_is_made() -> None:
    engine = FakeEngine(token_delay_s=TOKEN_DELAY_S)
    server_off = make_serving(engine)
    server_on = make_serving(engine, class_rules=ClassRules(paces_readers=True))
    cases = [
        (server_off, {"stream": True, "stream_rate": RATE_TPS}),  # off by default
        (server_on, {**PACED_READER, "stream_pacing": False}),  # turned off by the request
        (server_on, {**PACED_READER, "stream_class": "eager"}),  # an eager stream: never paced
    ]

    async def each() -> list[list[Sent]]:
        return [await sent_events(serving, {**body, "max_tokens": 6}) for serving, body in cases]

    for sent in run_in_virtual_time(each()):
        tokens = token_chunks(sent)
        assert [c.texts[0] for c in tokens] == [f" t{j}" for j in range(6)]
        start_s = tokens[0].at_s
        assert [c.at_s - start_s for c in tokens] == pytest.approx(made_s(6))


def test_the_server_option_paces_readers_that_do_not_say() -> None:
    engine = FakeEngine(token_delay_s=TOKEN_DELAY_S)
    serving = make_serving(engine, class_rules=ServerConfig(stream_pacing=True).class_rules)
    reader = {"stream": True, "stream_rate": RATE_TPS, "max_tokens": 4}

    async def both() -> tuple[list[Sent], list[Sent]]:
        paced = await sent_events(serving, reader)
        unpaced = await sent_events(serving, reader, Stated(pacing=False))  # X-Stream-Pacing
        return paced, unpaced

    paced, unpaced = run_in_virtual_time(both())
    assert_sent_when_due(token_chunks(paced), consumption_times_s(made_s(4), RATE_TPS))
    start_s = unpaced[0].at_s
    assert [c.at_s - start_s for c in token_chunks(unpaced)] == pytest.approx(made_s(4))


def test_each_choice_is_paced_on_its_own() -> None:
    engine = FakeEngine()  # every token made at once
    body = {**PACED_READER, "max_tokens": 3, "n": 2}
    sent = run_in_virtual_time(sent_events(make_serving(engine), body))
    due_s = consumption_times_s(made_s(3, 0.0), RATE_TPS)  # 0, 0.25, 0.5 for each choice
    for index in (0, 1):
        chunks = token_chunks(sent, index)
        assert [c.texts[index] for c in chunks] == [" t0", " t1", " t2"]
        assert_sent_when_due(chunks, due_s)


def test_a_drain_sends_what_is_held_at_once() -> None:
    engine = FakeEngine()  # every token made at once: all held but the first
    drain = Drain()

    async def main() -> list[Sent]:
        asyncio.get_running_loop().call_later(0.6, drain.begin)  # t0, t1, t2 are sent by then
        return await sent_events(
            make_serving(engine, drain=drain), {**PACED_READER, "max_tokens": 8}
        )

    sent = run_in_virtual_time(main())
    tokens = token_chunks(sent)
    assert [c.texts[0] for c in tokens] == [" t0", " t1", " t2", " t3 t4 t5 t6 t7"]
    assert [c.at_s for c in tokens] == pytest.approx([0.0, 0.25, 0.5, 0.6])
    assert sent[-1].data == "[DONE]" and sent[-1].at_s == pytest.approx(0.6)
    assert json.loads(tokens[-1].data)["choices"][0]["finish_reason"] == "length"


def test_an_engine_failure_sends_what_is_held_then_the_error() -> None:
    engine = FakeEngine(fail_after_tokens=3)  # t0, t1, t2 made at once, then the failure
    sent = run_in_virtual_time(sent_events(make_serving(engine), {**PACED_READER, "max_tokens": 8}))
    assert [s.texts.get(0) for s in sent[:2]] == [" t0", " t1 t2"]
    assert "error" in json.loads(sent[2].data) and sent[3].data == "[DONE]"
    assert all(s.at_s == 0.0 for s in sent)


def asgi_scope(body: bytes) -> dict[str, Any]:
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("test", 80),
    }


def test_a_client_that_leaves_while_a_token_is_held_aborts_its_request() -> None:
    engine = FakeEngine(token_delay_s=TOKEN_DELAY_S)
    app = build_app(engine, ServerConfig(keepalive_s=0))
    body = json.dumps({"prompt": PROMPT, **PACED_READER, "max_tokens": 50}).encode()
    leaves_at_s = 0.1  # t1 (made at 0.05) is held until 0.25

    async def main() -> tuple[float, bytes]:
        loop = asyncio.get_running_loop()
        left = asyncio.Event()
        loop.call_later(leaves_at_s, left.set)
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        sent: list[bytes] = []

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop(0)
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message.get("body", b""))

        await app(asgi_scope(body), receive, send)
        return loop.time(), b"".join(sent)

    ended_s, raw = run_in_virtual_time(main())
    assert ended_s == pytest.approx(leaves_at_s)  # at once, not when t1 was due
    assert len(engine.aborted_ids) == 1 and engine.aborted_ids[0].startswith("cmpl-")
    assert engine.num_finished == 0
    assert b'"text":" t0"' in raw and b" t1" not in raw


def test_the_body_field_and_the_header_turn_pacing_on_or_off_over_http() -> None:
    cases = [  # (body, headers, seconds the answer takes: 6 tokens)
        ({**PACED_READER}, {}, 1.25),
        ({"stream": True, "stream_rate": RATE_TPS}, {"X-Stream-Pacing": "true"}, 1.25),
        ({**PACED_READER}, {"X-Stream-Pacing": "false"}, 1.25),  # the body wins
        ({"stream": True, "stream_rate": RATE_TPS}, {}, 0.25),  # off by default
        ({**PACED_READER, "stream_class": "eager"}, {}, 0.25),
        ({**PACED_READER, "stream": False}, {}, 0.25),  # batch: never paced
    ]

    async def durations() -> list[float]:
        engine = FakeEngine(token_delay_s=TOKEN_DELAY_S)
        transport = httpx.ASGITransport(app=build_app(engine, ServerConfig(keepalive_s=0)))
        loop = asyncio.get_running_loop()
        took = []
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            for body, headers, _ in cases:
                start_s = loop.time()
                body = {"prompt": PROMPT, **body, "max_tokens": 6}
                response = await http.post("/v1/completions", json=body, headers=headers)
                assert response.status_code == 200, response.text
                took.append(loop.time() - start_s)
        return took

    assert run_in_virtual_time(durations()) == pytest.approx([c[2] for c in cases])


@pytest.mark.anyio
async def test_a_pacing_that_is_not_a_boolean_is_a_400(client: httpx.AsyncClient) -> None:
    body = {"prompt": "x", "max_tokens": 1, "stream": True}
    response = await client.post("/v1/completions", json={**body, "stream_pacing": "yes"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "stream_pacing"
    response = await client.post("/v1/completions", json=body, headers={"X-Stream-Pacing": "2"})
    assert response.status_code == 400


def test_only_readers_are_paced_and_the_request_decides_first() -> None:
    off, on = ClassRules(), ClassRules(paces_readers=True)
    reader, eager, batch = Consumption.READER, Consumption.EAGER, Consumption.BATCH
    assert not off.is_paced(reader, None, Stated()) and on.is_paced(reader, None, Stated())
    assert off.is_paced(reader, True, Stated()) and not on.is_paced(reader, False, Stated())
    assert off.is_paced(reader, None, Stated(pacing=True))
    assert not on.is_paced(reader, False, Stated(pacing=True))  # the body over the header
    assert not any(on.is_paced(c, True, Stated(pacing=True)) for c in (eager, batch))


def test_the_stream_pacing_flag_and_config_key(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_server_options(parser)
    assert server_config_from(parser.parse_args([])).class_rules.paces_readers is False
    on = server_config_from(parser.parse_args(["--stream-pacing"]))
    assert on.stream_pacing and on.class_rules.paces_readers
    path = tmp_path / "serve.toml"
    write_config(path, {"stream-pacing": True})
    apply_config_file(parser, ["--config", str(path)])
    assert server_config_from(parser.parse_args([])).class_rules.paces_readers


def test_begun_returns_once_another_thread_begins_the_drain() -> None:
    drain = Drain()

    async def main() -> None:
        waiter = asyncio.ensure_future(drain.begun())
        await asyncio.sleep(0)  # (virtual) the waiter registers
        assert not waiter.done()
        thread = threading.Thread(target=drain.begin)  # as a signal handler would
        thread.start()
        await waiter
        thread.join()
        await drain.begun()  # already begun: at once

    run_in_virtual_time(main())
