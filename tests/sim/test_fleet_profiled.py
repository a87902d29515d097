"""A fleet of profiled real engines (`tokenflow simulate --profile P --replicas N`): one replica
serves a workload as the single profiled engine does; a replica that joins takes queued
requests, each landing the fleet's move latency after its export; replicas of both kinds are
not mixed."""

import pytest

from tests.sim.synthetic import synthetic_profile
from tokenflow.cli.main import main
from tokenflow.core.rebalance import MigrateMode
from tokenflow.eval.workload import WorkloadRequest
from tokenflow.sim.fleet import FleetConfig, ReplicaJoined, run_fleet
from tokenflow.sim.profiled import ProfiledDeployment, build_profiled_engine
from tokenflow.sim.runner import SimConfig, run_engine

# Two streams at a time: a burst of 12 queues behind them.
DEPLOYMENT = ProfiledDeployment(synthetic_profile(), device_kv_tokens=1024, max_num_seqs=2)


def _burst(n: int = 12) -> list[WorkloadRequest]:
    return [WorkloadRequest(f"req-{i:02d}", 0.0, 40, 48, 1000.0) for i in range(n)]


def _joined(latency_s: float):
    config = FleetConfig(
        (DEPLOYMENT,),
        report_period_s=0.5,
        changes=(ReplicaJoined(2.0, DEPLOYMENT),),
        migrate=MigrateMode.QUEUED,
        move_latency_s=latency_s,
    )
    return run_fleet(_burst(), "tokenflow", config)


def test_one_profiled_replica_serves_as_the_single_profiled_engine():
    alone = run_engine(_burst(), "tokenflow", build_profiled_engine(DEPLOYMENT, "tokenflow"),
                       SimConfig())  # fmt: skip
    fleet = run_fleet(_burst(), "tokenflow", FleetConfig((DEPLOYMENT,)))
    assert fleet.summary == alone.summary


def test_queued_requests_move_to_a_joining_replica_and_land_the_move_latency_later():
    result = _joined(0.25)
    assert result.num_moved > 0 and result.summary.num_completed == 12
    assert {m.target_id for m in result.moves} == {"replica-1"}
    for move in result.moves:
        assert move.planned_s >= 2.0 and move.exported_s >= move.planned_s
        assert move.landed_s == pytest.approx(move.exported_s + 0.25)
    first_token_s = {t.request_id: t.token_times_s[0] for t in result.traces}
    assert all(first_token_s[m.request_id] > m.landed_s for m in result.moves)


def test_a_slower_move_delays_the_moved_requests_first_tokens():
    def first_moved_token_s(latency_s: float) -> float:
        result = _joined(latency_s)
        moved = {m.request_id for m in result.moves}
        return min(t.token_times_s[0] for t in result.traces if t.request_id in moved)

    assert first_moved_token_s(1.0) > first_moved_token_s(0.0) + 0.9


def test_replicas_on_a_gpu_cost_model_and_profiled_ones_are_not_mixed():
    with pytest.raises(ValueError, match="all on GPU cost models or all profiled"):
        FleetConfig((DEPLOYMENT,), changes=(ReplicaJoined(1.0, SimConfig()),))


def test_the_cli_simulates_a_profiled_fleet(tmp_path, capsys):
    path = tmp_path / "profile.json"
    synthetic_profile().save(path)
    code = main(
        ["simulate", "--profile", str(path), "--max-num-seqs", "2", "--device-kv-tokens", "1024",
         "--workload", "burst", "--num-requests", "12", "--output-len", "48", "--router",
         "tokenflow", "--join", "2", "--migrate", "queued", "--move-latency-s", "0.1",
         "--no-progress"]
    )  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "requests per replica [12, 0]" in out.out and " moved, 0 cut" in out.out
