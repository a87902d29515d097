"""A fleet of simulated engines behind a router: `tokenflow simulate --replicas N --router R`.

Every replica is the same core as a single simulated engine (its own scheduler, policy, KV
tiers, cost model and clock): on a GPU's cost model (`runner.build_engine`, a `SimConfig`),
possibly a different GPU each, or as a profiled real engine (`profiled.build_profiled_engine`, a
`ProfiledDeployment`; then requests map to served prompt tokens and reach the fleet after their
request path as a single profiled engine's do).  One event loop
keeps them on one time line: the earliest of (the next round of reports, a replica joining or
leaving, a draining replica's deadline, a moved stream landing, the next arrival, the replica
whose clock is furthest behind) happens first, so a request is routed at its arrival and joins
its replica mid-step if that replica is busy.  Every `report_period_s` each replica's
`LoadReport` (tokenflow/core/load_report.py) is handed to the router, which decides on reports up
to a period old plus what it routed since.

Replicas may join and leave (`FleetConfig.changes`).  A leaving replica takes no new request
and drains: its streams run on for up to `drain_timeout_s` and are then cut.  With migration
(`FleetConfig.migrate`, tokenflow/core/rebalance.py) the rule runs after every round of reports
and when a replica leaves: the requests it picks are exported from their replica, and land on
their target `FleetConfig.move_latency_s` later (`migration.MOVE_LATENCY_S`, measured on Ray
Serve) as waiting or paused streams, which the target resumes by recompute (its cost model
charges the recompute like any other prefill).
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass, field

from tokenflow.core.clock import SimClock
from tokenflow.core.engine_core import EngineCore
from tokenflow.core.load_report import LoadReport, RouteRequest, load_report
from tokenflow.core.migration import MOVE_LATENCY_S, StreamExport
from tokenflow.core.rebalance import (
    MigrateMode,
    ReplicaLoad,
    plan_moves,
    replica_load,
)
from tokenflow.core.request import Request
from tokenflow.core.routing import Router, make_router
from tokenflow.eval.metrics import MetricsConfig, summarize
from tokenflow.eval.workload import WorkloadRequest
from tokenflow.sim.arrivals import Arrivals
from tokenflow.sim.fleet_result import FleetResult, MoveRecord
from tokenflow.sim.profiled import ProfiledDeployment, build_profiled_engine
from tokenflow.sim.runner import (
    SimConfig,
    SimEngine,
    SimulationStalled,
    build_engine,
    caches_prefixes,
    executor_clock,
    make_request,
    prefix_cache_stats,
    trace_of,
)

DRAIN_TIMEOUT_S = 30.0  # as `serve --drain-timeout-s`: a leaving replica's streams are then cut
_STALL_LIMIT_STEPS = SimConfig().stall_limit_steps  # a replica's steps without a token

# A replica: a deployment on a GPU's cost model, or a profiled real engine's.
ReplicaSpec = SimConfig | ProfiledDeployment


def build_replica(spec: ReplicaSpec, policy: str) -> SimEngine:
    """One replica's simulated engine, as a single simulation builds it."""
    if isinstance(spec, ProfiledDeployment):
        return build_profiled_engine(spec, policy)
    core, executor = build_engine(spec, policy)
    return SimEngine(core, executor, idle_tick_s=spec.idle_tick_s)


@dataclass(frozen=True)
class ReplicaJoined:
    """A replica of `config` joins at `at_s` (it takes requests from then on)."""

    at_s: float
    config: ReplicaSpec


@dataclass(frozen=True)
class ReplicaLeft:
    """Replica `replica_id` (`replica-I`, numbered in order of joining) is told to stop."""

    at_s: float
    replica_id: str


