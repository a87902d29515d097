"""The step-time estimator: decode and prefill fits on synthetic step durations."""

import pytest

from tokenflow.core.estimator import StepTimeEstimator


def fed(decode_steps=(), prefill_steps=(), prior_token_s=1e-3):
    """An estimator fed decode steps (batch, context, s) and prefill-only steps (tokens, s
    beyond the 50 ms step base)."""
    est = StepTimeEstimator(0.05, prior_token_s, per_seq_s=0.0)
    for batch, context, seconds in decode_steps:
        est.observe(batch, 0, seconds, context)
    for tokens, seconds in prefill_steps:
        est.observe(0, tokens, 0.05 + seconds)
    return est


def test_decode_fit_recovers_base_per_stream_and_per_token_costs():
    def true_s(b, c):
        return 0.02 + 0.003 * b + 2e-6 * c

    steps = [(b, c, true_s(b, c)) for b in (1, 4, 8, 16, 32) for c in (100 * b, 900 * b)]
    est = fed(decode_steps=steps * 6)
    assert est.decode_time_s(20, 500) == pytest.approx(true_s(20, 20 * 500), rel=0.05)
    assert est.capacity_tps(20, 500) == pytest.approx(20 / true_s(20, 20 * 500), rel=0.05)


def test_prefill_fit_separates_a_fixed_step_cost_from_the_per_token_cost():
    est = fed(prefill_steps=[(t, 0.08 + 1e-3 * t) for t in (32, 64, 256, 512)] * 4)
    assert est.prefill_step_s == pytest.approx(0.08, rel=0.05)
    assert est.prefill_token_s == pytest.approx(1e-3, rel=0.05)
    # four 32-token prompts started together pay the fixed cost once
    assert est.prefill_batch_time_s(128, 4096) == pytest.approx(0.08 + 0.128, rel=0.05)
    assert est.prefill_time_s(32) * 4 > 2 * est.prefill_batch_time_s(128, 4096)


def test_one_prompt_length_alone_puts_the_rest_in_the_fixed_cost():
    est = fed(prefill_steps=[(32, 0.08)] * 5, prior_token_s=2e-4)
    assert est.prefill_token_s == pytest.approx(2e-4)  # no variety: the prior stands
    assert est.prefill_time_s(32) == pytest.approx(0.08)  # and the observation is matched
    assert est.prefill_step_s == pytest.approx(0.08 - 32 * 2e-4)


def test_a_negative_fixed_cost_falls_back_to_the_mean_cost_per_token():
    # a prefill that hides in a memory-bound step costs nothing until it is large
    est = fed(prefill_steps=[(t, max(0.0, 2e-4 * (t - 100))) for t in (64, 512)] * 4)
    assert est.prefill_step_s == 0.0
    assert est.prefill_time_s(288) == pytest.approx((0.0 + 2e-4 * 412) / 2, rel=1e-6)


def test_batch_time_counts_one_fixed_cost_per_step():
    est = fed(prefill_steps=[(t, 0.1 + 1e-3 * t) for t in (100, 300)] * 4)
    one_step = est.prefill_batch_time_s(1000, 1000)
    three_steps = est.prefill_batch_time_s(1000, 400)
    assert three_steps - one_step == pytest.approx(2 * est.prefill_step_s)
    assert est.prefill_batch_time_s(0, 400) == 0.0


def test_mean_cost_per_token_spreads_the_fixed_cost_over_recent_prefills():
    est = fed(prefill_steps=[(64, 0.2)] * 4)
    assert est.prefill_mean_token_s == pytest.approx(0.2 / 64)
    assert fed().prefill_mean_token_s == pytest.approx(1e-3)  # the prior before any prefill


def test_a_one_off_slow_step_is_left_out_of_the_fits():
    # e.g. a kernel compiled for a new shape inside the first prefill of a burst
    steady = [(128, 0.1)] * 10
    est = fed(prefill_steps=[*steady, (128, 4.6), *steady[:3]])
    assert est.num_outliers == 1
    assert est.prefill_time_s(128) == pytest.approx(0.1, rel=0.05)
    decode = fed(decode_steps=[(8, 800, 0.05)] * 10 + [(8, 800, 2.0)] + [(8, 800, 0.05)] * 2)
    assert decode.num_outliers == 1
    assert decode.decode_time_s(8, 100) == pytest.approx(0.05, rel=0.05)


def test_a_machine_that_stays_slow_is_learnt():
    # three slow steps in a row are a slower machine, not one-offs: all of them count
    est = fed(decode_steps=[(8, 800, 0.05)] * 10 + [(8, 800, 0.5)] * 64)
    assert est.num_outliers == 0
    assert est.decode_time_s(8, 100) == pytest.approx(0.5, rel=0.05)


def test_a_slower_machine_is_slower_per_stream_too_before_other_batch_sizes_are_timed():
    # the prior: 0.027 s + 0.003 s a stream; the machine runs every part of a step 2x slower,
    # and so far only steps of 2 streams were timed
    est = StepTimeEstimator(0.03, 1e-3)

    def true_s(batch: int) -> float:
        return 2 * (0.027 + 0.003 * batch)

    for _ in range(20):
        est.observe(2, 0, true_s(2), 0)
    assert est.decode_time_s(2, 0) == pytest.approx(true_s(2))
    # the prior's per-stream cost kept as it was would say 0.06 + 0.003 x 12 = 0.096 s
    assert est.decode_time_s(12, 0) == pytest.approx(true_s(12), rel=0.02)


def test_early_steps_are_never_left_out():
    # with too few steps to predict from, the prior may be far off: every step counts
    est = fed(decode_steps=[(1, 100, 2.0)] * 3)
    assert est.num_outliers == 0


def test_the_kept_window_sums_fit_as_a_fresh_pass_would():
    # 1000 varied steps through a 64-step window: the sums kept as steps come and go must give
    # the fit of the last 64 steps alone (to rounding).
    import random

    rng = random.Random(7)
    steps = [
        (b, b * rng.randint(50, 900), 0.02 + 0.003 * b + rng.random() * 0.01)
        for b in (rng.randint(1, 64) for _ in range(1000))
    ]
    kept = fed(decode_steps=steps)
    fresh = fed(decode_steps=steps[-64:])
    for batch, context in ((1, 100), (16, 400), (64, 900)):
        assert kept.decode_time_s(batch, context) == pytest.approx(
            fresh.decode_time_s(batch, context), rel=1e-9
        )
