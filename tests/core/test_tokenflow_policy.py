"""TokenFlow's phases on small hand-built situations."""

from dataclasses import replace

import pytest

from tests.core.helpers import make_core, make_request
from tokenflow.core.config import SchedulerConfig, TokenFlowConfig
from tokenflow.core.estimator import StepTimeEstimator
from tokenflow.core.kv_manager import KVConfig, KVTierManager
from tokenflow.core.plan import CopyKind
from tokenflow.core.policies.admission import CapacityFloor
from tokenflow.core.policies.survey import Candidate, Survey, survey
from tokenflow.core.policies.tokenflow import TokenFlowPolicy
from tokenflow.core.request import PreemptMode, RequestState

OPTIMISTIC = SchedulerConfig(
    init_new_token_ratio=0.01,
    min_new_token_ratio=0.01,
    link_bytes_per_s=1e6,
    initial_decode_step_s=0.05,
)


def three_streams(tokenflow_config=None):
    """R1 reads slowly (big buffer), R2 about as fast as it is generated, R3 arrives at 1 s.
    The device holds 24 blocks of 4 tokens: R1 and R2 fill 20, R3 needs 5 more."""
    core, clock, ex = make_core(
        "tokenflow",
        num_device_blocks=24,
        step_s=0.05,
        scheduler_config=OPTIMISTIC,
        tokenflow_config=tokenflow_config,
    )
    r1 = make_request("R1", num_prompt=20, max_tokens=60, rate=2.0)
    r2 = make_request("R2", num_prompt=20, max_tokens=60, rate=15.0)
    core.add_request(r1)
    core.add_request(r2)
    while clock.t < 0.99:
        core.step()
    r3 = make_request("R3", num_prompt=20, max_tokens=60, rate=2.0, arrival=clock.t)
    core.add_request(r3)
    return core, clock, (r1, r2, r3)


def test_big_buffer_stream_is_offloaded_so_the_newcomer_starts():
    core, clock, (r1, r2, r3) = three_streams()
    policy = core.scheduler.policy
    assert policy.can_pause(core.scheduler.view(clock.t), r1)
    assert not policy.can_pause(core.scheduler.view(clock.t), r2)
    plan, _ = core.step()
    assert r1.state is RequestState.PREEMPTED and r1.num_preemptions == 1
    assert r2.state is RequestState.RUNNING and r3.state is RequestState.RUNNING
    assert any(c.kind is CopyKind.EVICT and c.request_id == "R1" for c in plan.device_to_host)
    assert [c.request_id for c in plan.chunks] == ["R3"]  # prefill-first
    assert r3.output_token_ids


def test_preempted_stream_resumes_by_load_before_its_buffer_runs_dry():
    core, clock, (r1, r2, r3) = three_streams()
    stalls_before = r1.num_output_tokens
    while r1.state is not RequestState.RUNNING or r1.num_output_tokens == stalls_before:
        core.step()
        assert clock.t < 30
    assert core.scheduler.num_loads_total >= 1
    # the reader never ran dry: each token arrived before the reader wanted it
    consume = None
    for t in r1.token_times_s:
        if consume is not None:
            assert t <= consume + 1 / r1.rate_tps + 1e-9
        consume = t if consume is None else max(t, consume + 1 / r1.rate_tps)


def test_no_admission_when_nothing_can_be_paused_and_memory_is_full():
    core, clock, (r1, r2, r3) = three_streams()
    view = core.scheduler.view(clock.t)
    policy: TokenFlowPolicy = core.scheduler.policy
    assert policy.admit(view) == [r3]
    strict = TokenFlowPolicy(TokenFlowConfig(buffer_conservativeness=1000.0))
    assert not strict.can_pause(view, r1)
    assert strict.admit(view) == []


def test_working_set_limit_smooths_toward_the_running_count():
    core, clock, _ = three_streams()
    view = core.scheduler.view(clock.t)
    eager = TokenFlowPolicy(TokenFlowConfig(working_set_smoothing=0.0))
    cautious = TokenFlowPolicy(TokenFlowConfig(working_set_smoothing=1.0))
    assert cautious.working_set_limit(view) == len(view.running)
    assert eager.working_set_limit(view) > cautious.working_set_limit(view)


