"""Hand-computed checks of the metrics of SPEC section 5, plus brute-force cross-checks."""

from __future__ import annotations

import json
import math
import random
from dataclasses import fields

import numpy as np
import pytest

from tests.python_calls import count_python_calls
from tokenflow.eval.metrics import (
    MetricsConfig,
    RequestTrace,
    Summary,
    andes_qoe,
    buffer_at_generation,
    buffer_timeline,
    consumption_times_s,
    effective_weights,
    rebuffer_time_s,
    summarize,
)


def at_rate(start_s: float, num_tokens: int, rate_tps: float) -> list[float]:
    """Token j (0-based) exactly at start + j/r: the reader never waits and never gets ahead."""
    return [start_s + j / rate_tps for j in range(num_tokens)]


def trace(
    times: list[float], arrival_s: float = 0.0, rate_tps: float = 10.0, **kwargs
) -> RequestTrace:
    kwargs.setdefault("finish_reason", "stop")
    return RequestTrace("r", arrival_s, rate_tps, 8, tuple(times), **kwargs)


# -- literal SPEC definitions, O(n^2), to cross-check the vectorised kernels -------------------
def reference_consumption(times: list[float], rate_tps: float) -> list[float]:
    consumed = [times[0]]
    for g in times[1:]:
        consumed.append(max(g, consumed[-1] + 1.0 / rate_tps))
    return consumed


def reference_buffer(times: list[float], rate_tps: float) -> list[int]:
    consumed = reference_consumption(times, rate_tps)
    # Equal within a nanosecond = already read (see TIME_TOLERANCE_S).
    return [sum(1 for k in range(j) if consumed[k] > times[j] + 1e-9) for j in range(len(times))]


def random_stream(rng: random.Random, num_tokens: int) -> list[float]:
    t, times = rng.uniform(0, 3), []
    for _ in range(num_tokens):
        stall = rng.uniform(0.5, 3) if rng.random() < 0.03 else 0.0
        t += rng.choice([0.0, 0.0, 0.01, 0.04, 0.07]) + stall
        times.append(t)
    return times


# -- consumption, buffer, weights, rebuffer -----------------------------------------------------
def test_consumption_and_buffer_hand_case() -> None:
    # Three tokens at once, one at 0.15 s, one after a stall.  r = 10: one token per 0.1 s.
    times = [0.0, 0.0, 0.0, 0.15, 1.0]
    assert consumption_times_s(times, 10.0) == pytest.approx([0.0, 0.1, 0.2, 0.3, 1.0])
    # B_4: of c = 0, .1, .2 only .2 > .15.  B_5: everything was read by 1.0.
    assert buffer_at_generation(times, 10.0) == [0, 0, 1, 1, 0]
    # The reader wanted token 5 at 0.3 + 0.1 = 0.4 and got it at 1.0.
    assert rebuffer_time_s(times, 10.0) == pytest.approx(0.6)


def test_ties_between_reading_and_generation_ignore_rounding() -> None:
    # Three tokens at 0, read at 0, 0.05, 0.1 (r = 20); a simulated clock stepping 0.01 s
    # produces the fourth at 0.09999999999999999.  In exact arithmetic token 3 is read at the
    # instant token 4 arrives, so the buffer is empty: a rounding error must not add a token.
    clock = 0.0
    for _ in range(10):
        clock += 0.01
    assert clock < 0.1
    assert buffer_at_generation([0.0, 0.0, 0.0, clock], 20.0) == [0, 0, 1, 0]
    # Likewise a one-token stream exactly on its target TTFT (up to rounding) is not late.
    assert andes_qoe(0.1, [0.1 + 0.7], 20.0, ttft_target_s=0.7000000000000001) == 1.0
    assert andes_qoe(0.1, [0.1 + 0.7000000000000001], 20.0, ttft_target_s=0.7) == 1.0


def test_stream_at_exact_rate_counts_every_token() -> None:
    times = at_rate(0.5, 100, 20.0)
    assert buffer_at_generation(times, 20.0) == [0] * 100
    assert effective_weights(times, 20.0) == [1.0] * 100
    assert rebuffer_time_s(times, 20.0) == 0.0
    assert andes_qoe(0.0, times, 20.0, ttft_target_s=1.0) == pytest.approx(1.0)


