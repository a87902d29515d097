"""TokenFlowRequestRouter's choices follow the replicas' reports, and a moved request's planned
replica (no cluster: Ray Serve's router object on hand-made candidates)."""

import json
import math
from dataclasses import dataclass, replace

import pytest

from tokenflow.core.consumption import DEFAULT_READER_RATE_TPS
from tokenflow.core.load_report import CapacityPoint, LoadReport
from tokenflow.core.prefix_summary import PrefixSummary
from tokenflow.core.request import Consumption
from tokenflow.replicas.deployments import served_default_rate
from tokenflow.replicas.guards import parse_body
from tokenflow.replicas.reports import (
    report_from_stats,
    report_to_stats,
    route_facts,
    with_avoided,
    with_preferred,
)
from tokenflow.replicas.router import TokenFlowRequestRouter
from tokenflow.serving.auth import bearer_token
from tokenflow.serving.classes import ClassRules, Stated
from tokenflow.serving.config import ServerConfig
from tokenflow.serving.protocol import MAX_CHOICES, CompletionRequest


@dataclass
class _Id:
    unique_id: str


@dataclass
class _Replica:
    replica_id: _Id
    routing_stats: dict


@dataclass
class _Pending:
    args: tuple


def _report(demand_tps: float, now_s: float = 1.0) -> LoadReport:
    return LoadReport(
        now_s=now_s,
        gamma_tps=100.0,
        working_demand_tps=demand_tps,
        waiting_demand_tps=0.0,
        num_running=4,
        num_preempted=0,
        num_waiting=0,
        num_free_device_blocks=100,
        num_free_host_blocks=400,
        num_lifetime_blocks=40,
        block_size=16,
        capacity_points=(CapacityPoint(1e6, 100.0, 8),),
        num_device_blocks=200,
        num_host_blocks=800,
    )


def _router() -> TokenFlowRequestRouter:
    router = TokenFlowRequestRouter.__new__(TokenFlowRequestRouter)  # (no Serve controller)
    router.initialize_state(rule="tokenflow")
    return router


def _choose(
    router,
    replicas,
    body=b'{"prompt": "hi", "max_tokens": 16, "stream": true, "stream_rate": 4}',
    avoid=(),
    prefer=None,
):
    import asyncio

    facts = with_avoided(route_facts(parse_body(body), {}, ClassRules(), 4.0), avoid)
    pending = _Pending((facts if prefer is None else with_preferred(facts, prefer),))
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    return [rank[0].replica_id.unique_id for rank in ranks]


def test_the_replica_whose_readers_ask_less_of_its_capacity_goes_first():
    busy = _Replica(_Id("a"), report_to_stats(_report(90.0)))
    idle = _Replica(_Id("b"), report_to_stats(_report(10.0)))
    assert _choose(_router(), [busy, idle]) == ["b", "a"]


def test_a_new_report_changes_the_choice_and_counts_restart():
    router = _router()
    a = _Replica(_Id("a"), report_to_stats(_report(10.0)))
    b = _Replica(_Id("b"), report_to_stats(_report(20.0)))
    first = [_choose(router, [a, b])[0] for _ in range(4)]
    assert first[0] == "a" and "b" in first  # what it routed since the report counts
    a.routing_stats = report_to_stats(replace(_report(95.0), now_s=2.0))
    assert _choose(router, [a, b])[0] == "b"


def test_a_call_without_routing_facts_keeps_every_candidate():
    router = _router()
    replicas = [_Replica(_Id("a"), {}), _Replica(_Id("b"), {})]
    import asyncio

    ranks = asyncio.run(router.choose_replicas(replicas, _Pending(("not facts",))))
    assert ranks == [replicas]


def test_a_replica_that_refused_the_request_is_left_out_while_another_is_up():
    busy = _Replica(_Id("a"), report_to_stats(_report(10.0)))
    idle = _Replica(_Id("b"), report_to_stats(_report(90.0)))
    assert _choose(_router(), [busy, idle]) == ["a", "b"]
    assert _choose(_router(), [busy, idle], avoid=["a"]) == ["b"]
    assert _choose(_router(), [busy, idle], avoid=["a", "b"]) == ["a", "b"]  # all refused


def test_a_moved_request_goes_to_its_planned_replica_and_counts_there():
    router = _router()
    a = _Replica(_Id("a"), report_to_stats(_report(40.0)))  # readers at 4 tok/s: 4% each
    b = _Replica(_Id("b"), report_to_stats(_report(50.0)))
    assert _choose(router, [a, b], prefer="b") == ["b", "a"]  # (the rule would pick "a")
    for _ in range(4):
        assert _choose(router, [a, b], prefer="a")[0] == "a"
    # "a" holds 56% once they land, "b" 54%: the rule counts the moves where they went
    assert _choose(router, [a, b])[0] == "b"


