"""Runs the core against the cost model on a simulated clock: `tokenflow simulate`."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tqdm import tqdm

from tokenflow.core.clock import SimClock
from tokenflow.core.config import AndesConfig, SchedulerConfig, TokenFlowConfig
from tokenflow.core.engine_core import EngineCore
from tokenflow.core.kv_manager import KVConfig
from tokenflow.core.policies import make_policy
from tokenflow.core.request import Consumption, Request, SamplingParams
from tokenflow.core.scheduler import Scheduler
from tokenflow.eval.metrics import MetricsConfig, RequestTrace, Summary, summarize
from tokenflow.eval.workload import WorkloadRequest
from tokenflow.sim.cost_model import CostModel, CostModelConfig
from tokenflow.sim.executor import SimExecutor
from tokenflow.sim.hardware import get_gpu, get_model
from tokenflow.sim.overhead import OverheadCharge, SchedulerOverhead, default_overhead
from tokenflow.sim.setups import Setup

_GIB = 2**30


class SimulationStalled(RuntimeError):
    """The simulated engine made no progress for too long (a scheduling bug, never expected)."""


@dataclass(frozen=True)
class SimConfig:
    """One simulated deployment: hardware, memory split, costs, ablations and policy parameters.

    Ablations (paper §5-6), each off by default:
    - `offload=False`: preemption by recompute only (no host copy is ever made or loaded);
    - `write_through=False`: write-back, the preempting step waits for its whole eviction;
    - `overlap_load_evict=False`: a victim's device memory (synced blocks included) is not
      reusable until its eviction completes.
    """

    gpu: str = "h200"
    model: str = "llama3-8b"
    memory_fraction: float = 0.3  # of GPU memory for weights + device KV pool
    host_memory_gib: float = 128.0  # host KV tier
    block_size: int = 16
    offload: bool = True
    write_through: bool = True
    overlap_load_evict: bool = True
    check_integrity: bool = False
    cost: CostModelConfig = field(default_factory=CostModelConfig)
    # Scheduler CPU time charged per step; None: the policy's calibrated default.
    scheduler_overhead: SchedulerOverhead | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    tokenflow: TokenFlowConfig = field(default_factory=TokenFlowConfig)
    andes: AndesConfig = field(default_factory=AndesConfig)
    idle_tick_s: float = 0.005  # clock advance when nothing can run (waiting on a decision)
    stall_limit_steps: int = 200_000  # consecutive steps without a token before giving up


def setup_config(setup: Setup, **overrides: object) -> SimConfig:
    """The deployment of a paper setup (its GPU, model, memory and host tier), with
    `overrides` of any other `SimConfig` field (ablations, the scheduler charge)."""
    return SimConfig(
        gpu=setup.gpu,
        model=setup.model,
        memory_fraction=setup.memory_fraction,
        host_memory_gib=setup.host_memory_gib,
        **overrides,
    )


@dataclass(frozen=True)
class SimResult:
    policy: str
    summary: Summary
    traces: tuple[RequestTrace, ...]
    num_steps: int
    num_loads: int
    num_recomputes: int
    d2h_gib: float
    h2d_gib: float
    compute_s: float  # simulated time the device spent computing (the rest: copies, idle)
    scheduler_cpu_s: float  # simulated time charged for the scheduler's own CPU work
    wall_s: float


def build_engine(config: SimConfig, policy: str) -> tuple[EngineCore, SimExecutor]:
    """The core wired to a cost-model executor, a simulated clock and the overhead charge."""
    cost_model = CostModel(get_gpu(config.gpu), get_model(config.model), config.cost)
    block_bytes = config.block_size * cost_model.model.kv_bytes_per_token
    kv_config = KVConfig(
        num_device_blocks=cost_model.kv_pool_bytes(config.memory_fraction) // block_bytes,
        num_host_blocks=int(config.host_memory_gib * _GIB) // block_bytes,
        block_size=config.block_size,
        block_bytes=block_bytes,
        offload=config.offload,
        free_synced_on_evict=config.overlap_load_evict,
    )
    scheduler_config = replace(
        config.scheduler,
        # What the link achieves per block, latency of its pieces included: copy budgets and
        # the policies' I/O estimates then match what the executor charges.
        link_bytes_per_s=block_bytes / cost_model.block_copy_time_s(block_bytes),
        initial_decode_step_s=1.0 / cost_model.decode_tokens_per_s(1, 1024),
        initial_decode_seq_s=decode_seq_s(cost_model),
        initial_decode_token_s=decode_token_s(cost_model),
        initial_prefill_token_s=1.0 / cost_model.prefill_tokens_per_s(2048),
    )
    write_through = config.write_through and config.tokenflow.write_through
    tokenflow = replace(config.tokenflow, write_through=write_through)
    policy_obj = make_policy(policy, scheduler_config, tokenflow, config.andes)
    scheduler = Scheduler(scheduler_config, kv_config, policy_obj)
    clock = SimClock()
    executor = SimExecutor(
        cost_model, clock, config.block_size, blocking_evictions=not write_through
    )
    overhead = config.scheduler_overhead or default_overhead(policy)
    charge = OverheadCharge(overhead, clock, lambda: scheduler.num_unfinished)
    core = EngineCore(
        scheduler, executor, clock, before_execute=charge, check_integrity=config.check_integrity
    )
    return core, executor


def decode_token_s(cost_model: CostModel, batch: int = 64) -> float:
    """What each context token adds to a decode step, from the cost model (an estimator prior:
    the hardware is known, so Gamma at batches and contexts not yet run need not be guessed)."""
    short = batch / cost_model.decode_tokens_per_s(batch, 1024)
    long = batch / cost_model.decode_tokens_per_s(batch, 2048)
    return max(long - short, 0.0) / (batch * 1024)


def decode_seq_s(cost_model: CostModel, batch: int = 64) -> float:
    """What each extra stream adds to a decode step besides its context (estimator prior)."""
    one = 1.0 / cost_model.decode_tokens_per_s(1, 1024)
    many = batch / cost_model.decode_tokens_per_s(batch, 1024)
    return max(max(many - one, 0.0) / (batch - 1) - 1024 * decode_token_s(cost_model), 0.0)


def make_request(
    item: WorkloadRequest, prompt_tokens: Callable[[int], int] | None = None
) -> Request:
    """A core request for a workload item; output length fixed by ignore_eos + max_tokens.
    `prompt_tokens` maps the item's prompt length to the tokens the server makes of it."""
    num_prompt = (
        item.num_prompt_tokens if prompt_tokens is None else prompt_tokens(item.num_prompt_tokens)
    )
    return Request(
        request_id=item.request_id,
        prompt_token_ids=(1,) * num_prompt,
        sampling_params=SamplingParams(max_tokens=item.num_output_tokens, ignore_eos=True),
        rate_tps=item.rate_tps,
        arrival_s=item.arrival_s,
        consumption=Consumption(item.consumption),
    )


