"""Andes' QoE knapsack on small hand-built situations."""

from dataclasses import replace

from tests.core.helpers import make_core, make_request
from tokenflow.core.config import AndesConfig, SchedulerConfig
from tokenflow.core.policies.andes import AndesPolicy
from tokenflow.core.request import Consumption, PreemptMode

OPTIMISTIC = SchedulerConfig(
    init_new_token_ratio=0.01,
    min_new_token_ratio=0.01,
    link_bytes_per_s=1e6,
    initial_decode_step_s=0.05,
)


def pressured(policy="andes"):
    """Two streams fill the device (one far ahead of its reader), a third arrives at 1 s."""
    core, clock, _ = make_core(
        policy, num_device_blocks=22, step_s=0.05, scheduler_config=OPTIMISTIC
    )
    ahead = make_request("ahead", num_prompt=20, max_tokens=60, rate=1.0)
    behind = make_request("behind", num_prompt=20, max_tokens=60, rate=15.0)
    core.add_request(ahead)
    core.add_request(behind)
    while clock.t < 0.99:
        core.step()
    late = make_request("late", num_prompt=20, max_tokens=60, rate=5.0, arrival=clock.t)
    core.add_request(late)
    return core, clock, (ahead, behind, late)


def test_gain_is_zero_for_a_stream_far_ahead_and_positive_for_a_late_newcomer():
    core, clock, (ahead, behind, late) = pressured()
    policy = AndesPolicy(AndesConfig(ttft_target_s=0.1))
    view = core.scheduler.view(clock.t + 1.0)
    assert policy.gain(view, ahead, 20.0) == 0.0
    assert policy.gain(view, late, 20.0) > 0.0


def test_knapsack_preempts_the_stream_that_can_wait_by_recompute():
    core, clock, (ahead, behind, late) = pressured()
    assert core.scheduler.kv.device_usage >= 0.9
    policy = AndesPolicy(AndesConfig(ttft_target_s=0.1))
    view = core.scheduler.view(clock.t + 1.0)
    moves = policy.knapsack(view)
    assert [p.request_id for p in moves.preemptions] == ["ahead"]
    assert all(p.mode is PreemptMode.RECOMPUTE for p in moves.preemptions)
    assert [s.request_id for s in moves.starts] == ["late"]


def test_eager_and_batch_requests_are_valued_at_one_stream_s_pace_not_divided_by_infinity():
    core, clock, _ = pressured()
    policy = AndesPolicy(AndesConfig(ttft_target_s=0.1))
    view = core.scheduler.view(clock.t + 1.0)
    for consumption in (Consumption.EAGER, Consumption.BATCH):
        request = make_request("agent", max_tokens=60, arrival=clock.t, consumption=consumption)
        alone_tps = 1.0 / view.estimator.decode_time_s(1)
        assert policy.wanted_tps(view, request) == alone_tps
        assert policy.gain(view, request, alone_tps) > 0.0  # (was a ZeroDivisionError)


def test_a_mixed_burst_under_pressure_completes_every_request():
    core, clock, requests = pressured()
    for i, consumption in enumerate((Consumption.EAGER, Consumption.BATCH) * 2):
        request = make_request(f"m{i}", max_tokens=30, arrival=clock.t, consumption=consumption)
        core.add_request(request)
        requests += (request,)
    while core.has_work and clock.t < 120.0:
        core.step()
    assert all(r.is_finished for r in requests)


def test_no_preemption_once_the_budget_per_request_is_spent():
    core, clock, _ = pressured()
    policy = AndesPolicy(AndesConfig(max_preemptions_per_request=0.0))
    view = core.scheduler.view(clock.t)
    assert policy.plan_moves(view).preemptions == ()


def test_below_the_usage_threshold_it_is_plain_fcfs():
    core, clock, (ahead, behind, late) = pressured()
    policy = AndesPolicy(AndesConfig(kv_usage_threshold=1.0))
    view = replace(core.scheduler.view(clock.t), waiting=[late])
    assert view.kv.device_usage < 1.0
    assert policy.plan_moves(view).preemptions == ()


def first_token_delay_s(policy: str) -> float:
    core, clock, (ahead, behind, late) = pressured(policy)
    if policy == "andes":
        core.scheduler.policy = AndesPolicy(AndesConfig(ttft_target_s=0.1))
    while not late.output_token_ids:
        core.step()
    return late.token_times_s[0] - late.arrival_s


def test_end_to_end_the_newcomer_starts_sooner_than_under_fcfs():
    assert first_token_delay_s("andes") < first_token_delay_s("fcfs")
