"""An engine slower than its readers, on hand-built states: readers faster than their slot's
share of Gamma are demand it cannot meet (not schedulable), Gamma is trusted only as far as
batches were timed (a prior admits a burst in steps), and past Gamma the decision serves every
started stream while they fit the feasible batch, else the earliest readers it can keep fed,
and says why the others wait."""

from __future__ import annotations

from dataclasses import replace

from tests.core.helpers import make_core, make_request
from tests.core.tokenflow_states import OPTIMISTIC
from tokenflow.core.config import TokenFlowConfig
from tokenflow.core.policies.base import Policy, WaitReason
from tokenflow.core.policies.capacity import degraded_served, measure_capacity, served_set
from tokenflow.core.policies.tokenflow import Decision, TokenFlowPolicy
from tokenflow.core.request import RequestState

BASE_S, PER_STREAM_S = 0.05, 0.05  # the slow engine: a step of B streams takes 0.05 + 0.05 B s


def timed_slow_engine(core, max_batch: int = 12) -> None:
    """The estimator as it is once steps of every batch up to `max_batch` were timed."""
    for batch in range(1, max_batch + 1):
        for _ in range(4):
            core.scheduler.estimator.observe(batch, 0, BASE_S + PER_STREAM_S * batch)


def readers(n: int, rate: float, prefix: str = "r") -> list:
    return [make_request(f"{prefix}{i}", num_prompt=8, max_tokens=40, rate=rate) for i in range(n)]


def test_readers_faster_than_their_slot_are_demand_a_slow_engine_cannot_meet():
    core, clock, _ = make_core("tokenflow", num_device_blocks=64, block_size=4)
    timed_slow_engine(core)
    burst = readers(8, rate=3.0)
    for r in burst:
        core.add_request(r)
    view = core.scheduler.view(clock.t)
    capacity = measure_capacity(view)
    # 7 blocks each (8 + 40 / 2 tokens): 9 streams fit, Gamma 9 / 0.5 s = 18 tok/s, a slot 2.
    assert capacity.batch == 9 and capacity.share_tps < 3.0
    assert 8 * min(3.0, capacity.share_tps) <= capacity.gamma_tps  # (a slot-capped count)
    assert capacity.demand_tps(burst) == 8 * 3.0 > capacity.gamma_tps
    decision = core.scheduler.policy.decide(view)
    assert len(decision.starts) >= 1 and 3.0 * len(decision.starts) <= capacity.gamma_tps


def test_a_prior_only_estimate_admits_a_burst_in_steps():
    """Before any step the prior's Gamma counts at one stream (what a batch of one would
    make): a burst whose readers a full batch of the prior would carry joins a few at a time,
    more as measured steps arrive."""
    config = replace(OPTIMISTIC, initial_decode_step_s=0.05)  # the prior: 20 tok/s alone
    core, clock, _ = make_core(
        "tokenflow", num_device_blocks=256, block_size=4, scheduler_config=config
    )
    burst = readers(20, rate=4.0)
    for r in burst:
        core.add_request(r)
    view = core.scheduler.view(clock.t)
    capacity = measure_capacity(view)
    full = view.estimator.capacity_tps(20, capacity.beta_blocks * 4)
    assert capacity.batch == 1 and full >= 20 * 4.0  # (the prior's full batch carries them all)
    started = core.scheduler.policy.plan_moves(view).starts
    assert 1 <= len(started) <= capacity.gamma_tps / 4.0 < 20
    timed_slow_engine(core, max_batch=2)
    assert measure_capacity(core.scheduler.view(clock.t)).batch == 4  # twice the largest timed


def test_past_gamma_the_earliest_readers_the_engine_can_feed_are_served_and_the_rest_wait():
    core, clock, _ = make_core("tokenflow", num_device_blocks=64, block_size=4)
    timed_slow_engine(core)
    burst = readers(8, rate=3.0)
    view = core.scheduler.view(clock.t)
    for r in burst:
        core.add_request(r)
    capacity = measure_capacity(core.scheduler.view(clock.t))
    served = served_set(view, capacity, burst)
    # The smallest batch that makes their sum must still give each stream 3 tok/s: 1 / (0.05
    # + 0.05 B) >= 3 holds up to B = 5, which makes 5 / 0.3 = 16.7 tok/s: five readers.
    assert served == burst[:5]
    faster = make_request("fast", num_prompt=8, max_tokens=40, rate=9.0)  # alone only: B = 1
    assert served_set(view, capacity, [faster, *burst]) == [faster]
    assert served_set(view, capacity, [*burst[:4], faster, *burst[4:]]) == burst[:5]