def test_a_planned_replica_that_is_not_a_candidate_leaves_the_choice_to_the_rule():
    busy = _Replica(_Id("a"), report_to_stats(_report(90.0)))
    idle = _Replica(_Id("b"), report_to_stats(_report(10.0)))
    assert _choose(_router(), [busy, idle], prefer="gone") == ["b", "a"]  # (not up yet, or died)
    assert _choose(_router(), [busy, idle], avoid=["a"], prefer="a") == ["b"]  # it refused


_KEYS = ("reader-key=reader:6", "eager-key=eager", "soft-key=~reader:5", "soft-eager-key=~eager")
_STREAM = {"prompt": "x", "max_tokens": 10, "stream": True}
# (default class, body, headers): what a request states, on a server with `_KEYS`' rules.
_CLASS_CASES = [
    ("eager", _STREAM, {}),  # rateless streaming: the server's default class
    ("reader", _STREAM, {}),  # ... a reader at the server's --default-rate
    ("eager", {"prompt": "x"}, {}),  # no `stream`: batch
    ("reader", {**_STREAM, "stream": False, "stream_rate": 8}, {}),  # batch, its rate ignored
    ("eager", {**_STREAM, "stream_rate": 8}, {}),  # a stated rate: a reader
    ("eager", _STREAM, {"x-stream-rate": "2"}),
    ("eager", {**_STREAM, "stream_rate": 8}, {"x-stream-rate": "2"}),  # the body's wins
    ("reader", {**_STREAM, "stream_class": "eager", "stream_rate": 8}, {}),
    ("reader", _STREAM, {"x-stream-class": "eager"}),
    ("eager", {**_STREAM, "stream_class": "reader"}, {}),  # a reader at the default rate
    ("eager", {**_STREAM, "stream_rate": 500}, {"authorization": "Bearer reader-key"}),  # binds
    ("reader", {**_STREAM, "stream_class": "reader"}, {"authorization": "Bearer eager-key"}),
    ("eager", {**_STREAM, "stream": False}, {"authorization": "Bearer reader-key"}),  # batch
    ("eager", _STREAM, {"authorization": "Bearer soft-key"}),  # the key's default rate
    ("eager", {**_STREAM, "stream_rate": 2}, {"authorization": "Bearer soft-key"}),
    ("eager", {**_STREAM, "stream_class": "eager"}, {"authorization": "Bearer soft-key"}),
    ("reader", _STREAM, {"authorization": "Bearer soft-eager-key"}),
    ("reader", {**_STREAM, "stream_rate": 3}, {"authorization": "Bearer soft-eager-key"}),
    ("reader", _STREAM, {"authorization": "Bearer other-key"}),  # a key without a rule
]


@pytest.mark.parametrize(("default_class", "body", "headers"), _CLASS_CASES)
def test_route_facts_read_the_class_and_rate_as_the_server_does(default_class, body, headers):
    config = ServerConfig(default_class=default_class, api_key_classes=_KEYS)
    default_rate_tps = 7.0  # (not the core's default: the router must be told the server's)
    request = CompletionRequest.model_validate(body)
    header_rate = headers.get("x-stream-rate")
    stated = Stated(
        rate_tps=None if header_rate is None else float(header_rate),
        stream_class=headers.get("x-stream-class"),
        api_key=bearer_token(headers.get("authorization")),
    )
    served = config.class_rules.resolve(
        request.stream, request.stream_class, request.stream_rate, stated, default_rate_tps
    )
    parsed = parse_body(json.dumps(body).encode())
    facts = route_facts(parsed, headers, config.class_rules, default_rate_tps)
    assert facts["rate_tps"] == served.rate_tps  # (inf for eager and batch, as RouteRequest has)
    assert math.isfinite(facts["rate_tps"]) == (served.consumption is Consumption.READER)


def test_the_class_cases_cover_every_class_and_rate_source():
    config = ServerConfig(default_class="eager", api_key_classes=_KEYS)
    rates = set()
    for default_class, body, headers in _CLASS_CASES:
        rules = replace(config, default_class=default_class).class_rules
        rates.add(route_facts(body, headers, rules, 7.0)["rate_tps"])
    assert rates == {math.inf, 7.0, 8.0, 2.0, 6.0, 5.0, 3.0}


def test_the_router_reads_the_replicas_default_rate_from_their_options():
    assert served_default_rate([]) == DEFAULT_READER_RATE_TPS
    assert served_default_rate(["--model", "m", "--default-rate", "6", "--port", "1"]) == 6.0
    with pytest.raises(ValueError, match="--default-rate: a reader's rate must be"):
        served_default_rate(["--default-rate", "5000"])


