"""Admission's written-out paths decide as the obvious ones do, on random inputs."""

from __future__ import annotations

import random
import statistics
from dataclasses import replace

import pytest

from tests.core.helpers import make_request
from tests.core.test_tokenflow_policy import small_view
from tokenflow.core.config import TokenFlowConfig
from tokenflow.core.estimator import StepTimeEstimator
from tokenflow.core.kv_manager import KVConfig, KVTierManager
from tokenflow.core.policies.admission import (
    Admitted,
    CapacityFloor,
    admit,
    newcomer_candidates,
    prefill_batch_time_s,
)
from tokenflow.core.policies.base import SchedulingView
from tokenflow.core.policies.pricing import decision_costs
from tokenflow.core.policies.survey import Candidate, Survey, survey
from tokenflow.core.request import Request, RequestState

BLOCK_SIZE = 4


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


def slow_admit(view, started, limit, spare_rate_tps, rate_cap_tps, prefill_budget_s):
    """`admission.admit` through the view's helpers, one call per question."""
    if not view.waiting:
        return Admitted([], prefill_budget_s, [])
    size = started.num_members
    free = view.kv.num_free_device_blocks - view.running_reserve_blocks()
    pauses = started.pauses(view)
    extra_rate, prefill_tokens, admitted, rates = 0.0, 0, [], []
    for request in view.waiting:
        rate = min(request.rate_tps, rate_cap_tps)
        if size >= limit or (size and extra_rate + rate > spare_rate_tps):
            break
        tokens = prefill_tokens + request.num_tokens
        if admitted and prefill_batch_time_s(view, tokens) > prefill_budget_s:
            break
        need = view.start_blocks(request)
        if need > free:
            free += pauses.take(need - free)
        if need > free:
            break
        free -= need + view.reserve_blocks(request)
        prefill_tokens = tokens
        admitted.append(request)
        rates.append(rate)
        size += 1
        extra_rate += rate
    unused_s = prefill_budget_s - prefill_batch_time_s(view, prefill_tokens)
    return Admitted(admitted, unused_s, rates)


def random_request(rng: random.Random, name: str, kv: KVTierManager) -> Request:
    """A waiting request; some with output and computed tokens, a host copy or not (states a
    waiting request does not reach today, which the written-out path must still price)."""
    request = make_request(
        name, num_prompt=rng.randint(1, 40), max_tokens=rng.randint(1, 60), rate=rng.uniform(1, 30)
    )
    if rng.random() < 0.3:
        for token in range(rng.randint(0, 5)):
            request.append_token(100 + token, 0.0)
        request.num_computed_tokens = rng.randint(1, request.num_tokens)
        if rng.random() < 0.5 and kv.allocate(name, request.num_computed_tokens):
            if kv.evict(name, request.num_computed_tokens) is None:
                kv.drop(name)
            kv.end_step()
    return request


def random_view(rng: random.Random, base: SchedulingView) -> SchedulingView:
    kv = KVTierManager(KVConfig(rng.randint(20, 200), 400, BLOCK_SIZE))
    waiting = [random_request(rng, f"w{i}", kv) for i in range(rng.randint(0, 30))]
    kv.allocate("owner", rng.randint(0, kv.num_free_device_blocks) * BLOCK_SIZE)
    estimator = StepTimeEstimator(0.02, rng.uniform(1e-5, 1e-3))
    for _ in range(rng.randint(0, 8)):  # a fitted prefill: a fixed part per step too
        tokens = rng.randint(1, 300)
        estimator.observe(4, tokens, 0.02 + rng.uniform(0.001, 0.01) + tokens * 2e-4)
    max_prefill_tokens = rng.choice((8, 32, 100, 4096))
    return replace(
        base,
        kv=kv,
        estimator=estimator,
        config=replace(base.config, max_prefill_tokens=max_prefill_tokens),
        waiting=waiting,
        new_token_ratio=rng.choice((0.0, 0.05, 0.3, 0.7)),
        remaining_output_tokens=rng.randint(0, 300),
    )


def random_started(rng: random.Random, view: SchedulingView) -> Survey:
    pausable = []
    for i in range(rng.randint(0, 6)):
        request = make_request(f"p{i}", num_prompt=rng.randint(1, 30), max_tokens=30)
        reclaim = rng.randint(0, 12)
        pausable.append(
            Candidate(
                request,
                rng.random(),
                reclaim,
                True,
                False,
                True,
                False,
                False,
                reclaim,
                rng.randint(0, 4),
                0.0,
            )  # fmt: skip
        )
    return Survey(pausable, [], 0, num_implicit_pinned=rng.randint(0, 8))


@pytest.mark.parametrize("seed", range(4))
def test_admit_decides_as_the_views_helpers_do(seed):
    rng, base = random.Random(seed), small_view(24)
    num_admitted = 0
    for _ in range(150):
        view = random_view(rng, base)
        started = random_started(rng, view)
        args = (
            rng.randint(0, 40),
            rng.choice((1e9, rng.uniform(0.0, 200.0))),
            rng.uniform(1.0, 40.0),
            rng.choice((0.0, 0.01, 0.05, 1.0)),
        )
        fast = admit(view, started, *args)
        assert fast == slow_admit(view, started, *args)  # (each call takes fresh pauses)
        num_admitted += len(fast.requests)
    assert num_admitted > 100  # (the random views do admit)


@pytest.mark.parametrize("growth", [0, 1, 7, 50])
def test_newcomer_candidates_equal_the_surveys(growth):
    rng, base = random.Random(growth), small_view(24)
    config = TokenFlowConfig(switch_penalty=0.3, stall_penalty=2.0, value_horizon_s=3.0)
    for _ in range(40):
        view = random_view(rng, base)
        members = list(view.waiting)
        for request in members[::3]:
            request.state = rng.choice((RequestState.WAITING, RequestState.PREEMPTED))
        costs = decision_costs(config, view)
        expected = survey(config, view, members, growth, costs).candidates
        assert newcomer_candidates(config, view, members, growth, costs) == expected
