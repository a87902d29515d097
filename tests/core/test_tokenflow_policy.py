"""TokenFlow's decisions, judged by the moves it makes on small hand-built states."""

import math
from dataclasses import replace

import pytest

from tests.core.helpers import make_core, make_request
from tests.core.tokenflow_states import OPTIMISTIC, three_streams
from tokenflow.core.config import SchedulerConfig, TokenFlowConfig
from tokenflow.core.plan import CopyKind
from tokenflow.core.policies import tokenflow as tokenflow_policy
from tokenflow.core.policies.balance import select
from tokenflow.core.policies.capacity import measure_capacity
from tokenflow.core.policies.pricing import Prices, is_pausable
from tokenflow.core.policies.tokenflow import TokenFlowPolicy
from tokenflow.core.request import MAX_READER_RATE_TPS, Consumption, PreemptMode, RequestState


def test_big_buffer_stream_is_offloaded_so_the_newcomer_starts():
    core, clock, (r1, r2, r3) = three_streams()
    plan, _ = core.step()
    assert r1.state is RequestState.PREEMPTED and r1.num_preemptions == 1
    assert r2.state is RequestState.RUNNING and r3.state is RequestState.RUNNING
    assert any(c.kind is CopyKind.EVICT and c.request_id == "R1" for c in plan.device_to_host)
    assert [c.request_id for c in plan.chunks] == ["R3"]  # prefill-first
    assert r3.output_token_ids


def test_a_cautious_mu_pauses_nobody_and_admits_nobody_into_full_memory():
    core, clock, (r1, r2, r3) = three_streams()
    view = core.scheduler.view(clock.t)
    strict = TokenFlowPolicy(TokenFlowConfig(buffer_conservativeness=1000.0))
    assert strict.decide(view).preemptions == ()
    assert strict.decide(view).starts == ()


def test_preempted_stream_resumes_by_load_before_its_buffer_runs_dry():
    core, clock, (r1, r2, r3) = three_streams()
    tokens_before = r1.num_output_tokens
    while r1.state is not RequestState.RUNNING or r1.num_output_tokens == tokens_before:
        core.step()
        assert clock.t < 30
    assert core.scheduler.num_loads_total >= 1
    consume = None  # the reader never ran dry: each token came before the reader wanted it
    for t in r1.token_times_s:
        if consume is not None:
            assert t <= consume + 1 / r1.rate_tps + 1e-9
        consume = t if consume is None else max(t, consume + 1 / r1.rate_tps)


def test_over_capacity_the_decision_admits_nobody_and_serves_the_earliest_readers_it_can_feed(
    monkeypatch,
):
    core, clock, (r1, r2, r3) = three_streams()
    view = core.scheduler.view(clock.t)
    orders = []

    def spy(*args, by_arrival, **kwargs):
        orders.append(by_arrival)
        return select(*args, by_arrival=by_arrival, **kwargs)

    monkeypatch.setattr(tokenflow_policy, "select", spy)
    policy = TokenFlowPolicy(TokenFlowConfig())
    decision = policy.decide(view)
    assert [s.request_id for s in decision.starts] == ["R3"]
    assert policy.num_degraded_decisions == 0 and orders == [False]
    assert not decision.is_overloaded and not decision.unserved
    for r in (r1, r2):  # readers far faster than the engine: each alone takes all of it
        r.rate_tps = 1e4
    fresh = TokenFlowPolicy(TokenFlowConfig())
    fresh._capacity_floor = TrustAll()  # even where the trusted Gamma would leave room
    decision = fresh.decide(view)
    assert all(s.request_id != "R3" for s in decision.starts)
    assert fresh.num_degraded_decisions == 1 and decision.is_overloaded
    assert decision.unserved == {r2.request_id}  # the earlier arrival is served, whole
    assert [p.request_id for p in decision.preemptions] == [r2.request_id]
    assert orders == [False, False]  # within the served set, by utility as ever


class TrustAll:
    def observe(self, now_s: float, gamma_tps: float) -> float:
        return 1e9


def test_a_later_request_never_starts_before_an_earlier_one_that_does_not_fit():
    core, clock, (r1, r2, r3) = three_streams()
    view = core.scheduler.view(clock.t)
    policy = TokenFlowPolicy(TokenFlowConfig())
    # R4's rate counts for one stream's share of Gamma, more than the members leave spare.
    greedy = make_request(
        "R4", num_prompt=4, max_tokens=2, rate=MAX_READER_RATE_TPS, arrival=clock.t
    )
    modest = make_request("R5", num_prompt=4, max_tokens=2, rate=0.1, arrival=clock.t + 1)
    starts = policy.decide(replace(view, waiting=[greedy, modest])).starts
    assert [s.request_id for s in starts] == []
    alone = policy.decide(replace(view, waiting=[modest])).starts
    assert [s.request_id for s in alone] == ["R5"]


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


def test_a_reader_near_running_dry_is_stress_and_a_calm_one_is_not():
    core, clock, (r1, r2, r3) = three_streams()
    policy = TokenFlowPolicy(TokenFlowConfig(critical_slack_s=2.0))
    view = replace(core.scheduler.view(clock.t), waiting=[])
    assert policy.is_stressed(view)  # R2 reads about as fast as it is generated
    calm = replace(view, running=[r1], preempted=[])
    assert r1.slack_s(clock.t) >= 2.0 and not policy.is_stressed(calm)
    near = replace(calm, now_s=r1.dry_s - 1.0)
    assert policy.is_stressed(near)


