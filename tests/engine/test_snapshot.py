"""The streams snapshot on hand-built states: the stall formula against the metrics module's,
the urgency order, the bounds and totals, the state names, and the moves a step made."""

from __future__ import annotations

import math

import pytest

from tests.core.helpers import make_core, make_request
from tokenflow.core.policies.base import Policy
from tokenflow.core.policies.capacity import measure_capacity
from tokenflow.core.request import MIN_READER_RATE_TPS, Consumption, SamplingParams
from tokenflow.engine.engine_args import EngineArgs
from tokenflow.engine.llm_engine import LLMEngine
from tokenflow.engine.snapshot import MoveWatch, stalled_s, stream_row, take_snapshot
from tokenflow.eval.metrics import rebuffer_time_s


def test_stalls_read_off_the_buffer_match_the_metrics_module() -> None:
    request = make_request("r", rate=2.0)
    times = [1.0, 1.2, 3.0, 3.1, 5.0, 5.05]
    for i, t in enumerate(times):
        request.append_token(100 + i, t)
    now = 5.05  # the reader still has tokens: no stall going on
    assert stalled_s(request, now) == pytest.approx(rebuffer_time_s(times, 2.0))
    # Later, past the buffer: the stall going on counts too.
    assert stalled_s(request, 20.0) == pytest.approx(
        rebuffer_time_s(times, 2.0) + 20.0 - request.dry_s
    )


def test_a_stream_state_for_a_reader_and_an_eager_request() -> None:
    reader = make_request("reader", rate=4.0, arrival=0.5)
    for i, t in enumerate((1.0, 1.0, 1.0, 1.0)):
        reader.append_token(100 + i, t)
    state = stream_row(reader, now_s=1.5, policy=Policy())
    assert state.state == "waiting" and state.ttft_s == pytest.approx(0.5)
    assert state.wait_reason == "queued"
    assert state.num_output_tokens == 4
    # Tokens at c = 1.0, 1.25, 1.5, 1.75: at 1.5 the first three are read, 0.25 s buffered.
    assert state.buffered_s == pytest.approx(0.25) and state.num_consumed_tokens == 3
    assert state.stalled_s == pytest.approx(0.0)
    eager = make_request("eager", consumption=Consumption.EAGER)
    eager.append_token(100, 1.0)
    state = stream_row(eager, now_s=2.0, policy=Policy())
    assert math.isinf(state.rate_tps) and state.buffered_s is None and state.stalled_s is None
    assert state.num_consumed_tokens == 1


def test_the_slowest_reader_allowed_has_a_finite_stream_state() -> None:
    # 1e-309 tokens/s once passed validation and made the snapshot raise for everyone
    reader = make_request("slow", rate=MIN_READER_RATE_TPS)
    reader.append_token(100, 1.0)
    state = stream_row(reader, now_s=2.0, policy=Policy())
    assert state.num_consumed_tokens == 1 and math.isfinite(state.buffered_s)


def test_the_snapshot_lists_the_most_urgent_and_counts_every_stream() -> None:
    core, clock, _ = make_core("tokenflow", num_device_blocks=12, block_size=4)
    for i in range(6):
        core.add_request(make_request(f"r{i}", num_prompt=8, max_tokens=12, rate=5.0))
    watch = MoveWatch()
    for _ in range(8):
        watch.before_step(core.scheduler)
        core.step()
        watch.after_step(core.scheduler, clock.now())
    snapshot = take_snapshot(core.scheduler, clock.now(), 3, "tokenflow", watch.last)
    s = snapshot
    assert len(s.streams) == 3
    assert s.num_waiting + s.num_running + s.num_loading + s.num_paused == 6
    slacks = [stream.slack_s for stream in s.streams]
    assert slacks == sorted(slacks)
    everyone = take_snapshot(core.scheduler, clock.now(), 100, "tokenflow", watch.last)
    assert sorted(x.request_id for x in everyone.streams) == [f"r{i}" for i in range(6)]
    assert {x.state for x in everyone.streams} <= {"waiting", "running", "loading", "paused"}
    assert s.num_device_blocks == 12 and 0 < s.num_device_blocks_used <= 12
    assert s.capacity_tps > 0 and s.demand_tps > 0
    assert s.last_moves is not None and s.last_moves.num_starts >= 1


def test_the_move_watch_ignores_a_step_that_moved_nothing() -> None:
    core, clock, _ = make_core("fcfs")
    core.add_request(make_request("a", max_tokens=8))
    watch = MoveWatch()
    watch.before_step(core.scheduler)
    core.step()
    watch.after_step(core.scheduler, clock.now())
    first = watch.last
    assert first is not None and first.num_starts == 1 and first.num_preemptions == 0
    watch.before_step(core.scheduler)
    core.step()  # a decode: nobody starts, nobody pauses
    watch.after_step(core.scheduler, clock.now())
    assert watch.last is first


def test_the_engine_keeps_the_class_it_is_given(tiny_model_dir) -> None:
    engine = LLMEngine(EngineArgs(model=tiny_model_dir, device="cpu", max_model_len=256))
    params = SamplingParams(max_tokens=4)
    prompt = engine.tokenizer.encode("Hello")
    engine.add_request("batch", prompt, params, math.inf, Consumption.BATCH)
    engine.add_request("eager", prompt, params, math.inf)  # an infinite rate alone: eager
    engine.add_request("reader", prompt, params, 3.0)
    classes = {s.request_id: s.consumption for s in engine.streams(8).streams}
    assert classes == {
        "batch": Consumption.BATCH,
        "eager": Consumption.EAGER,
        "reader": Consumption.READER,
    }
    engine.close()


def test_the_snapshot_shows_what_every_reader_asks_against_gamma() -> None:
    """Each reader counts its rate whole, up to what the engine gives one stream alone (past
    that it stalls whatever the schedule): six readers far faster than the engine ask six solo
    streams' worth, above Gamma, so the engine shows as overloaded; and the snapshot says how
    many readers are on the device."""
    core, clock, _ = make_core("fcfs", num_device_blocks=12, block_size=4, step_s=0.5)
    for i in range(6):
        core.add_request(make_request(f"r{i}", num_prompt=8, max_tokens=12, rate=900.0))
    for _ in range(3):
        core.step()
    s = take_snapshot(core.scheduler, clock.now(), 10, "fcfs", None)
    solo_tps = measure_capacity(core.scheduler.view(clock.now())).solo_tps
    assert s.asked_tps == pytest.approx(6 * solo_tps) and s.asked_tps > s.capacity_tps
    assert s.demand_tps < s.asked_tps  # (the started ones only)
    assert s.num_readers == 6 and 0 < s.num_served_readers <= 6
