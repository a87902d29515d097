"""Moving requests between replicas: which queued requests and paused streams leave a replica
whose readers ask more than its capacity, and where they go.

The routing rule (routing.py) places a request once, at its arrival.  A replica that joins
later gets only new arrivals, while requests already queued elsewhere wait behind the burst that
filled their replica; a replica told to stop holds streams it can only finish or cut.  This rule
moves them (`plan_moves`), on the same reports the router reads:

- a source is a replica whose load (reading demand / Gamma, `load_report.project`) exceeds 1, or
  one that is leaving (draining, `ReplicaLoad.drain_left_s` before it must be empty); and a
  queued request that its replica has not started in a whole period (memory, or its policy's
  admission, holds it back even where the load reads <= 1) is offered too;
- a target has room: once the moves it takes join it, its load is still <= 1, its tiers still
  hold every joining request's longest footprint, and it has no queue of its own;
- a move costs the target's recompute of the stream's context (its prefill rate, from the
  report) plus a fixed latency (`migration.MOVE_LATENCY_S`), behind the recomputes already
  moved to that target this round.  A queued request has no reader yet: it moves whenever a
  target has room (its wait there is shorter than behind the burst).  A paused stream moves
  only if its slack covers the move and that wait, so its reader never notices;
- each goes to the target with room where it resumes first (the move's cost), then the least
  loaded;
- a leaving replica's queued requests all move at once.  Of its started streams (running ones
  too, resumed by recompute, in `MigrateMode.PAUSED`) only those that would not finish before
  the deadline at one stream's share of its Gamma move: the others finish where they are, and
  each move costs its target a recompute that delays the target's own streams and arrivals.
  They move paced over the drain, an equal share of them each period (`period_s`), the most
  tokens still to generate first among those whose slack covers the move (a stream whose
  buffer is short waits: it grows while it runs), so no target has a whole replica's
  recomputes to do at once.  Whatever must still
  leave in the last period moves then, whatever its slack, to the least loaded target where
  none has room: a late stream beats a cut one.

Order, deterministic: sources in replica order; from each, queued requests oldest first, then
paused streams least slack first (from a leaving replica: started streams most tokens left
first), ties by request id; targets tied on cost and load go to the replica listed first.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from tokenflow.core.load_report import LoadReport, Projection, RouteRequest, load_report, project
from tokenflow.core.migration import MOVE_LATENCY_S
from tokenflow.core.policies.base import SchedulingView
from tokenflow.core.request import Request, RequestState


class StreamKind(enum.Enum):
    QUEUED = "queued"  # never started: it has no reader yet
    PAUSED = "paused"  # started, off the device: its reader reads its buffer
    RUNNING = "running"  # on the device (moves only from a leaving replica)


_KIND_OF_STATE = {
    RequestState.WAITING: StreamKind.QUEUED,
    RequestState.PREEMPTED: StreamKind.PAUSED,
    RequestState.RUNNING: StreamKind.RUNNING,
    RequestState.LOADING: StreamKind.RUNNING,
}


def stream_kind(request: Request) -> StreamKind | None:
    """What an unfinished `request` is to the rule, by its state now; None once it ended."""
    return _KIND_OF_STATE.get(request.state)


class MigrateMode(enum.Enum):
    """What may move (`tokenflow simulate --migrate`)."""

    OFF = "off"
    QUEUED = "queued"  # queued requests only
    PAUSED = "paused"  # queued requests and paused streams (and a leaving replica's running)

    def allows(self, kind: StreamKind) -> bool:
        """Whether a stream of `kind` may move in this mode."""
        if self is MigrateMode.OFF:
            return False
        return kind is StreamKind.QUEUED or self is MigrateMode.PAUSED


@dataclass(frozen=True)
class Movable:
    """A request that could move, as its replica knows it."""

    route: RouteRequest  # what the target's load counts of it
    kind: StreamKind
    num_context_tokens: int  # prompt + generated: what the target recomputes
    num_left_tokens: int  # still to generate (max_tokens - generated)
    slack_s: float  # seconds of reading its buffer holds (0 for a queued request)
    arrival_s: float
    queued_s: float = 0.0  # a queued request: how long it has waited on this replica

    @property
    def request_id(self) -> str:
        return self.route.request_id


def movable_of(request: Request, now_s: float, reached_s: float) -> Movable:
    """What the rule knows of the unfinished `request` on its replica at `now_s`, which it
    reached at `reached_s` (its arrival, or the landing of its move there)."""
    kind = stream_kind(request)
    if kind is None:
        raise ValueError(f"{request.request_id!r} has ended: it cannot move")
    return Movable(
        route=RouteRequest.of(request),
        kind=kind,
        num_context_tokens=request.num_tokens,
        num_left_tokens=request.num_remaining_output_tokens,
        slack_s=request.slack_s(now_s) if kind is not StreamKind.QUEUED else 0.0,
        arrival_s=request.arrival_s,
        queued_s=now_s - reached_s,
    )


@dataclass(frozen=True)
class ReplicaLoad:
    """A replica as the rule sees it: its report, what it could give up, and, when it is
    leaving, how long until everything it holds must be gone."""

    replica_id: str
    report: LoadReport
    movable: tuple[Movable, ...] = ()
    routed_since: tuple[RouteRequest, ...] = ()  # sent to it since its report
    drain_left_s: float | None = None  # leaving: seconds to its drain deadline

    @property
    def is_leaving(self) -> bool:
        return self.drain_left_s is not None


def replica_load(
    replica_id: str,
    view: SchedulingView,
    reached_s: Mapping[str, float],
    *,
    report: LoadReport | None = None,
    movable_ids: Collection[str] | None = None,
    routed_since: tuple[RouteRequest, ...] = (),
    drain_left_s: float | None = None,
) -> ReplicaLoad:
    """A replica's load from the `view` its scheduler gives: `report` (None: measured from
    `view`), and what could move at `view.now_s`: its queued requests and paused streams, and
    its running ones too when it is leaving (`drain_left_s` given: everything must go), among
    `movable_ids` (None: all), each reached at `reached_s` (where it moved here) or its
    arrival."""
    queues = [view.waiting, view.preempted]
    if drain_left_s is not None:
        queues.append(view.running)
    movable = tuple(
        movable_of(r, view.now_s, reached_s.get(r.request_id, r.arrival_s))
        for queue in queues
        for r in queue
        if movable_ids is None or r.request_id in movable_ids
    )
    return ReplicaLoad(
        replica_id=replica_id,
        report=load_report(view) if report is None else report,
        movable=movable,
        routed_since=routed_since,
        drain_left_s=drain_left_s,
    )


@dataclass(frozen=True)
class Move:
    """One request to move, and what its move is expected to cost."""

    request_id: str
    source_id: str
    target_id: str
    kind: StreamKind
    cost_s: float  # fixed latency + the target's recompute of the stream, queued ones ahead


@dataclass
class _Target:
    load: ReplicaLoad
    joining: list[RouteRequest] = field(default_factory=list)
    busy_s: float = 0.0  # the recomputes moved to it this round

    def projection(self, extra: RouteRequest) -> Projection:
        return project(self.load.report, [*self.load.routed_since, *self.joining, extra])

    def has_room(self, projection: Projection) -> bool:
        is_queueing = self.load.report.num_waiting > 0
        return projection.load <= 1.0 and projection.num_spare_blocks >= 0 and not is_queueing

    def recompute_s(self, movable: Movable) -> float:
        return movable.num_context_tokens * self.load.report.prefill_token_s


def plan_moves(
    replicas: Sequence[ReplicaLoad],
    mode: MigrateMode = MigrateMode.PAUSED,
    period_s: float = 1.0,
    move_latency_s: float = MOVE_LATENCY_S,
) -> list[Move]:
    """The moves that bring overloaded and leaving replicas' requests to replicas with room,
    for a rule run every `period_s` (see the module docstring for the rule and its order);
    none in `MigrateMode.OFF`."""
    if mode is MigrateMode.OFF:
        return []
    targets = [_Target(r) for r in replicas if not r.is_leaving]
    moves: list[Move] = []
    for source in replicas:
        if source.is_leaving:
            moves += _drain(source, mode, targets, period_s, move_latency_s)
        else:
            moves += _shed(source, mode, targets, period_s, move_latency_s)
    return moves


def _drain(
    source: ReplicaLoad,
    mode: MigrateMode,
    targets: list[_Target],
    period_s: float,
    move_latency_s: float,
) -> list[Move]:
    """A leaving replica: its queued requests now; of its started streams, only those that
    cannot finish there before the deadline (`_must_leave`), paced: their share of the periods
    left, most tokens left first among those whose slack covers the move (in the last period
    all of them, whatever their slack)."""
    allowed = [m for m in source.movable if mode.allows(m.kind)]
    queued = _in_order([m for m in allowed if m.kind is StreamKind.QUEUED])
    drain_left_s = source.drain_left_s or 0.0
    started = sorted(
        (m for m in allowed if m.kind is not StreamKind.QUEUED and _must_leave(source, m)),
        key=lambda m: (-m.num_left_tokens, m.request_id),
    )
    is_last = drain_left_s <= period_s
    moves = [_place(source, m, targets, move_latency_s) for m in queued]
    num_to_move = math.ceil(len(started) / max(drain_left_s / period_s, 1.0))
    for movable in started:
        if num_to_move == 0:
            break
        move = _place(source, movable, targets, move_latency_s, is_last)
        if move is not None:
            moves.append(move)
            num_to_move -= 1
    return [m for m in moves if m is not None]


def _must_leave(source: ReplicaLoad, movable: Movable) -> bool:
    """Whether a leaving replica's started stream would still have tokens to generate at its
    deadline, generating at one stream's share of the replica's Gamma (what each stream of a
    full batch gets: a floor, since a draining replica takes no new request).  The others
    finish where they are: a move would cost their target a recompute for nothing."""
    report = source.report
    rate_tps = report.capacity_at(_mean_blocks(report)).share_tps
    return movable.num_left_tokens > rate_tps * (source.drain_left_s or 0.0)


def _shed(
    source: ReplicaLoad,
    mode: MigrateMode,
    targets: list[_Target],
    period_s: float,
    move_latency_s: float,
) -> list[Move]:
    """An overloaded replica gives up queued requests and paused streams (never running ones)
    while its load without them stays above 1; any replica, the queued requests it has not
    started in a whole period (its policy has no room for them there)."""
    report = source.report
    load = project(report, source.routed_since).load
    point = report.capacity_at(_mean_blocks(report))
    offered = [
        m for m in source.movable if m.kind is not StreamKind.RUNNING and mode.allows(m.kind)
    ]
    moves = []
    for movable in _in_order(offered):
        is_stuck = movable.kind is StreamKind.QUEUED and movable.queued_s >= period_s
        if load <= 1.0 and not is_stuck:
            continue
        move = _place(source, movable, targets, move_latency_s)
        if move is not None:
            moves.append(move)
            load -= point.demand_tps(movable.route.rate_tps) / report.gamma_tps
    return moves


def _place(
    source: ReplicaLoad,
    movable: Movable,
    targets: list[_Target],
    move_latency_s: float,
    is_last_period: bool = False,
) -> Move | None:
    """`movable`'s target, recorded as joining it; None where no target takes it.

    Among the targets with room, the one where it resumes first (the move's cost, the
    recomputes already moved there included), then the least loaded, then the first listed;
    from a leaving replica, where none has room, the least loaded.  A started stream moves
    only if its slack covers the cost, except from a leaving replica in its last period."""
    scored = []
    for index, target in enumerate(targets):
        if target.load.replica_id == source.replica_id:
            continue
        projection = target.projection(movable.route)
        cost_s = move_latency_s + target.busy_s + target.recompute_s(movable)
        scored.append((not target.has_room(projection), cost_s, projection.load, index, target))
    if not scored:
        return None
    is_full, cost_s, _, _, target = min(scored, key=lambda s: s[:4])
    if is_full and not source.is_leaving:
        return None
    is_started = movable.kind is not StreamKind.QUEUED
    if is_started and not is_last_period and movable.slack_s < cost_s:
        return None
    target.joining.append(movable.route)
    target.busy_s += target.recompute_s(movable)
    return Move(movable.request_id, source.replica_id, target.load.replica_id, movable.kind, cost_s)


def _in_order(movables: Sequence[Movable]) -> list[Movable]:
    """Queued requests oldest first, then started streams least slack first."""
    queued = sorted(
        (m for m in movables if m.kind is StreamKind.QUEUED),
        key=lambda m: (m.arrival_s, m.request_id),
    )
    started = sorted(
        (m for m in movables if m.kind is not StreamKind.QUEUED),
        key=lambda m: (m.slack_s, m.request_id),
    )
    return [*queued, *started]


def _mean_blocks(report: LoadReport) -> float:
    num = report.num_unfinished
    return report.num_lifetime_blocks / num if num else 1.0
