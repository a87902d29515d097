"""The paused members priced afresh, against the costs and the survey priced member by member."""

from __future__ import annotations

import random

from tests.core.test_parity import TOKENFLOW
from tests.core.test_residents import _rotating
from tokenflow.core.policies.paused import PausedPrices, price_paused
from tokenflow.core.policies.pricing import decision_costs
from tokenflow.core.policies.survey import survey


def test_fresh_prices_equal_the_costs_priced_member_by_member():
    """Priced afresh (the estimator's prefill time written out), the paused members' resume
    times and queue equal `decision_costs`' (`prefill_time_s` called per member), over
    random prefill fits where loading or recomputing wins; the footprints equal the
    survey's."""
    rng = random.Random(2)
    policy, started, _ = _rotating(TOKENFLOW)
    view = started.view
    est, config = view.estimator, policy.config
    for _ in range(40):
        est._prefill_step_s = rng.choice([0.0, -1e-4, rng.uniform(0, 0.05)])
        est._prefill_token_s = rng.uniform(0, 2e-3) ** rng.randint(1, 2)
        growth = rng.choice([0, 1, policy.growth_tokens(view), rng.randint(0, 300)])
        for by_arrival in (False, True):
            costs, got = price_paused(config, view, growth, PausedPrices(), by_arrival)
            expected = decision_costs(config, view)
            assert costs.resume_of == expected.resume_of
            assert costs.queue_s == expected.queue_s
            assert [c.resume_s for c in got] == list(expected.resume_of.values())
            surveyed = survey(config, view, view.preempted, growth, expected).candidates
            assert [c.footprint_blocks for c in got] == [c.footprint_blocks for c in surveyed]


def test_kept_prices_outlive_a_growth_that_moves_and_comes_back():
    """The growth moves with the running count: the entries of the last few growths are kept,
    a fit not kept starts empty, and the kept entries price as fresh ones do."""
    policy, started, _ = _rotating(TOKENFLOW)
    view, config = started.view, policy.config
    assert view.preempted
    prices = PausedPrices()
    growth = policy.growth_tokens(view)
    first = prices.entries(view, growth)
    fresh = price_paused(config, view, growth, PausedPrices(), by_arrival=True)[1]
    assert price_paused(config, view, growth, prices, by_arrival=True)[1] == fresh
    assert len(first) == len(view.preempted)
    for moved in range(growth + 1, growth + PausedPrices.KEPT_FITS):
        price_paused(config, view, moved, prices, by_arrival=True)
    assert prices.entries(view, growth) is first  # back within the kept fits
    for moved in range(growth + 1, growth + PausedPrices.KEPT_FITS + 1):
        prices.entries(view, moved)
    assert prices.entries(view, growth) == {}  # pushed out by as many newer ones
    assert price_paused(config, view, growth, prices, by_arrival=True)[1] == fresh
