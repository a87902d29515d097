"""The serving probe's arithmetic: a lone request's prefill factor and per-request path."""

import pytest

from tests.sim.synthetic import synthetic_profile
from tokenflow.calibrate.probe import PROBE_POLICY, prefill_speed_factor, request_path_s
from tokenflow.calibrate.profile_file import ProbePoint
from tokenflow.sim.overhead import default_overhead

PROBE_STEP_S = default_overhead(PROBE_POLICY).step_s


def lone_ttft_s(costs, prompt: int, prefill_factor: float, decode_factor: float) -> float:
    """A lone request's in-process first step on a machine running prefill `prefill_factor`
    times slower than the fit: base, prefill terms, the scheduler's charge, the engine's time."""
    fit = costs.compute_fit(prompt)
    base_s = fit.time_s(0, 0, 0, 0)
    prefill_s = fit.time_s(0, 0, prompt, prompt * (prompt + 1) // 2) - base_s
    engine_s = costs.server_step_s + costs.server_per_chunk_s
    fixed_s = PROBE_STEP_S(1) + engine_s
    return base_s * decode_factor + prefill_s * prefill_factor + fixed_s


@pytest.mark.parametrize("prefill_factor", [0.8, 1.0, 1.4])
def test_the_prefill_factor_is_recovered_from_a_lone_request(prefill_factor):
    costs = synthetic_profile().costs
    ttft = lone_ttft_s(costs, 60, prefill_factor, decode_factor=0.9)
    lone = ProbePoint(batch=1, step_gap_s=0.05, in_process_step_s=0.04, ttft_s=ttft + 0.03,
                      in_process_ttft_s=ttft, prompt_tokens=60)  # fmt: skip
    burst = ProbePoint(batch=4, step_gap_s=0.06, in_process_step_s=0.05, prompt_tokens=30)
    points = [lone, burst]
    assert prefill_speed_factor(costs, points, 0.9, PROBE_STEP_S) == pytest.approx(prefill_factor)
    assert request_path_s(points) == pytest.approx(0.03)


def test_without_a_lone_request_nothing_is_scaled_or_charged():
    costs = synthetic_profile().costs
    points = [ProbePoint(4, 0.06, 0.05), ProbePoint(16, 0.09, 0.08)]  # an older profile's probe
    assert prefill_speed_factor(costs, points, 0.9, PROBE_STEP_S) == 1.0
    assert request_path_s(points) == 0.0
    early = [ProbePoint(1, 0.05, 0.04, 0.10, 0.12)]  # through the server faster: no charge
    assert request_path_s(early) == 0.0


def test_the_lone_request_is_one_prefill_step_of_the_embedded_model():
    from tokenflow.calibrate.probe import LONE_PROMPT_WORDS, prompt_words
    from tokenflow.cli.profile import prompt_tokens
    from tokenflow.core.step_budget import MIN_PREFILL_CHUNK_TOKENS
    from tokenflow.model.loader import read_gguf_header

    chat = prompt_tokens(read_gguf_header().tokenizer)["chat"]
    assert prompt_words(1) == LONE_PROMPT_WORDS and prompt_words(16) < LONE_PROMPT_WORDS
    assert 96 <= chat.tokens(LONE_PROMPT_WORDS) <= MIN_PREFILL_CHUNK_TOKENS
