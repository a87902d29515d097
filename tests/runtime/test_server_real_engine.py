"""The OpenAI server on the real engine (tiny model): streaming, errors, disconnects, a burst
over the device tier, and (on a step clock) that burst's P99 TTFT under tokenflow and fcfs."""

import asyncio
import json

import httpx
import pytest

from tests.runtime.test_preemption_exact import StepClock
from tests.serving.live_server import serve_in_thread, wait_until
from tokenflow.core.request import SamplingParams
from tokenflow.engine.async_engine import AsyncEngine
from tokenflow.engine.engine_args import EngineArgs
from tokenflow.engine.llm_engine import LLMEngine
from tokenflow.eval.client import ClientConfig, run_workload
from tokenflow.eval.metrics import RequestTrace, summarize
from tokenflow.eval.workload import LengthDist, RateMix, WorkloadSpec, generate
from tokenflow.serving.app import build_app
from tokenflow.serving.config import ServerConfig


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    engine = AsyncEngine(
        EngineArgs(model=tiny_model_dir, device="cpu", max_model_len=512, max_num_requests=64)
    )
    with serve_in_thread(build_app(engine)) as url:
        yield engine, url
    engine.close()


def frames(text: str) -> list[str]:
    assert text.endswith("data: [DONE]\n\n")
    return [f[len("data: ") :] for f in text.split("\n\n") if f]