@dataclass(frozen=True)
class FleetConfig:
    """The replicas (one deployment each, all on GPU cost models or all profiled), the
    policy they all run, the report period, the replicas joining and leaving over the run,
    what may move between them, and what a move costs beyond the target's recompute."""

    replicas: tuple[ReplicaSpec, ...]
    policy: str = "tokenflow"
    report_period_s: float = 1.0  # reports reach the router this often (so up to this old)
    changes: tuple[ReplicaJoined | ReplicaLeft, ...] = ()
    migrate: MigrateMode = MigrateMode.OFF
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    move_latency_s: float = MOVE_LATENCY_S

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ValueError("a fleet needs at least one replica")
        if self.report_period_s <= 0:
            raise ValueError("report_period_s must be > 0")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must be >= 0")
        if any(c.at_s < 0 for c in self.changes):
            raise ValueError("a replica joins or leaves at a time >= 0")
        if not self.move_latency_s >= 0:
            raise ValueError("move_latency_s must be >= 0")
        joined = [c.config for c in self.changes if isinstance(c, ReplicaJoined)]
        profiled = {isinstance(spec, ProfiledDeployment) for spec in (*self.replicas, *joined)}
        if len(profiled) > 1:
            raise ValueError("a fleet's replicas are all on GPU cost models or all profiled")


@dataclass
class _Replica:
    replica_id: str
    engine: SimEngine
    clock: SimClock
    idle_tick_s: float  # the clock's advance after a step that ran nothing
    num_routed: int = 0
    idle_steps: int = 0
    drain_deadline_s: float | None = None  # set while it drains (it takes no new request)
    routed_ids: list[str] = field(default_factory=list)  # in the order they were routed

    @property
    def core(self) -> EngineCore:
        return self.engine.core


@dataclass(order=True)
class _Landing:
    """A moved stream on its way to `target_id`."""

    at_s: float
    order: int  # (the order of the moves: ties by it, never by the state)
    target_id: str = field(compare=False)
    state: StreamExport = field(compare=False)


def run_fleet(
    workload: list[WorkloadRequest],
    router_name: str,
    config: FleetConfig,
    metrics_config: MetricsConfig | None = None,
) -> FleetResult:
    """Serve `workload` on the fleet behind the named router and measure it as one service."""
    started = time.perf_counter()
    fleet = _Fleet(config, workload, router_name)
    fleet.run()
    metrics = metrics_config or MetricsConfig()
    records = fleet.records
    traces = {r.replica_id: [trace_of(records[i]) for i in r.routed_ids] for r in fleet.replicas}
    every = [t for r in fleet.replicas for t in traces[r.replica_id]]
    return FleetResult(
        router=router_name,
        summary=summarize(every, metrics),
        num_requests_by_replica=tuple(r.num_routed for r in fleet.replicas),
        ttft_p99_by_replica_s=tuple(
            summarize(traces[r.replica_id], metrics).ttft_p99_s if traces[r.replica_id] else 0.0
            for r in fleet.replicas
        ),
        wall_s=time.perf_counter() - started,
        moves=tuple(fleet.moves),
        num_cut=fleet.num_cut,
        traces=tuple(every),
        prefix_cache=prefix_cache_stats([r.core for r in fleet.replicas]),
        sessions=fleet.arrivals.session_stats(),
    )


