"""Every bad input is an OpenAI-shaped error: 400 (never 422), 404, 429, 401; a dead engine 503."""

from __future__ import annotations

import threading

import anyio
import httpx
import pytest

from tests.serving.fake_engine import FakeEngine
from tokenflow.serving.app import build_app
from tokenflow.serving.config import ServerConfig

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        (COMPLETIONS, b"{not json"),
        (CHAT, b'{"messages": [}'),
        (COMPLETIONS, b""),
        (COMPLETIONS, b"[1, 2]"),
    ],
)
async def test_malformed_json(client: httpx.AsyncClient, path: str, raw: bytes) -> None:
    headers = {"content-type": "application/json"}
    assert_error(await client.post(path, content=raw, headers=headers), 400)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (COMPLETIONS, {"prompt": 5}, "prompt"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": "10"}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "stream": "yes"}, "stream"),
        (COMPLETIONS, {"prompt": "x", "stream_rate": "fast"}, "stream_rate"),
        (COMPLETIONS, {"prompt": [["a"], ["b"]]}, "prompt"),
        (COMPLETIONS, {"prompt": [1, "b"]}, "prompt"),
        (COMPLETIONS, {"prompt": [[1], []]}, "prompt"),
        (CHAT, {"messages": "hi"}, "messages"),
        (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {"messages": MESSAGES, "stream_options": {"include_usage": 1}}, "stream_options"),
        (COMPLETIONS, {"max_tokens": 3}, "prompt"),
    ],
)
async def test_wrong_types_are_400(
    client: httpx.AsyncClient, path: str, body: dict, param: str
) -> None:
    assert_error(await client.post(path, json=body), 400, param)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
