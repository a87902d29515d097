"""A stream's portable state: export from one scheduler, import into another, and the stream
goes on as if it had stayed (same tokens, same reader's clock), with both KV pools intact."""

from __future__ import annotations

import pytest

from tests.core.helpers import make_core, make_request, run_to_completion
from tokenflow.core.migration import export_of, request_of
from tokenflow.core.request import RequestState, StructuredOutput


def _step_until(core, clock, request, num_tokens: int) -> None:
    while request.num_output_tokens < num_tokens:
        plan, _ = core.step()
        if plan.is_empty:
            clock.t += 0.005


def _undisturbed(**kwargs):
    core, clock, _ = make_core("tokenflow")
    request = make_request("s", **kwargs)
    core.add_request(request)
    run_to_completion(core, clock)
    return request


def _assert_empty(kv) -> None:
    kv.check_integrity()
    assert kv.num_free_device_blocks == kv.config.num_device_blocks
    assert kv.num_free_host_blocks == kv.config.num_host_blocks


def test_a_moved_stream_continues_with_the_same_tokens_and_counts():
    alone = _undisturbed(num_prompt=40, max_tokens=30)
    source, clock, _ = make_core("tokenflow")
    request = make_request("s", num_prompt=40, max_tokens=30)
    source.add_request(request)
    _step_until(source, clock, request, 12)
    state = source.scheduler.export_stream("s")
    _assert_empty(source.scheduler.kv)
    assert not source.has_work and "s" not in source.scheduler.requests

    target, target_clock, _ = make_core("tokenflow")
    target_clock.t = clock.t
    moved = target.scheduler.import_stream(state)
    target.scheduler.kv.check_integrity()
    assert moved.state is RequestState.PREEMPTED and moved.num_computed_tokens == 0
    run_to_completion(target, target_clock)
    target.scheduler.kv.check_integrity()
    assert moved.output_token_ids == alone.output_token_ids
    assert moved.num_output_tokens == len(moved.token_times_s) == 30
    assert moved.token_times_s[:12] == request.token_times_s[:12]
    assert target.scheduler.num_recomputes_total == 1  # it resumed by recompute


def test_the_reader_s_clock_goes_on_across_the_move():
    source, clock, _ = make_core("tokenflow")
    request = make_request("s", num_prompt=20, max_tokens=40, rate=5.0)
    source.add_request(request)
    _step_until(source, clock, request, 10)
    now = clock.t
    slack, buffered = request.slack_s(now), request.buffered_s(now)
    state = source.scheduler.export_stream("s")
    assert state.slack_s(now) == slack and slack > 0  # (one rule: `reader_slack_s`)
    assert state.num_delivered_tokens == 10
    assert state.consumption_start_s == request.token_times_s[0]
    target, target_clock, _ = make_core("tokenflow")
    target_clock.t = now
    moved = target.scheduler.import_stream(state)
    assert moved.slack_s(now) == slack and moved.buffered_s(now) == buffered
    assert moved.last_consume_s == request.last_consume_s and moved.rate_tps == 5.0


def test_a_paused_stream_moves_on_and_a_second_move_is_the_same():
    alone = _undisturbed(num_prompt=24, max_tokens=20)
    first, clock, _ = make_core("tokenflow")
    request = make_request("s", num_prompt=24, max_tokens=20)
    first.add_request(request)
    _step_until(first, clock, request, 5)
    second, second_clock, _ = make_core("tokenflow")
    paused = second.scheduler.import_stream(first.scheduler.export_stream("s"))
    assert paused.state is RequestState.PREEMPTED
    assert second.scheduler.preempted == [paused]
    third, third_clock, _ = make_core("tokenflow")
    third_clock.t = second_clock.t = clock.t
    moved = third.scheduler.import_stream(second.scheduler.export_stream("s"))
    _assert_empty(second.scheduler.kv)
    run_to_completion(third, third_clock)
    assert moved.output_token_ids == alone.output_token_ids


def test_a_queued_request_waits_again_keeping_its_arrival():
    source, _, _ = make_core("fcfs")
    source.add_request(make_request("q", arrival=1.5, seed=7, temperature=0.8))
    state = source.scheduler.export_stream("q")
    assert not state.is_started and state.arrival_s == 1.5
    target, clock, _ = make_core("fcfs")
    target.add_request(make_request("early", arrival=1.0))
    target.add_request(make_request("late", arrival=2.0))
    moved = target.scheduler.import_stream(state)
    assert moved.state is RequestState.WAITING and moved.arrival_s == 1.5
    assert [r.request_id for r in target.scheduler.waiting] == ["early", "q", "late"]
    assert moved.sampling_params.seed == 7 and moved.sampling_params.temperature == 0.8
    clock.t = 1.5
    run_to_completion(target, clock)
    assert moved.token_times_s[0] >= 1.5


def test_export_frees_the_host_copy_and_tells_the_executor():
    core, clock, _ = make_core("tokenflow")
    request = make_request("s", num_prompt=40, max_tokens=50)
    core.add_request(request)
    for _ in range(6):
        core.step()
    kv = core.scheduler.kv
    assert kv.num_free_device_blocks < kv.config.num_device_blocks
    core.scheduler.export_stream("s")
    _assert_empty(kv)
    plan, _ = core.step()
    assert plan.released_request_ids == ("s",)


def test_export_refuses_an_unknown_request_or_a_step_in_flight():
    core, clock, _ = make_core("fcfs")
    core.add_request(make_request("a"))
    with pytest.raises(ValueError, match="no such"):
        core.scheduler.export_stream("nope")
    core.scheduler.schedule(clock.t)
    with pytest.raises(ValueError, match="in flight"):
        core.scheduler.export_stream("a")


def test_a_stream_held_to_a_grammar_moves_with_its_schema():
    source, _, _ = make_core("fcfs")
    schema = StructuredOutput('{"type": "object"}')
    source.add_request(make_request("a", structured_output=schema))
    state = source.scheduler.export_stream("a")
    assert "a" not in source.scheduler.requests
    target, _, _ = make_core("fcfs")
    moved = target.scheduler.import_stream(state)
    assert moved.sampling_params.structured_output == schema  # (the engine resumes its matcher)


def test_import_refuses_a_duplicate_or_a_stream_too_long_for_it():
    core, _, _ = make_core("fcfs")
    core.add_request(make_request("a"))
    with pytest.raises(ValueError, match="duplicate"):
        core.scheduler.import_stream(export_of(make_request("a")))
    small, _, _ = make_core("fcfs", num_device_blocks=4)
    with pytest.raises(ValueError, match="device KV pool"):
        small.scheduler.import_stream(export_of(make_request("b", num_prompt=40)))


def test_the_state_round_trips_through_a_request():
    request = make_request("s", num_prompt=8, max_tokens=10, seed=3)
    for position in range(4):
        request.append_token(100 + position, 0.1 * (position + 1))
    again = request_of(export_of(request))
    assert export_of(again) == export_of(request)
    assert again.dry_s == request.dry_s and again.num_tokens == request.num_tokens


def test_the_session_hint_moves_with_the_stream():
    request = make_request("s", num_prompt=10, max_tokens=4)
    request.session_key = "conversation-7"
    assert request_of(export_of(request)).session_key == "conversation-7"