@dataclass
class SimEngine:
    """A simulated engine ready to run: the core on a cost-model executor, and what a
    deployment adds around each step (see tokenflow/sim/profiled.py)."""

    core: EngineCore
    executor: SimExecutor
    prompt_tokens: Callable[[int], int] | None = None  # workload prompt -> tokens served
    idle_tick_s: float | None = None  # the wait after a step that ran nothing (None: config's)
    arrival_delay_s: float = 0.0  # a request's way to the engine (its TTFT still counts it)


def run_simulation(
    workload: list[WorkloadRequest],
    policy: str,
    config: SimConfig,
    metrics_config: MetricsConfig | None = None,
    progress: bool = False,
) -> SimResult:
    """Serve `workload` with `policy` on the simulated deployment and measure it."""
    core, executor = build_engine(config, policy)
    return run_engine(workload, policy, SimEngine(core, executor), config, metrics_config, progress)


def run_engine(
    workload: list[WorkloadRequest],
    policy: str,
    engine: SimEngine,
    config: SimConfig,
    metrics_config: MetricsConfig | None = None,
    progress: bool = False,
) -> SimResult:
    """Serve `workload` on a built simulated engine (`config` gives the idle tick and the
    stall limit) and measure it."""
    started = time.perf_counter()
    core, executor = engine.core, engine.executor
    clock = executor_clock(core)
    pending = deque(sorted(workload, key=lambda w: w.arrival_s))
    delay_s = engine.arrival_delay_s
    requests: list[Request] = []
    bar = tqdm(total=len(workload), desc=policy, disable=not progress, unit="req", leave=False)
    idle_steps = 0
    while pending or core.has_work:
        now = clock.now()
        while pending and pending[0].arrival_s + delay_s <= now:
            request = make_request(pending.popleft(), engine.prompt_tokens)
            core.add_request(request)
            requests.append(request)
        if not core.has_work:
            clock.advance_to(pending[0].arrival_s + delay_s)
            continue
        plan, outputs = core.step()
        bar.update(sum(1 for o in outputs if o.is_finished))
        idle_steps = 0 if outputs else idle_steps + 1
        if idle_steps > config.stall_limit_steps:
            raise SimulationStalled(f"{policy}: no token for {idle_steps} steps at t={now:.2f}s")
        if plan.is_empty:
            next_arrival = pending[0].arrival_s + delay_s if pending else float("inf")
            tick_s = config.idle_tick_s if engine.idle_tick_s is None else engine.idle_tick_s
            clock.advance_to(min(next_arrival, now + tick_s))
    bar.close()
    return _result(policy, core, executor, requests, metrics_config, started)


def _result(
    policy: str,
    core: EngineCore,
    executor: SimExecutor,
    requests: list[Request],
    metrics_config: MetricsConfig | None,
    started: float,
) -> SimResult:
    traces = tuple(trace_of(r) for r in requests)
    scheduler = core.scheduler
    return SimResult(
        policy=policy,
        summary=summarize(traces, metrics_config or MetricsConfig()),
        traces=traces,
        num_steps=core.num_steps,
        num_loads=scheduler.num_loads_total,
        num_recomputes=scheduler.num_recomputes_total,
        d2h_gib=executor.total_d2h_bytes / _GIB,
        h2d_gib=executor.total_h2d_bytes / _GIB,
        compute_s=executor.total_compute_s,
        scheduler_cpu_s=_overhead_total_s(core),
        wall_s=time.perf_counter() - started,
    )


def executor_clock(core: EngineCore) -> SimClock:
    clock = core.clock
    assert isinstance(clock, SimClock)
    return clock


def _overhead_total_s(core: EngineCore) -> float:
    charge = core.before_execute
    return charge.total_s if isinstance(charge, OverheadCharge) else 0.0


def trace_of(request: Request) -> RequestTrace:
    """What the metrics read of a simulated request."""
    return RequestTrace(
        request_id=request.request_id,
        arrival_s=request.arrival_s,
        rate_tps=request.rate_tps,
        num_prompt_tokens=request.num_prompt_tokens,
        token_times_s=tuple(request.token_times_s),
        num_preemptions=request.num_preemptions,
        finish_reason=request.finish_reason.value if request.finish_reason else None,
        consumption=request.consumption.value,
    )