def test_stream_delivered_at_once_counts_about_its_first_fifth() -> None:
    # All L = 100 tokens at t = 1: token j is generated with B_j = j - 2 earlier tokens unread
    # (j >= 2), so j = 1..12 weigh 1 (B <= 10) and B = 11..19 weigh 0.9, 0.8, ..., 0.1 (sum 4.5).
    times = [1.0] * 100
    assert buffer_at_generation(times, 10.0) == [0, 0, *range(1, 99)]
    weights = effective_weights(times, 10.0)
    assert weights[:12] == [1.0] * 12
    assert weights[12:21] == pytest.approx([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1])
    assert weights[21:] == [0.0] * 79
    assert sum(weights) == pytest.approx(16.5)
    # L = 1000: 102 full tokens + sum(k/100 for k in 1..99) = 151.5, about 0.15 L.
    assert sum(effective_weights([0.0] * 1000, 10.0)) == pytest.approx(151.5)


def test_effective_fractions_come_from_the_config() -> None:
    config = MetricsConfig(effective_full_fraction=0.0, effective_zero_fraction=0.5)
    # L = 10, weight = (5 - B) / 5 for B = 0, 0, 1, ..., 8.
    expected = [1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.0, 0.0, 0.0, 0.0]
    assert effective_weights([0.0] * 10, 10.0, config) == pytest.approx(expected)


def test_single_stall_gives_its_length_as_rebuffer_time() -> None:
    # At rate 10 tok/s, then the 6th token comes 2 s late, then at rate again.
    times = [j / 10 for j in range(5)] + [0.5 + 2.0 + j / 10 for j in range(5)]
    assert rebuffer_time_s(times, 10.0) == pytest.approx(2.0)
    # A buffer absorbs part of a stall: 5 tokens at 0 are read until 0.5; the next comes at 1.0.
    assert rebuffer_time_s([0.0] * 5 + [1.0], 10.0) == pytest.approx(0.5)


def test_kernels_match_the_literal_definitions_on_random_streams() -> None:
    rng = random.Random(7)
    for _ in range(20):
        times = random_stream(rng, rng.randint(1, 300))
        rate = rng.choice([5.0, 15.0, 20.0, 33.0])
        reference = reference_consumption(times, rate)
        np.testing.assert_allclose(consumption_times_s(times, rate), reference, atol=1e-9)
        assert buffer_at_generation(times, rate) == reference_buffer(times, rate)
        stalls = sum(
            max(0.0, times[j] - (reference[j - 1] + 1 / rate)) for j in range(1, len(times))
        )
        assert rebuffer_time_s(times, rate) == pytest.approx(stalls, abs=1e-9)


def test_stream_functions_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="non-decreasing"):
        consumption_times_s([1.0, 0.5], 10.0)
    with pytest.raises(ValueError, match="rate_tps"):
        rebuffer_time_s([0.0], 0.0)
    with pytest.raises(ValueError, match="finite"):
        buffer_at_generation([0.0, math.nan], 10.0)


def test_one_token_and_no_token_streams() -> None:
    assert consumption_times_s([2.0], 10.0) == [2.0]
    assert buffer_at_generation([2.0], 10.0) == [0]
    assert effective_weights([2.0], 10.0) == [1.0]
    assert rebuffer_time_s([2.0], 10.0) == 0.0
    assert effective_weights([], 10.0) == []
    assert andes_qoe(0.0, [], 10.0, 1.0) == 0.0


# -- Andes QoE ----------------------------------------------------------------------------------
def test_qoe_is_one_at_or_ahead_of_the_ideal_timeline() -> None:
    # Ideal: token j read at 0 + 1.0 + (j-1)/10.
    assert andes_qoe(0.0, at_rate(1.0, 50, 10.0), 10.0, 1.0) == pytest.approx(1.0)
    assert andes_qoe(0.0, at_rate(0.2, 50, 10.0), 10.0, 1.0) == 1.0
    assert andes_qoe(0.0, [0.3] * 50, 10.0, 1.0) == 1.0  # all early: read at the ideal pace
    assert andes_qoe(0.0, [0.99], 10.0, 1.0) == 1.0


def test_qoe_hand_cases_of_late_streams() -> None:
    # One token 1 s late: the ideal curve has area 0 before T = 2 except where it is delayed.
    assert andes_qoe(0.0, [2.0], 10.0, 1.0) == 0.0
    # r = 1, target 1: ideal e = 1, 2; actual c = 2, 3.  S_delay = 1 + 1; T = 3,
    # S_whole = (3 - 1) + (3 - 2) = 3, so QoE = 1 - 2/3.
    assert andes_qoe(0.0, [2.0, 3.0], 1.0, 1.0) == pytest.approx(1 / 3)
    # A stall in the middle: ideal 1, 2, 3, 4; actual 1, 2, 5, 6 -> S_delay = 4,
    # T = 6, S_whole = 5 + 4 + 3 + 2 = 14.
    assert andes_qoe(0.0, [1.0, 2.0, 5.0, 6.0], 1.0, 1.0) == pytest.approx(1 - 4 / 14)
    # Hugely late tends to 0, and later is always worse.
    late = [andes_qoe(0.0, at_rate(1.0 + d, 100, 10.0), 10.0, 1.0) for d in (0.5, 5, 50, 5000)]
    assert late == sorted(late, reverse=True)
    assert late[-1] < 0.01


