"""Hostile bodies (hypothesis) and a 1,000-stream storm against the real server (tiny model).

Every fuzzed body gets a clear 4xx or a complete answer, and an innocent stream sent beside it
always completes with exactly its solo tokens.  The storm loses no request.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.runtime.sse_client import StreamResult, read_stream
from tests.serving.live_server import serve_in_thread
from tokenflow.engine.async_engine import AsyncEngine
from tokenflow.engine.engine_args import EngineArgs
from tokenflow.serving.app import build_app

INNOCENT = {
    "prompt": "The innocent reader",
    "max_tokens": 6,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
    "stream_rate": 1000,
}

_numbers = st.one_of(
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 1e-40, 1e-5, 2, 1000, 1e308, 1 << 63, (1 << 64) - 1]),
)
_scalars = st.one_of(st.none(), st.booleans(), _numbers, st.text(max_size=20))
_values = st.one_of(
    _scalars,
    st.lists(_scalars, max_size=5),
    st.dictionaries(st.text(max_size=5), _scalars, max_size=3),
)
_FIELDS = {
    "max_tokens": st.one_of(st.integers(-2, 8), _values),
    "temperature": _values,
    "top_p": _values,
    "top_k": _values,
    "seed": _values,
    "stop": st.one_of(st.lists(st.text(max_size=300), max_size=20), _values),
    "stop_token_ids": st.one_of(st.lists(st.integers(-5, 60000), max_size=70), _values),
    "stream_rate": _values,
    "min_tokens": _values,
    "ignore_eos": _values,
    "n": _values,
    "logit_bias": _values,
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), _values),
    "unknown_field": _values,
}
_prompts = st.one_of(
    st.text(max_size=40),
    st.lists(st.integers(-3, 60000), max_size=12),
    _values,
)
bodies = st.fixed_dictionaries(
    {"prompt": _prompts, "stream": st.booleans()},
    optional={name: strategy for name, strategy in _FIELDS.items()},
)


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    args = EngineArgs(model=tiny_model_dir, device="cpu", max_model_len=48, max_num_seqs=64)
    engine = AsyncEngine(args)
    with serve_in_thread(build_app(engine)) as url:
        yield url
    engine.close()


async def _send(http: httpx.AsyncClient, body: dict) -> StreamResult:
    content = json.dumps(body)  # NaN and Infinity travel as JSON's non-standard literals
    headers = {"content-type": "application/json"}
    if body.get("stream") is True:
        return await read_stream(http, "/v1/completions", body, content)
    response = await http.post("/v1/completions", content=content, headers=headers)
    result = StreamResult(response.status_code, is_done=True)
    data = response.json()
    if response.status_code == 200:
        result.finish_reason = data["choices"][0]["finish_reason"]
        result.text = data["choices"][0]["text"]
    else:
        result.errors.append(data["error"]["message"])
    return result


def test_fuzzed_bodies_get_a_4xx_or_an_answer_and_never_hurt_an_innocent(served):
    async def solo() -> str:
        async with httpx.AsyncClient(base_url=served, timeout=30) as http:
            result = await read_stream(http, "/v1/completions", INNOCENT)
        assert result.is_complete
        return result.text

    expected = asyncio.run(solo())

    @settings(
        max_examples=30,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(body=bodies)
    def check(body: dict) -> None:
        async def go() -> tuple[StreamResult, StreamResult]:
            async with httpx.AsyncClient(base_url=served, timeout=30) as http:
                return await asyncio.gather(
                    read_stream(http, "/v1/completions", INNOCENT), _send(http, body)
                )

        innocent, fuzzed = asyncio.run(go())
        assert innocent.is_complete and innocent.text == expected, (body, innocent)
        if fuzzed.status == 200:
            assert fuzzed.is_done and not fuzzed.errors, (body, fuzzed)
            assert fuzzed.finish_reason in ("stop", "length"), (body, fuzzed)
        else:
            assert 400 <= fuzzed.status < 500, (body, fuzzed)

    check()


def test_a_storm_of_1000_concurrent_streams_loses_nothing(tiny_model_dir):
    args = EngineArgs(
        model=tiny_model_dir,
        device="cpu",
        max_model_len=48,
        max_num_seqs=256,
        max_num_requests=1000,
    )
    engine = AsyncEngine(args)
    body = {**INNOCENT, "max_tokens": 3}
    try:
        with serve_in_thread(build_app(engine)) as url:

            async def storm() -> list[StreamResult]:
                limits = httpx.Limits(max_connections=1000, max_keepalive_connections=0)
                async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
                    sends = (read_stream(http, "/v1/completions", body) for _ in range(1000))
                    # a hang guard, no speed bound: the storm took 8 s on 2 free cores
                    return await asyncio.wait_for(asyncio.gather(*sends), timeout=300)

            started = time.monotonic()
            results = asyncio.run(storm())
            elapsed = time.monotonic() - started
    finally:
        engine.close()
    complete = sum(r.is_complete for r in results)
    print(f"1000 concurrent streams: {complete} complete in {elapsed:.1f} s")
    assert complete == 1000
    assert len({r.text for r in results}) == 1  # all greedy, all the same