def test_route_facts_route_a_class_the_server_refuses_as_if_unstated():
    readers = ClassRules.parse("reader", ())
    for body, headers in (
        ({**_STREAM, "stream_class": "robot"}, {}),
        ({**_STREAM, "stream_class": "batch"}, {}),  # (a 400: batch is not streamed)
        (_STREAM, {"x-stream-class": "robot"}),
        ({**_STREAM, "stream_class": 5}, {}),  # (a 422)
    ):
        assert route_facts(body, headers, readers, 7.0)["rate_tps"] == 7.0


def _facts(body: dict) -> dict:
    return route_facts(parse_body(json.dumps(body).encode()), {}, ClassRules(), 4.0)


def test_route_facts_count_every_choice_a_body_starts():
    assert _facts({"prompt": "hi"})["num_choices"] == 1
    assert _facts({"prompt": "hi", "n": 3})["num_choices"] == 3
    assert _facts({"messages": [{"role": "user", "content": "hi"}], "n": 5})["num_choices"] == 5
    assert _facts({"prompt": ["a", "b", "c"], "n": 2})["num_choices"] == 6
    assert _facts({"prompt": [[1, 2], [3, 4], [5]]})["num_choices"] == 3
    assert _facts({"prompt": [1, 2, 3, 4], "n": 2})["num_choices"] == 2  # one token-id prompt


def test_a_token_id_prompt_counts_its_length_in_tokens():
    one = _facts({"prompt": list(range(1000)), "max_tokens": 10})
    assert one["end_tokens"] == 1000 + 10
    several = _facts({"prompt": [list(range(1000)), list(range(600))], "max_tokens": 10})
    assert several["end_tokens"] == 800 + 10  # each choice holds its prompt: 800 on average
    texts = _facts({"prompt": ["x" * 4000, "y" * 4000], "max_tokens": 10})
    assert texts["end_tokens"] == 4000 // 4 + 1 + 10


def test_a_body_cannot_state_more_choices_than_the_server_takes():
    assert _facts({"prompt": "hi", "n": 10**9})["num_choices"] == MAX_CHOICES
    for n in ("many", -3, 0, None, [2], 1e400):
        assert _facts({"prompt": "hi", "n": n})["num_choices"] == 1


def test_the_router_counts_every_choice_a_request_starts():
    router = _router()
    a = _Replica(_Id("a"), report_to_stats(_report(40.0)))  # readers at 4 tok/s: 4% each
    b = _Replica(_Id("b"), report_to_stats(_report(50.0)))
    body = {"prompt": "hi", "max_tokens": 16, "stream": True, "stream_rate": 4}
    assert _choose(router, [a, b], json.dumps({**body, "n": 4}).encode())[0] == "a"
    # "a" holds 56% once its 4 choices start, "b" 50%: the next request goes to "b"
    assert _choose(router, [a, b], json.dumps(body).encode())[0] == "b"


def test_a_report_s_prefix_summary_survives_the_routing_stats():
    summary = PrefixSummary(device_block_hashes=(8, 16), host_block_hashes=(24,))
    report = replace(_report(10.0), cached_prefixes=summary)
    assert report_from_stats(report_to_stats(report)) == report


def test_route_facts_carry_the_session_a_body_names():
    assert _facts({"prompt": "hi", "prompt_cache_key": "chat-7"})["session_key"] == "chat-7"
    for value in (None, 7, "", "x" * 5000):
        assert _facts({"prompt": "hi", "prompt_cache_key": value})["session_key"] is None


@pytest.mark.parametrize("rule", ["prefix-affinity", "tokenflow"])
def test_a_session_s_next_turn_goes_where_its_last_turn_went(rule):
    router = TokenFlowRequestRouter.__new__(TokenFlowRequestRouter)
    router.initialize_state(rule=rule)
    report = replace(_report(10.0), prefill_token_s=1e-3)
    a = _Replica(_Id("a"), report_to_stats(report))
    b = _Replica(_Id("b"), report_to_stats(report))
    turn = {"prompt": "x" * 400, "max_tokens": 16, "stream": True, "stream_rate": 4}
    first = _choose(router, [a, b], json.dumps({**turn, "prompt_cache_key": "s"}).encode())[0]
    other = "b" if first == "a" else "a"
    # the replica that took the first turn is now the busier one
    busier = report_to_stats(replace(report, working_demand_tps=40.0, num_running=9, now_s=2.0))
    (a if first == "a" else b).routing_stats = busier
    (b if first == "a" else a).routing_stats = report_to_stats(replace(report, now_s=2.0))
    second = json.dumps({**turn, "prompt": "x" * 800, "prompt_cache_key": "s"}).encode()
    assert _choose(router, [a, b], second)[0] == first
    assert _choose(router, [a, b], json.dumps(turn).encode())[0] == other
