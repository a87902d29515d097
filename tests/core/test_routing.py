"""The routing rules, by the replicas they pick on hand-built reports (no clock, no sleeps)."""

from __future__ import annotations

import math
import tracemalloc
from dataclasses import replace

import pytest

from tests.core.helpers import make_core, make_request
from tokenflow.core.load_report import (
    CapacityPoint,
    LoadReport,
    RouteRequest,
    load_report,
    project,
    route_request,
)
from tokenflow.core.request import Consumption
from tokenflow.core.routing import TokenFlowRouter, make_router, parse_router_names


def _report(
    gamma_tps: float = 1000.0,
    demand_tps: float = 0.0,
    num_running: int = 0,
    num_free_blocks: int = 10_000,
    batch: int = 50,
) -> LoadReport:
    """A replica whose Gamma is the same at every footprint (one sampled point)."""
    return LoadReport(
        now_s=0.0,
        gamma_tps=gamma_tps,
        working_demand_tps=demand_tps,
        waiting_demand_tps=0.0,
        num_running=num_running,
        num_preempted=0,
        num_waiting=0,
        num_free_device_blocks=num_free_blocks,
        num_free_host_blocks=0,
        num_lifetime_blocks=num_running * 10,
        block_size=16,
        capacity_points=(CapacityPoint(1e9, gamma_tps, batch),),
        num_device_blocks=10_000,
        num_host_blocks=0,
    )


def _request(index: int, rate: float = 10.0, tokens: int = 160) -> RouteRequest:
    return RouteRequest(f"r{index}", rate, lifetime_tokens=tokens, end_tokens=2 * tokens)


def _router(name: str, reports: dict[str, LoadReport]):
    router = make_router(name, list(reports))
    for replica_id, report in reports.items():
        router.report(replica_id, report)
    return router


def test_round_robin_takes_replicas_in_turn():
    router = _router("round-robin", {"a": _report(), "b": _report(), "c": _report()})
    assert [router.choose(_request(i)) for i in range(5)] == ["a", "b", "c", "a", "b"]


def test_least_outstanding_counts_what_it_routed_since_the_last_report():
    router = _router("least-outstanding", {"a": _report(num_running=3), "b": _report()})
    assert [router.choose(_request(i)) for i in range(5)] == ["b", "b", "b", "a", "b"]
    router.report("b", _report(num_running=4))  # the three routed to b are in its report now
    assert router.choose(_request(9)) == "a"


def test_tokenflow_weighs_demand_against_each_replica_s_capacity():
    # b runs fewer requests but its readers already ask most of its (smaller) Gamma
    reports = {
        "a": _report(gamma_tps=4000, demand_tps=2000, num_running=100),
        "b": _report(gamma_tps=1000, demand_tps=800, num_running=40),
    }
    assert _router("tokenflow", reports).choose(_request(0)) == "a"
    assert _router("least-outstanding", reports).choose(_request(0)) == "b"


def test_tokenflow_spreads_a_burst_between_reports_by_capacity():
    reports = {"big": _report(gamma_tps=3000, batch=300), "small": _report(gamma_tps=1000)}
    router = _router("tokenflow", reports)
    chosen = [router.choose(_request(i, rate=10.0)) for i in range(40)]
    # each share of Gamma asked stays within one request's step of the other's
    assert chosen.count("big") == 30 and chosen.count("small") == 10


def test_tokenflow_skips_a_replica_whose_tiers_cannot_hold_the_request():
    reports = {"full": _report(num_free_blocks=5), "roomy": _report(demand_tps=500)}
    assert _router("tokenflow", reports).choose(_request(0, tokens=160)) == "roomy"


def test_tokenflow_sends_to_the_least_loaded_when_none_fits():
    reports = {
        "a": _report(gamma_tps=1000, demand_tps=1500),
        "b": _report(gamma_tps=1000, demand_tps=1200),
    }
    assert _router("tokenflow", reports).choose(_request(0)) == "b"


def test_ties_go_to_the_replica_listed_first():
    reports = {"b": _report(), "a": _report()}
    for name in ("least-outstanding", "tokenflow"):
        assert _router(name, reports).choose(_request(0)) == "b"


def test_a_reader_faster_than_one_stream_s_share_counts_that_share():
    report = _report(gamma_tps=1000, batch=10)  # one stream's share: 100 tok/s
    assert project(report, [_request(0, rate=math.inf)]).load == pytest.approx(0.1)
    assert project(report, [_request(0, rate=50.0)]).load == pytest.approx(0.05)


