"""The simulated fleet: every request served once, the rule's choices, the CLI's records."""

import json
from dataclasses import replace

import pytest

from tokenflow.cli.main import main
from tokenflow.eval.workload import LengthDist, RateMix, WorkloadSpec, generate
from tokenflow.sim.fleet import FleetConfig, run_fleet
from tokenflow.sim.fleet_setups import fleet_replicas, fleet_setups, get_fleet_setup
from tokenflow.sim.runner import SimConfig


def _workload(n: int = 12, kind: str = "burst"):
    lengths = LengthDist(mean=128, std=16, minimum=16, maximum=256)
    spec = WorkloadSpec(kind, n, 20.0, prompt=lengths, output=lengths, rates=RateMix.parse("20"))
    return generate(spec)


def _mixed() -> FleetConfig:
    slow = SimConfig(gpu="rtx4090", memory_fraction=0.75, host_memory_gib=16.0)
    fast = SimConfig(gpu="h200", memory_fraction=0.3, host_memory_gib=64.0)
    return FleetConfig((slow, fast), report_period_s=0.5)


@pytest.mark.parametrize("router", ["round-robin", "least-outstanding", "tokenflow"])
def test_every_request_is_served_once_on_some_replica(router):
    workload = _workload(kind="poisson")
    result = run_fleet(workload, router, _mixed())
    assert result.summary.num_requests == result.summary.num_completed == len(workload)
    assert sum(result.num_requests_by_replica) == len(workload)
    assert result.summary.total_output_tokens == sum(w.num_output_tokens for w in workload)


def test_the_rule_gives_the_faster_replica_more_of_a_burst():
    result = run_fleet(_workload(32), "tokenflow", _mixed())
    slow, fast = result.num_requests_by_replica
    assert fast > slow > 0
    assert run_fleet(_workload(32), "round-robin", _mixed()).num_requests_by_replica == (16, 16)


def test_the_same_seed_routes_the_same_way():
    first = run_fleet(_workload(), "tokenflow", _mixed())
    second = run_fleet(_workload(), "tokenflow", _mixed())
    assert first.num_requests_by_replica == second.num_requests_by_replica
    assert first.summary == second.summary


def test_presets():
    assert set(fleet_setups()) == {
        "fleet-h200-burst",
        "fleet-h200-poisson-40",
        "fleet-h200-poisson-80",
        "fleet-mixed-burst",
        "fleet-h200-scaleout",
        "fleet-h200-rolling",
        "fleet-h200-chat",
        "fleet-h200-chat-burst",
    }
    chat, chat_burst = get_fleet_setup("fleet-h200-chat"), get_fleet_setup("fleet-h200-chat-burst")
    for setup in (chat, chat_burst):
        assert setup.prefix_caching and setup.workload.kind == "conversation"
        replicas = fleet_replicas(setup, SimConfig())
        assert len(replicas) == 8 and all(r.prefix_caching for r in replicas)
    assert chat.workload.conversation.session_arrivals == "poisson"
    assert chat.workload.request_rate * 60 == chat.workload.conversation.num_sessions
    assert chat_burst.workload.conversation.session_arrivals == "burst"
    assert not any(
        r.prefix_caching for r in fleet_replicas(get_fleet_setup("fleet-h200-burst"), SimConfig())
    )
    scaleout = get_fleet_setup("fleet-h200-scaleout")
    assert scaleout.gpus == ("h200",) * 4 and scaleout.joins_at_s == (60.0,) * 4
    assert len(get_fleet_setup("fleet-h200-rolling").restarts_at_s) == 8
    burst = get_fleet_setup("fleet-h200-burst", seed=3)
    assert burst.gpus == ("h200",) * 8 and burst.workload.num_requests == 3200
    assert burst.workload.seed == 3
    assert get_fleet_setup("fleet-mixed-burst").gpus.count("rtx4090") == 4
    assert get_fleet_setup("fleet-h200-poisson-80").workload.request_rate == 80.0
    with pytest.raises(ValueError, match="fleet-h200-burst"):
        get_fleet_setup("fleet-nope")
    with pytest.raises(ValueError):
        replace(FleetConfig((SimConfig(),)), report_period_s=0.0)


def test_cli_writes_one_record_per_router_with_the_single_engine_keys(tmp_path, capsys):
    out = tmp_path / "fleet.json"
    args = ["simulate", "--gpu", "rtx4090", "--memory-fraction", "0.75", "--workload", "burst"]
    args += ["--num-requests", "16", "--prompt-len", "128:16", "--output-len", "128:16"]
    fleet = ["--replicas", "2", "--routers", "least-outstanding,tokenflow", "--json", str(out)]
    assert main([*args, *fleet, "--report-period-s", "0.5"]) == 0
    records = json.loads(out.read_text())
    single = tmp_path / "single.json"
    assert main([*args, "--policies", "tokenflow", "--no-progress", "--json", str(single)]) == 0
    assert [r["policy"] for r in records] == ["least-outstanding", "tokenflow"]
    assert all(set(r) == set(json.loads(single.read_text())[0]) for r in records)
    assert "requests per replica" in capsys.readouterr().out


def test_cli_refuses_an_unknown_router(capsys):
    assert main(["simulate", "--replicas", "2", "--router", "random", "--workload", "burst"]) == 2
    assert "unknown router" in capsys.readouterr().err
