"""TokenFlow's phases and formulas, each on a small hand-built state."""

import math
import random
import statistics
from dataclasses import replace

import pytest

from tests.core.helpers import make_request
from tests.core.tokenflow_states import empty_view, full_view, member, three_streams
from tokenflow.core.config import TokenFlowConfig
from tokenflow.core.estimator import StepTimeEstimator
from tokenflow.core.policies.admission import admit, refilled_prefill_budget_s, working_set_limit
from tokenflow.core.policies.balance import select
from tokenflow.core.policies.capacity import CapacityFloor, measure_capacity
from tokenflow.core.policies.pricing import Prices, is_pausable, utility
from tokenflow.core.policies.pricing import member as member_of
from tokenflow.core.policies.resume import resume_start
from tokenflow.core.request import Consumption

# -- pricing --------------------------------------------------------------------------------------


def test_utility_is_the_documented_formula():
    config = TokenFlowConfig(schedule_interval_s=0.5, value_horizon_s=8.0, switch_penalty=0.2)
    for buffered in (0.0, 0.3, 4.0, 9.0):
        value = max(0.0, 1 - buffered / 8.0)
        expected = value * 0.5 + 1.0 * 0.5 * math.exp(-buffered / 0.5)
        assert utility(config, buffered, True) == pytest.approx(expected)
        assert utility(config, buffered, False) == pytest.approx(expected - 0.2 * 0.5)
    assert utility(config, 0.1, True) > utility(config, 1.0, True) > utility(config, 5.0, True)


def test_pausable_needs_a_buffer_of_mu_round_trips_and_host_room():
    core, clock, (r1, r2, r3) = three_streams()
    view = core.scheduler.view(clock.t)
    config = TokenFlowConfig()
    prices = Prices.at(config, view)
    assert is_pausable(config, view, r1, prices)  # reads at 2 tok/s: seconds buffered
    assert not is_pausable(config, view, r2, prices)  # reads as fast as it is generated
    assert not is_pausable(config, view, r3, prices)  # waiting: nothing to pause
    cautious = TokenFlowConfig(buffer_conservativeness=1000.0)
    assert not is_pausable(cautious, view, r1, prices)


def test_a_stall_past_the_bound_is_overdue_and_a_newcomer_never_is():
    core, clock, (r1, r2, r3) = three_streams()
    config = TokenFlowConfig(max_stall_s=1.0)
    view = core.scheduler.view(r2.dry_s + 1.5)
    prices = Prices.at(config, view)
    stalled, newcomer = (member_of(config, view, r, 1, prices) for r in (r2, r3))
    assert stalled.is_overdue and stalled.is_urgent  # stalled 1.5 s > 1 s
    assert not newcomer.is_overdue and not newcomer.is_urgent  # no token yet: no stall


# -- capacity -------------------------------------------------------------------------------------


def test_gamma_is_measured_at_the_batch_the_device_holds_at_the_mean_lifetime_footprint():
    core, clock, (r1, r2, r3) = three_streams()
    view = core.scheduler.view(clock.t)
    capacity = measure_capacity(view)
    beta = (math.ceil((20 + 30) / 4) + math.ceil((20 + 30) / 4)) / 2  # prompt + max_tokens / 2
    assert capacity.beta_blocks == beta
    assert capacity.batch == max(1, int(24 / beta))
    expected = view.estimator.capacity_tps(capacity.batch, beta * 4)
    assert capacity.gamma_tps == expected
    assert capacity.demand_tps([r1, r2]) == min(2.0, capacity.solo_tps) + min(
        15.0, capacity.solo_tps
    )


def test_capacity_floor_reads_the_lower_median_of_its_window():
    rng = random.Random(7)
    for window_s in (0.0, 0.35, 2.0):
        floor, seen, now = CapacityFloor(window_s), [], 0.0
        for _ in range(400):
            now += rng.choice((0.0, 0.05, 0.1, 0.4))
            gamma = float(rng.choice((rng.randint(90, 110), rng.uniform(50.0, 150.0))))
            seen.append((now, gamma))
            window = [g for t, g in seen if t >= now - window_s]
            assert floor.observe(now, gamma) == statistics.median_low(window)


def test_one_high_gamma_is_not_trusted_until_it_holds():
    floor = CapacityFloor(window_s=1.0)
    assert floor.observe(0.0, 5500.0) == 5500.0
    assert floor.observe(0.5, 7600.0) == 5500.0  # one high estimate alone is not trusted
    assert floor.observe(1.0, 5600.0) == 5600.0  # the lower median of the window
    assert floor.observe(1.5, 5700.0) == 5700.0
    assert floor.observe(2.0, 7700.0) == 5700.0
    assert floor.observe(2.5, 7800.0) == 7700.0  # a rise that held is trusted
    falling = CapacityFloor(window_s=1.0)
    falling.observe(0.0, 6000.0)
    assert falling.observe(0.5, 3000.0) == 3000.0  # a fall, in half the window, is followed


