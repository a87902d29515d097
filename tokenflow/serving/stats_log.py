"""The periodic stats line of vLLM's `LoggingStatLogger`, worded as vLLM 0.32.0's so that log
searches and parsers written for `vllm serve` find it, with our paused streams added:

    Engine 000: Avg prompt throughput: 51.2 tokens/s, Avg generation throughput: 88.0 tokens/s,
    Running: 4 reqs, Waiting: 3 reqs, Paused: 2 reqs, Preemptions: 1, GPU KV cache usage: 41.0%

- Waiting counts the paused streams, as `vllm:num_requests_waiting` does (vllm_metrics.py);
  Paused says how many of them are paused, as vLLM's "Deferred" says how many of its waiting
  requests were skipped.
- Prompt throughput counts the prompt tokens prefilled (prefix-cache hits left out), as vLLM's;
  both throughputs are per second of the interval since the previous line.
- Preemptions (streams taken off the device in the interval) only where there were some.

A line is logged at INFO after an interval that served tokens, and after the one following it
(the line that shows the server went idle); at DEBUG otherwise: vLLM's rule against noise on an
idle server.  `tokenflow serve --disable-log-stats` turns the line off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from tokenflow.engine.client import EngineClient
from tokenflow.serving.vllm_metrics import VllmMetrics, vllm_num_waiting

logger = logging.getLogger(__name__)

LOG_STATS_INTERVAL_S = 10.0  # vLLM's default (VLLM_LOG_STATS_INTERVAL)
# vLLM names the device its KV lives on ("GPU" under CUDA); the engine client does not say.
KV_CACHE_DEVICE = "GPU"
ENGINE_PREFIX = "Engine 000: "  # vLLM's prefix for its engine 0 (the `engine` label "0")


@dataclass(frozen=True)
class StatsLine:
    """One interval's numbers, as the line shows them."""

    prompt_tps: float  # prompt tokens prefilled per second
    generation_tps: float
    num_running: int
    num_waiting: int  # queued plus paused
    num_paused: int
    num_preemptions: int  # in the interval
    kv_cache_usage: float  # device blocks in use, 0..1
    is_idle: bool  # no token in this interval nor the one before: logged at DEBUG

    def message(self, kv_cache_device: str = KV_CACHE_DEVICE) -> str:
        """The line as vLLM words it."""
        parts = [
            f"Avg prompt throughput: {self.prompt_tps:.1f} tokens/s",
            f"Avg generation throughput: {self.generation_tps:.1f} tokens/s",
            f"Running: {self.num_running} reqs",
            f"Waiting: {self.num_waiting} reqs",
            f"Paused: {self.num_paused} reqs",
        ]
        if self.num_preemptions > 0:
            parts.append(f"Preemptions: {self.num_preemptions}")
        parts.append(f"{kv_cache_device} KV cache usage: {self.kv_cache_usage * 100:.1f}%")
        return ENGINE_PREFIX + ", ".join(parts)


class StatsLog:
    """Logs a `StatsLine` every `interval_s` of `clock` (monotonic seconds) while `run()` runs;
    the tokens come from the vLLM counters, the requests and KV from the engine's stats."""

    def __init__(
        self,
        engine: EngineClient,
        metrics: VllmMetrics,
        interval_s: float = LOG_STATS_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        self._engine = engine
        self._metrics = metrics
        self._interval_s = interval_s
        self._clock = clock
        self._sleep = sleep
        self._last_s = clock()
        self._last_served = metrics.tokens_served()
        self._last_preemptions = engine.stats().num_preemptions_total
        self._was_active = False

    def take(self) -> StatsLine:
        """The numbers of the interval since the previous take (or the start); begins the
        next interval."""
        now, served, stats = self._clock(), self._metrics.tokens_served(), self._engine.stats()
        elapsed_s = now - self._last_s
        interval = served.since(self._last_served)
        num_prompt = interval.num_computed_prompt_tokens
        num_generated = interval.num_generation_tokens
        is_active = num_prompt > 0 or num_generated > 0
        line = StatsLine(
            prompt_tps=num_prompt / elapsed_s if elapsed_s > 0 else 0.0,
            generation_tps=num_generated / elapsed_s if elapsed_s > 0 else 0.0,
            num_running=stats.num_running,
            num_waiting=vllm_num_waiting(stats),
            num_paused=stats.num_preempted,
            num_preemptions=stats.num_preemptions_total - self._last_preemptions,
            kv_cache_usage=stats.device_kv_usage,
            is_idle=not (is_active or self._was_active),
        )
        self._last_s, self._last_served = now, served
        self._last_preemptions, self._was_active = stats.num_preemptions_total, is_active
        return line

    def log(self) -> StatsLine:
        """Take the interval's numbers and log them (DEBUG when idle, else INFO)."""
        line = self.take()
        logger.log(logging.DEBUG if line.is_idle else logging.INFO, "%s", line.message())
        return line

    async def run(self) -> None:
        """Log a line every `interval_s` until cancelled (the app's lifespan starts it)."""
        while True:
            await self._sleep(self._interval_s)
            self.log()


@contextlib.asynccontextmanager
async def logging_stats(stats_log: StatsLog | None) -> AsyncIterator[None]:
    """Runs `stats_log` in the background for the length of the block (None: nothing runs)."""
    task = None if stats_log is None else asyncio.create_task(stats_log.run())
    try:
        yield
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
