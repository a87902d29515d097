"""tool_choice through the server (a fake engine whose answer is scripted): "auto" with tools
(also the default when tools are given) is a 400 naming the flags without a tool-call parser, and
with `--enable-auto-tool-choice --tool-call-parser hermes` the model's `<tool_call>` blocks
come back as `tool_calls`, whole and streamed; "none", and "auto" without tools, are plain chat;
tool messages need a chat template with a tools section; n choices are n readers at the
request's rate."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.serving.fake_engine import FakeEngine, WordTokenizer
from tokenflow.serving.app import build_app
from tokenflow.serving.config import ServerConfig

pytestmark = pytest.mark.anyio

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ASK = [{"role": "user", "content": "weather in Paris?"}]
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
# The scripted answer: a word of text, then one call in the Hermes format (no spaces inside a
# word: the fake tokenizer splits on whitespace).
WORDS = ("Checking.", "<tool_call>", json.dumps(CALL, separators=(",", ":")), "</tool_call>")
AUTO = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")


class ToolsTokenizer(WordTokenizer):
    renders_tools = True


async def _client(engine: FakeEngine, config: ServerConfig | None) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=build_app(engine, config))
    return httpx.AsyncClient(transport=transport, base_url="http://test")


@pytest.fixture
async def plain() -> AsyncIterator[httpx.AsyncClient]:
    """A server without a tool-call parser, its template without a tools section."""
    async with await _client(FakeEngine(eos_after=3), None) as http:
        yield http


@pytest.fixture
async def auto() -> AsyncIterator[httpx.AsyncClient]:
    """A server with the hermes parser on, its template rendering tools, the answer scripted."""
    engine = FakeEngine(words=WORDS, tokenizer=ToolsTokenizer())
    async with await _client(engine, AUTO) as http:
        yield http


def _body(**extra: object) -> dict:
    return {"model": "fake-model", "messages": ASK, "max_tokens": 16, **extra}


@pytest.mark.parametrize("extra", [{"tool_choice": "auto"}, {}])
async def test_auto_with_tools_without_a_parser_is_a_400_naming_the_flags(plain, extra):
    reply = await plain.post("/v1/chat/completions", json=_body(tools=[WEATHER], **extra))
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "tool_choice"
    assert "--enable-auto-tool-choice --tool-call-parser hermes" in error["message"]


@pytest.mark.parametrize(
    "extra", [{"tools": [WEATHER], "tool_choice": "none"}, {"tool_choice": "auto"}]
)
async def test_none_and_auto_without_tools_are_plain_chat(plain, extra):
    reply = await plain.post("/v1/chat/completions", json=_body(**extra))
    assert reply.status_code == 200, reply.text
    message = reply.json()["choices"][0]["message"]
    assert message["content"] and "tool_calls" not in message


async def test_auto_on_a_template_without_tools_is_a_400():
    async with await _client(FakeEngine(words=WORDS), AUTO) as http:
        reply = await http.post("/v1/chat/completions", json=_body(tools=[WEATHER]))
    assert reply.status_code == 400
    assert "no tools section" in reply.json()["error"]["message"]


async def test_auto_returns_the_models_call_as_tool_calls(auto):
    reply = await auto.post("/v1/chat/completions", json=_body(tools=[WEATHER]))
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == " Checking. "
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == CALL["arguments"]


async def test_auto_streamed_gives_the_same_content_and_call(auto):
    whole = (await auto.post("/v1/chat/completions", json=_body(tools=[WEATHER]))).json()
    body = _body(tools=[WEATHER], stream=True)
    async with auto.stream("POST", "/v1/chat/completions", json=body) as reply:
        lines = [line async for line in reply.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [call for d in deltas for call in d.get("tool_calls") or []]
    assert all("<tool_call>" not in (d.get("content") or "") for d in deltas)
    assert content == whole["choices"][0]["message"]["content"]
    (call,) = calls
    want = whole["choices"][0]["message"]["tool_calls"][0]
    assert call["index"] == 0 and call["function"] == want["function"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(
    "message",
    [
        {"role": "tool", "content": "18 C", "tool_call_id": "call_1"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
    ],
)
async def test_tool_messages_need_a_template_with_a_tools_section(plain, message):
    reply = await plain.post("/v1/chat/completions", json=_body(messages=[*ASK, message]))
    assert reply.status_code == 400
    assert "no tools section" in reply.json()["error"]["message"]


async def test_a_tool_message_needs_its_call_id(auto):
    messages = [*ASK, {"role": "tool", "content": "18 C"}]
    reply = await auto.post("/v1/chat/completions", json=_body(messages=messages))
    assert reply.status_code == 400
    assert "tool_call_id" in reply.json()["error"]["message"]


async def test_n_choices_are_n_readers_at_the_requests_rate():
    engine = FakeEngine(eos_after=3)
    async with await _client(engine, None) as http:
        reply = await http.post(
            "/v1/chat/completions", json=_body(n=3, stream=True, stream_rate=5.5)
        )
        assert reply.status_code == 200
    assert [rate for _, _, rate in engine.submitted] == [5.5, 5.5, 5.5]
    assert len({request_id for request_id, _, _ in engine.submitted}) == 3


def test_the_auto_flags_are_validated():
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ServerConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        ServerConfig(tool_call_parser="mistral")
    assert ServerConfig(tool_call_parser="hermes").auto_tool_call_parser is None
    assert AUTO.auto_tool_call_parser == "hermes"