def test_over_capacity_working_set_degrades_without_admission():
    core, clock, (r1, r2, r3) = three_streams()
    view = core.scheduler.view(clock.t)
    policy: TokenFlowPolicy = core.scheduler.policy
    assert policy.check_schedulable(view, 0.0)
    assert [s.request_id for s in policy.decide(view).starts] == ["R3"]
    assert policy.num_degraded_decisions == 0
    # The same situation with readers far faster than the engine: nobody is admitted.
    for r in (r1, r2):
        r.rate_tps = 1e4
    # (a rate is fixed once queued; the scheduler counts the members' rates on events)
    view = replace(view, started_rates={1e4: 2})
    fresh = TokenFlowPolicy(TokenFlowConfig())
    assert not fresh.check_schedulable(view, 0.0)
    assert all(s.request_id != "R3" for s in fresh.decide(view).starts)
    assert fresh.num_degraded_decisions == 1


def test_reload_or_recompute_follows_the_link_speed():
    core, clock, (r1, r2, r3) = three_streams()
    core.step()  # R1 offloaded
    core.step()
    view = core.scheduler.view(clock.t)
    assert core.scheduler.kv.has_host_copy("R1", r1.num_computed_tokens)
    for link, expect_load in ((1e9, True), (10.0, False)):
        linked = replace(view, config=replace(view.config, link_bytes_per_s=link))
        start = core.scheduler.policy.choose_resume_mode(linked, r1)
        assert start.by_load is expect_load


def cand(name, utility, blocks, pinned=False, resident=True, arrival=0.0, rate=20.0, **flags):
    request = make_request(name, arrival=arrival, rate=rate)
    request.arrival_index = int(arrival * 1000)
    fields = dict(
        is_urgent=False, is_overdue=False, reclaim_blocks=0, unsynced_blocks=0, resume_s=0.0
    )
    fields.update(flags)
    return Candidate(request, utility, blocks, resident, pinned, not pinned, **fields)


def small_view(num_device_blocks):
    core, clock, _ = three_streams()
    view = core.scheduler.view(clock.t)
    return replace(view, kv=KVTierManager(KVConfig(num_device_blocks, 0, 4)))


def picked(policy, view, cands, by_arrival=False):
    return [c.request.request_id for c in policy.balance(view, cands, by_arrival)]


def test_balance_is_greedy_by_utility_under_memory():
    view = small_view(10)
    policy = TokenFlowPolicy(TokenFlowConfig())
    # greedy takes A (6), skips B (5, no room), takes C (4)
    a, b, c = cand("A", 1.0, 6), cand("B", 0.9, 5), cand("C", 0.5, 4)
    assert picked(policy, view, [c, b, a]) == ["A", "C"]


def test_pinned_members_are_always_kept():
    view = small_view(10)
    policy = TokenFlowPolicy(TokenFlowConfig())
    low_pinned = cand("P", -5.0, 8, pinned=True)
    high = cand("H", 3.0, 8)
    assert picked(policy, view, [high, low_pinned]) == ["P"]


def test_degraded_balance_serves_by_arrival_streams_about_to_stall_first():
    view = small_view(4)
    policy = TokenFlowPolicy(TokenFlowConfig())
    early = cand("early", 0.1, 4, arrival=0.0, is_urgent=True)
    late = cand("late", 0.9, 4, arrival=1.0, is_urgent=True)
    assert picked(policy, view, [late, early]) == ["late"]  # normal: by utility
    assert picked(policy, view, [late, early], by_arrival=True) == ["early"]
    # a member far from stalling yields to a later one about to stall
    calm = cand("calm", 0.1, 4, arrival=0.0)
    assert picked(policy, view, [calm, late], by_arrival=True) == ["late"]


def test_a_stream_stalled_past_the_bound_goes_first():
    view = small_view(4)
    policy = TokenFlowPolicy(TokenFlowConfig())
    stalled = cand("stalled", 0.5, 4, resident=False, arrival=0.0, rate=5.0, is_overdue=True)
    fresh = cand("fresh", 0.9, 4, resident=False, arrival=1.0, rate=20.0)
    assert picked(policy, view, [fresh, stalled]) == ["stalled"]
    assert picked(policy, view, [fresh, stalled], by_arrival=True) == ["stalled"]


def test_overdue_comes_from_the_reader_model():
    core, clock, (r1, r2, r3) = three_streams()
    config = TokenFlowConfig(max_stall_s=1.0)
    view = core.scheduler.view(r2.last_consume_s + 1 / r2.rate_tps + 1.5)
    by_id = {c.request.request_id: c for c in survey(config, view, [r1, r2, r3], 1).candidates}
    assert by_id["R2"].is_overdue and by_id["R2"].is_urgent  # stalled 1.5 s > 1 s
    assert not by_id["R3"].is_overdue and not by_id["R3"].is_urgent  # not started: no stall


