"""The benchmark client and the workload play each consumption class: readers, eager streams and
non-streamed (batch) requests."""

from __future__ import annotations

import asyncio
import math

import pytest

from tests.serving.fake_engine import FakeEngine
from tests.serving.live_server import serve_in_thread
from tokenflow.eval.client import ClientConfig, request_body, run_workload
from tokenflow.eval.metrics import summarize_by_class
from tokenflow.eval.workload import ClassMix, RateMix, WorkloadError, WorkloadSpec, generate
from tokenflow.eval.workload import WorkloadRequest as Item
from tokenflow.serving.app import build_app


def test_each_class_asks_as_its_clients_do():
    config = ClientConfig(url="http://x", show_progress=False)
    reader, eager, batch = (
        request_body(Item("r", 0.0, 4, 5, 6.0, name), 0, config, None)
        for name in ("reader", "eager", "batch")
    )
    assert reader["stream"] and reader["stream_rate"] == 6.0 and "stream_class" not in reader
    assert eager["stream"] and eager["stream_class"] == "eager" and "stream_rate" not in eager
    assert not batch["stream"] and "stream_rate" not in batch and "stream_options" not in batch


def test_a_mixed_run_scores_every_class_apart():
    engine = FakeEngine(token_delay_s=0.002)
    classes = ("reader", "eager", "batch")
    items = [Item(f"req-{i}", 0.0, 4, 5 + i, 8.0, c) for i, c in enumerate(classes)]
    with serve_in_thread(build_app(engine)) as url:
        config = ClientConfig(url=url, show_progress=False, timeout_s=20.0)
        run = asyncio.run(run_workload(items, config, name="fake"))
    assert run.num_failed == 0
    # the three arrive at once, in any order: each is known by its output length
    rates = {params.max_tokens: rate for _, params, rate in engine.submitted}
    assert rates == {5: 8.0, 6: math.inf, 7: math.inf}
    batch = run.traces[2]
    assert batch.consumption == "batch" and len(set(batch.token_times_s)) == 1  # all at once
    assert [t.num_output_tokens for t in run.traces] == [5, 6, 7]
    assert list(summarize_by_class(run.traces)) == ["reader", "eager", "batch"]


def test_a_class_mix_is_drawn_on_its_own_stream():
    spec = WorkloadSpec("burst", num_requests=200, rates=RateMix((4.0, 8.0), (1.0, 1.0)))
    mixed = WorkloadSpec(**{**spec.__dict__, "classes": ClassMix.parse("reader:0.6,eager:0.4")})
    readers, both = generate(spec), generate(mixed)
    assert {r.consumption for r in readers} == {"reader"}
    assert [(r.num_prompt_tokens, r.rate_tps) for r in readers] == [
        (r.num_prompt_tokens, r.rate_tps) for r in both
    ]  # the same requests, only their classes drawn
    share = sum(r.consumption == "eager" for r in both) / len(both)
    assert 0.3 < share < 0.5 and generate(mixed) == both
    with pytest.raises(WorkloadError, match="unknown class"):
        ClassMix.parse("reader:1,robot:1")
