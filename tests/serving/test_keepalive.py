"""Accepted streams send their headers at once and `: keep-alive` comments while they wait;
refusals stay real status codes; the official `openai` client parses such streams unchanged."""

from __future__ import annotations

import time

import httpx
import openai

from tests.serving.fake_engine import FakeEngine
from tests.serving.live_server import serve_in_thread
from tokenflow.serving.app import build_app
from tokenflow.serving.config import ServerConfig

KEEPALIVE = ServerConfig(keepalive_s=0.05)


def test_headers_at_once_then_keepalives_until_the_first_token() -> None:
    engine = FakeEngine(first_token_delay_s=0.4)
    with serve_in_thread(build_app(engine, KEEPALIVE)) as url:
        body = {"prompt": "x", "max_tokens": 2, "stream": True}
        started = time.monotonic()
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=10) as response:
            headers_s = time.monotonic() - started
            assert response.status_code == 200
            text = "".join(response.iter_text())
    assert headers_s < 0.3
    head, _, rest = text.partition("data: ")
    assert head.count(": keep-alive\n\n") >= 3 and head.replace(": keep-alive\n\n", "") == ""
    assert rest.endswith("data: [DONE]\n\n") and '"finish_reason":"length"' in rest


def test_refusals_stay_status_codes_for_streams() -> None:
    engine = FakeEngine(max_num_requests=0, first_token_delay_s=5)
    with serve_in_thread(build_app(engine, KEEPALIVE)) as url:
        body = {"prompt": "x", "max_tokens": 2, "stream": True}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=10).status_code == 429
        long = {**body, "prompt": "x " * 300}
        assert httpx.post(f"{url}/v1/completions", json=long, timeout=10).status_code == 400


def test_official_client_parses_streams_with_keepalives() -> None:
    engine = FakeEngine(first_token_delay_s=0.2, token_delay_s=0.1, eos_after=3)
    with serve_in_thread(build_app(engine, KEEPALIVE)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        chat = client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        chunks = list(chat)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == " t0 t1 t2"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_keepalives_fill_a_pause_between_tokens() -> None:
    # A stream paused by preemption looks like this to the server: no delta for a while.
    engine = FakeEngine(token_delay_s=0.3)
    with serve_in_thread(build_app(engine, KEEPALIVE)) as url:
        body = {"prompt": "x", "max_tokens": 2, "stream": True}
        text = httpx.post(f"{url}/v1/completions", json=body, timeout=10).text
    _, _, rest = text.partition('"finish_reason":null')
    between, _, _ = rest.partition('"finish_reason":"length"')
    assert between.count(": keep-alive\n\n") >= 2
    assert text.endswith("data: [DONE]\n\n")
