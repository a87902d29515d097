"""Metrics of requests without a human reader: eager streams and batch (non-streamed) answers."""

from __future__ import annotations

import math

import pytest

from tokenflow.eval.metrics import RequestTrace, summarize, summarize_by_class


def trace(name: str, times: list[float], consumption: str, rate_tps: float = 2.0):
    return RequestTrace(name, 0.0, rate_tps, 8, tuple(times), 0, "stop", consumption)


def test_an_eager_stream_has_no_buffer_no_stall_and_every_token_is_effective():
    gappy = [1.0, 1.1, 4.0, 4.1, 9.0]  # a reader at 2 tok/s would stall on these gaps
    eager = summarize([trace("e", gappy, "eager")])
    reader = summarize([trace("r", gappy, "reader")])
    assert reader.rebuffer_mean_s > 0 and eager.rebuffer_mean_s == 0.0
    assert eager.effective_throughput_tps == pytest.approx(eager.throughput_tps)
    assert eager.ttft_mean_s == reader.ttft_mean_s == 1.0 and eager.e2e_mean_s == 9.0
    assert RequestTrace("x", 0.0, 3.0, 1, (), consumption="batch").rate_tps == math.inf


def test_stall_and_qoe_are_the_readers_and_the_classes_are_summarized_apart():
    reader = trace("r", [1.0, 1.5, 2.0, 5.0], "reader")
    runs = [reader, trace("e", [0.5, 7.0], "eager"), trace("b", [3.0, 3.1], "batch")]
    alone, mixed = summarize([reader]), summarize(runs)
    assert mixed.rebuffer_mean_s == alone.rebuffer_mean_s > 0
    assert mixed.qoe_mean == alone.qoe_mean
    by_class = summarize_by_class(runs)
    assert list(by_class) == ["reader", "eager", "batch"]
    assert by_class["reader"] == alone and by_class["batch"].e2e_mean_s == pytest.approx(3.1)
    assert summarize_by_class([reader]).keys() == {"reader"}


def test_an_unknown_class_is_refused():
    with pytest.raises(ValueError, match="consumption must be one of"):
        RequestTrace("x", 0.0, 3.0, 1, (), consumption="robot")
