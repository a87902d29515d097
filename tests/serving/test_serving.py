"""The serving logic without HTTP: releasing engine requests however a stream ends."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from tests.serving.fake_engine import FakeEngine
from tokenflow.serving.choices import EventStream
from tokenflow.serving.classes import Stated
from tokenflow.serving.metrics import ServingMetrics
from tokenflow.serving.openai_serving import OpenAIServing
from tokenflow.serving.protocol import CompletionRequest
from tokenflow.serving.responder import ClientDisconnected

pytestmark = pytest.mark.anyio


def make_serving(engine: FakeEngine) -> OpenAIServing:
    ids = iter(range(100))
    return OpenAIServing(engine, ServingMetrics(engine), new_id=lambda: str(next(ids)))


async def never_disconnects() -> None:
    await asyncio.Event().wait()


async def until(predicate: Callable[[], object], timeout_s: float = 60.0) -> None:
    """Yield to the event loop until `predicate()` holds; the timeout only guards a hang."""
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.001)


async def start_stream(serving: OpenAIServing, max_tokens: int = 5) -> EventStream:
    body = CompletionRequest(prompt="a", max_tokens=max_tokens, stream=True)
    stream = await serving.create_completion(body, Stated(), never_disconnects)
    assert isinstance(stream, EventStream)
    return stream


async def test_closed_before_first_frame_aborts() -> None:
    engine = FakeEngine()
    stream = await start_stream(make_serving(engine))
    assert engine.active_ids == ["cmpl-0"]
    await stream.aclose()
    await stream.aclose()  # idempotent
    assert engine.aborted_ids == ["cmpl-0"]
    assert engine.active_ids == []


async def test_closed_mid_stream_aborts_once() -> None:
    engine = FakeEngine()
    stream = await start_stream(make_serving(engine), max_tokens=50)
    frames = aiter(stream)
    assert (await anext(frames)).startswith('{"id":"cmpl-0"')
    await anext(frames)
    await stream.aclose()
    assert engine.aborted_ids == ["cmpl-0"]
    assert engine.active_ids == []


async def test_cancelled_consumer_aborts() -> None:
    engine = FakeEngine(token_delay_s=60.0)  # the consumer waits for token 1 when cancelled
    stream = await start_stream(make_serving(engine), max_tokens=50)
    frames: list[str] = []

    async def consume() -> None:
        async for frame in stream:
            frames.append(frame)

    task = asyncio.create_task(consume())
    await until(lambda: frames)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.aborted_ids == ["cmpl-0"]


async def test_finished_stream_is_not_aborted() -> None:
    engine = FakeEngine()
    stream = await start_stream(make_serving(engine))
    frames = [frame async for frame in stream]
    await stream.aclose()
    assert frames[-1] == "[DONE]"
    assert engine.aborted_ids == [] and engine.active_ids == []
    assert engine.num_finished == 1


async def test_disconnect_while_waiting_for_first_token() -> None:
    engine = FakeEngine(first_token_delay_s=30.0)
    serving = make_serving(engine)
    gone = asyncio.Event()

    async def wait_for_disconnect() -> None:
        await gone.wait()

    body = CompletionRequest(prompt="a", max_tokens=5)
    task = asyncio.create_task(serving.create_completion(body, Stated(), wait_for_disconnect))
    await until(lambda: engine.active_ids)
    assert engine.active_ids == ["cmpl-0"] and not task.done()
    gone.set()
    with pytest.raises(ClientDisconnected):
        await task
    assert engine.aborted_ids == ["cmpl-0"]
    assert engine.active_ids == []


async def test_ttft_uses_the_injected_clock() -> None:
    engine = FakeEngine()
    times = iter([10.0, 12.5, 13.0, 13.25])
    metrics = ServingMetrics(engine)
    serving = OpenAIServing(engine, metrics, clock=lambda: next(times), wall_clock=lambda: 99.0)
    body = CompletionRequest(prompt="a", max_tokens=3)
    response = await serving.create_completion(body, Stated(), never_disconnects)
    assert response.created == 99
    text = metrics.render()[0].decode()
    assert 'tokenflow_time_to_first_token_seconds_sum{stream_class="batch"} 2.5' in text
    assert 'tokenflow_inter_token_seconds_sum{stream_class="batch"} 0.75' in text
    assert 'tokenflow_e2e_latency_seconds_sum{stream_class="batch"} 3.25' in text
