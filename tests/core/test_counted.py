"""The counted balance's shortcuts give what the balancer's own steps give, on random inputs.

The others' order (paused members and newcomers, each list in arrival order) must be
`balance.priority_order`'s, with many equal utilities and rates, overdue members, paused
members without a token and newcomers with one (where the shortcut must step aside).
"""

from __future__ import annotations

import random

import pytest

from tokenflow.core.policies.balance import _utility_order, priority_order
from tokenflow.core.policies.counted import _others_order, _resume_flags
from tokenflow.core.policies.survey import Candidate
from tokenflow.core.request import Request, SamplingParams


def _candidate(rng: random.Random, index: int, started: bool) -> Candidate:
    r = Request(
        f"r{index:03d}",
        (1, 2, 3),
        SamplingParams(max_tokens=50),
        rate_tps=rng.choice((2.0, 5.0, 10.0)),
        arrival_s=round(index * 0.01 + rng.choice((0.0, 0.0, 0.005)), 3),
        arrival_index=index,
    )
    if started:
        r.output_token_ids.append(7)
    overdue = started and rng.random() < 0.05
    utility = rng.choice((0.1, 0.2, 0.3, 0.9, rng.random()))
    resume = rng.choice((0.0, 0.01, 0.1, 0.3)) if started else 0.0
    return Candidate(r, utility, 3, False, False, False, overdue, overdue, 0, 0, resume)


def _others(rng: random.Random, odd: bool) -> tuple[list[Candidate], list[Candidate]]:
    """Paused members and newcomers, each in arrival order; `odd`: a few paused members
    without a token and newcomers with one."""
    num_paused, num_new = rng.randint(0, 40), rng.randint(0, 30)
    paused = [_candidate(rng, i, not (odd and rng.random() < 0.1)) for i in range(num_paused)]
    newcomers = [_candidate(rng, 100 + i, odd and rng.random() < 0.1) for i in range(num_new)]
    if rng.random() < 0.3:  # interleaved arrivals: a newcomer before some paused member
        newcomers = [_candidate(rng, 5 + i * 7, False) for i in range(num_new)]
        newcomers.sort(key=lambda c: c.request.sort_key)
    return paused, newcomers


@pytest.mark.parametrize("seed", range(300))
def test_the_others_order_is_the_balancers(seed):
    rng = random.Random(seed)
    paused, newcomers = _others(rng, odd=seed % 3 == 0)
    for by_arrival in (False, True):
        expected = priority_order(paused + newcomers, by_arrival)
        assert _others_order(paused, newcomers, by_arrival) == expected
    assert _others_order(paused, newcomers, False) == sorted(paused + newcomers, key=_utility_order)


@pytest.mark.parametrize("seed", range(100))
def test_resume_flags_follow_the_greedy(seed):
    """Taken when reached: a resume that fits the budget with those taken (the first always)."""
    rng = random.Random(seed)
    costs = [rng.choice((0.0, 0.0, 0.05, 0.2, 0.6, rng.random())) for _ in range(30)]
    budget_s = rng.choice((0.1, 0.5, 1.0))
    flags, resume_before = _resume_flags(costs, budget_s)
    spent = 0.0
    for i, cost in enumerate(costs):
        assert resume_before[i] == spent
        fits = cost == 0.0 or spent == 0.0 or spent + cost <= budget_s
        assert flags[i] == fits
        spent += cost if fits else 0.0
    assert resume_before[-1] == spent
