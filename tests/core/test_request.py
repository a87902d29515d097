import math

import pytest

from tests.core.helpers import make_request
from tokenflow.core.request import (
    MAX_READER_RATE_TPS,
    MIN_READER_RATE_TPS,
    SamplingParams,
    is_reader_rate,
)


def test_buffer_counts_tokens_not_yet_read():
    r = make_request("a", rate=10.0)  # one token read every 0.1 s
    for _ in range(5):
        r.append_token(7, 1.0)  # five tokens at once at t = 1
    # consumption times 1.0, 1.1, 1.2, 1.3, 1.4
    assert r.buffer_tokens(1.0) == 4
    assert r.buffer_tokens(1.15) == 3
    assert r.buffer_tokens(1.4) == 0
    assert r.slack_s(1.0) == pytest.approx(0.5)


def test_buffer_is_zero_before_first_token_and_after_a_stall():
    r = make_request("a", rate=10.0)
    assert r.buffer_tokens(0.0) == 0 and r.slack_s(0.0) == 0.0
    r.append_token(7, 1.0)
    r.append_token(7, 3.0)  # the reader stalled from 1.1 to 3.0
    assert r.last_consume_s == 3.0
    assert r.buffer_tokens(3.0) == 0
    assert r.slack_s(3.0) == pytest.approx(0.1)


def test_stream_at_exactly_its_rate_never_builds_a_buffer():
    r = make_request("a", rate=4.0)
    for j in range(8):
        r.append_token(7, j * 0.25)
        assert r.buffer_tokens(j * 0.25) == 0


def test_token_ids_span_prompt_and_outputs():
    r = make_request("a", num_prompt=3)
    r.append_token(50, 0.0)
    r.append_token(51, 0.0)
    assert r.token_ids_from(0, 5) == (3, 4, 5, 50, 51)
    assert r.token_ids_from(2, 2) == (5, 50)
    assert r.token_ids_from(4, 1) == (51,)


@pytest.mark.parametrize("rate", [0.0, -1.0, math.nan, math.inf])
def test_invalid_rate_is_rejected(rate):
    with pytest.raises(ValueError, match="rate"):
        make_request("a", rate=rate)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ],
)
def test_invalid_sampling_params_are_rejected(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


def test_a_request_keeps_its_fields_in_slots_not_a_dict():
    # The per-step path touches every running request: fields in the object itself (no
    # per-instance dict) read fewer cache lines, and a typo in an attribute name fails instead
    # of adding a field.
    request = make_request("r0")
    assert not hasattr(request, "__dict__")
    with pytest.raises(AttributeError):
        request.num_token = 3  # (num_tokens)


@pytest.mark.parametrize("rate", [1e-309, 1e-4, 1001.0, math.inf, math.nan, 0.0, -1.0])
def test_a_rate_outside_the_readers_bound_is_refused(rate):
    assert not is_reader_rate(rate)
    with pytest.raises(ValueError, match="reader's rate"):
        make_request("r", rate=rate)


@pytest.mark.parametrize("rate", [MIN_READER_RATE_TPS, 4.0, MAX_READER_RATE_TPS])
def test_rates_inside_the_bound_make_a_reader_whose_clock_is_finite(rate):
    request = make_request("r", rate=rate)
    assert math.isfinite(request.dry_s)
