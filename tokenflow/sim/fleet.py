"""A fleet of simulated engines behind a router: `tokenflow simulate --replicas N --router R`.

Every replica is the same core as a single simulated engine (`runner.build_engine`: its own
scheduler, policy, KV tiers, cost model and clock), possibly on a different GPU.  One event loop
keeps them on one time line: the earliest of (the next arrival, the next round of reports, the
replica whose clock is furthest behind) happens first, so a request is routed at its arrival
and joins its replica mid-step if that replica is busy.  Every `report_period_s` each replica's
`LoadReport` (tokenflow/core/routing.py) is handed to the router, which decides on reports up
to a period old plus what it routed since.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace

from tokenflow.core.clock import SimClock
from tokenflow.core.engine_core import EngineCore
from tokenflow.core.request import Request
from tokenflow.core.routing import RouteRequest, load_report, make_router
from tokenflow.eval.metrics import MetricsConfig, Summary, summarize
from tokenflow.eval.workload import LengthDist, RateMix, WorkloadRequest, WorkloadSpec
from tokenflow.sim.runner import (
    SimConfig,
    SimulationStalled,
    build_engine,
    executor_clock,
    make_request,
    trace_of,
)
from tokenflow.sim.setups import PAPER_RATES


@dataclass(frozen=True)
class FleetConfig:
    """The replicas (one deployment each), the policy they all run, and the report period."""

    replicas: tuple[SimConfig, ...]
    policy: str = "tokenflow"
    report_period_s: float = 1.0  # reports reach the router this often (so up to this old)

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ValueError("a fleet needs at least one replica")
        if self.report_period_s <= 0:
            raise ValueError("report_period_s must be > 0")


@dataclass(frozen=True)
class FleetResult:
    router: str
    summary: Summary  # over every request of the fleet, as a single engine's
    num_requests_by_replica: tuple[int, ...]
    ttft_p99_by_replica_s: tuple[float, ...]
    wall_s: float


@dataclass
class _Replica:
    replica_id: str
    core: EngineCore
    clock: SimClock
    num_routed: int = 0
    idle_steps: int = 0


def run_fleet(
    workload: list[WorkloadRequest],
    router_name: str,
    config: FleetConfig,
    metrics_config: MetricsConfig | None = None,
) -> FleetResult:
    """Serve `workload` on the fleet behind the named router and measure it as one service."""
    started = time.perf_counter()
    replicas = [_replica(i, c, config.policy) for i, c in enumerate(config.replicas)]
    router = make_router(router_name, [r.replica_id for r in replicas])
    by_id = {r.replica_id: r for r in replicas}
    pending = deque(sorted(workload, key=lambda w: (w.arrival_s, w.request_id)))
    requests: dict[str, list[Request]] = {r.replica_id: [] for r in replicas}
    next_report_s = 0.0
    while pending or any(r.core.has_work for r in replicas):
        busy = [r for r in replicas if r.core.has_work]
        step_s = min((r.clock.now() for r in busy), default=float("inf"))
        arrival_s = pending[0].arrival_s if pending else float("inf")
        if next_report_s <= min(step_s, arrival_s):
            for replica in replicas:  # (a busy replica reports as of its last step)
                now = max(replica.clock.now(), next_report_s)
                router.report(replica.replica_id, load_report(replica.core.scheduler.view(now)))
            next_report_s += config.report_period_s
        elif arrival_s <= step_s:
            request = make_request(pending.popleft())
            replica = by_id[router.choose(RouteRequest.of(request))]
            if not replica.core.has_work:
                replica.clock.advance_to(max(replica.clock.now(), request.arrival_s))
            replica.core.add_request(request)
            replica.num_routed += 1
            requests[replica.replica_id].append(request)
        else:
            _step(min(busy, key=lambda r: r.clock.now()), pending, config)
    traces = {rid: [trace_of(r) for r in reqs] for rid, reqs in requests.items()}
    metrics = metrics_config or MetricsConfig()
    every = [t for rid in by_id for t in traces[rid]]
    return FleetResult(
        router=router_name,
        summary=summarize(every, metrics),
        num_requests_by_replica=tuple(r.num_routed for r in replicas),
        ttft_p99_by_replica_s=tuple(
            summarize(traces[r.replica_id], metrics).ttft_p99_s if traces[r.replica_id] else 0.0
            for r in replicas
        ),
        wall_s=time.perf_counter() - started,
    )


def _replica(index: int, config: SimConfig, policy: str) -> _Replica:
    core, _ = build_engine(config, policy)
    return _Replica(f"replica-{index}", core, executor_clock(core))


def _step(replica: _Replica, pending: deque[WorkloadRequest], config: FleetConfig) -> None:
    """One step of the replica furthest behind; an empty plan idles it a tick (or to the next
    arrival), as a single simulated engine does."""
    now = replica.clock.now()
    plan, outputs = replica.core.step()
    replica.idle_steps = 0 if outputs else replica.idle_steps + 1
    limits = config.replicas[0]
    if replica.idle_steps > limits.stall_limit_steps:
        raise SimulationStalled(f"{replica.replica_id}: no token for long at t={now:.2f}s")
    if plan.is_empty:
        next_arrival = pending[0].arrival_s if pending else float("inf")
        replica.clock.advance_to(max(now, min(next_arrival, now + limits.idle_tick_s)))


# -- presets ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FleetSetup:
    """A fleet preset: the GPUs of its replicas and the workload."""

    name: str
    gpus: tuple[str, ...]
    workload: WorkloadSpec
    description: str


_MEMORY = {"h200": (0.3, 512.0), "rtx4090": (0.9, 64.0)}  # as the paper setups (setups.py)


def fleet_setups(seed: int = 0) -> dict[str, FleetSetup]:
    """fleet-h200-burst, fleet-h200-poisson-40, fleet-h200-poisson-80, fleet-mixed-burst: the
    H200 workload of the paper (inputs 512, outputs 2048, readers at 15/20 tok/s) at 8x."""

    def spec(kind: str, n: int, rate: float) -> WorkloadSpec:
        lengths = {m: LengthDist(mean=m, std=m / 4, minimum=16, maximum=2 * m) for m in (512, 2048)}
        rates = RateMix.parse(PAPER_RATES)
        return WorkloadSpec(
            kind, n, rate, prompt=lengths[512], output=lengths[2048], rates=rates, seed=seed
        )

    h200s = ("h200",) * 8
    mixed = ("h200",) * 4 + ("rtx4090",) * 4
    presets = (
        FleetSetup("fleet-h200-burst", h200s, spec("burst", 3200, 1.0), "8 x H200, burst of 3,200"),
        FleetSetup(
            "fleet-h200-poisson-40", h200s, spec("poisson", 2400, 40.0), "8 x H200, 40 req/s"
        ),
        FleetSetup(
            "fleet-h200-poisson-80", h200s, spec("poisson", 4800, 80.0), "8 x H200, 80 req/s"
        ),
        FleetSetup(
            "fleet-mixed-burst", mixed, spec("burst", 1840, 1.0), "4 x H200 + 4 x RTX 4090, 1,840"
        ),
    )
    return {p.name: p for p in presets}


def fleet_replicas(setup: FleetSetup, base: SimConfig) -> tuple[SimConfig, ...]:
    """One deployment per GPU of the preset: `base` with that GPU's memory split."""
    configs = []
    for gpu in setup.gpus:
        fraction, host_gib = _MEMORY[gpu]
        configs.append(_with_gpu(base, gpu, fraction, host_gib))
    return tuple(configs)


def _with_gpu(base: SimConfig, gpu: str, fraction: float, host_gib: float) -> SimConfig:
    return replace(base, gpu=gpu, memory_fraction=fraction, host_memory_gib=host_gib)


def get_fleet_setup(name: str, seed: int = 0) -> FleetSetup:
    """A fleet preset by name; ValueError lists the valid names."""
    setups = fleet_setups(seed)
    if name not in setups:
        raise ValueError(f"unknown fleet setup {name!r}; choose one of {', '.join(setups)}")
    return setups[name]
