"""Conversations in the simulator: closed-loop arrivals, token identity, prefix-cache hits."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tests.eval.test_conversation import chat_spec
from tests.sim.synthetic import synthetic_profile
from tokenflow.cli.main import main
from tokenflow.core.request import FinishReason, Request
from tokenflow.eval.metrics import RequestTrace, consumption_times_s
from tokenflow.eval.workload import LengthDist, WorkloadRequest, WorkloadSpec, generate
from tokenflow.sim.arrivals import Arrivals
from tokenflow.sim.fleet import FleetConfig, run_fleet
from tokenflow.sim.runner import SimConfig, make_request, run_simulation

# 10 sessions of 2-4 turns, system prompts of ~64 tokens shared by 3 apps, on an RTX 4090.
CACHED = SimConfig(
    gpu="rtx4090", memory_fraction=0.9, host_memory_gib=2, prefix_caching=True, check_integrity=True
)


def workload() -> list[WorkloadRequest]:
    return generate(chat_spec(num_sessions=10, request_rate=2.0, think_mean_s=1.0))


def finished(request: Request, num_tokens: int, last_consume_s: float, aborted: bool = False):
    request.output_token_ids.extend(range(1, num_tokens + 1))
    request.token_times_s.extend([last_consume_s] * num_tokens)
    request.last_consume_s = last_consume_s
    request.finish_reason = FinishReason.ABORT if aborted else FinishReason.LENGTH
    return request


def assert_each_turn_sent_after_its_reader_read_the_last(
    requests: list[WorkloadRequest], traces: tuple[RequestTrace, ...]
) -> None:
    by_id = {t.request_id: t for t in traces}
    items = {r.request_id: r for r in requests}
    assert by_id.keys() == items.keys()
    for item in requests:
        if item.after_id is None:
            continue
        previous = by_id[item.after_id]
        read_end_s = consumption_times_s(previous.token_times_s, previous.rate_tps)[-1]
        sent_s = by_id[item.request_id].arrival_s
        assert sent_s >= read_end_s + item.think_s - 1e-9
        assert sent_s == pytest.approx(read_end_s + item.think_s, abs=1e-6)


# -- the arrivals, on hand-made finishes ------------------------------------------------------
def test_a_turn_is_released_at_the_last_read_plus_think_with_the_answer_as_generated() -> None:
    requests = generate(chat_spec(num_sessions=1, min_turns=3, max_turns=3))
    arrivals = Arrivals(requests)
    first = arrivals.pop()
    assert first.turn == 0 and not arrivals.has_pending and arrivals.next_s() == float("inf")
    request_0 = make_request(first, answers=arrivals.answers(first))
    arrivals.finished(finished(request_0, first.num_output_tokens, last_consume_s=42.0))
    second = arrivals.pop()
    assert second.request_id == requests[1].request_id
    assert second.arrival_s == 42.0 + second.think_s
    request_1 = make_request(second, answers=arrivals.answers(second))
    prefix = request_0.prompt_token_ids + tuple(request_0.output_token_ids)
    assert request_1.prompt_token_ids[: len(prefix)] == prefix
    assert request_1.num_prompt_tokens == second.num_prompt_tokens
    assert request_1.session_key == second.session_id


def test_an_aborted_turn_ends_its_session() -> None:
    requests = generate(chat_spec(num_sessions=1, min_turns=3, max_turns=3))
    arrivals = Arrivals(requests)
    request = make_request(arrivals.pop())
    arrivals.finished(finished(request, 2, last_consume_s=1.0, aborted=True))
    assert not arrivals.has_pending
    stats = arrivals.session_stats()
    assert stats is not None and (stats.num_sessions_ended, stats.num_turns_unsent) == (1, 2)


def test_an_open_loop_workload_is_sent_in_arrival_order_and_has_no_sessions() -> None:
    requests = generate(WorkloadSpec(kind="poisson", num_requests=5, request_rate=2.0))
    arrivals = Arrivals(list(reversed(requests)))
    assert [arrivals.pop() for _ in requests] == requests
    assert arrivals.session_stats() is None


# -- whole runs -------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["fcfs", "tokenflow"])
def test_a_run_is_closed_loop_and_hits_the_prefix_cache(policy: str) -> None:
    requests = workload()
    result = run_simulation(requests, policy, CACHED)
    assert result.summary.num_completed == len(requests)
    assert_each_turn_sent_after_its_reader_read_the_last(requests, result.traces)
    assert result.prefix_cache is not None and result.prefix_cache.num_hit_tokens > 0
    assert 0.5 < result.prefix_hit_rate < 1.0
    assert result.sessions is not None and result.sessions.num_sessions == 10
    assert result.sessions.num_turns_unsent == 0


def test_without_prefix_caching_nothing_hits() -> None:
    result = run_simulation(workload(), "fcfs", replace(CACHED, prefix_caching=False))
    assert result.prefix_cache is None and result.prefix_hit_rate == 0.0


def test_open_loop_prompts_do_not_hit_each_other_when_caching() -> None:
    spec = WorkloadSpec(
        kind="burst", num_requests=8, prompt=LengthDist(256, 0), output=LengthDist(16, 0)
    )
    result = run_simulation(generate(spec), "fcfs", CACHED)
    assert result.prefix_cache is not None and result.prefix_cache.num_queried_tokens > 0
    assert result.prefix_hit_rate == 0.0


def test_a_fleet_runs_conversations_closed_loop() -> None:
    requests = workload()
    config = FleetConfig(replicas=(CACHED, CACHED), policy="fcfs", report_period_s=0.5)
    result = run_fleet(requests, "least-outstanding", config)
    assert_each_turn_sent_after_its_reader_read_the_last(requests, result.traces)
    assert result.prefix_cache is not None and result.prefix_cache.hit_rate > 0.3


# -- the command line -------------------------------------------------------------------------
CHAT = ["simulate", "--gpu", "rtx4090", "--memory-fraction", "0.9", "--workload", "conversation",
        "--num-sessions", "6", "--turns", "2:3", "--num-apps", "2", "--system-len", "64",
        "--user-len", "16:4", "--output-len", "32:8", "--think-s", "1", "--request-rate", "2",
        "--policies", "fcfs", "--no-progress"]  # fmt: skip


@pytest.mark.parametrize("retention", ["reading", "lru"])
def test_simulate_reports_the_prefix_hit_rate_and_the_sessions(tmp_path, capsys, retention):
    out = tmp_path / "r.json"
    flags = ["--enable-prefix-caching", "--prefix-retention", retention, "--json", str(out)]
    assert main([*CHAT, *flags]) == 0
    (record,) = json.loads(out.read_text())
    assert record["prefix_hit_rate"] > 0 and record["num_sessions"] == 6
    assert record["num_sessions_ended"] == 0 and record["num_turns_unsent"] == 0
    assert f"prefix caching ({retention})" in capsys.readouterr().out


def test_simulate_without_caching_writes_no_hit_rate(tmp_path):
    out = tmp_path / "r.json"
    assert main([*CHAT, "--json", str(out)]) == 0
    (record,) = json.loads(out.read_text())
    assert "prefix_hit_rate" not in record and record["num_sessions"] == 6


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--prefix-retention", "lru"], "--prefix-retention applies with prefix caching on"),
        (["--setup", "cpu-chat"], "cpu-chat runs on a profiled engine"),
        (["--workload", "conversation", "--turns", "3-8"], "invalid turns"),
    ],
)
def test_bad_chat_options_are_one_line(args, words, capsys):
    assert main(["simulate", "--workload", "burst", "--no-progress", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err


def test_cpu_chat_runs_on_a_profile(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    synthetic_profile().save(profile)
    out = tmp_path / "r.json"
    args = ["simulate", "--profile", str(profile), "--setup", "cpu-chat", "--policies", "fcfs"]
    assert main([*args, "--no-progress", "--json", str(out)]) == 0
    (record,) = json.loads(out.read_text())
    assert record["prefix_hit_rate"] > 0.5 and record["num_sessions"] == 16
    assert "device KV 2048 tokens" in capsys.readouterr().out