async def test_unknown_field_served_and_logged(
    client: httpx.AsyncClient, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """As vLLM: a field neither API defines is ignored, and the log names it."""
    body = {"prompt": "x", "messages": MESSAGES, "frobnicate": 1, "max_tokens": 2}
    body.pop("messages" if path == COMPLETIONS else "prompt")
    with caplog.at_level("WARNING", logger="tokenflow.serving.openai_serving"):
        response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    ignored = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert ignored == [
        "The following fields were present in the request but ignored: ['frobnicate']"
    ]


async def test_unknown_field_inside_a_message_refused(client: httpx.AsyncClient) -> None:
    body = {"messages": [{"role": "user", "content": "x", "frobnicate": 1}]}
    assert_error(await client.post(CHAT, json=body), 400, "messages")


async def test_refusal_reason_logged(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="tokenflow.serving.app"):
        assert_error(await client.post(COMPLETIONS, json={"prompt": "x", "n": 0}), 400, "n")
    lines = [r.getMessage() for r in caplog.records if r.name == "tokenflow.serving.app"]
    assert len(lines) == 1
    assert lines[0].startswith("POST /v1/completions -> 400 invalid_request_error: n: ")


@pytest.mark.parametrize("rate", ["-1", "0", "NaN", "Infinity", "-Infinity", "1e-309", "1e-4"])
async def test_bad_rate_in_body(client: httpx.AsyncClient, rate: str) -> None:
    raw = f'{{"prompt": "x", "max_tokens": 1, "stream_rate": {rate}}}'
    response = await client.post(
        COMPLETIONS, content=raw, headers={"content-type": "application/json"}
    )
    assert_error(response, 400, "stream_rate")


@pytest.mark.parametrize("rate", ["-3", "0", "nan", "inf", "fast", "", "1e-309", "2000"])
async def test_bad_rate_in_header(client: httpx.AsyncClient, rate: str) -> None:
    body = {"messages": MESSAGES, "max_tokens": 1}
    response = await client.post(CHAT, json=body, headers={"X-Stream-Rate": rate})
    assert_error(response, 400, "X-Stream-Rate")


async def test_lengths(engine: FakeEngine) -> None:
    engine.max_model_len = 10
    transport = httpx.ASGITransport(app=build_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        for max_tokens in (0, -5):
            body = {"prompt": "a b", "max_tokens": max_tokens}
            assert_error(await http.post(COMPLETIONS, json=body), 400, "max_tokens")
        body = {"prompt": "a b c", "max_tokens": 8}
        error = assert_error(await http.post(COMPLETIONS, json=body), 400, "max_tokens")
        assert all(str(n) in error["message"] for n in (10, 3, 8, 11))
        body = {"messages": MESSAGES, "max_completion_tokens": 9}
        assert_error(await http.post(CHAT, json=body), 400, "max_tokens")
        body = {"prompt": " ".join("w" * 10)}
        error = assert_error(await http.post(COMPLETIONS, json=body), 400, "prompt")
        assert "10" in error["message"]
        assert_error(await http.post(COMPLETIONS, json={"prompt": "   "}), 400, "prompt")
        body = {"prompt": "a", "max_tokens": 9}
        assert (await http.post(COMPLETIONS, json=body)).status_code == 200
    assert len(engine.submitted) == 1


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        (COMPLETIONS, {"n": 129}, "n"),
        (COMPLETIONS, {"n": 2, "prompt": ["x"] * 65}, "n"),  # 130 choices
        (CHAT, {"presence_penalty": 2.5}, "presence_penalty"),
        (COMPLETIONS, {"frequency_penalty": -2.5}, "frequency_penalty"),
        (CHAT, {"repetition_penalty": 0.0}, "repetition_penalty"),
        (CHAT, {"min_p": 1.5}, "min_p"),
        (CHAT, {"top_logprobs": 3}, "top_logprobs"),  # without logprobs
        (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (COMPLETIONS, {"logprobs": 21}, "logprobs"),
        (COMPLETIONS, {"max_tokens": 0}, "max_tokens"),  # without echo
        (COMPLETIONS, {"suffix": "y"}, "suffix"),
        (COMPLETIONS, {"best_of": 3}, "best_of"),
        (CHAT, {"logit_bias": {"5": 10}}, "logit_bias"),
        (CHAT, {"use_beam_search": True}, "use_beam_search"),
        (COMPLETIONS, {"use_beam_search": True}, "use_beam_search"),
        (CHAT, {"chat_template": "{{ messages }}"}, "chat_template"),
        (CHAT, {"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
        (CHAT, {"continue_final_message": True}, "continue_final_message"),  # with the opener
        (CHAT, {"reasoning_effort": "extreme"}, "reasoning_effort"),
        (CHAT, {"tools": [{"type": "function"}]}, "tools"),
        (COMPLETIONS, {"min_tokens": 5, "max_tokens": 2}, None),
        (COMPLETIONS, {"temperature": -1.0}, None),
        (COMPLETIONS, {"top_k": -2}, "top_k"),
        (COMPLETIONS, {"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
async def test_unsupported_values(
    client: httpx.AsyncClient, path: str, extra: dict, param: str | None
) -> None:
    body = {"prompt": "x"} if path == COMPLETIONS else {"messages": MESSAGES}
    assert_error(await client.post(path, json={**body, **extra}), 400, param)


async def test_supported_neutral_values_pass(client: httpx.AsyncClient) -> None:
    body = {
        "model": "fake-model",
        "messages": MESSAGES,
        "n": 1,
        "logprobs": False,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "user": "u",
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
        "reasoning_effort": "low",
        "prompt_cache_key": "k",
        "safety_identifier": "s",
        "parallel_tool_calls": True,
        "seed": 3,
        "top_k": -1,
        "stop": "zzz",
        "stop_token_ids": [99999],
        "temperature": 0.0,
        "top_p": 0.9,
        "max_tokens": 2,
    }
    assert (await client.post(CHAT, json=body)).status_code == 200


async def test_unknown_model_is_404(client: httpx.AsyncClient) -> None:
    response = await client.post(COMPLETIONS, json={"model": "gpt-9", "prompt": "x"})
    error = assert_error(response, 404, "model")
    assert error["code"] == "model_not_found"
    # The model is checked before the prompt: 404 even when the prompt is too long.
    body = {"model": "gpt-9", "messages": [{"role": "user", "content": "w " * 300}]}
    assert_error(await client.post(CHAT, json=body), 404, "model")


async def test_unknown_route_is_openai_shaped(client: httpx.AsyncClient) -> None:
    assert_error(await client.get("/v1/nothing"), 404)
    assert_error(await client.get(COMPLETIONS), 405)


async def test_overload_is_429_with_retry_after() -> None:
    engine = FakeEngine(max_num_requests=0, retry_after_s=2.2)
    transport = httpx.ASGITransport(app=build_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        for stream in (False, True):
            body = {"prompt": "x", "max_tokens": 2, "stream": stream}
            response = await http.post(COMPLETIONS, json=body)
            error = assert_error(response, 429)
            assert error["code"] == "rate_limit_exceeded"
            assert response.headers["retry-after"] == "3"
        metrics = (await http.get("/metrics")).text
    assert 'tokenflow_http_errors_total{status="429"} 2.0' in metrics


async def test_retry_after_is_at_least_one_second() -> None:
    engine = FakeEngine(max_num_requests=0, retry_after_s=0.01)
    transport = httpx.ASGITransport(app=build_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        response = await http.post(CHAT, json={"messages": MESSAGES})
    assert response.headers["retry-after"] == "1"


async def test_engine_request_error_is_400() -> None:
    engine = FakeEngine(reject_prompts_longer_than=1)
    transport = httpx.ASGITransport(app=build_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        body = {"prompt": "a b", "max_tokens": 1, "stream": True}
        error = assert_error(await http.post(COMPLETIONS, json=body), 400)
    assert "longer than 1" in error["message"]


async def test_api_key() -> None:
    transport = httpx.ASGITransport(app=build_app(FakeEngine(), ServerConfig(api_keys=("sesame",))))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        body = {"prompt": "x", "max_tokens": 1}
        assert_error(await http.post(COMPLETIONS, json=body), 401)
        wrong = {"Authorization": "Bearer nope"}
        assert_error(await http.post(COMPLETIONS, json=body, headers=wrong), 401)
        right = {"Authorization": "Bearer sesame"}
        assert (await http.post(COMPLETIONS, json=body, headers=right)).status_code == 200
        assert (await http.get("/health")).status_code == 200


async def test_a_dead_engine_is_503_for_streams_and_plain_requests() -> None:
    engine = FakeEngine(death="the engine loop died: boom")
    transport = httpx.ASGITransport(app=build_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        for stream in (False, True):
            body = {"prompt": "x", "max_tokens": 2, "stream": stream}
            error = assert_error(await http.post(COMPLETIONS, json=body), 503)
            assert error["type"] == "server_error"
            assert "not running" in error["message"] and "boom" not in error["message"]
    assert engine.submitted == []


async def test_an_engine_that_stops_mid_way_is_a_503_with_retry_after() -> None:
    # a drain past its timeout stops the loop: a plain request cut then gets 503, not 500
    engine = FakeEngine(fail_after_tokens=2, dies_mid_way=True)
    transport = httpx.ASGITransport(app=build_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        body = {"prompt": "x", "max_tokens": 10}
        response = await http.post(COMPLETIONS, json=body)
        error = assert_error(response, 503)
        assert response.headers["Retry-After"] == "1"
        assert error["code"] == "engine_stopped" and "fake" not in error["message"]
        frames = (await http.post(COMPLETIONS, json={**body, "stream": True})).text
    assert '"code":"engine_stopped"' in frames and frames.endswith("data: [DONE]\n\n")


async def test_a_prompt_no_context_could_hold_is_refused_before_tokenizing() -> None:
    engine = FakeEngine()
    calls: list[int] = []
    encode = engine.tokenizer.encode
    engine.tokenizer.encode = lambda text: calls.append(len(text)) or encode(text)
    limit = engine.max_model_len * engine.tokenizer.max_token_chars
    transport = httpx.ASGITransport(app=build_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        body = {"prompt": "x" * (limit + 1), "max_tokens": 1}
        error = assert_error(await http.post(COMPLETIONS, json=body), 400)
        assert error["code"] == "context_length_exceeded" and calls == []
        messages = [{"role": "user", "content": "y" * (limit + 1)}]
        chat = {"messages": messages, "max_tokens": 1}
        assert_error(await http.post("/v1/chat/completions", json=chat), 400)


async def test_tokenizing_runs_off_the_event_loop() -> None:
    # While one prompt is being tokenized, /health (and everyone else) is still answered.
    engine = FakeEngine()
    started, release, finished = threading.Event(), threading.Event(), threading.Event()
    encode = engine.tokenizer.encode

    def slow_encode(text: str, add_special_tokens: bool = True) -> list[int]:
        started.set()
        try:
            if not release.wait(10):
                raise RuntimeError("the test never released the tokenizer")
            return encode(text)
        finally:
            finished.set()

    engine.tokenizer.encode = slow_encode
    transport = httpx.ASGITransport(app=build_app(engine))

    async def complete() -> None:
        await http.post(COMPLETIONS, json={"prompt": "x y", "max_tokens": 1})

    async with (
        httpx.AsyncClient(transport=transport, base_url="http://t") as http,
        anyio.create_task_group() as tasks,
    ):
        tasks.start_soon(complete)
        await anyio.to_thread.run_sync(started.wait, 30)
        health = await http.get("/health")
        answered_while_tokenizing = not finished.is_set()
        release.set()
    assert health.status_code == 200 and answered_while_tokenizing
