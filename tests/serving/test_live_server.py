"""Against a real uvicorn server: client disconnects abort the engine request, and the official
`openai` client works unchanged."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from tests.serving.fake_engine import FakeEngine
from tests.serving.live_server import serve_in_thread, wait_until
from tokenflow.serving.app import build_app


def test_disconnect_mid_stream_aborts_in_engine() -> None:
    engine = FakeEngine(gate=threading.Event(), gate_at_token=1)  # never opened: no token 1
    with serve_in_thread(build_app(engine)) as url, httpx.Client(base_url=url, timeout=10) as http:
        body = {"prompt": "x", "max_tokens": 200, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert '"text":" t0"' in first
        # Closing the response drops the connection while the stream waits for token 1.
        assert wait_until(lambda: len(engine.aborted_ids) == 1)
        assert engine.aborted_ids[0].startswith("cmpl-")
        assert wait_until(lambda: not engine.active_ids)
        metrics = http.get("/metrics").text
    assert 'tokenflow_requests_finished_total{finish_reason="abort"} 1.0' in metrics
    assert engine.num_finished == 0


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_before_first_token_aborts(stream: bool) -> None:
    engine = FakeEngine(first_token_delay_s=30.0)
    with serve_in_thread(build_app(engine)) as url:
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": stream}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/chat/completions", json=body, timeout=0.3)
        assert wait_until(lambda: len(engine.aborted_ids) == 1)
        assert engine.aborted_ids[0].startswith("chatcmpl-")
        assert wait_until(lambda: not engine.active_ids)


def test_completed_stream_is_not_aborted() -> None:
    engine = FakeEngine()
    with serve_in_thread(build_app(engine)) as url:
        body = {"prompt": "x", "max_tokens": 3, "stream": True}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=10)
        assert response.text.endswith("data: [DONE]\n\n")
    assert engine.aborted_ids == []
    assert engine.num_finished == 1


def test_official_openai_client_streams_chat_and_completions() -> None:
    engine = FakeEngine(eos_after=4)
    with serve_in_thread(build_app(engine)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        chat = client.chat.completions.create(
            model="fake-model",
            messages=[{"role": "user", "content": "hello"}],
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"stream_rate": 5},
        )
        chunks = list(chat)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == " t0 t1 t2 t3"
        assert chunks[0].choices[0].delta.role == "assistant"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5

        stream = client.completions.create(
            model="fake-model",
            prompt="a b c",
            max_tokens=3,
            stream=True,
            extra_body={"stream_rate": 5},
        )
        pieces = list(stream)
        assert "".join(p.choices[0].text for p in pieces) == " t0 t1 t2"
        assert pieces[-1].choices[0].finish_reason == "length"

        models = client.models.list()
        assert [m.id for m in models.data] == ["fake-model"]
        with pytest.raises(openai.BadRequestError):
            client.completions.create(
                model="fake-model", prompt="x", extra_body={"stream_rate": -1}
            )
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="x")
    assert [rate for _, _, rate in engine.submitted] == [5.0, 5.0]
