"""Logprobs, echo, n and penalties through the server on the real engine (tiny model), every
answer parsed by the openai SDK's types; what lm-eval's loglikelihood request gets."""

import httpx
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.serving.live_server import serve_in_thread
from tokenflow.engine.async_engine import AsyncEngine
from tokenflow.engine.engine_args import EngineArgs
from tokenflow.serving.app import build_app


@pytest.fixture(scope="module")
def url(tiny_model_dir):
    engine = AsyncEngine(EngineArgs(model=tiny_model_dir, device="cpu", max_model_len=512))
    with serve_in_thread(build_app(engine)) as base:
        yield base
    engine.close()


def test_chat_logprobs_streamed_and_not_agree(url):
    body = {
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
        "ignore_eos": True,
    }
    whole = ChatCompletion.model_validate(
        httpx.post(f"{url}/v1/chat/completions", json=body).json()
    )
    content = whole.choices[0].logprobs.content
    assert len(content) == 6
    assert all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.logprob for t in content)  # greedy: the top one
    text = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": True}).text
    chunks = [
        ChatCompletionChunk.model_validate_json(line[6:])
        for line in text.splitlines()
        if line.startswith("data: {")
    ]
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]


def test_loglikelihood_request_as_lm_eval_sends_it(url):
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    body = {"prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    # The prompt's first token has a null logprob (as vLLM answers and lm-eval reads it), which
    # the SDK's Completion type does not allow: these answers are read as JSON.
    answer = httpx.post(f"{url}/v1/completions", json=body).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    for choice, prompt in zip(answer["choices"], prompts, strict=True):
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(prompt) + 1  # the prompt, then the sampled token
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert all(lp <= 0 for lp in logprobs["token_logprobs"][1:])
        pairs = zip(logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:], strict=True)
        for lp, top in pairs:
            assert max(top.values()) >= lp  # lm-eval's is_greedy reads this
        assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    scored = {"prompt": prompts[0], "max_tokens": 0, "logprobs": 2, "echo": True}
    alone = httpx.post(f"{url}/v1/completions", json=scored).json()
    only = alone["choices"][0]["logprobs"]
    assert len(only["tokens"]) == 4 and alone["usage"]["completion_tokens"] == 0
    assert only["token_logprobs"] == answer["choices"][0]["logprobs"]["token_logprobs"][:4]


def test_n_and_penalties(url):
    body = {"prompt": "Once upon", "max_tokens": 8, "n": 3, "seed": 1, "ignore_eos": True}
    answer = Completion.model_validate(httpx.post(f"{url}/v1/completions", json=body).json())
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert answer.usage.completion_tokens == 24
    greedy = {"prompt": "Once upon", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(f"{url}/v1/completions", json=greedy).json()["choices"][0]["text"]
    penalised = {**greedy, "frequency_penalty": 2.0, "repetition_penalty": 1.5, "top_k": 5}
    other = httpx.post(f"{url}/v1/completions", json=penalised).json()["choices"][0]["text"]
    assert other != plain