class _Fleet:
    """One run's replicas, router and pending events (see the module docstring)."""

    def __init__(self, config: FleetConfig, workload: list[WorkloadRequest], router: str):
        self.config = config
        self.replicas: list[_Replica] = []  # every replica that ever joined, in joining order
        for replica_config in config.replicas:
            self._new_replica(replica_config)
        self.router: Router = make_router(router, [r.replica_id for r in self.replicas])
        first = self.replicas[0].engine  # (the fleet's prompt mapping and request path)
        self.prompt_tokens, self.arrival_delay_s = first.prompt_tokens, first.arrival_delay_s
        self.arrivals = Arrivals(workload, order_key=lambda w: (w.arrival_s, w.request_id))
        self.caches = caches_prefixes(first.core)  # (prompt ids: runner.py)
        # Requests are routed with their prompts' block keys where the replicas cache prefixes.
        self.block_size = first.core.scheduler.kv.block_size if self.caches else None
        changes = sorted(
            enumerate(config.changes),
            key=lambda c: (c[1].at_s, isinstance(c[1], ReplicaLeft), c[0]),
        )
        self.changes = deque(c for _, c in changes)  # (joins before leaves at one time)
        self.landings: list[_Landing] = []  # a heap
        self.records: dict[str, Request] = {}  # each request's latest object (moves replace it)
        self.landed_s: dict[str, float] = {}  # when each moved request reached its replica
        self.next_report_s = 0.0
        self.moves: list[MoveRecord] = []
        self.num_cut = 0

    @property
    def _live(self) -> list[_Replica]:
        """The replicas that still hold or take requests."""
        return [r for r in self.replicas if r.drain_deadline_s is None or r.core.has_work]

    @property
    def _serving(self) -> list[_Replica]:
        """The replicas that take requests (not draining)."""
        return [r for r in self.replicas if r.drain_deadline_s is None]

    def run(self) -> None:
        """Serve until every request has finished (or been cut)."""
        while (
            self.arrivals.has_pending
            or self.landings
            or any(r.core.has_work for r in self.replicas)
        ):
            busy = [r for r in self._live if r.core.has_work]
            step_s = min((r.clock.now() for r in busy), default=float("inf"))
            arrival_s = self._next_arrival_s()
            change_s = self.changes[0].at_s if self.changes else float("inf")
            landing_s = self.landings[0].at_s if self.landings else float("inf")
            deadlines = [r.drain_deadline_s for r in busy if r.drain_deadline_s is not None]
            deadline_s = min(deadlines, default=float("inf"))
            first_event_s = min(change_s, deadline_s, landing_s)
            if self.next_report_s <= min(step_s, arrival_s, first_event_s):
                self._report_round()
            elif change_s <= min(step_s, arrival_s, deadline_s, landing_s):
                self._change(self.changes.popleft())
            elif deadline_s <= min(step_s, arrival_s, landing_s):
                self._cut(next(r for r in busy if r.drain_deadline_s == deadline_s))
            elif landing_s <= min(step_s, arrival_s):
                self._land(heapq.heappop(self.landings))
            elif arrival_s <= step_s:
                self._arrive(self._next_request())
            else:
                self._step(min(busy, key=lambda r: r.clock.now()))

    # -- events -----------------------------------------------------------------------------
    def _report_round(self) -> None:
        for replica in self._serving:  # (a busy replica reports as of its last step)
            now = max(replica.clock.now(), self.next_report_s)
            report = load_report(replica.core.scheduler.view(now))
            self.router.report(replica.replica_id, report)
        self._rebalance(self.next_report_s)
        self.next_report_s += self.config.report_period_s

    def _change(self, change: ReplicaJoined | ReplicaLeft) -> None:
        if isinstance(change, ReplicaJoined):
            replica = self._new_replica(change.config)
            replica.clock.advance_to(change.at_s)
            self.router.add(replica.replica_id)
            self.router.report(replica.replica_id, self._report(replica, change.at_s))
            return
        replica = next((r for r in self._serving if r.replica_id == change.replica_id), None)
        if replica is None:
            raise ValueError(f"{change.replica_id} leaves at {change.at_s:g} s but is not serving")
        replica.drain_deadline_s = change.at_s + self.config.drain_timeout_s
        self.router.remove(replica.replica_id)
        self._rebalance(change.at_s)

    def _cut(self, replica: _Replica) -> None:
        """A draining replica's deadline: whatever it still holds is cut."""
        for request_id in sorted(replica.core.scheduler.requests):
            replica.core.abort(request_id)
            self.arrivals.finished(self.records[request_id])
            self.num_cut += 1

    def _next_arrival_s(self) -> float:
        """When the next request reaches the fleet (its arrival, after its request path)."""
        return self.arrivals.next_s() + self.arrival_delay_s

    def _next_request(self) -> Request:
        """The next request sent to the fleet, as a core request (runner.make_request)."""
        item = self.arrivals.pop()
        answers = self.arrivals.answers(item)
        return make_request(item, self.prompt_tokens, answers, has_prefix_cache=self.caches)

    def _arrive(self, request: Request) -> None:
        replica = self._by_id(self.router.choose(self._route(request)))
        self._join(replica, request.arrival_s + self.arrival_delay_s)
        replica.core.add_request(request)
        replica.num_routed += 1
        replica.routed_ids.append(request.request_id)
        self.records[request.request_id] = request

    def _land(self, landing: _Landing) -> None:
        replica = self._by_id(landing.target_id)
        if replica.drain_deadline_s is not None:  # (the target left meanwhile: route again)
            route = self._route(self.records[landing.state.request_id])
            replica = self._by_id(self.router.choose(route))
        self._join(replica, landing.at_s)
        self.landed_s[landing.state.request_id] = landing.at_s
        self.records[landing.state.request_id] = replica.core.scheduler.import_stream(landing.state)

    def _step(self, replica: _Replica) -> None:
        """One step of the replica furthest behind; an empty plan idles it a tick (or to the
        next arrival), as a single simulated engine does."""
        now = replica.clock.now()
        plan, outputs = replica.core.step()
        for output in outputs:
            if output.is_finished:
                self.arrivals.finished(self.records[output.request_id])
        replica.idle_steps = 0 if outputs else replica.idle_steps + 1
        if replica.idle_steps > _STALL_LIMIT_STEPS:
            raise SimulationStalled(f"{replica.replica_id}: no token for long at t={now:.2f}s")
        if plan.is_empty:
            next_arrival_s = self._next_arrival_s()
            replica.clock.advance_to(max(now, min(next_arrival_s, now + replica.idle_tick_s)))

    # -- moves ------------------------------------------------------------------------------
    def _rebalance(self, now_s: float) -> None:
        """Run the rule on the latest reports and the draining replicas' streams, and send
        its moves."""
        if self.config.migrate is MigrateMode.OFF:
            return
        loads = [self._load(r, now_s) for r in self._live]
        period_s, latency_s = self.config.report_period_s, self.config.move_latency_s
        for move in plan_moves(loads, self.config.migrate, period_s, latency_s):
            source = self._by_id(move.source_id)
            exported_s = max(source.clock.now(), now_s)
            state = source.core.scheduler.export_stream(move.request_id)
            self.router.record(move.target_id, self._route(self.records[move.request_id]))
            landed_s = exported_s + latency_s
            landing = _Landing(landed_s, len(self.moves), move.target_id, state)
            heapq.heappush(self.landings, landing)
            self.moves.append(
                MoveRecord(
                    request_id=move.request_id,
                    kind=move.kind,
                    source_id=move.source_id,
                    target_id=move.target_id,
                    planned_s=now_s,
                    exported_s=exported_s,
                    landed_s=landed_s,
                )
            )

    def _load(self, replica: _Replica, now_s: float) -> ReplicaLoad:
        view = replica.core.scheduler.view(max(replica.clock.now(), now_s))
        drain_left_s = None
        if replica.drain_deadline_s is not None:
            drain_left_s = max(replica.drain_deadline_s - now_s, 0.0)
        return replica_load(
            replica.replica_id,
            view,
            self.landed_s,
            report=self.router.reports.get(replica.replica_id),  # (None: measured now)
            routed_since=tuple(self.router.routed_since.get(replica.replica_id, ())),
            drain_left_s=drain_left_s,
        )

    # -- replicas ---------------------------------------------------------------------------
    def _new_replica(self, spec: ReplicaSpec) -> _Replica:
        engine = build_replica(spec, self.config.policy)
        idle_tick_s = engine.idle_tick_s
        assert idle_tick_s is not None  # (`build_replica` gives every replica its tick)
        replica_id = f"replica-{len(self.replicas)}"
        replica = _Replica(replica_id, engine, executor_clock(engine.core), idle_tick_s)
        self.replicas.append(replica)
        return replica

    def _route(self, request: Request) -> RouteRequest:
        """What the router knows of `request`."""
        return RouteRequest.of(request, self.block_size)

    def _report(self, replica: _Replica, now_s: float) -> LoadReport:
        return load_report(replica.core.scheduler.view(now_s))

    def _by_id(self, replica_id: str) -> _Replica:
        return next(r for r in self.replicas if r.replica_id == replica_id)

    @staticmethod
    def _join(replica: _Replica, at_s: float) -> None:
        """An idle replica's clock moves up to a request that reaches it at `at_s`."""
        if not replica.core.has_work:
            replica.clock.advance_to(max(replica.clock.now(), at_s))


# -- presets ------------------------------------------------------------------------------------