def test_qoe_areas_match_a_numerical_integral() -> None:
    rng = random.Random(3)
    arrival, rate, target = 0.0, 8.0, 1.0
    times = random_stream(rng, 60)
    consumed = np.array(consumption_times_s(times, rate))
    ideal = arrival + target + np.arange(60) / rate
    horizon = max(ideal[-1], consumed[-1])
    grid = np.linspace(arrival, horizon, 400_001)
    n_ideal = np.searchsorted(ideal, grid, side="right")
    n_actual = np.searchsorted(consumed, grid, side="right")
    dt = grid[1] - grid[0]
    s_whole = n_ideal.sum() * dt
    s_delay = np.maximum(n_ideal - n_actual, 0).sum() * dt
    assert andes_qoe(arrival, times, rate, target) == pytest.approx(1 - s_delay / s_whole, abs=1e-3)


# -- buffer timeline ----------------------------------------------------------------------------
def test_buffer_timeline_counts_generated_minus_consumed() -> None:
    t = trace([1.0] * 5, rate_tps=10.0)  # read at 1.0, 1.1, 1.2, 1.3, 1.4
    assert buffer_timeline(t, [0.5, 1.0, 1.25, 1.4, 2.0]) == [0, 4, 2, 0, 0]


# -- the summary --------------------------------------------------------------------------------
def test_empty_input_gives_zeros() -> None:
    summary = summarize([])
    data = summary.to_dict()
    assert list(data) == [f.name for f in fields(Summary)]
    assert all(v == 0 and not math.isnan(v) for v in data.values())
    json.dumps(data)


def test_one_token_trace() -> None:
    s = summarize([trace([0.5])])
    assert (s.num_requests, s.num_completed, s.total_output_tokens) == (1, 1, 1)
    assert s.makespan_s == pytest.approx(0.5)
    assert s.ttft_mean_s == s.ttft_p99_s == s.e2e_mean_s == pytest.approx(0.5)
    assert s.tpot_mean_s == s.itl_p99_s == s.rebuffer_mean_s == 0.0  # TPOT only for n > 1
    assert s.throughput_tps == s.effective_throughput_tps == pytest.approx(2.0)
    assert s.goodput_rps == pytest.approx(2.0)  # one-token requests count as TPOT 0
    assert s.qoe_mean == 1.0
    assert s.qos == pytest.approx((1 - 0.5) / 0.5)


def test_exact_rate_stream_summary() -> None:
    times = at_rate(0.5, 100, 20.0)  # arrival 0; last token at 0.5 + 99/20 = 5.45
    s = summarize([trace(times, rate_tps=20.0)])
    assert s.makespan_s == pytest.approx(5.45)
    assert (
        s.effective_throughput_tps == pytest.approx(s.throughput_tps) == pytest.approx(100 / 5.45)
    )
    assert s.tpot_mean_s == pytest.approx(0.05) and s.itl_p99_s == pytest.approx(0.05)
    assert s.rebuffer_mean_s == pytest.approx(0.0, abs=1e-9)
    assert s.qos == pytest.approx((100 - 0.5) / 5.45)


def test_burst_stream_effective_throughput() -> None:
    s = summarize([trace([1.0] * 100, arrival_s=0.0), trace(at_rate(1.0, 100, 10.0))])
    makespan = 1.0 + 99 / 10
    assert s.total_output_tokens == 200
    assert s.effective_throughput_tps == pytest.approx((16.5 + 100) / makespan)
    assert s.throughput_tps == pytest.approx(200 / makespan)


