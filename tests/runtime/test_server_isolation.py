"""The real server (tiny model): a poison request beside an innocent stream, a dead engine loop,
a shutdown with streams in flight; every request ends in tokens or its own explicit error."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from tests.runtime.sse_client import read_stream
from tests.serving.live_server import serve_in_thread, wait_until
from tokenflow.engine.async_engine import AsyncEngine
from tokenflow.engine.engine_args import EngineArgs
from tokenflow.serving.app import build_app

INNOCENT = {
    "prompt": "Once upon a time",
    "max_tokens": 24,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
    "stream_options": {"include_usage": True},
    "stream_rate": 1000,
}
POISON_SEED = 666


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    engine = AsyncEngine(EngineArgs(model=tiny_model_dir, device="cpu", max_model_len=256))
    with serve_in_thread(build_app(engine)) as url:
        yield engine, url
    engine.close()


async def stream_and_act(http: httpx.AsyncClient, body: dict, action) -> list[str]:
    """Stream `body`; call `action()` once the first data frame arrived; return the frames."""
    frames: list[str] = []
    async with http.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                frames.append(line[len("data: ") :])
                if len(frames) == 1:
                    action()
    return frames


def run_together(url: str, *bodies: dict):
    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            return await asyncio.gather(*(read_stream(http, "/v1/completions", b) for b in bodies))

    return asyncio.run(go())


@pytest.fixture(scope="module")
def solo(served):
    _, url = served
    (result,) = run_together(url, INNOCENT)
    assert result.is_complete and result.completion_tokens == 24
    return result.text


def test_the_issue_repro_tiny_temperature_beside_an_innocent_stream(served, solo):
    _, url = served
    poison = {**INNOCENT, "temperature": 1e-40, "max_tokens": 8}
    innocent, tiny = run_together(url, INNOCENT, poison)
    assert innocent.is_complete and innocent.text == solo
    assert tiny.is_complete  # 1e-40 means greedy


def test_a_request_failing_in_the_engine_fails_alone(served, solo, monkeypatch):
    engine, url = served
    sampler = engine.engine.executor.sampler
    original = sampler._sample_rows

    def sample_rows(logits, rows):
        if any(row.params.seed == POISON_SEED for row in rows):
            raise RuntimeError("poisoned row")
        return original(logits, rows)

    monkeypatch.setattr(sampler, "_sample_rows", sample_rows)
    poison = {**INNOCENT, "temperature": 0.7, "seed": POISON_SEED}
    innocent, failed = run_together(url, INNOCENT, poison)
    assert innocent.is_complete and innocent.text == solo
    # Its own explicit error: a 500 if it failed before its first bytes, else an error frame;
    # either way without the internal text (that goes to the server log).
    assert failed.status in (200, 500) and "server log" in failed.errors[0]
    assert "poisoned row" not in failed.errors[0]
    assert httpx.get(f"{url}/health").status_code == 200
    assert wait_until(lambda: engine.stats().num_running == 0)


def hold_steps(engine: AsyncEngine, num_streams: int) -> threading.Event:
    """Once `num_streams` requests have tokens, each engine step waits for the returned event,
    which the test sets when it has acted: the streams are still live when the action comes,
    however fast or slow the machine.  The wait's timeout only turns a hang into an error."""
    acted = threading.Event()
    step = engine.engine.step
    started: set[str] = set()

    def held_step():
        if len(started) >= num_streams and not acted.wait(timeout=120):
            raise RuntimeError("the test never acted")
        ran, deltas = step()
        started.update(delta.request_id for delta in deltas)
        return ran, deltas

    engine.engine.step = held_step  # type: ignore[method-assign]
    return acted


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_loop_fails_everyone_at_once_and_health_says_so(tiny_model_dir):
    engine = AsyncEngine(EngineArgs(model=tiny_model_dir, device="cpu", max_model_len=128))
    original = engine.engine.stats
    broken = {"on": False}

    def stats():  # runs in the loop after each step, outside step()'s own guard
        if broken["on"]:
            raise RuntimeError("bookkeeping corrupted")
        return original()

    engine.engine.stats = stats  # type: ignore[method-assign]
    acted = hold_steps(engine, 1)
    slow = {**INNOCENT, "max_tokens": 100, "stream_rate": 1}

    def break_stats() -> None:
        broken["on"] = True
        acted.set()

    try:
        with serve_in_thread(build_app(engine)) as url:

            async def go():
                async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                    return await stream_and_act(http, slow, break_stats)

            frames = asyncio.run(go())
            assert frames[-1] == "[DONE]" and '"code":"engine_stopped"' in frames[-2]
            assert wait_until(lambda: not engine.health().is_alive)
            health = httpx.get(f"{url}/health")
            assert health.status_code == 503 and health.json()["status"] == "dead"
            late = httpx.post(f"{url}/v1/completions", json=slow, timeout=10)
            assert late.status_code == 503 and "not running" in late.json()["error"]["message"]
    finally:
        engine.close()


def test_shutdown_ends_live_streams_with_an_error_frame(tiny_model_dir):
    engine = AsyncEngine(EngineArgs(model=tiny_model_dir, device="cpu", max_model_len=128))
    acted = hold_steps(engine, 3)
    slow = {**INNOCENT, "max_tokens": 100, "stream_rate": 1}

    def stop() -> None:
        engine.stop()
        acted.set()

    try:
        with serve_in_thread(build_app(engine)) as url:

            async def go():
                async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                    others = [
                        asyncio.ensure_future(read_stream(http, "/v1/completions", slow))
                        for _ in range(2)
                    ]
                    first = await stream_and_act(http, slow, stop)
                    return first, await asyncio.gather(*others)

            first, others = asyncio.run(go())
            assert first[-1] == "[DONE]" and "shutting down" in first[-2]
            # Each other stream ends with its own error: a frame, or a 503 if it came too late.
            assert all((r.is_done and r.errors) or r.status == 503 for r in others)
            assert httpx.get(f"{url}/health").status_code == 503
    finally:
        engine.close()
