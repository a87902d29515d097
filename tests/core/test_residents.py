"""The decision that ranks running streams by buffer decides as the reference does.

The parity runs (`test_parity.py`) keep the device tier tight, where the counted balance often
falls back to surveying everyone.  Here the device has room and `max_num_seqs` binds, as on a
large GPU: rotations pause and resume streams through the counted path, in utility order and
(overloaded) in arrival order, with many equal buffers (bursts) and, in one configuration, a
utility that is flat over a range of buffers (ties between distinct buffers).  At every
decision the reference policy decides on the same view, and the moves must be the same.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest

from tests.core.helpers import ManualClock
from tests.core.reference.tokenflow_policy import TokenFlowPolicy as RefTokenFlow
from tests.core.test_parity import CONFIG, TOKENFLOW, TimedExecutor
from tokenflow.core.config import TokenFlowConfig
from tokenflow.core.kv_manager import KVConfig
from tokenflow.core.policies import counted as counted_module
from tokenflow.core.policies import tokenflow as tokenflow_module
from tokenflow.core.policies.paused import PausedPrices, price_paused
from tokenflow.core.policies.started import StartedMembers
from tokenflow.core.policies.tokenflow import TokenFlowPolicy
from tokenflow.core.request import FinishReason, Request, RequestState, SamplingParams
from tokenflow.core.scheduler import Scheduler

# Utility 0 past 0.8 s of buffer, paused or running alike: ties between distinct buffers.
FLAT = replace(TOKENFLOW, stall_penalty=0.0, value_horizon_s=0.8, switch_penalty=0.0)


def _requests(
    num: int, rng: random.Random, window_s: float, rates: tuple[float, ...] = (2.0, 5.0, 10.0)
) -> list[Request]:
    # Arrivals in a few instants: streams started together share their buffers exactly.
    instants = [round(rng.uniform(0, window_s), 2) for _ in range(6)]
    return sorted(
        (
            Request(
                request_id=f"r{i:03d}",
                prompt_token_ids=tuple(range(3, 3 + rng.randint(1, 30))),
                sampling_params=SamplingParams(max_tokens=rng.randint(20, 200), ignore_eos=True),
                rate_tps=rng.choice(rates),
                arrival_s=rng.choice(instants),
            )
            for i in range(num)
        ),
        key=lambda r: r.arrival_s,
    )


def _drive(
    config: TokenFlowConfig,
    seed: int,
    num: int,
    host_blocks: int,
    device_blocks: int = 600,
    rates: tuple[float, ...] = (2.0, 5.0, 10.0),
) -> Counter:
    """Serve `num` requests (max_num_seqs 24, by default a roomy device); compare every
    decision with the reference's."""
    rng = random.Random(seed)
    policy = TokenFlowPolicy(config)
    reference = RefTokenFlow(config)
    kv = KVConfig(device_blocks, host_blocks, block_size=4, block_bytes=1000)
    scheduler = Scheduler(replace(CONFIG, link_bytes_per_s=4e6), kv, policy)
    clock = ManualClock()
    executor = TimedExecutor(clock)
    pending = _requests(num, rng, window_s=3.0, rates=rates)
    decide = policy.decide

    def checked(view):
        _check_paused_prices(policy, view)
        expected = reference.decide(view)
        moves = decide(view)
        assert moves == expected, f"decision {policy.num_decisions} at {view.now_s:.3f} s"
        return moves

    policy.decide = checked
    steps = 0
    while pending or scheduler.has_work:
        while pending and pending[0].arrival_s <= clock.t:
            scheduler.add_request(pending.pop(0))
        if rng.random() < 0.005 and scheduler.requests:
            ids = sorted(scheduler.requests)
            scheduler.finish_request(ids[rng.randrange(len(ids))], FinishReason.ABORT)
        plan = scheduler.schedule(clock.t)
        scheduler.update(plan, executor.execute(plan), clock.t)
        scheduler.kv.check_integrity()
        _check_queue_sums(scheduler)
        if plan.is_empty:
            clock.t += 0.005
        steps += 1
        assert steps < 50_000, "no progress"
    return Counter(preemptions=scheduler.num_preemptions_total)


def _check_paused_prices(policy: TokenFlowPolicy, view) -> None:
    """The paused members' candidates (ranked by utility and by arrival), costs and resume
    modes from the prices kept across decisions equal those priced afresh."""
    growth = policy.growth_tokens(view)
    for by_arrival in (False, True):
        kept = price_paused(policy.config, view, growth, policy._paused_prices, by_arrival)
        fresh = price_paused(policy.config, view, growth, PausedPrices(), by_arrival)
        assert kept == fresh
    # Ranked by arrival, the kept candidates are the utility ones without the utility.
    by_utility = price_paused(policy.config, view, growth, PausedPrices())[1]
    assert kept[1] == [c._replace(utility=0.0) for c in by_utility]


