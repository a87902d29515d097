"""A synthetic executor whose step times are known exactly, and a profile built from it."""

from __future__ import annotations

from dataclasses import dataclass

from tokenflow.calibrate.costs import ComputeFit, CopyFit, StepCosts, fit_step_costs, residuals
from tokenflow.calibrate.profile_file import EngineFacts, Profile, PromptTokens
from tokenflow.calibrate.sweep import SweepSpec, run_sweep
from tokenflow.core.config import SchedulerConfig, TokenFlowConfig
from tokenflow.core.plan import StepPlan, StepResult

SERIAL = ComputeFit(a_s=0.010, b_s=0.004, c_s=2e-6)
PARALLEL = ComputeFit(a_s=0.020, b_s=0.002, c_s=3e-6, p0_s=0.030, p1_s=8e-4, p2_s=2e-8)
D2H = CopyFit(latency_s=2e-4, block_s=5e-5)
H2D = CopyFit(latency_s=3e-4, block_s=4e-5)
SERIAL_BELOW = 8
SMALL_SPEC = SweepSpec(
    decode_batches=(1, 2, 4, 8, 16),
    decode_contexts=(32, 96),
    prefill_tokens=(16, 48),
    prefill_starts=(0, 64),
    mixed_decodes=(4,),
    copy_blocks=(1, 4),
    repeats=3,
    rounds=2,
)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


@dataclass
class SyntheticExecutor:
    """Advances `clock` by the known cost of each plan; `slow_every` makes every n-th step
    `slow_factor` times longer (a machine busy now and then)."""

    clock: FakeClock
    slow_every: int = 0
    slow_factor: float = 5.0
    num_steps: int = 0

    def execute(self, plan: StepPlan) -> StepResult:
        self.num_steps += 1
        b, c, t = plan.num_decode_tokens, plan.num_decode_context_tokens, plan.num_prefill_tokens
        pairs = sum(
            len(ch.token_ids) * ch.start_position + len(ch.token_ids) * (len(ch.token_ids) + 1) // 2
            for ch in plan.chunks
            if not ch.is_decode
        )
        fit = SERIAL if b + t < SERIAL_BELOW else PARALLEL
        compute_s = fit.time_s(b, c, t, pairs) if plan.chunks else 0.0
        copies_s = D2H.time_s(len(plan.device_to_host)) + H2D.time_s(len(plan.host_to_device))
        step_s = max(compute_s, copies_s)
        if self.slow_every and self.num_steps % self.slow_every == 0:
            step_s *= self.slow_factor
        self.clock.now_s += step_s
        return StepResult(sampled=())


def synthetic_costs(slow_every: int = 0) -> tuple[StepCosts, list]:
    clock = FakeClock()
    executor = SyntheticExecutor(clock, slow_every=slow_every)
    samples = run_sweep(executor, clock, SMALL_SPEC, (16, 256, 64))
    return fit_step_costs(samples, SERIAL_BELOW), samples


def synthetic_profile(server_step_s: float = 0.001, **costs_given: float) -> Profile:
    """A profile of the synthetic executor, as `tokenflow profile` would write it (`costs_given`:
    other `StepCosts` fields, e.g. request_path_s)."""
    costs, samples = synthetic_costs()
    costs = StepCosts(**{**costs.__dict__, "server_step_s": server_step_s, **costs_given})
    engine = EngineFacts(
        block_size=16,
        block_bytes=16 * 1024,
        device_kv_tokens=2048,
        host_kv_tokens=8192,
        max_num_seqs=32,
        max_prefill_tokens=4096,
        step_target_ms=250.0,
        min_prefill_chunk_tokens=128,
        max_model_len_cap=8192,
        default_rate_tps=4.0,
    )
    scheduler = SchedulerConfig(
        max_num_seqs=32,
        max_prefill_tokens=4096,
        chunk_tokens=512,
        max_model_len=8192,
        link_bytes_per_s=16 * 1024 / D2H.block_s,
        initial_decode_step_s=0.03,
        initial_prefill_token_s=1e-3,
    )
    return Profile(
        machine={"cpu_model": "synthetic", "device": "cpu"},
        model={"name": "synthetic"},
        engine=engine,
        scheduler=scheduler,
        tokenflow=TokenFlowConfig(critical_slack_s=1.0, init_new_token_ratio=0.3),
        prompt={"chat": PromptTokens(30.0, 1.0), "completions": PromptTokens(0.0, 1.0)},
        costs=costs,
        residuals=tuple(residuals(costs, samples)),
        samples=tuple(samples),
    )