# -- admission ------------------------------------------------------------------------------------


def _admit(view, members, waiting, spare_tps=1e9, budget_s=10.0):
    admission = admit(replace(view, waiting=waiting), members, 100, spare_tps, _rate, budget_s)
    return [r.request_id for r in admission.requests]


def _rate(request):
    return request.rate_tps


def test_admission_counts_the_blocks_a_pause_frees():
    newcomer = make_request("new", num_prompt=40, max_tokens=1)  # 10 blocks
    view, members = full_view(20, 100, {"small": (4, 0)})
    assert _admit(view, members, [newcomer]) == []
    view, members = full_view(20, 100, {"big": (12, 0)})
    assert _admit(view, members, [newcomer]) == ["new"]
    view, members = full_view(20, 100, {"small": (4, 0), "big": (12, 0)})
    assert _admit(view, members, [newcomer]) == ["new"]


def test_admission_needs_host_room_for_each_pause():
    newcomer = make_request("new", num_prompt=40, max_tokens=1)  # 10 blocks: needs both
    tight, members = full_view(20, 4 + 5, {"a": (6, 4), "b": (6, 4)})  # (4 already synced)
    assert _admit(tight, members, [newcomer]) == []  # host room for one tail only
    roomy, members = full_view(20, 4 + 8, {"a": (6, 4), "b": (6, 4)})
    assert _admit(roomy, members, [newcomer]) == ["new"]


def test_admission_stops_at_the_rate_budget_in_arrival_order():
    view = empty_view(100)
    first = make_request("first", num_prompt=4, max_tokens=2, rate=5.0)
    second = make_request("second", num_prompt=4, max_tokens=2, rate=5.0, arrival=1.0)
    third = make_request("third", num_prompt=4, max_tokens=2, rate=0.1, arrival=2.0)
    members = [member("m", 0.0, 1, pinned=True)]
    assert _admit(view, members, [first, second, third], spare_tps=7.0) == ["first"]
    assert _admit(view, [], [first, second, third], spare_tps=0.0) == ["first"]  # empty set


def test_admission_stops_at_the_working_set_limit():
    view = empty_view(400, 400)
    waiting = [make_request(f"n{i}", num_prompt=4, max_tokens=2) for i in range(5)]
    admission = admit(replace(view, waiting=waiting), [], 3, 1e9, _rate, 10.0)
    assert len(admission.requests) == 3
    eager = working_set_limit(TokenFlowConfig(working_set_smoothing=0.0), view, 4.0)
    cautious = working_set_limit(TokenFlowConfig(working_set_smoothing=1.0), view, 4.0)
    assert cautious == len(view.running) and eager == int((400 + 400) / 4.0)


def _prompt_of(view, seconds):
    per_token_s = view.estimator.prefill_time_s(1000) / 1000
    return int(seconds / per_token_s)


def test_admission_is_paced_by_one_interval_of_prefill():
    view = empty_view(4000)
    prompt = _prompt_of(view, 0.2)  # each newcomer takes ~0.2 s of the 0.5 s interval
    waiting = [make_request(f"n{i}", num_prompt=prompt, max_tokens=1) for i in range(4)]
    assert _admit(view, [], waiting, budget_s=0.5) == ["n0", "n1"]
    assert _admit(view, [], waiting[:1], budget_s=0.0) == ["n0"]  # the first always fits


def test_unused_prefill_time_carries_over_one_interval_at_most():
    view = empty_view(4000)
    prompt = _prompt_of(view, 0.3)
    waiting = [make_request(f"n{i}", num_prompt=prompt, max_tokens=1) for i in range(6)]
    first = admit(replace(view, waiting=waiting), [], 100, 1e9, _rate, 0.5)
    assert len(first.requests) == 1 and first.prefill_budget_s == pytest.approx(0.2, abs=0.02)
    carried = refilled_prefill_budget_s(0.5, first.prefill_budget_s, queue_drained=False)
    assert _admit(view, [], waiting[1:], budget_s=carried) == ["n1", "n2"]
    # a quiet spell carries one interval
    assert refilled_prefill_budget_s(0.5, 5.0, queue_drained=False) == 1.0


def test_a_drained_queue_refills_the_prefill_budget_to_one_interval():
    assert refilled_prefill_budget_s(0.5, -0.3, queue_drained=True) == 0.5
    assert refilled_prefill_budget_s(0.5, 0.8, queue_drained=True) == 0.8  # (kept, not cut)


def test_admission_credits_prompts_prefilled_together():
    """Short prompts whose prefill is mostly a fixed per-step cost start together."""
    estimator = StepTimeEstimator(0.05, 1e-4)
    for tokens in (32, 64, 32, 128):
        estimator.observe(0, tokens, 0.05 + 0.3 + 1e-4 * tokens)  # base + p0 + p1 * T
    view = replace(empty_view(4000), estimator=estimator)
    waiting = [make_request(f"n{i}", num_prompt=32, max_tokens=1) for i in range(6)]
    assert estimator.prefill_time_s(32) * 2 > 0.5  # one after another: two take an interval
    admission = admit(replace(view, waiting=waiting), [], 100, 1e9, _rate, 0.5)
    assert len(admission.requests) == 6
    assert admission.prefill_budget_s == pytest.approx(0.5 - estimator.prefill_time_s(6 * 32))


