"""The benchmark client against the fake-engine server on a real uvicorn."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from dataclasses import replace
from typing import Any

import pytest

from tests.serving.fake_engine import FakeEngine
from tests.serving.live_server import serve_in_thread, wait_until
from tokenflow.cli.bench import BenchTarget, benchmark, report_runs
from tokenflow.eval.client import (
    BenchRun,
    ClientConfig,
    endpoint_url,
    request_body,
    run_workload,
    synthetic_prompt,
)
from tokenflow.eval.metrics import RequestTrace, summarize
from tokenflow.eval.report import report_records
from tokenflow.eval.workload import WorkloadRequest
from tokenflow.serving.app import KEEPALIVE, build_app
from tokenflow.serving.config import ServerConfig

SUMMARY_KEYS = {
    "num_requests", "num_completed", "makespan_s", "total_output_tokens", "throughput_tps",
    "effective_throughput_tps", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "tpot_mean_s",
    "tpot_p99_s", "itl_p99_s", "e2e_mean_s", "e2e_p99_s", "rebuffer_mean_s", "rebuffer_p99_s",
    "qoe_mean", "qos", "goodput_rps", "num_preemptions",
}  # fmt: skip


def burst(num: int, output_tokens: int = 5) -> list[WorkloadRequest]:
    return [
        WorkloadRequest(f"req-{i}", 0.0, 4 + i, output_tokens + i, 15.0 + i) for i in range(num)
    ]


def config(url: str, **kwargs: object) -> ClientConfig:
    return ClientConfig(url=url, show_progress=False, timeout_s=20.0, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("endpoint", "per_delta"), [("chat", 1), ("completions", 3)])
def test_burst_traces(endpoint: str, per_delta: int) -> None:
    engine = FakeEngine(token_delay_s=0.005, tokens_per_delta=per_delta, max_model_len=1024)
    requests = burst(6)
    with serve_in_thread(build_app(engine)) as url:
        run = asyncio.run(run_workload(requests, config(url, endpoint=endpoint), name="fake"))
    assert run.num_failed == 0 and run.errors == ()
    assert [t.request_id for t in run.traces] == [r.request_id for r in requests]
    for trace, request in zip(run.traces, requests, strict=True):
        assert trace.num_output_tokens == request.num_output_tokens
        assert trace.finish_reason == "length"
        assert trace.rate_tps == request.rate_tps
        assert trace.token_times_s[0] > trace.arrival_s >= 0.0
        expected_prompt = request.num_prompt_tokens + (2 if endpoint == "chat" else 0)
        assert trace.num_prompt_tokens == expected_prompt  # whitespace tokenizer: exact
    # The server saw our sampling settings and each reader's rate.
    by_id = {rid: (params, rate) for rid, params, rate in engine.submitted}
    assert len(by_id) == 6
    rates = sorted(rate for _, rate in by_id.values())
    assert rates == [15.0, 16.0, 17.0, 18.0, 19.0, 20.0]
    assert all(p.ignore_eos and p.min_tokens == p.max_tokens for p, _ in by_id.values())
    summary = summarize(run.traces)
    assert summary.num_completed == 6
    assert summary.total_output_tokens == sum(r.num_output_tokens for r in requests)
    assert summary.ttft_mean_s > 0
    records = report_records({"fake": summary})
    assert records[0]["policy"] == "fake"
    assert set(records[0]) == SUMMARY_KEYS | {"policy"}


def test_multi_token_chunks_without_continuous_usage_settle_on_the_usage_chunk() -> None:
    engine = FakeEngine(tokens_per_delta=4, max_model_len=1024)
    requests = [WorkloadRequest("req-0", 0.0, 3, 10, 20.0)]
    with serve_in_thread(build_app(engine)) as url:
        cfg = config(url, endpoint="completions", continuous_usage=False)
        run = asyncio.run(run_workload(requests, cfg))
    assert run.num_failed == 0
    assert run.traces[0].num_output_tokens == 10


class OpenAfterKeepalives:
    """ASGI wrapper: sets `gate` once the app has sent `count` keep-alives."""

    def __init__(self, app: Any, gate: threading.Event, count: int) -> None:
        self.app, self.gate, self.count = app, gate, count
        self.num_sent = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def watched(message: Any) -> None:
            if message["type"] == "http.response.body" and message["body"] == KEEPALIVE:
                self.num_sent += 1
                if self.num_sent >= self.count:
                    self.gate.set()
            await send(message)

        await self.app(scope, receive, watched)


def test_keepalives_between_tokens_are_skipped() -> None:
    # Token 2 waits until the server has sent two keep-alives: the client reads them mid-stream.
    gate = threading.Event()
    engine = FakeEngine(gate=gate, gate_at_token=2, max_model_len=1024)
    app = OpenAfterKeepalives(build_app(engine, ServerConfig(keepalive_s=0.01)), gate, 2)
    with serve_in_thread(app) as url:
        run = asyncio.run(run_workload([WorkloadRequest("req-0", 0.0, 3, 6, 20.0)], config(url)))
    assert gate.is_set() and run.num_failed == 0
    assert run.traces[0].num_output_tokens == 6 and run.traces[0].finish_reason == "length"


def test_errors_are_counted_not_raised() -> None:
    # One request at a time: the one admitted holds its first token until the other three
    # were refused with 429, however the machine schedules the burst.
    gate = threading.Event()
    engine = FakeEngine(gate=gate, max_num_requests=1, max_model_len=1024)

    def open_gate_once_all_others_are_refused() -> None:
        if wait_until(lambda: engine.num_refused == 3):
            gate.set()

    threading.Thread(target=open_gate_once_all_others_are_refused, daemon=True).start()
    with serve_in_thread(build_app(engine, ServerConfig(max_queue_wait_s=0))) as url:
        run = asyncio.run(run_workload(burst(4, output_tokens=20), config(url)))
    assert run.num_failed == 3
    assert all("HTTP 429" in line for line in run.errors)
    finished = [t for t in run.traces if t.finish_reason != "error"]
    assert len(finished) == 1 and finished[0].num_output_tokens >= 20
    assert summarize(run.traces).num_completed == 1


def test_engine_failure_mid_stream_is_an_error_with_partial_tokens() -> None:
    engine = FakeEngine(fail_after_tokens=2, max_model_len=1024)
    with serve_in_thread(build_app(engine)) as url:
        run = asyncio.run(run_workload(burst(2), config(url)))
    assert run.num_failed == 2
    assert all(t.finish_reason == "error" and t.num_output_tokens == 2 for t in run.traces)
    assert "server log" in run.errors[0]  # the exception's own text stays in the server log


def test_unreachable_server_and_timeout() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run = asyncio.run(run_workload(burst(3), config(f"http://127.0.0.1:{port}")))
    assert run.num_failed == 3 and len(run.traces) == 3
    assert summarize(run.traces).num_completed == 0
    engine = FakeEngine(first_token_delay_s=30.0)
    with serve_in_thread(build_app(engine)) as url:
        cfg = ClientConfig(url=url, show_progress=False, timeout_s=0.3)
        run = asyncio.run(run_workload(burst(2), cfg))
    assert run.num_failed == 2
    assert all("timed out" in line for line in run.errors)


def test_side_by_side_runs_and_report(tmp_path: pytest.TempPathFactory, capsys) -> None:
    engines = [FakeEngine(max_model_len=1024), FakeEngine(token_delay_s=0.002, max_model_len=1024)]
    with (
        serve_in_thread(build_app(engines[0])) as first,
        serve_in_thread(build_app(engines[1])) as second,
    ):
        targets = [BenchTarget("fcfs", first), BenchTarget("tokenflow", second)]
        runs = asyncio.run(benchmark(targets, burst(3), config(first)))
    json_path, plot_path = tmp_path / "out.json", tmp_path / "out.png"  # type: ignore[operator]
    summaries = report_runs(runs, json_path=str(json_path), plot_path=str(plot_path))
    assert list(summaries) == ["fcfs", "tokenflow"]
    records = json.loads(json_path.read_text())
    assert [r["policy"] for r in records] == ["fcfs", "tokenflow"]
    assert all(set(r) == SUMMARY_KEYS | {"policy"} for r in records)
    assert plot_path.read_bytes().startswith(b"\x89PNG")
    table = capsys.readouterr().out
    assert "fcfs" in table and "tokenflow" in table and "TTFT p99" in table
    assert len(engines[0].submitted) == len(engines[1].submitted) == 3


def test_request_shape_and_urls() -> None:
    request = WorkloadRequest("req-3", 1.0, 12, 7, 15.0)
    body = request_body(request, 3, ClientConfig(url="http://h:1", endpoint="chat"), "m")
    assert body["max_tokens"] == body["min_tokens"] == 7
    assert body["ignore_eos"] is True and body["stream"] is True and body["stream_rate"] == 15.0
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert body["model"] == "m"
    assert len(body["messages"][0]["content"].split()) == 12
    assert synthetic_prompt(12, 3) != synthetic_prompt(12, 4)
    assert endpoint_url("http://h:1", "chat") == "http://h:1/v1/chat/completions"
    assert endpoint_url("http://h:1/v1/", "completions") == "http://h:1/v1/completions"
    assert endpoint_url("http://h:1/v1/completions", "chat") == "http://h:1/v1/completions"
    with pytest.raises(ValueError, match="endpoint"):
        ClientConfig(url="http://h:1", endpoint="embeddings")
    with pytest.raises(ValueError, match="http"):
        ClientConfig(url="h:1")


class _PausingEngine(FakeEngine):
    """A fake engine whose preemption counters grow with every request it takes: 2 pauses,
    1 reload and 1 recompute a request."""

    def stats(self):  # type: ignore[no-untyped-def]
        from dataclasses import replace

        n = len(self.submitted)
        return replace(
            super().stats(),
            num_preemptions_total=3 + 2 * n,
            num_loads_total=2 + n,
            num_recomputes_total=1 + n,
        )


def test_the_servers_preemption_count_reaches_the_table(capsys) -> None:
    engine = _PausingEngine(max_model_len=1024)
    with serve_in_thread(build_app(engine)) as url:
        runs = asyncio.run(benchmark([BenchTarget("live", url)], burst(3), config(url)))
    assert runs["live"].server_counts == {"preemptions": 6, "kv_loads": 3, "recomputes": 3}
    summaries = report_runs(runs)
    assert summaries["live"].num_preemptions == 6  # the server's count, not the traces' 0
    out = capsys.readouterr().out
    assert "the server counted 6 preemptions, 3 KV reloads, 3 recomputes" in out
    row = next(line for line in out.splitlines() if line.startswith("live"))
    assert row.split()[-1] == "6"


def test_a_server_without_counters_says_so_instead_of_zero(capsys) -> None:
    run = asyncio.run(_run_against_no_metrics())
    assert run.server_counts == {}
    report_runs({"other": run})
    assert "preemptions: n/a" in capsys.readouterr().out


async def _run_against_no_metrics():  # type: ignore[no-untyped-def]
    """A run whose server answers /metrics with 404 (as a server without Prometheus does)."""
    from starlette.responses import PlainTextResponse

    app = build_app(FakeEngine(max_model_len=1024))

    async def without_metrics(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] == "http" and scope["path"] == "/metrics":
            return await PlainTextResponse("not found", 404)(scope, receive, send)
        return await app(scope, receive, send)

    with serve_in_thread(without_metrics) as url:
        return await run_workload(burst(1), config(url))


def test_a_runs_preemptions_are_the_servers_count_else_its_traces():
    """A client sees a pause only as a gap: the server's count wins where it has one."""
    traces = tuple(
        RequestTrace(f"r{i}", 0.0, 4.0, 8, (0.5, 0.75), num_preemptions=1) for i in range(2)
    )
    run = BenchRun(
        name="x", traces=traces, num_failed=0, errors=(), duration_s=1.0, server_counts={}
    )
    assert run.num_preemptions == 2
    assert replace(run, server_counts={"preemptions": 5}).num_preemptions == 5