def test_equal_newcomers_start_by_arrival_so_none_is_passed_over():
    view = small_view(4)
    policy = TokenFlowPolicy(TokenFlowConfig())
    slow_early = cand("early", 0.5, 4, resident=False, arrival=0.0, rate=2.0)
    fast_late = cand("late", 0.5, 4, resident=False, arrival=1.0, rate=20.0)
    assert picked(policy, view, [fast_late, slow_early]) == ["early"]


def full_view(num_device_blocks, num_host_blocks):
    """A view whose device tier is fully owned by someone else (no free blocks)."""
    view = small_view(num_device_blocks)
    kv = KVTierManager(KVConfig(num_device_blocks, num_host_blocks, 4))
    kv.allocate("owner", num_device_blocks * 4)
    return replace(view, kv=kv, running=[], preempted=[])


def admit_with(view, pausable, waiting):
    policy = TokenFlowPolicy(TokenFlowConfig(working_set_host_share=100.0))
    started = Survey(pausable, 0.0, 0, sum(c.footprint_blocks for c in pausable))
    return [r.request_id for r in policy._admit(replace(view, waiting=waiting), started, 1e9)]


def test_admission_counts_the_blocks_a_pause_frees():
    view = full_view(20, 100)
    small = cand("small", 0.0, 4, reclaim_blocks=4, unsynced_blocks=0)
    newcomer = make_request("new", num_prompt=40, max_tokens=1)  # 10 blocks
    assert admit_with(view, [small], [newcomer]) == []
    big = cand("big", 0.0, 12, reclaim_blocks=12, unsynced_blocks=0)
    assert admit_with(view, [big], [newcomer]) == ["new"]
    assert admit_with(view, [small, big], [newcomer]) == ["new"]


def test_admission_needs_host_room_for_each_pause():
    view = full_view(20, 5)
    a = cand("a", 0.0, 6, reclaim_blocks=6, unsynced_blocks=4)
    b = cand("b", 0.0, 6, reclaim_blocks=6, unsynced_blocks=4)
    newcomer = make_request("new", num_prompt=40, max_tokens=1)  # 10 blocks: needs both
    assert admit_with(view, [a, b], [newcomer]) == []  # host room for one pause only
    roomy = full_view(20, 8)
    assert admit_with(roomy, [a, b], [newcomer]) == ["new"]


def test_admission_stops_at_the_rate_budget_in_arrival_order():
    core, clock, (r1, r2, r3) = three_streams()
    view = core.scheduler.view(clock.t)
    policy: TokenFlowPolicy = core.scheduler.policy
    spare = policy.config.capacity_headroom * policy.capacity_tps(view) - r1.rate_tps - r2.rate_tps
    greedy = make_request("R4", num_prompt=4, max_tokens=2, rate=spare + 1.0, arrival=clock.t)
    modest = make_request("R5", num_prompt=4, max_tokens=2, rate=0.1, arrival=clock.t + 1)
    assert policy.admit(replace(view, waiting=[greedy, modest])) == []  # R5 may not pass R4
    assert policy.admit(replace(view, waiting=[modest])) == [modest]


@pytest.mark.parametrize("queue_headroom", [1.0, 1.5])
def test_the_whole_queue_joins_only_when_it_fits_the_queue_headroom(queue_headroom):
    """Past Gamma a waiting request joins only when every waiting one fits in queue_headroom
    x Gamma: a small deficit is shared, a large one kept out (and 1.0 turns it off)."""
    core, clock, (r1, r2, r3) = three_streams(TokenFlowConfig(queue_headroom=queue_headroom))
    view = core.scheduler.view(clock.t)
    policy: TokenFlowPolicy = core.scheduler.policy
    capacity = policy.capacity_tps(view)
    spare = capacity - r1.rate_tps - r2.rate_tps
    a = make_request("A", num_prompt=4, max_tokens=2, rate=0.6 * spare, arrival=clock.t)
    b = make_request("B", num_prompt=4, max_tokens=2, rate=0.6 * spare, arrival=clock.t + 1)
    big = make_request("C", num_prompt=4, max_tokens=2, rate=0.5 * capacity, arrival=clock.t + 2)
    assert 1.2 * spare <= 1.5 * capacity - r1.rate_tps - r2.rate_tps < 1.2 * spare + big.rate_tps
    small_queue = [r.request_id for r in policy.admit(replace(view, waiting=[a, b]))]
    assert small_queue == (["A", "B"] if queue_headroom > 1.0 else ["A"])
    assert policy.admit(replace(view, waiting=[a, b, big])) == [a]


