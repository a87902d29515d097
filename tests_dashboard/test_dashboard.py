"""/dashboard in Debian's headless Chromium against a live server (the tiny model) while a burst
of readers does not fit the device tier: the page makes its data calls, and draws a bar per
stream it was told of.  Pixels are not checked (tests_dashboard/screenshot.py takes a
picture); `make test-dashboard` installs Chromium where it is missing."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import httpx
import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tests.serving.live_server import serve_in_thread, wait_until
from tokenflow.engine.async_engine import AsyncEngine
from tokenflow.engine.engine_args import EngineArgs
from tokenflow.serving.app import build_app
from tokenflow.serving.config import ServerConfig

API_KEY = "page-key"
STREAMS_PATH = "/v1/tokenflow/streams"
MAX_TOKENS = 1000
NUM_STREAMS = 6  # of 4 + 1000 tokens (63 blocks) where the device tier holds 128 blocks
SHARED_PROMPT = "You are a careful assistant who answers in short sentences. " * 4  # 3+ blocks
# (long answers: the tiny model makes hundreds of tokens a second, and the streams must still
# be generating when the page is captured)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class CountPageCalls:
    """ASGI wrapper: the status of every request Chromium made to `path`."""

    def __init__(self, app: ASGIApp, path: str) -> None:
        self.app = app
        self.path = path
        self.statuses: list[int] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope.get("headers", ()))
        is_page = b"HeadlessChrome" in headers.get(b"user-agent", b"")
        if scope["type"] != "http" or scope["path"] != self.path or not is_page:
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.statuses.append(message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)


@contextlib.contextmanager
def open_streams(url: str, num_streams: int) -> Iterator[None]:
    """Readers at 2 tokens/s reading their streams until the block ends (then they hang up,
    which aborts what is left of them in the engine)."""
    stop = threading.Event()
    body = {"prompt": "Tell me a story", "max_tokens": MAX_TOKENS, "stream": True, "stream_rate": 2}
    body["ignore_eos"] = True
    headers = {"Authorization": f"Bearer {API_KEY}"}

    async def read(http: httpx.AsyncClient) -> None:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            async for _ in response.aiter_lines():
                if stop.is_set():
                    return

    async def main() -> None:
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300) as http:
            tasks = [asyncio.ensure_future(read(http)) for _ in range(num_streams)]
            while not stop.is_set() and not all(t.done() for t in tasks):
                await asyncio.sleep(0.05)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=60)


def warm_up(url: str) -> None:
    """One short request first: the first decode compiles a kernel (seconds with a cold
    compiler cache), during which the loop answers no snapshot."""
    body = {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=600)
    assert response.status_code == 200, response.text


def streams(url: str) -> dict:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.get(f"{url}{STREAMS_PATH}", headers=headers, timeout=60).json()


def num_unfinished(url: str) -> int:
    return streams(url)["totals"]["num_unfinished"]


def percent(share: float) -> str:
    """`share` as the page writes it: 100 x share by JavaScript's toFixed(1), which takes the
    larger of two equally near values (Python's format would round half to even)."""
    return str(Decimal(100 * share).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP))


def dump_dom(url: str, profile: Path) -> str:
    """The page's DOM after 10 s of its (virtual) time: about ten polls."""
    command = [
        CHROMIUM,
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=10000",
        "--dump-dom",
        f"{url}/dashboard#key={API_KEY}",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (make test-dashboard)")
def test_the_page_polls_and_draws_a_bar_per_stream(tiny_model_dir, tmp_path):
    args = EngineArgs(
        model=tiny_model_dir, device="cpu", device_kv_tokens=128 * 16, max_model_len=1024
    )
    engine = AsyncEngine(args)
    app = CountPageCalls(build_app(engine, ServerConfig(api_keys=(API_KEY,))), STREAMS_PATH)
    try:
        with serve_in_thread(app) as url:  # type: ignore[arg-type]
            warm_up(url)
            with open_streams(url, NUM_STREAMS):
                assert wait_until(lambda: num_unfinished(url) == NUM_STREAMS)
                dom = dump_dom(url, tmp_path / "profile")
                still_unfinished = num_unfinished(url)
    finally:
        engine.close()
    assert len(app.statuses) >= 2 and set(app.statuses) == {200}, app.statuses
    rows = re.findall(r'<div class="stream (\w+)[^"]*" data-id="(cmpl-[0-9a-f]+)"', dom)
    shown = re.search(r"streams <b>(\d+)</b>", dom)
    assert shown is not None, dom[-2000:]
    page = dom.split("<script", 1)[0][-4000:]  # the drawn page, without its script
    assert len(rows) == int(shown.group(1)) >= 1, page  # a bar per stream it was told of
    assert {state for state, _ in rows} <= {"waiting", "running", "loading", "paused"}
    assert still_unfinished >= 1  # (the page saw the burst, not its end)
    assert "<canvas" in dom and "policy tokenflow" in dom


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (make test-dashboard)")
def test_the_page_shows_the_cached_blocks_per_tier_and_the_prefix_hit_rate(
    tiny_model_dir, tmp_path
):
    args = EngineArgs(model=tiny_model_dir, device="cpu", max_model_len=1024)
    engine = AsyncEngine(args)
    app = build_app(engine, ServerConfig(api_keys=(API_KEY,)))
    body = {"prompt": SHARED_PROMPT, "max_tokens": 4, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    try:
        with serve_in_thread(app) as url:
            for _ in range(2):  # the second finds the first's full blocks cached
                response = httpx.post(f"{url}/v1/completions", json=body, headers=headers,
                                      timeout=600)  # fmt: skip
                assert response.status_code == 200, response.text
            shown = streams(url)  # (idle from here on: the page sees the same numbers)
            dom = dump_dom(url, tmp_path / "profile")
    finally:
        engine.close()
    kv, prefix = shown["kv"], shown["prefix_cache"]
    assert kv["device_cached_blocks"] >= 3 and prefix["device_hit_tokens_total"] >= 32
    page = dom.split("<script", 1)[0][-4000:]  # the drawn page, without its script
    cached = f"{kv['device_cached_blocks']} device, {kv['host_cached_blocks']} host"
    assert f"cached blocks <b>{cached}</b>" in page, page
    rate = f"{percent(prefix['hit_rate'])}% of {prefix['queried_tokens_total']} tok"
    assert f"prefix hits <b>{rate}</b>" in page, page