def _check_queue_sums(scheduler: Scheduler) -> None:
    """What the queues keep on events equals a rescan."""
    queues, running = scheduler.queues, scheduler.running
    assert queues.resident_tokens == sum(r.num_tokens for r in running)
    assert queues.running_by_arrival == sorted(running, key=lambda r: r.sort_key)
    assert queues.started_rates == Counter(r.rate_tps for r in running + scheduler.preempted)
    kv = scheduler.kv
    to_load = (kv.num_blocks_to_load(r.request_id, r.num_computed_tokens) for r in queues.loading)
    assert kv.num_queued_load_blocks == sum(to_load)
    for r in running:  # every resident left out of `unsettled` is decoding
        if r.request_id not in queues.unsettled:
            assert r.state is RequestState.RUNNING and r.output_token_ids
            assert r.num_computed_tokens == r.num_tokens - 1


@pytest.mark.parametrize("config", [TOKENFLOW, FLAT], ids=["default", "flat-utility"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_counted_decisions_match_the_reference(config, seed, monkeypatch):
    paths: Counter = Counter()
    counted = counted_module.balance_counted

    def spy(paused, newcomers, residents, blocks, max_seqs, by_arrival, budget_s):
        result = counted(paused, newcomers, residents, blocks, max_seqs, by_arrival, budget_s)
        if result is None:
            paths["fallback"] += 1
        elif result[1]:
            paths["arrival rotation" if by_arrival else "utility rotation"] += 1
        return result

    monkeypatch.setattr(tokenflow_module, "balance_counted", spy)
    stats = _drive(config, seed, num=90, host_blocks=4000)
    assert stats["preemptions"] > 10
    assert paths["utility rotation"] > 0  # the counted path really paused streams


def test_a_small_host_tier_falls_back_and_still_matches(monkeypatch):
    """Below a device tier of host room, the survey decides (and still as the reference)."""
    stats = _drive(TOKENFLOW, seed=3, num=60, host_blocks=300)
    assert stats["preemptions"] > 0


@pytest.mark.parametrize("rates", [(2.0, 5.0, 10.0), (2.0, 2.5, 1 / 3)])
def test_demand_from_counted_rates_is_the_sum_in_member_order(rates):
    """The rate counts the queues keep give the demand the members' list would, to the bit:
    all capped, all integral and below the cap, or (otherwise) summed in member order."""
    rng = random.Random(7)
    policy = TokenFlowPolicy(TOKENFLOW)
    kv = KVConfig(600, 4000, block_size=4, block_bytes=1000)
    scheduler = Scheduler(CONFIG, kv, policy)
    clock = ManualClock()
    executor = TimedExecutor(clock)
    for i in range(40):
        scheduler.add_request(
            Request(f"r{i:02d}", (3, 4, 5), SamplingParams(max_tokens=400), rng.choice(rates), 0.0)
        )
    for _ in range(300):
        plan = scheduler.schedule(clock.t)
        scheduler.update(plan, executor.execute(plan), clock.t)
    view = scheduler.view(clock.t)
    assert view.preempted and view.running
    started = policy._started(view, 1)[0]
    members = view.running + view.preempted
    for cap in (0.3, 1.0, 2.0, 2.2, 4.9, 5.0, 7.3, 1e9):
        expected = sum(min(r.rate_tps, cap) for r in members)
        assert started.demand_tps(cap) == expected


@pytest.mark.parametrize(
    ("config", "rates", "kind"),
    [
        (TOKENFLOW, (2.0, 5.0, 10.0), "utility"),
        (FLAT, (2.0, 5.0, 10.0), "utility"),
        (TOKENFLOW, (20.0, 40.0), "arrival"),
    ],
    ids=["default", "flat-utility", "degraded"],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_memory_short_walk_matches_the_reference(config, rates, kind, seed, monkeypatch):
    """A device too small for the residents' next interval: the counted walk finds where
    memory binds (bulk before, the greedy exactly after) and still decides as the reference,
    in utility order and (overloaded) in arrival order."""
    paths: Counter = Counter()
    walk = counted_module.memory_walk

    def spy(by_arrival, others, residents, blocks, max_seqs, budget_s, slot_result):
        result = walk(by_arrival, others, residents, blocks, max_seqs, budget_s, slot_result)
        order = "arrival" if by_arrival else "utility"
        paths[order, "slots" if result is slot_result else "memory"] += 1
        paths[order, "paused"] += bool(result[1])
        return result

    monkeypatch.setattr(counted_module, "memory_walk", spy)
    stats = _drive(config, seed, num=90, host_blocks=4000, device_blocks=160, rates=rates)
    assert stats["preemptions"] > 10
    assert paths[kind, "memory"] > 20, paths  # the walk really ran where memory binds
    assert paths[kind, "paused"] > 5, paths  # and left residents out


def test_paused_prices_follow_a_dropped_host_copy():
    """A start by recompute that finds no room leaves its member paused without its host copy
    (same tokens): the kept prices must see it (the key holds computed tokens and the copy)."""
    rng = random.Random(5)
    policy = TokenFlowPolicy(TOKENFLOW)
    kv = KVConfig(600, 4000, block_size=4, block_bytes=1000)
    scheduler = Scheduler(replace(CONFIG, link_bytes_per_s=4e6), kv, policy)
    clock, pending = ManualClock(), _requests(90, rng, window_s=3.0)
    executor = TimedExecutor(clock)
    while not any(scheduler.kv.synced_tokens(r.request_id) for r in scheduler.preempted):
        while pending and pending[0].arrival_s <= clock.t:
            scheduler.add_request(pending.pop(0))
        plan = scheduler.schedule(clock.t)
        scheduler.update(plan, executor.execute(plan), clock.t)
        clock.t += 0.005 if plan.is_empty else 0.0
    view = scheduler.view(clock.t)
    growth = policy.growth_tokens(view)
    price_paused(policy.config, view, growth, policy._paused_prices)
    member = next(r for r in view.preempted if scheduler.kv.synced_tokens(r.request_id))
    scheduler.kv.drop(member.request_id)  # what `_apply_starts` does before a failed allocate
    member.num_computed_tokens = 0
    for by_arrival in (False, True):
        kept = price_paused(policy.config, view, growth, policy._paused_prices, by_arrival)
        assert kept == price_paused(policy.config, view, growth, PausedPrices(), by_arrival)


def _rotating(config: TokenFlowConfig) -> tuple[TokenFlowPolicy, StartedMembers, float]:
    """A policy and its started members (some pausable, some paused) mid-run, and the time."""
    rng = random.Random(11)
    policy = TokenFlowPolicy(config)
    kv = KVConfig(600, 4000, block_size=4, block_bytes=1000)
    scheduler = Scheduler(replace(CONFIG, link_bytes_per_s=4e6), kv, policy)
    clock = ManualClock()
    executor = TimedExecutor(clock)
    for request in _requests(60, rng, window_s=0.5, rates=(1.0, 2.0, 5.0)):
        scheduler.add_request(request)
    for _ in range(100):
        plan = scheduler.schedule(clock.t)
        scheduler.update(plan, executor.execute(plan), clock.t)
    view = scheduler.view(clock.t)
    started = policy._started(view, policy.growth_tokens(view))[0]
    assert started.residents.num_pausable > 5 and started.paused
    return policy, started, clock.t


@pytest.mark.parametrize("config", [TOKENFLOW, FLAT], ids=["default", "flat-utility"])
def test_has_before_is_the_count_compared(config):
    """`Residents.has_before` (one utility read) answers as `num_before` counted, for every
    count, for paused members, newcomers and others tying with each pausable member."""
    _, started, now = _rotating(config)
    residents = started.residents
    newcomer = Request("new", (3, 4), SamplingParams(max_tokens=9), 2.0, now)
    template = started.paused[0]
    others = started.paused + [c._replace(is_overdue=True) for c in started.paused[:3]]
    for member in residents.pausable():
        u = residents.utility(member)
        others += [c._replace(utility=u) for c in started.paused[:3]]
        others.append(template._replace(request=newcomer, utility=u))
    for other in others:
        num_before = residents.num_before(other)
        for count in range(-1, residents.num_pausable + 2):
            assert residents.has_before(other, count) == (num_before >= count)


def test_footprint_floor_and_total_bound_the_members_blocks():
    """The floor is at most the total, which sums each member's `footprint_blocks`."""
    rng = random.Random(3)
    for growth in (0, 1, 2, 5, 40):
        policy, started, _ = _rotating(TOKENFLOW)
        residents = started.residents
        residents.growth = growth
        members = residents.pausable()
        for _ in range(20):
            some = rng.sample(members, rng.randint(0, len(members)))
            total = sum(map(residents.footprint_blocks, some))
            assert residents.footprint_total(some) == total
            assert residents.footprint_sums(some)[-1] == total
            assert residents.footprint_floor(some) <= total