def test_stream_usage_and_finish_reason(served):
    engine, url = served
    body = {
        "model": engine.model_name,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 7,
        "stream": True,
        "stream_options": {"include_usage": True},
        "stream_rate": 50,
        "ignore_eos": True,
    }
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200
    chunks = [json.loads(f) for f in frames(response.text)[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1]["usage"]["completion_tokens"] == 7


def test_the_model_card_shows_the_kernel_choice(served):
    engine, url = served
    card = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
    # the tiny checkpoint is stored in float32: dense float32 is its only automatic path
    assert card["kernels"] == "kernels (checkpoint): float32" == engine.kernels


def test_non_streaming_completion_with_header_rate(served):
    engine, url = served
    body = {"prompt": "Once", "max_tokens": 5, "ignore_eos": True}
    response = httpx.post(
        f"{url}/v1/completions", json=body, headers={"X-Stream-Rate": "8"}, timeout=60
    )
    data = response.json()
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 5


def test_prompt_over_the_context_is_a_400(served):
    engine, url = served
    body = {"prompt": "word " * 600, "max_tokens": 4}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert "context length" in response.json()["error"]["message"]


def test_disconnect_aborts_and_frees_kv_in_both_tiers(served):
    engine, url = served
    kv = engine.engine.scheduler.kv
    body = {
        "prompt": "Tell a long story",
        "max_tokens": 400,
        "stream": True,
        "stream_rate": 1,
        "ignore_eos": True,
    }
    with (
        httpx.Client(base_url=url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        for _ in range(6):
            next(line for line in lines if line.startswith("data: "))
        assert kv.num_free_device_blocks < kv.config.num_device_blocks
    assert wait_until(lambda: engine.stats().num_running == 0)
    assert wait_until(lambda: kv.num_free_device_blocks == kv.config.num_device_blocks)
    assert kv.num_free_host_blocks == kv.config.num_host_blocks
    assert engine.stats().num_preempted == 0


def test_overload_gets_429_with_retry_after(tiny_model_dir):
    engine = AsyncEngine(
        EngineArgs(model=tiny_model_dir, device="cpu", max_num_requests=1, max_num_seqs=1)
    )
    body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
    no_wait = ServerConfig(max_queue_wait_s=0)  # the engine's own 429 at once, no queue
    try:
        with serve_in_thread(build_app(engine, no_wait)) as url:

            async def burst():
                async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                    return await asyncio.gather(
                        *(http.post("/v1/completions", json=body) for _ in range(6))
                    )

            responses = asyncio.run(burst())
    finally:
        engine.close()
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) >= 1 and 429 in codes
    refused = next(r for r in responses if r.status_code == 429)
    assert int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["message"]
    assert all(r.text.endswith("data: [DONE]\n\n") for r in responses if r.status_code == 200)


BURST = WorkloadSpec(
    kind="burst",
    num_requests=12,
    prompt=LengthDist(24, 0),
    output=LengthDist(150, 0),
    rates=RateMix.parse("4"),
    seed=0,
)


def burst_args(tiny_model_dir, policy: str) -> EngineArgs:
    # The device tier holds about three of the twelve streams; readers take 4 tok/s.
    return EngineArgs(
        model=tiny_model_dir, device="cpu", policy=policy, device_kv_tokens=560, max_model_len=512
    )


def test_a_burst_over_the_device_tier_streams_every_token(tiny_model_dir):
    engine = AsyncEngine(burst_args(tiny_model_dir, "tokenflow"))
    kv = engine.engine.scheduler.kv
    try:
        with serve_in_thread(build_app(engine)) as url:
            config = ClientConfig(
                url=url, endpoint="completions", show_progress=False, timeout_s=300
            )
            run = asyncio.run(run_workload(generate(BURST), config, name="tokenflow"))
            assert wait_until(lambda: engine.stats().num_running == 0)
    finally:
        engine.close()
    assert run.num_failed == 0, run.errors
    assert [(t.num_output_tokens, t.finish_reason) for t in run.traces] == [(150, "length")] * 12
    assert kv.num_free_device_blocks == kv.config.num_device_blocks
    assert kv.num_free_host_blocks == kv.config.num_host_blocks


def step_clock_p99_ttft(tiny_model_dir, policy: str) -> float:
    """The burst's P99 TTFT on the engine itself, each step taking 50 ms of a step clock (the
    clock moves while the step runs, so the engine times its steps on it), so the policy's
    decisions and the TTFTs are the same on any machine, however fast or busy."""
    engine = LLMEngine(burst_args(tiny_model_dir, policy))
    clock = StepClock()
    engine.core.clock = clock

    def run_for_50_ms(plan) -> None:
        if not plan.is_empty:
            clock.t += 0.05

    engine.core.before_execute = run_for_50_ms
    requests = generate(BURST)  # all arrive at 0
    times: dict[str, list[float]] = {r.request_id: [] for r in requests}
    for request in requests:
        params = SamplingParams(
            max_tokens=request.num_output_tokens, temperature=0, ignore_eos=True
        )
        prompt = [100 + (i % 50) for i in range(request.num_prompt_tokens)]
        engine.add_request(request.request_id, prompt, params, request.rate_tps)
    while engine.has_work:
        ran, deltas = engine.step()
        clock.t += 0.0 if ran else 0.05  # (nothing to run: time passes all the same)
        for delta in deltas:
            times[delta.request_id].extend([clock.t] * len(delta.token_ids))
    traces = [
        RequestTrace(
            request_id=r.request_id,
            arrival_s=r.arrival_s,
            rate_tps=r.rate_tps,
            num_prompt_tokens=r.num_prompt_tokens,
            token_times_s=tuple(times[r.request_id]),
            finish_reason="length",
        )
        for r in requests
    ]
    assert all(t.num_output_tokens == 150 for t in traces)
    return summarize(traces).ttft_p99_s


def test_tokenflow_lowers_p99_ttft_on_a_burst_in_step_time(tiny_model_dir):
    # 12 x 150 tokens with room for about three streams: FCFS makes the last ones wait for
    # whole streams to finish; TokenFlow pauses streams with buffered tokens to start them.
    fcfs = step_clock_p99_ttft(tiny_model_dir, "fcfs")
    tokenflow = step_clock_p99_ttft(tiny_model_dir, "tokenflow")
    assert tokenflow < fcfs / 2, (tokenflow, fcfs)
