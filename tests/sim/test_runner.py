"""The simulated deployment: scheduler CPU charge and the three ablations, on small cases."""

from dataclasses import replace

import pytest

from tests.sim.test_executor import prefill
from tokenflow.core.clock import SimClock
from tokenflow.core.plan import BlockCopy, CopyKind, StepPlan
from tokenflow.core.policies import POLICY_NAMES
from tokenflow.eval.workload import LengthDist, RateMix, WorkloadSpec, generate
from tokenflow.sim.overhead import OverheadCharge, SchedulerOverhead, default_overhead
from tokenflow.sim.runner import (
    SimConfig,
    build_engine,
    make_request,
    run_simulation,
    setup_config,
)
from tokenflow.sim.setups import get_setup

EMPTY_PLAN = StepPlan(0, (), (), (), ())


def small_burst(num_requests: int, prompt: int = 512, output: int = 400) -> list:
    spec = WorkloadSpec(
        kind="burst",
        num_requests=num_requests,
        prompt=LengthDist(prompt, 0),
        output=LengthDist(output, 0),
        rates=RateMix.parse("20:1"),
    )
    return generate(spec)


# A deployment under memory pressure: 12 streams of 912 tokens, room for about 7.
PRESSED = SimConfig(gpu="rtx4090", memory_fraction=0.66, host_memory_gib=4, check_integrity=True)


# -- scheduler CPU time -------------------------------------------------------------------------
def test_overhead_is_fixed_plus_per_active_request() -> None:
    clock, active = SimClock(), [3]
    charge = OverheadCharge(SchedulerOverhead(0.002, 0.0001), clock, lambda: active[0])
    charge(EMPTY_PLAN)
    active[0] = 10
    charge(EMPTY_PLAN)
    assert clock.now() == pytest.approx(0.0023 + 0.003)
    assert charge.total_s == pytest.approx(clock.now())


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_overhead_advances_the_clock_for_every_policy(policy: str) -> None:
    workload = small_burst(1, prompt=32, output=5)
    free = run_simulation(workload, policy, SimConfig(scheduler_overhead=SchedulerOverhead(0, 0)))
    charged_config = SimConfig(scheduler_overhead=SchedulerOverhead(0.5, 0.25))
    charged = run_simulation(workload, policy, charged_config)
    # one active request on every step: 0.75 s each, and the same steps as without the charge
    assert charged.num_steps == free.num_steps
    assert charged.scheduler_cpu_s == pytest.approx(0.75 * charged.num_steps)
    expected = free.summary.makespan_s + charged.scheduler_cpu_s
    assert charged.summary.makespan_s == pytest.approx(expected)
    assert charged.summary.ttft_mean_s >= 0.75


def test_every_policy_has_a_calibrated_default_and_tokenflow_costs_more() -> None:
    costs = {p: default_overhead(p).step_s(500) for p in POLICY_NAMES}
    assert all(0 < cost < 0.01 for cost in costs.values())
    assert costs["tokenflow"] > costs["fcfs"]
    with pytest.raises(ValueError, match="no calibrated"):
        default_overhead("nope")


def test_default_run_charges_the_calibrated_overhead() -> None:
    result = run_simulation(small_burst(2, prompt=32, output=5), "fcfs", SimConfig())
    assert result.scheduler_cpu_s >= result.num_steps * default_overhead("fcfs").fixed_s > 0


# -- ablations ----------------------------------------------------------------------------------
def test_offload_loads_and_no_offload_never_loads() -> None:
    workload = small_burst(12)
    full = run_simulation(workload, "tokenflow", PRESSED)
    assert full.num_loads > 0 and full.h2d_gib > 0  # the case does exercise reloading
    ablated = run_simulation(workload, "tokenflow", replace(PRESSED, offload=False))
    assert ablated.num_loads == 0 and ablated.h2d_gib == 0 and ablated.d2h_gib == 0
    assert ablated.num_recomputes > 0  # it still preempts, by recompute
    assert ablated.summary.num_completed == len(workload)


def _evict_plan() -> StepPlan:
    copies = tuple(BlockCopy("v", CopyKind.EVICT, i, i) for i in range(20))
    return StepPlan(0, (prefill("a", 0, 2048, samples=True),), copies, (), ())


def test_write_back_wiring_disables_write_through_and_blocks_on_evictions() -> None:
    full_core, full_executor = build_engine(SimConfig(), "tokenflow")
    back_core, back_executor = build_engine(SimConfig(write_through=False), "tokenflow")
    assert full_core.scheduler.policy.config.write_through
    assert not back_core.scheduler.policy.config.write_through
    # the same step: write-through overlaps the eviction with the compute, write-back waits
    full_executor.execute(_evict_plan())
    back_executor.execute(_evict_plan())
    evict_s = 20 * back_executor.block_copy_s
    compute_s = full_executor.total_compute_s
    assert evict_s < compute_s
    assert full_executor.last_step_duration_s == pytest.approx(compute_s)
    assert back_executor.last_step_duration_s == pytest.approx(compute_s + evict_s)


def test_without_write_through_no_write_through_copies_are_made() -> None:
    workload = small_burst(12)
    plans: list[StepPlan] = []
    core, _ = build_engine(replace(PRESSED, write_through=False), "tokenflow")
    core.before_execute = plans.append
    for item in workload:
        core.add_request(make_request(item))
    for _ in range(3000):
        if not core.has_work:
            break
        core.step()
    kinds = {c.kind for p in plans for c in p.device_to_host}
    assert CopyKind.EVICT in kinds and CopyKind.WRITE_THROUGH not in kinds


def test_no_load_evict_overlap_wiring_holds_memory_until_the_eviction_completes() -> None:
    core, _ = build_engine(SimConfig(overlap_load_evict=False), "tokenflow")
    assert not core.scheduler.kv.config.free_synced_on_evict
    core, _ = build_engine(SimConfig(), "tokenflow")
    assert core.scheduler.kv.config.free_synced_on_evict


def test_ablations_slow_the_pressed_case_down() -> None:
    workload = small_burst(12)
    full = run_simulation(workload, "tokenflow", PRESSED).summary.makespan_s
    no_offload = replace(PRESSED, offload=False)
    assert run_simulation(workload, "tokenflow", no_offload).summary.makespan_s > full


def test_setup_config_takes_the_setup_deployment_and_overrides() -> None:
    setup = get_setup("4090-b")
    charge = SchedulerOverhead(0.0, 0.0)
    config = setup_config(setup, offload=False, scheduler_overhead=charge)
    assert (config.gpu, config.model) == ("rtx4090", "llama3-8b")
    assert (config.memory_fraction, config.host_memory_gib) == (0.9, 64.0)
    assert config.offload is False and config.scheduler_overhead is charge
    assert setup_config(setup).offload is True and setup_config(setup).scheduler_overhead is None
