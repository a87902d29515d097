"""The fast scheduler and policies decide exactly as the slow, obvious reference does.

`tests/core/reference` holds the straightforward implementations (every step and decision
rescans every request); `tokenflow.core` keeps aggregates and orders up to date on events and
sends block tables as deltas.  On randomized long runs - bursts, slow and fast readers, a tight
device tier, a small host tier, aborts - both must produce the same plan at every step: the same
chunks (block tables rebuilt from the deltas), copies, releases and sampled tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest

from tests.core.helpers import ManualClock
from tests.core.reference.scheduler import Scheduler as RefScheduler
from tests.core.reference.tokenflow_policy import TokenFlowPolicy as RefTokenFlow
from tokenflow.core.config import SchedulerConfig, TokenFlowConfig
from tokenflow.core.kv_manager import KVConfig
from tokenflow.core.plan import BlockTables, SampledToken, StepPlan, StepResult
from tokenflow.core.policies import make_policy
from tokenflow.core.request import FinishReason, Request, SamplingParams
from tokenflow.core.scheduler import Scheduler

CONFIG = SchedulerConfig(
    init_new_token_ratio=0.3,
    min_new_token_ratio=0.05,
    new_token_ratio_decay_steps=200,
    link_bytes_per_s=4e5,
    initial_decode_step_s=0.02,
    initial_decode_seq_s=0.001,
    chunk_tokens=48,
    max_num_seqs=24,
)
TOKENFLOW = TokenFlowConfig(schedule_interval_s=0.1, critical_slack_s=0.5, value_horizon_s=3.0)


@dataclass(frozen=True)
class Setup:
    num_requests: int
    num_device_blocks: int
    num_host_blocks: int
    arrival_window_s: float
    max_tokens: int
    rate_scale: float = 1.0  # readers' rates times this


SETUPS = {
    "burst": Setup(60, 70, 400, 0.5, 120),
    "stream": Setup(90, 90, 400, 20.0, 160),
    "small-host": Setup(50, 60, 40, 2.0, 100),
    "trickle": Setup(80, 120, 400, 40.0, 60),  # arrivals between decisions, often none waiting
    "fast-readers": Setup(90, 90, 400, 20.0, 160, rate_scale=4.0),  # the rate rule binds
}


class TimedExecutor:
    """Steps take time by batch, context, prefill and copies; tokens derive from the position."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.tables = BlockTables()

    def execute(self, plan: StepPlan) -> StepResult:
        self.tables.apply(plan)
        if not plan.is_empty:
            self.clock.t += (
                0.01
                + 5e-4 * plan.num_decode_tokens
                + 1e-6 * plan.num_decode_context_tokens
                + 2e-4 * plan.num_prefill_tokens
                + 1e-3 * (len(plan.device_to_host) + len(plan.host_to_device))
            )
        return StepResult(
            tuple(
                SampledToken(c.request_id, 100 + (c.start_position + len(c.token_ids)) % 50)
                for c in plan.chunks
                if c.samples_token
            )
        )


def _requests(setup: Setup, rng: random.Random) -> list[Request]:
    out = []
    for i in range(setup.num_requests):
        out.append(
            Request(
                request_id=f"r{i:03d}",
                prompt_token_ids=tuple(range(3, 3 + rng.randint(1, 40))),
                sampling_params=SamplingParams(
                    max_tokens=rng.randint(1, setup.max_tokens), ignore_eos=rng.random() < 0.8
                ),
                rate_tps=rng.choice([2.0, 5.0, 10.0, 40.0]) * setup.rate_scale,
                arrival_s=round(rng.uniform(0, setup.arrival_window_s), 3),
                eos_token_ids=(117,),
            )
        )
    return sorted(out, key=lambda r: r.arrival_s)


def _scheduler(kind: str, policy: str, setup: Setup, tokenflow: TokenFlowConfig):
    kv = KVConfig(setup.num_device_blocks, setup.num_host_blocks, block_size=4, block_bytes=1000)
    if kind == "fast":
        return Scheduler(CONFIG, kv, make_policy(policy, CONFIG, tokenflow))
    # FCFS and chunked share their (tiny) policy code; the reference scheduler checks the
    # mechanics and the view's derived state under them.
    reference = RefTokenFlow(tokenflow) if policy == "tokenflow" else make_policy(policy, CONFIG)
    return RefScheduler(CONFIG, kv, reference)


def _normalized(plan: StepPlan, tables: BlockTables) -> tuple:
    chunks = tuple(
        (
            c.request_id,
            c.token_ids,
            c.start_position,
            tuple(tables[c.request_id]),
            c.samples_token,
            c.num_output_tokens,
        )
        for c in plan.chunks
    )
    return (chunks, plan.device_to_host, plan.host_to_device, plan.released_request_ids)


def drive_both(
    policy: str, setup: Setup, seed: int, tokenflow: TokenFlowConfig = TOKENFLOW
) -> tuple[int, int]:
    """Run the fast and the reference scheduler in lockstep; returns (steps, preemptions)."""
    rng = random.Random(seed)
    pending = {kind: _requests(setup, random.Random(seed)) for kind in ("fast", "ref")}
    schedulers = {kind: _scheduler(kind, policy, setup, tokenflow) for kind in ("fast", "ref")}
    clocks = {kind: ManualClock() for kind in ("fast", "ref")}
    executors = {kind: TimedExecutor(clocks[kind]) for kind in ("fast", "ref")}
    steps = 0
    while pending["fast"] or schedulers["fast"].has_work:
        abort = rng.random() < 0.01
        traces = {}
        for kind, scheduler in schedulers.items():
            clock, queue = clocks[kind], pending[kind]
            while queue and queue[0].arrival_s <= clock.t:
                scheduler.add_request(queue.pop(0))
            if abort and scheduler.requests:
                ids = sorted(scheduler.requests)
                scheduler.finish_request(ids[(steps * 7) % len(ids)], FinishReason.ABORT)
            plan = scheduler.schedule(clock.t)
            result = executors[kind].execute(plan)
            outputs = scheduler.update(plan, result, clock.t)
            scheduler.kv.check_integrity()
            if plan.is_empty:
                clock.t += 0.005
            traces[kind] = (_normalized(plan, executors[kind].tables), outputs, clock.t)
        assert traces["fast"] == traces["ref"], f"{policy}: plans differ at step {steps}"
        steps += 1
        assert steps < 100_000, "no progress"
    assert not pending["ref"] and not schedulers["ref"].has_work
    return steps, schedulers["fast"].num_preemptions_total


@pytest.mark.parametrize("setup", sorted(SETUPS))
@pytest.mark.parametrize("policy", ["fcfs", "chunked", "tokenflow"])
@pytest.mark.parametrize("seed", [0, 1])
def test_fast_path_decides_exactly_as_the_reference(policy, setup, seed):
    steps, preemptions = drive_both(policy, SETUPS[setup], seed)
    assert steps > 200


@pytest.mark.parametrize("seed", [0, 1])
def test_the_queue_headroom_decides_as_the_reference(seed):
    """With `queue_headroom` on, the fast path still decides as the reference at every step,
    and the option changes the run (so the wider budget was really used)."""
    wider = replace(TOKENFLOW, queue_headroom=1.5)
    with_option = drive_both("tokenflow", SETUPS["fast-readers"], seed, wider)
    assert with_option != drive_both("tokenflow", SETUPS["fast-readers"], seed)


def test_the_parity_runs_exercise_preemption_and_rotation():
    """The runs above are only worth something if TokenFlow really pauses and resumes in them."""
    _, preemptions = drive_both("tokenflow", SETUPS["stream"], 0)
    assert preemptions > 20
