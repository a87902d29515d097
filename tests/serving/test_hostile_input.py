"""Inputs that used to stall the server or leak its internals: a prompt far past the context
is refused after tokenizing only its head, a structured output that cannot be compiled is a
400 naming why (before any byte of the answer), and errors carry no internal text."""

from __future__ import annotations

import httpx
import pytest

from tests.serving.fake_engine import FakeEngine
from tokenflow.serving.app import build_app
from tokenflow.serving.validation import context_head_chars

pytestmark = pytest.mark.anyio

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


class CountingTokenizer:
    """The fake engine's tokenizer, recording how many characters it was asked to encode."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.num_chars_encoded = 0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.num_chars_encoded += len(text)
        return self.inner.encode(text, add_special_tokens)


async def test_a_prompt_far_past_the_context_is_refused_by_its_head():
    engine = FakeEngine()
    tokenizer = CountingTokenizer(engine.tokenizer)
    engine.tokenizer = tokenizer
    head = context_head_chars(engine.max_model_len)
    prompt = "w " * (2 * head)  # one token every 2 characters: the head alone overflows
    async with _client(engine) as http:
        answer = await http.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 1})
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "context_length_exceeded"
    assert tokenizer.num_chars_encoded == head  # the rest was never tokenized
    assert engine.submitted == []


async def test_a_long_prompt_of_long_tokens_is_still_served_whole():
    engine = FakeEngine()
    head = context_head_chars(engine.max_model_len)
    word = "x" * 60  # a 60-character token: the whole text fits the context
    prompt = " ".join([word] * (head // 50))
    async with _client(engine) as http:
        answer = await http.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 1})
    assert answer.status_code == 200
    assert answer.json()["usage"]["prompt_tokens"] == head // 50


async def test_a_grammar_that_cannot_compile_is_a_400_before_the_answer_starts():
    engine = FakeEngine(grammar_error="response_format: the keyword 'not' is not supported")
    body = {
        "prompt": "x",
        "max_tokens": 4,
        "stream": True,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"schema": {"type": "string", "not": {"const": "a"}}},
        },
    }
    async with _client(engine) as http:
        answer = await http.post(COMPLETIONS, json=body)
    assert answer.status_code == 400 and "'not'" in answer.json()["error"]["message"]
    assert engine.num_compiles == 1 and engine.submitted == []


async def test_min_tokens_with_a_structured_output_is_a_400():
    body = {"prompt": "x", "max_tokens": 4, "min_tokens": 2, "guided_json": {"type": "integer"}}
    async with _client(FakeEngine()) as http:
        answer = await http.post(COMPLETIONS, json=body)
    assert answer.status_code == 400
    assert "min_tokens cannot be combined" in answer.json()["error"]["message"]


async def test_a_template_failure_shows_no_internals():
    engine = FakeEngine()

    def broken(*args, **kwargs):
        raise KeyError("internal_variable_name")

    engine.tokenizer.apply_chat_template = broken
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    async with _client(engine) as http:
        answer = await http.post(CHAT, json=body)
    assert answer.status_code == 400
    assert "internal_variable_name" not in answer.text


async def test_a_failure_before_the_first_token_shows_no_internals():
    engine = FakeEngine(fail_after_tokens=0)
    async with _client(engine) as http:
        answer = await http.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 2})
    assert answer.status_code == 500
    assert "fake engine failure" not in answer.text and "RuntimeError" not in answer.text


def _client(engine: FakeEngine) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=build_app(engine))
    return httpx.AsyncClient(transport=transport, base_url="http://test")


async def test_an_error_does_not_echo_a_long_input_whole():
    body = {"model": "m" * 20_000, "prompt": "x", "max_tokens": 1}
    async with _client(FakeEngine()) as http:
        answer = await http.post(COMPLETIONS, json=body)
    assert answer.status_code == 404
    assert len(answer.json()["error"]["message"]) < 300


async def test_a_chat_far_past_the_context_is_refused_by_its_head():
    engine = FakeEngine()
    tokenizer = CountingTokenizer(engine.tokenizer)
    engine.tokenizer = tokenizer
    head = context_head_chars(engine.max_model_len)
    messages = [{"role": "user", "content": "w " * head}, {"role": "user", "content": "w " * 9}]
    async with _client(engine) as http:
        answer = await http.post(CHAT, json={"messages": messages, "max_tokens": 1})
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "context_length_exceeded"
    assert tokenizer.num_chars_encoded == head  # the messages were never tokenized whole
