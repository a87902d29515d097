"""Random workloads with aborts keep every invariant, for every policy, and are deterministic."""

import random

import pytest

from tests.core.helpers import (
    assert_every_request_ended_whole,
    make_core,
    make_request,
    run_with_aborts,
)
from tokenflow.core.config import SchedulerConfig
from tokenflow.core.policies import POLICY_NAMES
from tokenflow.core.request import RequestState

TIGHT = SchedulerConfig(
    init_new_token_ratio=0.05,
    min_new_token_ratio=0.01,
    link_bytes_per_s=2e5,
    initial_decode_step_s=0.02,
    chunk_tokens=24,
    max_num_seqs=12,
)


def drive(policy: str, seed: int, with_aborts: bool = True):
    """Arrivals, random aborts and a small device pool so preemption happens often.

    Returns the decision trace (every plan) and the requests."""
    rng = random.Random(seed)
    core, clock, ex = make_core(
        policy,
        num_device_blocks=40,
        num_host_blocks=60,
        block_size=4,
        step_s=0.02,
        scheduler_config=TIGHT,
    )
    requests = []
    for i in range(30):
        arrival = rng.uniform(0, 1.5)
        requests.append(
            make_request(
                f"r{i:02d}",
                num_prompt=rng.randint(1, 30),
                max_tokens=rng.randint(1, 40),
                rate=rng.choice([2.0, 5.0, 20.0, 200.0]),
                arrival=arrival,
            )
        )
    requests.sort(key=lambda r: r.arrival_s)
    run_with_aborts(core, clock, list(requests), rng, policy, with_aborts)
    return ex.plans, requests, core


@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_invariants_hold_and_every_request_ends(policy, seed):
    plans, requests, core = drive(policy, seed)
    assert_every_request_ended_whole(requests, core)
    for request in requests:
        if request.state is RequestState.FINISHED:
            assert request.num_output_tokens == request.sampling_params.max_tokens


def test_the_tight_setup_really_preempts():
    _, _, tokenflow_core = drive("tokenflow", 0, with_aborts=False)
    _, _, fcfs_core = drive("fcfs", 0, with_aborts=False)
    assert tokenflow_core.scheduler.num_preemptions_total > 0
    assert tokenflow_core.scheduler.num_loads_total > 0
    assert fcfs_core.scheduler.num_recomputes_total > 0


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_same_workload_and_seed_give_the_same_decisions(policy):
    first, _, _ = drive(policy, 7)
    second, _, _ = drive(policy, 7)
    assert first == second
    other, _, _ = drive(policy, 8)
    assert other != first
