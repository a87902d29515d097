"""A structured output's grammar compiles where nobody waits for it: while a compile is held
(a stub that blocks on an event), /health answers and another stream runs to its end; a schema
over a bound is a 400 naming it, and nothing reaches the compiler."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.model.test_grammar_compile import BlockingWorker
from tests.serving.live_server import serve_in_thread
from tokenflow.engine.async_engine import AsyncEngine
from tokenflow.engine.engine_args import EngineArgs
from tokenflow.model.grammar_compile import GrammarCompiler
from tokenflow.serving.app import build_app

INNOCENT = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
CONSTRAINED = {
    "prompt": "A number:",
    "max_tokens": 8,
    "temperature": 0,
    "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "integer"}}},
}


@pytest.fixture(scope="module")
def held(tiny_model_dir):
    """A server whose one grammar compiler blocks until `release` is set."""
    engine = AsyncEngine(EngineArgs(model=tiny_model_dir, device="cpu", max_model_len=256))
    release, started = threading.Event(), threading.Event()
    grammars = engine.engine.grammars
    grammars.compiler.close()
    grammars.compiler = GrammarCompiler(
        grammars.compiler.tokenizer_info,
        timeout_s=120,
        make_worker=lambda info: BlockingWorker(info, release, started),
    )
    with serve_in_thread(build_app(engine)) as url:
        yield url, release, started
    release.set()
    engine.close()


def test_health_and_another_stream_go_on_while_a_grammar_compiles(held):
    url, release, started = held
    answers: dict[str, httpx.Response] = {}

    def constrained() -> None:
        with httpx.Client(timeout=120) as http:
            answers["constrained"] = http.post(url + "/v1/completions", json=CONSTRAINED)

    waiting = threading.Thread(target=constrained)
    waiting.start()
    assert started.wait(60), "the compile never started"
    with httpx.Client(timeout=60) as http:
        health = http.get(url + "/health")
        innocent = http.post(url + "/v1/completions", json=INNOCENT)
    assert not release.is_set() and "constrained" not in answers  # still compiling
    assert health.status_code == 200
    assert innocent.status_code == 200 and innocent.json()["usage"]["completion_tokens"] == 16
    release.set()
    waiting.join(120)
    assert answers["constrained"].status_code == 200


def test_a_schema_over_a_bound_is_a_400_naming_it(held):
    url, _, _ = held
    schema = {"type": "string", "pattern": "^([a-z0-9]{1,20}){1,20}$"}
    body = {
        **CONSTRAINED,
        "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
    }
    with httpx.Client(timeout=60) as http:
        answer = http.post(url + "/v1/completions", json=body)
        tools = http.post(
            url + "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 8,
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": schema}},
                        },
                    }
                ],
                "tool_choice": "required",
            },
        )
    assert answer.status_code == 400
    assert "at most 64" in answer.json()["error"]["message"]
    assert tools.status_code == 400 and "at most 64" in tools.json()["error"]["message"]
