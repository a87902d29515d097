"""Test doubles for driving the core without a model: a manual clock and a fake executor."""

from __future__ import annotations

from tokenflow.core.build import build_core
from tokenflow.core.config import SchedulerConfig, TokenFlowConfig
from tokenflow.core.engine_core import EngineCore
from tokenflow.core.kv_manager import KVConfig
from tokenflow.core.load_report import CapacityPoint, LoadReport
from tokenflow.core.plan import SampledToken, StepPlan, StepResult
from tokenflow.core.request import Consumption, Request, RequestState, SamplingParams


class ManualClock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t


class FakeExecutor:
    """Each step takes `step_s` (+ per-token cost); token ids derive from the position."""

    def __init__(
        self, clock: ManualClock, step_s: float = 0.01, eos_at: dict[str, int] | None = None
    ):
        self.clock = clock
        self.step_s = step_s
        self.eos_at = eos_at or {}
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        if not plan.is_empty:
            self.clock.t += self.step_s + 1e-5 * plan.num_prefill_tokens
        sampled = []
        for chunk in plan.chunks:
            if chunk.samples_token:
                position = chunk.start_position + chunk.num_tokens
                token = (
                    2
                    if self.eos_at.get(chunk.request_id) == chunk.num_output_tokens
                    else 100 + position % 50
                )
                sampled.append(SampledToken(chunk.request_id, token))
        return StepResult(tuple(sampled))


def make_request(
    request_id: str,
    num_prompt: int = 20,
    max_tokens: int = 10,
    rate: float = 20.0,
    arrival: float = 0.0,
    consumption: Consumption = Consumption.READER,
    **sampling: object,
) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=tuple(range(3, 3 + num_prompt)),
        sampling_params=SamplingParams(max_tokens=max_tokens, **sampling),  # type: ignore[arg-type]
        rate_tps=rate,
        arrival_s=arrival,
        eos_token_ids=(2,),
        consumption=consumption,
    )


def make_core(
    policy: str = "fcfs",
    num_device_blocks: int = 64,
    num_host_blocks: int = 256,
    block_size: int = 4,
    step_s: float = 0.01,
    scheduler_config: SchedulerConfig | None = None,
    tokenflow_config: TokenFlowConfig | None = None,
) -> tuple[EngineCore, ManualClock, FakeExecutor]:
    clock = ManualClock()
    executor = FakeExecutor(clock, step_s)
    config = scheduler_config or SchedulerConfig(
        link_bytes_per_s=1e6, initial_decode_step_s=step_s, chunk_tokens=32
    )
    kv = KVConfig(num_device_blocks, num_host_blocks, block_size, block_bytes=1000)
    core = build_core(
        config, kv, policy, executor, clock, tokenflow=tokenflow_config, check_integrity=True
    )
    return core, clock, executor


def run_to_completion(core: EngineCore, clock: ManualClock, max_steps: int = 20_000) -> int:
    steps = 0
    while core.has_work:
        plan, _ = core.step()
        if plan.is_empty:
            clock.t += 0.005
        steps += 1
        assert steps < max_steps, "the engine made no progress"
    return steps


FLAT_GAMMA_TPS = 1024.0  # `flat_report`'s capacity at every footprint


def flat_report(
    demand_tps: float = 0.0, num_waiting: int = 0, prefill_token_s: float = 0.0
) -> LoadReport:
    """A replica's report with ten running streams, reading `demand_tps` of a capacity of
    `FLAT_GAMMA_TPS` at every footprint, ample device blocks and no host tier."""
    return LoadReport(
        now_s=0.0,
        gamma_tps=FLAT_GAMMA_TPS,
        working_demand_tps=demand_tps,
        waiting_demand_tps=0.0,
        num_running=10,
        num_preempted=0,
        num_waiting=num_waiting,
        num_free_device_blocks=10_000,
        num_free_host_blocks=0,
        num_lifetime_blocks=100,
        block_size=16,
        capacity_points=(CapacityPoint(1e9, FLAT_GAMMA_TPS, 64),),
        num_device_blocks=10_000,
        num_host_blocks=0,
        prefill_token_s=prefill_token_s,
    )


def run_with_aborts(core, clock, pending: list, rng, policy: str, with_aborts: bool = True) -> None:
    """Step `core` until `pending` (sorted by arrival) has all arrived and every request ended,
    aborting a random live request now and then (`with_aborts`); the core's own checks run
    after every step, `check_integrity` after every abort too."""
    steps = 0
    while pending or core.has_work:
        while pending and pending[0].arrival_s <= clock.t:
            core.add_request(pending.pop(0))
        if with_aborts and rng.random() < 0.02 and core.scheduler.requests:
            victim = sorted(core.scheduler.requests)[rng.randrange(len(core.scheduler.requests))]
            assert core.abort(victim)
            core.scheduler.kv.check_integrity()
        plan, _ = core.step()
        if plan.is_empty:
            clock.t += 0.005
        steps += 1
        assert steps < 50_000, f"{policy} made no progress"


def assert_every_request_ended_whole(requests, core) -> None:
    """Each request finished or was aborted, a finished one with exactly the fake model's
    tokens (they depend only on position: pauses lost nothing), and both tiers are free."""
    for request in requests:
        assert request.state in (RequestState.FINISHED, RequestState.ABORTED)
        if request.state is RequestState.FINISHED:
            expected = [
                100 + (request.num_prompt_tokens + j) % 50 for j in range(request.num_output_tokens)
            ]
            assert request.output_token_ids == expected
    kv = core.scheduler.kv
    assert kv.num_free_device_blocks == kv.config.num_device_blocks
    assert kv.num_free_host_blocks == kv.config.num_host_blocks
