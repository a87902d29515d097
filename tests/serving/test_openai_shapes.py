"""Answers parsed by the openai SDK's own types: choices per prompt and n, echo, logprobs, the
tokenizer routes and a model card."""

import httpx
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.serving.fake_engine import FakeEngine
from tokenflow.serving.app import build_app

pytestmark = pytest.mark.anyio


def _client(engine: FakeEngine) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=build_app(engine)), base_url="http://t"
    )


async def test_completion_prompts_times_n_are_choices_in_order() -> None:
    engine = FakeEngine()
    async with _client(engine) as http:
        body = {"prompt": ["a b", "c"], "n": 2, "max_tokens": 2, "seed": 5}
        answer = Completion.model_validate((await http.post("/v1/completions", json=body)).json())
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert answer.usage.prompt_tokens == 3  # each prompt once
    assert answer.usage.completion_tokens == 8
    seeds = sorted(params.seed for _, params, _ in engine.submitted)
    assert seeds == [5, 5, 6, 6]  # choice j of a prompt draws from seed + j


async def test_token_id_prompts_and_batches() -> None:
    async with _client(FakeEngine()) as http:
        for prompt in ([3, 4], [[3], [4, 5]]):
            body = {"prompt": prompt, "max_tokens": 1}
            response = await http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            assert len(Completion.model_validate(response.json()).choices) == len(
                prompt if isinstance(prompt[0], list) else [prompt]
            )


async def test_streamed_n_choices_each_carry_their_index() -> None:
    async with _client(FakeEngine()) as http:
        body = {"messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 2}
        response = await http.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = [
        ChatCompletionChunk.model_validate_json(line[6:])
        for line in response.text.splitlines()
        if line.startswith("data: {")
    ]
    indices = {c.choices[0].index for c in chunks}
    assert indices == {0, 1, 2}
    for index in indices:
        own = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert own[0].delta.role == "assistant"
        assert own[-1].finish_reason == "length"


async def test_chat_n_is_parsed_by_the_sdk() -> None:
    async with _client(FakeEngine()) as http:
        body = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 2}
        answer = ChatCompletion.model_validate(
            (await http.post("/v1/chat/completions", json=body)).json()
        )
    assert [c.index for c in answer.choices] == [0, 1]
    assert all(c.message.content == " t0 t1" for c in answer.choices)


async def test_echo_repeats_the_prompt() -> None:
    async with _client(FakeEngine()) as http:
        body = {"prompt": "a b", "max_tokens": 1, "echo": True}
        answer = Completion.model_validate((await http.post("/v1/completions", json=body)).json())
        assert answer.choices[0].text == "a b t0"
        body = {"prompt": "a b", "max_tokens": 0, "echo": True}
        answer = Completion.model_validate((await http.post("/v1/completions", json=body)).json())
        assert answer.choices[0].text == "a b"
        assert answer.usage.completion_tokens == 0


async def test_model_card_and_unknown_model() -> None:
    async with _client(FakeEngine()) as http:
        card = Model.model_validate((await http.get("/v1/models/fake-model")).json())
        assert card.id == "fake-model"
        missing = await http.get("/v1/models/gpt-9")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"


async def test_tokenizer_routes() -> None:
    async with _client(FakeEngine()) as http:
        tokens = (await http.post("/tokenize", json={"prompt": "a b c"})).json()
        assert tokens["count"] == 3 and len(tokens["tokens"]) == 3
        assert tokens["max_model_len"] == 256
        text = (await http.post("/detokenize", json={"tokens": tokens["tokens"]})).json()
        assert text == {"prompt": " a b c"}
        messages = {"messages": [{"role": "user", "content": "x"}]}
        chat = (await http.post("/tokenize", json=messages)).json()
        assert chat["count"] > 0
        info = (await http.get("/tokenizer_info")).json()
        assert info["eos_token"] == "<eos>"
        bad = await http.post("/detokenize", json={"tokens": [1 << 30]})
        assert bad.status_code == 400