def test_oom_victim_is_the_pausable_stream_with_most_buffer_offloaded():
    core, clock, (r1, r2, r3) = three_streams()
    view = core.scheduler.view(clock.t)
    preemption = core.scheduler.policy.choose_oom_victim([r1, r2], view)
    assert preemption.request_id == "R1" and preemption.mode is PreemptMode.OFFLOAD
    fallback = core.scheduler.policy.choose_oom_victim([r2], view)
    assert fallback.mode is PreemptMode.RECOMPUTE


def test_write_through_goes_largest_buffer_first_and_can_be_disabled():
    core, clock, (r1, r2, r3) = three_streams(TokenFlowConfig(write_through=False))
    view = core.scheduler.view(clock.t)
    assert core.scheduler.kv.num_free_host_blocks == 256  # nothing was written through
    assert core.scheduler.policy.write_through_order(view) == []
    on = TokenFlowPolicy(TokenFlowConfig())
    assert [r.request_id for r in on.write_through_order(view)] == ["R1", "R2"]


def test_write_through_keeps_running_streams_synced():
    core, clock, (r1, r2, r3) = three_streams()
    kv = core.scheduler.kv
    for r in (r1, r2):
        assert kv.synced_tokens(r.request_id) == r.num_computed_tokens // 4 * 4


def test_no_decision_without_stress():
    core, clock, _ = make_core("tokenflow", scheduler_config=OPTIMISTIC)
    core.add_request(make_request("solo", rate=0.5, max_tokens=40))
    for _ in range(30):
        core.step()
    policy = core.scheduler.policy
    decisions = policy.num_decisions
    for _ in range(20):
        core.step()
    assert policy.num_decisions == decisions  # big buffer, nobody waiting: FCFS only


def test_survey_utility_matches_the_documented_formula():
    from tokenflow.core.policies.pricing import utility
    from tokenflow.core.policies.survey import survey

    core, clock, (r1, r2, r3) = three_streams()
    view = core.scheduler.view(clock.t)
    config = core.scheduler.policy.config
    for cand in survey(config, view, [r1, r2, r3], 1).candidates:
        expected = utility(config, cand.request.buffered_s(clock.t), cand.is_resident)
        assert abs(cand.utility - expected) < 1e-12


def test_admission_is_paced_by_one_interval_of_prefill():
    view = small_view(4000)
    policy = TokenFlowPolicy(TokenFlowConfig(working_set_host_share=100.0))
    per_token_s = view.estimator.prefill_time_s(1000) / 1000
    prompt = int(0.2 / per_token_s)  # each newcomer takes ~0.2 s of the 0.5 s interval to prefill
    waiting = [make_request(f"n{i}", num_prompt=prompt, max_tokens=1) for i in range(4)]
    started = Survey([], 0.0, 0, 0)
    admitted = policy._admit(replace(view, running=[], waiting=waiting), started, 1e9)
    assert [r.request_id for r in admitted] == ["n0", "n1"]
    alone = policy._admit(replace(view, running=[], waiting=waiting[:1]), started, 1e9)
    assert [r.request_id for r in alone] == ["n0"]


def test_unused_prefill_time_carries_over_one_interval():
    # Prompts of ~0.3 s in a 0.5 s interval: without the carry, one per decision forever (0.2 s
    # of every interval idle); with it, the unused 0.2 s lets the next decision start two.
    view = small_view(4000)
    policy = TokenFlowPolicy(TokenFlowConfig(working_set_host_share=100.0))
    per_token_s = view.estimator.prefill_time_s(1000) / 1000
    prompt = int(0.3 / per_token_s)
    waiting = [make_request(f"n{i}", num_prompt=prompt, max_tokens=1) for i in range(6)]
    started = Survey([], 0.0, 0, 0)
    first = policy._admit(replace(view, running=[], waiting=waiting), started, 1e9)
    assert [r.request_id for r in first] == ["n0"]
    assert policy._prefill_budget_s == pytest.approx(0.2, abs=0.02)
    second = policy._admit(replace(view, running=[], waiting=waiting[1:]), started, 1e9)
    assert [r.request_id for r in second] == ["n1", "n2"]
    policy._prefill_budget_s = 5.0  # a long quiet spell carries at most one interval
    third = policy._admit(replace(view, running=[], waiting=waiting[3:]), started, 1e9)
    assert [r.request_id for r in third] == ["n3", "n4", "n5"][: int(1.0 / 0.3)]


