"""The SSE parser gives the same events however the bytes are split across reads."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serving.fake_engine import FakeEngine
from tokenflow.bench.sse import SSEEvent, SSEParser
from tokenflow.serving.app import build_app

RECORDED = (
    b": keep-alive\r\n"
    b"\r\n"
    b'data: {"text": "h\xc3\xa9llo \xe2\x82\xac"}\r\n'
    b"\r\n"
    b"event: update\n"
    b"id: 7\n"
    b"data: line one\n"
    b"data:line two\n"
    b"retry: 100\n"
    b"\n"
    b":comment without data\n"
    b"data: cr only\r\r"
    b"event: empty\n\n"
    b"data\n\n"
    b"data: [DONE]\n\n"
    b"data: unterminated"
)
EXPECTED = [
    SSEEvent('{"text": "h\u00e9llo \u20ac"}'),
    SSEEvent("line one\nline two", event="update", event_id="7"),
    SSEEvent("cr only", event_id="7"),
    SSEEvent("", event_id="7"),
    SSEEvent("[DONE]", event_id="7"),
]


def parse(chunks: list[bytes]) -> list[SSEEvent]:
    parser = SSEParser()
    events = [event for chunk in chunks for event in parser.feed(chunk)]
    return events + parser.close()


def test_whole_stream() -> None:
    assert parse([RECORDED]) == EXPECTED


@pytest.mark.parametrize("offset", range(len(RECORDED) + 1))
def test_split_at_every_byte_offset(offset: int) -> None:
    assert parse([RECORDED[:offset], RECORDED[offset:]]) == EXPECTED


def test_one_byte_at_a_time_and_empty_reads() -> None:
    chunks = [RECORDED[i : i + 1] for i in range(len(RECORDED))]
    chunks.insert(5, b"")
    assert parse(chunks) == EXPECTED


def test_three_way_splits() -> None:
    size = len(RECORDED)
    for first in range(0, size, 3):
        for second in range(first, size, 5):
            chunks = [RECORDED[:first], RECORDED[first:second], RECORDED[second:]]
            assert parse(chunks) == EXPECTED, (first, second)


def test_bom_is_skipped_and_final_lone_cr_dispatches() -> None:
    stream = b"\xef\xbb\xbfdata: a\r\r"
    for offset in range(len(stream) + 1):
        assert parse([stream[:offset], stream[offset:]]) == [SSEEvent("a")]


@pytest.mark.anyio
async def test_recorded_server_stream_at_every_split() -> None:
    transport = httpx.ASGITransport(app=build_app(FakeEngine(tokens_per_delta=2)))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        body = {
            "messages": [{"role": "user", "content": "hi \u00e9t\u00e9"}],
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        raw = (await http.post("/v1/chat/completions", json=body)).content
    whole = parse([raw])
    assert [e.data for e in whole][-1] == "[DONE]"
    assert json.loads(whole[-2].data)["usage"]["completion_tokens"] == 5
    for offset in range(len(raw) + 1):
        assert parse([raw[:offset], raw[offset:]]) == whole
    crlf = raw.replace(b"\n", b"\r\n")
    for offset in range(0, len(crlf) + 1, 7):
        assert parse([crlf[:offset], crlf[offset:]]) == whole
