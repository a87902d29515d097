"""The paused members priced afresh, against the costs and the survey priced member by member."""

from __future__ import annotations

import random
from dataclasses import replace
from operator import attrgetter

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


def test_kept_prices_rank_by_arrival_as_the_survey_does_as_the_clock_moves():
    """Ranked by arrival, kept entries give each member the survey's footprint, resume time
    and urgent / overdue flags, as the clock moves them; another growth empties the table."""
    policy, started, _ = _rotating(TOKENFLOW)
    view, config = started.view, policy.config
    prices = PausedPrices()
    growth = policy.growth_tokens(view)
    fields = attrgetter("request", "footprint_blocks", "resume_s", "is_urgent", "is_overdue")
    flags = set()
    for ahead_s in (0.0, 0.5, 1.0, 2.0, 5.0, 30.0):
        later = replace(view, now_s=view.now_s + ahead_s)
        costs, kept = price_paused(config, later, growth, prices, by_arrival=True)
        surveyed = survey(config, later, later.preempted, growth, decision_costs(config, later))
        assert list(map(fields, kept)) == list(map(fields, surveyed.candidates))
        assert costs.queue_s == decision_costs(config, later).queue_s
        flags |= {(c.is_urgent, c.is_overdue) for c in kept}
    assert {(False, False), (True, False), (True, True)} <= flags  # every case was met
    assert len(prices.entries(view, growth)) == len(view.preempted)
    assert prices.entries(view, growth + 1) == {}