def test_oom_victim_is_the_pausable_stream_with_most_buffer_offloaded():
    core, clock, (r1, r2, r3) = three_streams()
    view = core.scheduler.view(clock.t)
    preemption = core.scheduler.policy.choose_oom_victim([r1, r2], view)
    assert preemption.request_id == "R1" and preemption.mode is PreemptMode.OFFLOAD
    unpausable = core.scheduler.policy.choose_oom_victim([r2], view)
    assert unpausable.mode is PreemptMode.OFFLOAD  # decoding: its KV goes to the host
    fallback = core.scheduler.policy.choose_oom_victim([r3], view)
    assert fallback.mode is PreemptMode.RECOMPUTE  # none decoding: SGLang's rule


def test_write_through_goes_largest_buffer_first_and_can_be_disabled():
    core, clock, (r1, r2, r3) = three_streams(TokenFlowConfig(write_through=False))
    view = core.scheduler.view(clock.t)
    assert core.scheduler.kv.num_free_host_blocks == 256  # nothing was written through
    assert core.scheduler.policy.write_through_order(view, [r2, r1]) == []
    on = TokenFlowPolicy(TokenFlowConfig())
    assert [r.request_id for r in on.write_through_order(view, [r2, r1])] == ["R1", "R2"]


def test_write_through_keeps_running_streams_synced():
    core, clock, (r1, r2, r3) = three_streams()
    kv = core.scheduler.kv
    for r in (r1, r2):
        assert kv.synced_tokens(r.request_id) == r.num_computed_tokens // 4 * 4


def test_a_lower_admission_reserve_admits_what_sglangs_holds_back():
    # A resident with ~60 tokens to go: SGLang's reserve (0.7 of them, 11 blocks of 4) leaves
    # 6 of the 17 free blocks, too few for a 32-token prompt; 0.3 (5 blocks) leaves 12.
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


def test_admission_spends_the_trusted_gamma_not_the_latest():
    class Distrust:  # a floor that trusts no capacity at all
        def observe(self, now_s: float, gamma_tps: float) -> float:
            seen.append(gamma_tps)
            return 0.0

    def started(distrust: bool) -> int:
        # (room for four of the five: with room for everyone they would all start, as FCFS)
        core, clock, _ = make_core("tokenflow", num_device_blocks=36, step_s=0.05)
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
    assert started(distrust=False) > 1
    assert started(distrust=True) == 1 and seen and seen[0] > 0


def test_a_request_arriving_between_decisions_starts_within_the_rate_left_spare():
    core, clock, _ = make_core("tokenflow", step_s=0.05, scheduler_config=OPTIMISTIC)
    core.add_request(make_request("a", num_prompt=4, max_tokens=60, rate=5.0))
    while clock.t < 0.6:  # a starts at 0 (room for everyone); a decision at 0.5 s (a near dry)
        core.step()
    policy = core.scheduler.policy
    assert policy.num_decisions == 1 and clock.t < policy.last_decision.next_decision_s
    late = make_request("b", num_prompt=4, max_tokens=60, rate=5.0, arrival=clock.t)
    never = make_request("c", num_prompt=240, max_tokens=4, rate=5.0, arrival=clock.t)
    core.add_request(late)
    core.add_request(never)  # (no room for it: the last decision's budgets apply)
    core.step()
    assert late.state is RequestState.RUNNING and policy.num_decisions == 1


@pytest.mark.parametrize("consumption", [Consumption.EAGER, Consumption.BATCH])
def test_an_eager_or_batch_stream_is_never_paused_for_its_buffer(consumption):
    # R1 reads slowly and is paused for the newcomer; the same stream consumed at once is not
    # (even with the most aggressive pause rule), so the newcomer waits instead.
    core, clock, (r1, r2, r3) = three_streams()
    assert core.step()[0].device_to_host and r1.state is RequestState.PREEMPTED
    agile = TokenFlowConfig(buffer_conservativeness=1.0, critical_slack_s=0.0)
    core, clock, (r1, r2, r3) = three_streams(agile, consumption=consumption)
    assert r1.rate_tps == math.inf and r1.buffered_s(clock.t) == 0.0
    view = core.scheduler.view(clock.t)
    assert not is_pausable(agile, view, r1, Prices.at(agile, view))
    while not r1.is_finished:
        core.step()
        assert r1.state is not RequestState.PREEMPTED and clock.t < 30
    assert r1.num_preemptions == 0 and r1.num_output_tokens == 60


def test_an_eager_reader_asks_one_streams_share_of_gamma():
    core, clock, (r1, r2, r3) = three_streams(consumption=Consumption.EAGER)
    capacity = measure_capacity(core.scheduler.view(clock.t))
    assert capacity.demand_tps([r1]) == capacity.share_tps < math.inf


def test_an_arrival_after_the_queue_drained_is_not_held_by_the_last_prefill_pace():
    """The prefill budget paces a queue: spent on one long prompt, it does not hold a later
    arrival that finds nobody waiting until the next decision (Poisson TTFT)."""
    config = replace(OPTIMISTIC, initial_prefill_token_s=0.01)  # 60 tokens: 0.6 s > 0.5 s budget
    core, clock, _ = make_core("tokenflow", step_s=0.05, scheduler_config=config)
    eager = Consumption.EAGER
    core.add_request(make_request("a", num_prompt=60, max_tokens=60, consumption=eager))
    core.step()  # at 0: a starts (room for everyone)
    core.step()  # nobody waits
    policy = core.scheduler.policy
    policy.last_decision = replace(  # as if a decision at 0 had started a: budget overdrawn
        policy.last_decision, next_decision_s=clock.t + 0.4, prefill_budget_s=-0.1
    )
    late = make_request("b", num_prompt=8, max_tokens=60, consumption=eager, arrival=clock.t)
    core.add_request(late)
    core.step()
    assert clock.t < policy.last_decision.next_decision_s and policy.num_decisions == 0
    assert late.state is RequestState.RUNNING