def test_an_unreported_replica_is_taken_as_an_idle_copy_of_a_reported_one():
    router = TokenFlowRouter(["new", "old"])
    router.report("old", _report(demand_tps=900, num_running=9, num_free_blocks=100))
    assert router.choose(_request(0)) == "new"  # idle beats 90% loaded
    router = TokenFlowRouter(["new", "old"])
    router.report("old", _report())
    burst = [router.choose(_request(i, rate=100.0)) for i in range(8)]
    assert burst.count("new") == burst.count("old") == 4  # a burst at start-up is spread


def test_with_no_report_at_all_a_burst_goes_round_the_replicas():
    router = TokenFlowRouter(["a", "b", "c"])
    assert [router.choose(_request(i)) for i in range(6)] == ["a", "b", "c"] * 2


def test_a_removed_replica_gets_nothing_and_candidates_restrict():
    router = _router("least-outstanding", {"a": _report(), "b": _report(num_running=5)})
    router.remove("a")
    assert router.choose(_request(0)) == "b"
    router = _router("tokenflow", {"a": _report(), "b": _report(demand_tps=900)})
    assert router.choose(_request(1), candidates=["b"]) == "b"
    with pytest.raises(ValueError):
        router.choose(_request(2), candidates=[])


def test_capacity_lookup_interpolates_between_sampled_footprints():
    points = (CapacityPoint(1, 9000, 90), CapacityPoint(4, 4000, 40), CapacityPoint(16, 900, 9))
    report = replace(_report(), capacity_points=points)
    assert report.capacity_at(0.5).gamma_tps == 9000
    assert report.capacity_at(4.0).gamma_tps == 4000
    assert report.capacity_at(2.0).gamma_tps == pytest.approx(6500)  # halfway in log terms
    assert report.capacity_at(2.0).batch == 65
    assert report.capacity_at(64.0).gamma_tps == 900


def test_load_report_reads_the_replica_s_view():
    core, clock, _ = make_core("tokenflow", num_device_blocks=64, num_host_blocks=256)
    for i in range(3):
        core.add_request(make_request(f"r{i}", num_prompt=20, max_tokens=10, rate=5.0))
    core.step()
    report = load_report(core.scheduler.view(clock.now()))
    assert report.num_unfinished == 3
    assert report.working_demand_tps + report.waiting_demand_tps == pytest.approx(15.0)
    assert report.num_free_device_blocks == core.scheduler.kv.num_free_device_blocks
    assert report.num_free_host_blocks == core.scheduler.kv.num_free_host_blocks
    assert report.num_lifetime_blocks == 3 * 7  # (20 + 10 // 2) tokens in blocks of 4
    betas = [p.beta_blocks for p in report.capacity_points]
    assert betas == sorted(betas) and betas[0] == 1.0 and betas[-1] >= 64
    gammas = [p.gamma_tps for p in report.capacity_points]
    assert gammas[-1] <= gammas[0]  # larger footprints, fewer streams, less capacity


def test_router_names():
    assert parse_router_names("round-robin, tokenflow") == ["round-robin", "tokenflow"]
    with pytest.raises(ValueError, match="least-outstanding"):
        parse_router_names("random")
    with pytest.raises(ValueError):
        make_router("tokenflow", [])


@pytest.mark.parametrize("consumption", [Consumption.READER, Consumption.EAGER])
@pytest.mark.parametrize(("num_prompt", "max_tokens"), [(1, 1), (7, 16), (513, 2048)])
def test_route_request_is_what_a_core_request_of_those_sizes_routes_as(
    num_prompt, max_tokens, consumption
):
    request = make_request("r", num_prompt, max_tokens, rate=8.0, consumption=consumption)
    facts = route_request("r", 8.0, num_prompt, max_tokens, consumption)
    assert facts == RouteRequest.of(request)


def test_route_request_builds_nothing_as_long_as_the_prompt():
    tracemalloc.start()
    facts = route_request("r", 8.0, 1 << 20, 16)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 64 << 10  # (a prompt of 2**20 placeholder tokens was 8 MiB)
    assert facts.end_tokens == (1 << 20) + 16 and facts.lifetime_tokens == (1 << 20) + 8


def test_route_request_refuses_a_rate_no_reader_states():
    with pytest.raises(ValueError, match="rate"):
        route_request("r", 5000.0, 10, 10)
    assert route_request("r", 5000.0, 10, 10, Consumption.EAGER).rate_tps == math.inf


def test_a_request_of_several_choices_counts_as_that_many_requests():
    report = _report(demand_tps=100.0, num_running=4, num_free_blocks=100)
    four = replace(_request(0), num_choices=4)
    assert project(report, [four]) == project(report, [_request(i) for i in range(4)])
    router = _router("least-outstanding", {"a": _report(), "b": _report()})
    assert router.choose(four) == "a"
    assert [router.choose(_request(i)) for i in range(1, 6)] == ["b", "b", "b", "b", "a"]
