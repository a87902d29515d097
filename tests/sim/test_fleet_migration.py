"""Replicas joining and leaving in the simulated fleet, with and without migration: a leaving
replica's streams move instead of being cut (every token delivered once), the ones that finish
within its drain stay, and a joining replica takes requests queued elsewhere."""

from tokenflow.core.rebalance import MigrateMode
from tokenflow.eval.workload import LengthDist, RateMix, WorkloadSpec, generate
from tokenflow.sim.fleet import FleetConfig, ReplicaJoined, ReplicaLeft, run_fleet
from tokenflow.sim.runner import SimConfig

H200 = SimConfig(gpu="h200", memory_fraction=0.3, host_memory_gib=64.0)
SMALL = SimConfig(gpu="rtx4090", memory_fraction=0.68, host_memory_gib=0.5)  # ~40 streams
LEAVES = (ReplicaLeft(1.0, "replica-0"),)


def _workload(num_requests: int, mean_output: int):
    prompt = LengthDist(mean=128, std=16, minimum=16, maximum=256)
    output = LengthDist(mean=mean_output, std=mean_output / 8, minimum=16, maximum=2 * mean_output)
    spec = WorkloadSpec(
        "burst", num_requests, 1.0, prompt=prompt, output=output, rates=RateMix.parse("20")
    )
    return generate(spec)


def _leaving(mode: MigrateMode, drain_timeout_s: float):
    """Two H200s sharing a burst of 12 long answers (~1,024 tokens); replica-0 leaves at 1 s."""
    config = FleetConfig(
        (H200, H200), changes=LEAVES, migrate=mode, drain_timeout_s=drain_timeout_s
    )
    return run_fleet(_workload(12, 1024), "tokenflow", config)


def test_a_leaving_replica_s_streams_move_instead_of_being_cut():
    workload = _workload(12, 1024)
    off, queued, paused = (_leaving(mode, 2.0) for mode in MigrateMode)
    assert off.num_cut > 0 and off.summary.num_completed == len(workload) - off.num_cut
    assert (queued.num_moved, queued.num_cut) == (0, off.num_cut)  # started streams stay
    assert paused.num_cut == 0 and paused.num_moved == off.num_cut
    assert paused.summary.num_completed == len(workload)
    assert paused.summary.total_output_tokens == sum(w.num_output_tokens for w in workload)


def test_streams_that_finish_within_the_drain_stay_where_they_are():
    result = _leaving(MigrateMode.PAUSED, 600.0)
    assert (result.num_moved, result.num_cut, result.summary.num_completed) == (0, 0, 12)


def test_a_joining_replica_takes_requests_queued_elsewhere():
    workload = _workload(96, 256)  # more than one small replica holds at once

    def run(mode: MigrateMode):
        config = FleetConfig((SMALL,), changes=(ReplicaJoined(1.0, SMALL),), migrate=mode)
        return run_fleet(workload, "tokenflow", config)

    off, queued = run(MigrateMode.OFF), run(MigrateMode.QUEUED)
    assert off.num_moved == 0 and queued.num_moved > 0
    assert queued.summary.ttft_p99_s < 0.7 * off.summary.ttft_p99_s
    assert queued.summary.num_completed == len(workload)
    assert queued.summary.total_output_tokens == sum(w.num_output_tokens for w in workload)
    again = run(MigrateMode.QUEUED)
    assert (again.num_moved, again.summary) == (queued.num_moved, queued.summary)