def test_latency_percentiles_use_linear_interpolation() -> None:
    ttfts = [1.0, 2.0, 3.0, 4.0, 10.0]
    traces = [trace([t, t + 0.5, t + 2.5], arrival_s=0.0) for t in ttfts]
    s = summarize(traces)
    assert s.ttft_mean_s == pytest.approx(4.0)
    assert s.ttft_p50_s == pytest.approx(3.0)
    assert s.ttft_p99_s == pytest.approx(4 + 0.96 * 6)  # rank 0.99 * 4 = 3.96
    assert s.tpot_mean_s == pytest.approx(1.25) and s.tpot_p99_s == pytest.approx(1.25)
    # ITLs: five of 0.5 and five of 2.0 -> rank 0.99 * 9 = 8.91 lies between two 2.0s.
    assert s.itl_p99_s == pytest.approx(2.0)
    assert s.e2e_p99_s == pytest.approx(6.5 + 0.96 * 6)
    assert s.makespan_s == pytest.approx(12.5)


def test_goodput_counts_requests_meeting_every_slo() -> None:
    config = MetricsConfig(slo_ttft_s=2.0, slo_tpot_s=0.2)
    traces = [
        trace([1.0, 1.1, 1.2]),  # good: TTFT 1, TPOT 0.1
        trace([3.0, 3.1]),  # TTFT too long
        trace([1.0, 1.3, 1.6]),  # TPOT 0.3 too long
        trace([1.0, 1.1], finish_reason="abort"),  # failed: never good
        trace([], finish_reason="abort"),  # no tokens
        trace([2.0, 2.2, 2.4, 10.0], finish_reason="length"),  # TPOT 8/3
    ]
    s = summarize(traces, config)
    assert (s.num_requests, s.num_completed) == (6, 4)
    assert s.makespan_s == pytest.approx(10.0)
    assert s.goodput_rps == pytest.approx(1 / 10.0)
    assert s.ttft_mean_s == pytest.approx((1 + 3 + 1 + 2) / 4)  # failed ones left out
    assert s.total_output_tokens == 3 + 2 + 3 + 2 + 0 + 4  # every token counts


def test_request_without_tokens_is_charged_in_qos_but_not_in_ttft() -> None:
    served = trace(at_rate(1.0, 10, 10.0))  # ends at 1.9
    starved = RequestTrace("s", 0.5, 10.0, 8, (), finish_reason=None)
    s = summarize([served, starved])
    assert (s.num_requests, s.num_completed) == (2, 1)
    assert s.ttft_mean_s == pytest.approx(1.0)
    assert s.qos == pytest.approx((10 - 1.0 - (1.9 - 0.5)) / 1.9)
    lone = summarize([starved])
    assert lone.num_requests == 1 and lone.makespan_s == 0.0 and lone.qos == 0.0


def test_preemptions_are_summed() -> None:
    s = summarize([trace([1.0], num_preemptions=2), trace([1.0], num_preemptions=3)])
    assert s.num_preemptions == 5


def test_trace_and_config_validation() -> None:
    with pytest.raises(ValueError, match="non-decreasing"):
        trace([1.0, 0.9])
    with pytest.raises(ValueError, match="precedes arrival"):
        trace([0.5], arrival_s=1.0)
    with pytest.raises(ValueError, match="rate_tps"):
        trace([1.0], rate_tps=0.0)
    with pytest.raises(ValueError, match="full < zero"):
        MetricsConfig(effective_full_fraction=0.2, effective_zero_fraction=0.2)
    with pytest.raises(ValueError, match="slo_tpot_s"):
        MetricsConfig(slo_tpot_s=0.0)


def _random_traces(num_streams: int, num_tokens: int) -> list[RequestTrace]:
    rng = np.random.default_rng(0)
    traces = []
    for i in range(num_streams):
        gaps = rng.choice([0.0, 0.01, 0.03, 0.5], size=num_tokens, p=[0.3, 0.4, 0.28, 0.02])
        times = tuple((rng.uniform(0, 60) + 1.0 + np.cumsum(gaps)).tolist())
        trace = RequestTrace(
            request_id=f"r{i}",
            arrival_s=0.0,
            rate_tps=20.0,
            num_prompt_tokens=512,
            token_times_s=times,
            finish_reason="stop",
        )
        traces.append(trace)
    return traces


def test_summarize_makes_python_calls_per_stream_not_per_token() -> None:
    # Tokens are numpy's work: 400 streams of 2048 tokens take as many Python calls as 400
    # of 16 (a loop over tokens would add ~800,000), so the summary stays fast on any machine.
    short, long = _random_traces(400, 16), _random_traces(400, 2048)
    summarize(short)  # warm numpy's lazy imports
    s = summarize(long)
    assert s.total_output_tokens == 400 * 2048
    num_short = count_python_calls(lambda: summarize(short))
    assert count_python_calls(lambda: summarize(long)) <= 1.1 * num_short
