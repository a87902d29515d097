"""vLLM's periodic stats line (serving/stats_log.py), on a fake clock and a stub engine."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace

import pytest

from tests.serving.fake_engine import FakeEngine
from tokenflow.cli.server_options import add_server_options, server_config_from
from tokenflow.engine.client import EngineStats
from tokenflow.serving.app import build_app
from tokenflow.serving.config import ServerConfig
from tokenflow.serving.metrics import ServingMetrics
from tokenflow.serving.stats_log import LOG_STATS_INTERVAL_S, StatsLog, logging_stats

IDLE = EngineStats(
    num_waiting=0,
    num_running=0,
    num_preempted=0,
    device_kv_usage=0.0,
    host_kv_usage=0.0,
    num_preemptions_total=0,
    num_loads_total=0,
    num_recomputes_total=0,
    buffer_slack_s=(),
)


@dataclass
class StubEngine:
    """What ServingMetrics and StatsLog read of an engine: its name and a settable snapshot."""

    model_name: str = "stub"
    snapshot: EngineStats = IDLE

    def stats(self) -> EngineStats:
        return self.snapshot


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def records() -> Iterator[list[logging.LogRecord]]:
    """What the stats logger emits, at every level (whatever the package loggers' setup)."""
    logger = logging.getLogger("tokenflow.serving.stats_log")
    got: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = got.append  # type: ignore[method-assign]
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield got
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def make_log(engine: StubEngine, clock: Clock) -> tuple[ServingMetrics, StatsLog]:
    metrics = ServingMetrics(engine)  # type: ignore[arg-type]
    return metrics, StatsLog(engine, metrics.vllm, clock=clock)  # type: ignore[arg-type]


def test_line_after_activity_is_vllms_at_info(records: list[logging.LogRecord]) -> None:
    engine, clock = StubEngine(), Clock()
    metrics, stats_log = make_log(engine, clock)
    # 40 prompt tokens of which 20 cached (prefilled: 20), 50 generated, in 10 s.
    metrics.observe_ttft(0.2, "eager", num_prompt_tokens=40, num_cached_tokens=20)
    metrics.observe_inter_token(0.05, 49, "eager")
    engine.snapshot = replace(
        IDLE,
        num_waiting=1,
        num_running=4,
        num_preempted=2,
        device_kv_usage=0.41,
        num_preemptions_total=3,
    )
    clock.now_s += 10.0
    stats_log.log()
    assert [r.getMessage() for r in records] == [
        "Engine 000: Avg prompt throughput: 2.0 tokens/s, Avg generation throughput: 5.0 "
        "tokens/s, Running: 4 reqs, Waiting: 3 reqs, Paused: 2 reqs, Preemptions: 3, "
        "GPU KV cache usage: 41.0%"
    ]
    assert records[0].levelno == logging.INFO


def test_idle_after_one_quiet_interval_goes_to_debug(records: list[logging.LogRecord]) -> None:
    engine, clock = StubEngine(), Clock()
    metrics, stats_log = make_log(engine, clock)
    clock.now_s += 10.0
    assert stats_log.log().is_idle  # nothing since start
    metrics.observe_ttft(0.2, "eager", num_prompt_tokens=8, num_cached_tokens=0)
    clock.now_s += 10.0
    active = stats_log.log()
    clock.now_s += 10.0
    after = stats_log.log()  # quiet, but shows the server went idle: still INFO, as vLLM
    clock.now_s += 10.0
    idle = stats_log.log()
    assert (active.prompt_tps, active.generation_tps) == (0.8, 0.1)
    assert (after.prompt_tps, after.generation_tps) == (0.0, 0.0)
    assert [r.levelno for r in records] == [
        logging.DEBUG,
        logging.INFO,
        logging.INFO,
        logging.DEBUG,
    ]
    assert not (active.is_idle or after.is_idle) and idle.is_idle
    assert "Preemptions" not in records[-1].getMessage()  # none in the interval


def test_preemptions_are_the_intervals() -> None:
    engine, clock = StubEngine(snapshot=replace(IDLE, num_preemptions_total=5)), Clock()
    _, stats_log = make_log(engine, clock)  # 5 before the first interval began
    engine.snapshot = replace(IDLE, num_preemptions_total=7)
    assert stats_log.take().num_preemptions == 2
    assert stats_log.take().num_preemptions == 0


@pytest.mark.anyio
async def test_run_logs_every_interval_until_cancelled(
    records: list[logging.LogRecord],
) -> None:
    engine, clock = StubEngine(), Clock()
    metrics = ServingMetrics(engine)  # type: ignore[arg-type]
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        clock.now_s += seconds
        if len(waits) == 3:
            raise asyncio.CancelledError

    stats_log = StatsLog(engine, metrics.vllm, clock=clock, sleep=sleep)  # type: ignore[arg-type]
    with pytest.raises(asyncio.CancelledError):
        await stats_log.run()
    assert waits == [LOG_STATS_INTERVAL_S] * 3 == [10.0] * 3  # vLLM's default interval
    assert len(records) == 2


@pytest.mark.anyio
async def test_logging_stats_cancels_its_task_on_exit() -> None:
    engine = StubEngine()
    metrics = ServingMetrics(engine)  # type: ignore[arg-type]
    events: list[str] = []

    async def sleep(seconds: float) -> None:
        events.append("sleeping")
        try:
            await asyncio.Event().wait()
        finally:
            events.append("cancelled")

    stats_log = StatsLog(engine, metrics.vllm, sleep=sleep)  # type: ignore[arg-type]
    async with logging_stats(stats_log):
        await asyncio.sleep(0)  # the task starts and sleeps
    assert events == ["sleeping", "cancelled"]
    async with logging_stats(None):  # --disable-log-stats: nothing runs
        pass


def test_disable_log_stats_flag() -> None:
    parser = argparse.ArgumentParser()
    add_server_options(parser)
    assert not server_config_from(parser.parse_args([])).disable_log_stats
    args = parser.parse_args(["--disable-log-stats"])
    assert server_config_from(args).disable_log_stats
    assert isinstance(build_app(FakeEngine()).state.stats_log, StatsLog)
    off = build_app(FakeEngine(), ServerConfig(disable_log_stats=True))
    assert off.state.stats_log is None