def test_admission_credits_prompts_prefilled_together():
    """Short prompts whose prefill is mostly a fixed per-step cost start together: one at
    ~0.3 s alone, four at ~0.33 s in one step, within the 0.5 s interval."""
    view = small_view(4000)
    estimator = StepTimeEstimator(0.05, 1e-4)
    for tokens in (32, 64, 32, 128):
        estimator.observe(0, tokens, 0.05 + 0.3 + 1e-4 * tokens)  # base + p0 + p1 * T
    view = replace(view, running=[], estimator=estimator)
    policy = TokenFlowPolicy(TokenFlowConfig(working_set_host_share=100.0))
    waiting = [make_request(f"n{i}", num_prompt=32, max_tokens=1) for i in range(6)]
    started = Survey([], 0.0, 0, 0)
    assert estimator.prefill_time_s(32) * 2 > policy.config.schedule_interval_s
    admitted = policy._admit(replace(view, waiting=waiting), started, 1e9)
    assert len(admitted) == 6
    assert policy._prefill_budget_s == pytest.approx(0.5 - estimator.prefill_time_s(6 * 32))


def test_a_lower_admission_reserve_admits_what_sglangs_holds_back():
    # A resident with ~60 tokens to go: SGLang's reserve (0.7 of them, 11 blocks of 4) leaves
    # 6 of the 17 free blocks, too few for a 32-token prompt; TokenFlow's (0.3, 5 blocks) leaves 12
    # (and both fit the next interval: 10 steps of 0.05 s).
    def second_started(tokenflow_config: TokenFlowConfig) -> bool:
        core, clock, _ = make_core(
            "tokenflow", num_device_blocks=20, step_s=0.05, tokenflow_config=tokenflow_config
        )
        core.add_request(make_request("a", num_prompt=8, max_tokens=60, rate=5.0))
        core.step()
        core.add_request(make_request("b", num_prompt=32, max_tokens=40, rate=5.0, arrival=0.01))
        for _ in range(3):
            clock.t += 0.6  # past the decision interval
            core.step()
        return core.scheduler.requests["b"].output_token_ids != []

    assert second_started(TokenFlowConfig(init_new_token_ratio=0.3))
    assert not second_started(TokenFlowConfig())  # the core's default: SGLang's 0.7


def test_the_policy_ratio_is_capped_by_the_schedulers_and_floored_by_its_minimum():
    policy = TokenFlowPolicy(TokenFlowConfig(init_new_token_ratio=0.3))
    assert policy.init_new_token_ratio(SchedulerConfig()) == 0.3
    low = SchedulerConfig(init_new_token_ratio=0.05, min_new_token_ratio=0.01)
    assert policy.init_new_token_ratio(low) == 0.05
    floor = SchedulerConfig(init_new_token_ratio=0.7, min_new_token_ratio=0.4)
    assert policy.init_new_token_ratio(floor) == 0.4
    core, _, _ = make_core("fcfs", scheduler_config=SchedulerConfig())
    assert core.scheduler.new_token_ratio == 0.7  # the baselines keep SGLang's reserve


def test_admission_trusts_a_rise_of_gamma_only_once_it_held_for_the_window():
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
    assert CapacityFloor(window_s=0.0).observe(0.0, 7600.0) == 7600.0


def test_admission_spends_the_trusted_gamma_not_the_latest():
    class Distrust:  # a floor that trusts no capacity at all
        def observe(self, now_s: float, capacity_tps: float) -> float:
            seen.append(capacity_tps)
            return 0.0

    def started(distrust: bool) -> int:
        core, clock, _ = make_core("tokenflow", step_s=0.05)
        core.add_request(make_request("a", num_prompt=4, max_tokens=40, rate=5.0))
        core.step()
        if distrust:
            core.scheduler.policy._capacity_floor = Distrust()
        for i in range(4):
            core.add_request(make_request(f"b{i}", num_prompt=4, max_tokens=40, rate=5.0))
        clock.t += 0.6
        core.step()
        return sum(1 for r in core.scheduler.requests.values() if r.num_computed_tokens)

    seen: list[float] = []
    assert started(distrust=False) == 5
    assert started(distrust=True) == 1 and seen and seen[0] > 0