def test_overloaded_within_the_feasible_batch_every_started_stream_is_served():
    """Past Gamma the readers all stall some; within the feasible batch none is left out (the
    batch of all makes the most tokens/s), past it the served set is: a spread would rotate
    streams over the link."""
    core, clock, _ = make_core("tokenflow", num_device_blocks=64, block_size=4)
    timed_slow_engine(core)
    eight, twelve = readers(8, rate=3.0), readers(12, rate=3.0)
    view = core.scheduler.view(clock.t)
    for r in twelve:
        core.add_request(r)
    capacity = measure_capacity(core.scheduler.view(clock.t))
    assert capacity.batch == 9 and capacity.demand_tps(eight) > capacity.gamma_tps
    assert served_set(view, capacity, eight) == eight[:5]  # (what the served set would keep)
    assert degraded_served(view, capacity, eight) == eight
    assert degraded_served(view, capacity, twelve) == served_set(view, capacity, twelve)
    assert len(served_set(view, capacity, twelve)) == 5


def test_an_overloaded_decision_pauses_no_started_reader_that_fits_the_batch():
    """Eight readers of 3 tok/s started, then the engine slows to feed each about 2 tok/s: the
    decision finds it overloaded, and leaves every one on the device, none unserved."""
    core, clock, _ = make_core("fcfs", num_device_blocks=128, block_size=4)
    burst = readers(8, rate=3.0)
    for r in burst:
        core.add_request(r)
    while not all(r.output_token_ids for r in burst):
        core.step()
    for _ in range(2):  # (the estimator's whole window: the slow engine's steps)
        timed_slow_engine(core)
    policy = TokenFlowPolicy(TokenFlowConfig())
    decision = policy.decide(core.scheduler.view(clock.t))
    assert decision.is_overloaded
    assert not decision.unserved and not decision.preemptions


def test_each_stream_off_the_device_says_why_it_waits():
    core, clock, _ = make_core("tokenflow", num_device_blocks=64, block_size=4)
    policy = core.scheduler.policy
    assert isinstance(policy, TokenFlowPolicy)
    waiting, left_out, paused, running = readers(4, rate=3.0)
    for r, state in ((left_out, RequestState.PREEMPTED), (paused, RequestState.PREEMPTED)):
        r.state = state
    running.state = RequestState.RUNNING
    assert policy.wait_reason(waiting) is WaitReason.QUEUED
    assert policy.wait_reason(paused) is WaitReason.BUFFERED
    assert policy.wait_reason(running) is None
    policy.last_decision = Decision(is_overloaded=True, unserved=frozenset({left_out.request_id}))
    assert policy.wait_reason(waiting) is WaitReason.OVERLOAD
    assert policy.wait_reason(left_out) is WaitReason.OVERLOAD
    assert policy.wait_reason(paused) is WaitReason.BUFFERED
    assert Policy().wait_reason(paused) is WaitReason.MEMORY  # (FCFS pauses only for memory)


def test_overload_is_logged_once_on_entering_and_once_on_leaving(caplog):
    """A demand hovering at Gamma logs one line, not one a decision; leaving needs demand at
    most 0.9 Gamma."""
    policy = TokenFlowPolicy(TokenFlowConfig())
    caplog.set_level("INFO", logger="tokenflow.core.policies.tokenflow")
    for demand_tps in (90.0, 101.0, 99.0, 102.0, 95.0, 101.0, 89.0, 80.0, 101.0):
        policy._note_overload(demand_tps, 100.0, num_served=3, started=[])
    lines = [r.getMessage().split(":")[0] for r in caplog.records]
    assert lines == ["overloaded", "overload over", "overloaded"]
