"""A saved trace reads back to the same requests, here and through `bench --save-trace`."""

import pytest

from tokenflow.cli.main import main
from tokenflow.eval.workload import (
    ClassMix,
    LengthDist,
    RateMix,
    WorkloadError,
    WorkloadSpec,
    generate,
    load_trace,
    save_trace,
)


def test_a_saved_trace_loads_back_to_the_same_requests(tmp_path):
    spec = WorkloadSpec(
        kind="poisson",
        num_requests=20,
        request_rate=3.0,
        prompt=LengthDist(64, 16),
        output=LengthDist(32, 8),
        rates=RateMix.parse("2:0.5,4:0.5"),
        seed=3,
    )
    requests = generate(spec)
    path = tmp_path / "t.jsonl"
    save_trace(path, requests)
    assert load_trace(path, default_rate_tps=1.0) == requests
    assert generate(WorkloadSpec(kind="trace", trace_path=str(path))) == requests


def test_a_saved_trace_keeps_each_requests_class(tmp_path):
    spec = WorkloadSpec(
        kind="burst", num_requests=30, classes=ClassMix.parse("reader:0.5,eager:0.3,batch:0.2")
    )
    requests = generate(spec)
    assert {r.consumption for r in requests} == {"reader", "eager", "batch"}
    path = tmp_path / "t.jsonl"
    save_trace(path, requests)
    assert load_trace(path, default_rate_tps=1.0) == requests
    # A stated class wins over the spec's mix; rows without one draw from it.
    every_eager = WorkloadSpec(kind="trace", trace_path=str(path), classes=ClassMix.parse("eager"))
    assert generate(every_eager) == requests
    path.write_text('{"arrival_s": 0, "prompt_tokens": 4, "output_tokens": 4}\n')
    assert generate(every_eager)[0].consumption == "eager"


def test_a_trace_with_an_unknown_class_names_file_and_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_tokens": 4, "output_tokens": 4, "stream_class": "x"}')
    with pytest.raises(WorkloadError, match=rf"^{path}:1: stream_class must be one of"):
        load_trace(path, default_rate_tps=1.0)


def test_an_unwritable_trace_is_one_line(tmp_path):
    with pytest.raises(WorkloadError, match="cannot write trace file"):
        save_trace(tmp_path / "missing" / "t.jsonl", [])


def test_bench_saves_the_workload_it_generated(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    # no server answers: the run fails, but the workload was written first
    code = main(
        ["bench", "--url", "http://127.0.0.1:9", "--num-requests", "5", "--prompt-len", "16",
         "--output-len", "8", "--save-trace", str(path), "--no-progress", "--timeout", "5"]
    )  # fmt: skip
    assert code == 1
    assert len(load_trace(path, default_rate_tps=1.0)) == 5
