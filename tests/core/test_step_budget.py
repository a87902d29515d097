"""The step budget (`StepBudget.tokens`): the decodes plus a prefill chunk sized to the target."""

from __future__ import annotations

import pytest

from tokenflow.core.estimator import StepTimeEstimator
from tokenflow.core.step_budget import StepBudget


def _estimator(prefill_token_s: float = 1e-3) -> StepTimeEstimator:
    # decode step 0.03 s + 0.004 s per stream; no fixed prefill cost yet
    return StepTimeEstimator(decode_step_s=0.03, prefill_token_s=prefill_token_s, per_seq_s=0.004)


def test_the_chunk_takes_about_the_step_target_at_the_prefill_cost():
    estimator = _estimator()
    budget = StepBudget(step_target_s=0.25, max_prefill_tokens=4096)
    assert budget.tokens(estimator, num_decodes=0) == 250  # 0.25 s at 1 ms a token


def test_the_decodes_come_on_top_of_the_chunk():
    estimator = _estimator()
    budget = StepBudget(step_target_s=0.25, max_prefill_tokens=4096)
    assert budget.tokens(estimator, 4) - 4 == budget.tokens(estimator, 0)


def test_decodes_slower_than_the_target_widen_the_chunk_to_their_time():
    estimator = _estimator()
    budget = StepBudget(step_target_s=0.05, max_prefill_tokens=4096)
    decode_s = estimator.decode_time_s(100)
    assert decode_s > 0.05
    assert budget.tokens(estimator, 100) == 100 + int(decode_s / 1e-3)


@pytest.mark.parametrize(("prefill_token_s", "chunk"), [(1.0, 128), (1e-7, 4096)])
def test_the_chunk_is_clamped_to_its_floor_and_the_prefill_limit(prefill_token_s, chunk):
    budget = StepBudget(step_target_s=0.25, max_prefill_tokens=4096)
    assert budget.tokens(_estimator(prefill_token_s), 0) == chunk


def test_a_fixed_prefill_cost_takes_at_most_half_the_time():
    estimator = _estimator()
    for tokens in (64, 256, 512):  # a fixed 0.4 s per prefill step, then 1 ms a token
        estimator.observe(num_decode=0, num_prefill_tokens=tokens, duration_s=0.4 + tokens * 1e-3)
    assert estimator.prefill_step_s > 0.25
    budget = StepBudget(step_target_s=0.5, max_prefill_tokens=4096)
    assert budget.tokens(estimator, 0) == pytest.approx(0.25 / estimator.prefill_token_s, abs=1)