# -- balancing ------------------------------------------------------------------------------------


def _select(members, blocks, by_arrival=False, resume_budget_s=math.inf):
    chosen = select(members, blocks, 256, by_arrival, resume_budget_s)
    return [m.request.request_id for m in chosen]


def test_balance_is_greedy_by_utility_under_memory():
    a, b, c = member("A", 1.0, 6), member("B", 0.9, 5), member("C", 0.5, 4)
    assert _select([c, b, a], 10) == ["A", "C"]  # B has no room after A; C has


def test_pinned_members_are_always_kept():
    assert _select([member("H", 3.0, 8), member("P", -5.0, 8, pinned=True)], 10) == ["P"]


def test_degraded_balance_serves_by_arrival_streams_about_to_stall_first():
    early = member("early", 0.1, 4, arrival=0.0, is_urgent=True)
    late = member("late", 0.9, 4, arrival=1.0, is_urgent=True)
    calm = member("calm", 0.1, 4, arrival=0.0)
    assert _select([late, early], 4) == ["late"]  # schedulable: by utility
    assert _select([late, early], 4, by_arrival=True) == ["early"]
    assert _select([calm, late], 4, by_arrival=True) == ["late"]  # about to stall goes first


def test_a_stream_stalled_past_the_bound_goes_first():
    # (a stalled stream is urgent too; it goes before an earlier urgent one)
    stalled = member("stalled", 0.5, 4, False, False, 1.0, 5.0, is_overdue=True, is_urgent=True)
    early = member("early", 0.9, 4, resident=False, arrival=0.0, is_urgent=True)
    assert _select([early, stalled], 4) == ["stalled"]
    assert _select([early, stalled], 4, by_arrival=True) == ["stalled"]


def test_a_paused_reader_about_to_run_dry_displaces_eager_and_batch_streams_latest_first():
    eager = [
        member(f"e{i}", 1.0, 4, pinned=True, arrival=i, consumption=Consumption.EAGER)
        for i in range(3)
    ]
    batch = member("b", 1.0, 4, pinned=True, arrival=3.0, consumption=Consumption.BATCH)
    dry = member("dry", 0.4, 6, resident=False, is_urgent=True)
    assert _select([*eager, batch, dry], 16) == ["e0", "e1", "dry"]  # b and e2 yield
    calm = member("calm", 0.4, 6, resident=False)  # (not about to run dry: waits)
    assert _select([*eager, batch, calm], 16) == ["e0", "e1", "e2", "b"]


def test_a_pinned_reader_never_yields_to_another_reader():
    pinned = [member(f"r{i}", 1.0, 4, pinned=True, arrival=i) for i in range(4)]
    dry = member("dry", 0.4, 6, resident=False, is_urgent=True)
    assert _select([*pinned, dry], 16) == ["r0", "r1", "r2", "r3"]


def test_equal_newcomers_start_by_arrival_so_none_is_passed_over():
    early = member("early", 0.5, 4, resident=False, rate=2.0, started=False)
    late = member("late", 0.5, 4, resident=False, arrival=1.0, rate=20.0, started=False)
    assert _select([late, early], 4) == ["early"]


def test_on_equal_utility_the_faster_started_reader_goes_first():
    slow = member("slow", 0.5, 4, resident=False, rate=2.0)
    fast = member("fast", 0.5, 4, resident=False, arrival=1.0, rate=20.0)
    assert _select([slow, fast], 4) == ["fast"]


def test_resumes_share_one_interval_of_link_time():
    a = member("a", 0.9, 1, resident=False, resume_s=0.3)
    b = member("b", 0.8, 1, resident=False, resume_s=0.3)
    c = member("c", 0.7, 1, resident=False, resume_s=0.1)
    assert _select([a, b, c], 10, resume_budget_s=0.5) == ["a", "c"]
    assert _select([member("big", 0.9, 1, resident=False, resume_s=9.0)], 10, False, 0.5) == [
        "big"
    ]  # the first resume always fits


# -- resume mode ----------------------------------------------------------------------------------


def test_reload_or_recompute_follows_the_link_speed():
    core, clock, (r1, r2, r3) = three_streams()
    core.step()  # R1 offloaded
    core.step()
    view = core.scheduler.view(clock.t)
    assert core.scheduler.kv.has_host_copy("R1", r1.num_computed_tokens)
    slow = replace(view.config, link_bytes_per_s=10.0)
    assert resume_start(view, r1, 0).by_load
    assert not resume_start(replace(view, config=slow), r1, 0).by_load
    assert not resume_start(view, r3, 0).by_load  # no host copy: recompute
