"""Runs the core against the cost model on a simulated clock: `tokenflow simulate`.

Prompts.  A request's prompt tokens are `(1,) * n` (the cost model charges by length, and the
scheduler never reads them) unless their identity matters: a conversation's turn is made of its
segments' token ids (tokenflow/eval/conversation.py), its earlier answers as generated, so its
turns and its app's sessions share prefixes as a real chat's do; and with prefix caching on,
every other prompt gets ids of its own (drawn from its request id), so none hits another's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

from tqdm import tqdm

from tokenflow.core.build import build_core
from tokenflow.core.clock import SimClock
from tokenflow.core.config import AndesConfig, SchedulerConfig, TokenFlowConfig
from tokenflow.core.engine_core import EngineCore
from tokenflow.core.kv_manager import KVConfig
from tokenflow.core.request import Consumption, Request, SamplingParams
from tokenflow.eval.conversation import Segment, prompt_token_ids, segment_token_ids
from tokenflow.eval.metrics import MetricsConfig, RequestTrace, Summary, summarize
from tokenflow.eval.workload import WorkloadRequest
from tokenflow.sim.arrivals import Arrivals, SessionStats
from tokenflow.sim.cost_model import CostModel, CostModelConfig
from tokenflow.sim.executor import SimExecutor
from tokenflow.sim.hardware import get_gpu, get_model
from tokenflow.sim.overhead import OverheadCharge, SchedulerOverhead, default_overhead
from tokenflow.sim.setups import Setup

_GIB = 2**30
TEMPLATE_TOKEN_ID = 0  # the chat template's own tokens around a conversation (profiled engines)


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
    # Share the device KV of common prompt prefixes (tokenflow/core/prefix_cache.py), reusing
    # cached blocks no request holds by `prefix_retention`: "reading" or "lru".
    prefix_caching: bool = False
    prefix_retention: str = "reading"
    cost: CostModelConfig = field(default_factory=CostModelConfig)
    # Scheduler CPU time charged per step; None: the policy's calibrated default.
    scheduler_overhead: SchedulerOverhead | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    tokenflow: TokenFlowConfig = field(default_factory=TokenFlowConfig)
    andes: AndesConfig = field(default_factory=AndesConfig)
    idle_tick_s: float = 0.005  # clock advance when nothing can run (waiting on a decision)
    stall_limit_steps: int = 200_000  # consecutive steps without a token before giving up


def setup_config(setup: Setup, **overrides: object) -> SimConfig:
    """The deployment of a setup (its GPU, model, memory, host tier and prefix caching), with
    `overrides` of any other `SimConfig` field (ablations, the scheduler charge)."""
    settings: dict[str, object] = {
        "gpu": setup.gpu,
        "model": setup.model,
        "memory_fraction": setup.memory_fraction,
        "host_memory_gib": setup.host_memory_gib,
        "prefix_caching": setup.prefix_caching,
    }
    return SimConfig(**(settings | overrides))  # type: ignore[arg-type]


@dataclass(frozen=True)
class PrefixCacheStats:
    """The prefix cache's lookups over a run (vLLM's prefix_cache_queries / _hits, in tokens):
    prompt tokens looked up when a request started fresh, and those found cached on the
    device or, after that, in the host tier (the core Scheduler's counters)."""

    num_queried_tokens: int = 0
    num_hit_tokens: int = 0
    num_host_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """Prompt tokens found cached (either tier) / prompt tokens looked up (0 if none)."""
        if not self.num_queried_tokens:
            return 0.0
        return (self.num_hit_tokens + self.num_host_hit_tokens) / self.num_queried_tokens


def prefix_cache_stats(cores: Sequence[EngineCore]) -> PrefixCacheStats | None:
    """The engines' prefix-cache counters together (the core Scheduler's), or None if they
    cache no prefix (a fleet's replicas all do or none does)."""
    if not caches_prefixes(cores[0]):
        return None
    schedulers = [core.scheduler for core in cores]
    return PrefixCacheStats(
        num_queried_tokens=sum(s.num_prefix_queried_tokens for s in schedulers),
        num_hit_tokens=sum(s.num_prefix_hit_tokens for s in schedulers),
        num_host_hit_tokens=sum(s.num_prefix_host_hit_tokens for s in schedulers),
    )


def extra_record(
    prefix_cache: PrefixCacheStats | None, sessions: SessionStats | None
) -> dict[str, float | int]:
    """What a simulated run (one engine or a fleet) adds to its summary in the JSON report:
    the prefix hit rate if the deployment caches prefixes, the sessions if the workload has
    conversations (else nothing: the record has the keys `tokenflow bench` writes)."""
    record: dict[str, float | int] = {}
    if prefix_cache is not None:
        record["prefix_hit_rate"] = prefix_cache.hit_rate
    if sessions is not None:
        record |= asdict(sessions)
    return record


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
    prefix_cache: PrefixCacheStats | None = None  # None: the deployment caches no prefix
    sessions: SessionStats | None = None  # the workload's conversations (None: it has none)

    @property
    def prefix_hit_rate(self) -> float:
        """The prefix cache's hit rate (0 without a prefix cache)."""
        return 0.0 if self.prefix_cache is None else self.prefix_cache.hit_rate


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
        prefix_caching=config.prefix_caching,
        prefix_retention=config.prefix_retention,
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
    clock = SimClock()
    executor = SimExecutor(
        cost_model, clock, config.block_size, blocking_evictions=not write_through
    )
    overhead = config.scheduler_overhead or default_overhead(policy)
    # (counted at each step, once `core` is built)
    charge = OverheadCharge(overhead, clock, lambda: core.scheduler.num_unfinished)
    core = build_core(
        scheduler_config,
        kv_config,
        policy,
        executor,
        clock,
        tokenflow=tokenflow,
        andes=config.andes,
        before_execute=charge,
        check_integrity=config.check_integrity,
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
    item: WorkloadRequest,
    prompt_tokens: Callable[[int], int] | None = None,
    answers: Mapping[str, Sequence[int]] | None = None,
    *,
    has_prefix_cache: bool = False,
) -> Request:
    """A core request for a workload item; output length fixed by ignore_eos + max_tokens.
    `prompt_tokens` maps the item's prompt length to the tokens the server makes of it;
    `answers` are the earlier turns' answers a conversation's prompt repeats (by turn name)."""
    return Request(
        request_id=item.request_id,
        prompt_token_ids=prompt_ids(item, prompt_tokens, answers, has_prefix_cache),
        sampling_params=SamplingParams(max_tokens=item.num_output_tokens, ignore_eos=True),
        rate_tps=item.rate_tps,
        arrival_s=item.arrival_s,
        consumption=Consumption(item.consumption),
        session_key=item.session_id,
    )


def prompt_ids(
    item: WorkloadRequest,
    prompt_tokens: Callable[[int], int] | None,
    answers: Mapping[str, Sequence[int]] | None,
    has_prefix_cache: bool,
) -> tuple[int, ...]:
    """The prompt's token ids (see the module docstring).  A profiled engine's chat template
    (`prompt_tokens`) adds its fixed tokens in front of a conversation, where every turn has
    them alike, and any per-word excess after it."""
    if not item.segments:
        num_prompt = item.num_prompt_tokens
        num_served = num_prompt if prompt_tokens is None else prompt_tokens(num_prompt)
        if not has_prefix_cache:
            return (1,) * num_served
        return segment_token_ids(Segment("user", item.request_id, num_served))
    ids = prompt_token_ids(item.segments, answers)
    if prompt_tokens is None:
        return ids
    num_header = prompt_tokens(0)
    num_excess = max(prompt_tokens(len(ids)) - num_header - len(ids), 0)
    return (TEMPLATE_TOKEN_ID,) * num_header + ids + (TEMPLATE_TOKEN_ID,) * num_excess


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
    core = engine.core
    clock = executor_clock(core)
    arrivals = Arrivals(workload)
    delay_s = engine.arrival_delay_s
    caches = caches_prefixes(core)
    requests: dict[str, Request] = {}  # in the order they were sent
    bar = tqdm(total=len(workload), desc=policy, disable=not progress, unit="req", leave=False)
    idle_steps = 0
    while arrivals.has_pending or core.has_work:
        now = clock.now()
        while arrivals.next_s() + delay_s <= now:
            item = arrivals.pop()
            answers = arrivals.answers(item)
            request = make_request(item, engine.prompt_tokens, answers, has_prefix_cache=caches)
            core.add_request(request)
            requests[request.request_id] = request
        if not core.has_work:
            clock.advance_to(arrivals.next_s() + delay_s)
            continue
        plan, outputs = core.step()
        for output in outputs:
            if output.is_finished:
                bar.update(1)
                arrivals.finished(requests[output.request_id])
        idle_steps = 0 if outputs else idle_steps + 1
        if idle_steps > config.stall_limit_steps:
            raise SimulationStalled(f"{policy}: no token for {idle_steps} steps at t={now:.2f}s")
        if plan.is_empty:
            tick_s = config.idle_tick_s if engine.idle_tick_s is None else engine.idle_tick_s
            clock.advance_to(min(arrivals.next_s() + delay_s, now + tick_s))
    bar.close()
    return _result(policy, engine, list(requests.values()), arrivals, metrics_config, started)


def _result(
    policy: str,
    engine: SimEngine,
    requests: list[Request],
    arrivals: Arrivals,
    metrics_config: MetricsConfig | None,
    started: float,
) -> SimResult:
    core, executor = engine.core, engine.executor
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
        prefix_cache=prefix_cache_stats([core]),
        sessions=arrivals.session_stats(),
    )


def caches_prefixes(core: EngineCore) -> bool:
    """Whether the engine's device tier shares cached prefix blocks."""
    return core.scheduler.kv.config.prefix_caching


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
