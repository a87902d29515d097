"""The fleet's board of moves: where every engine replica posts, once a report period, its load
report and the queued requests it could give up, and learns which of them to move, and where.

The rule that decides is the simulator's (`tokenflow.core.rebalance.plan_moves`): a replica
over its capacity, or one holding a request it has not started in a whole period, gives its
oldest queued requests to replicas with room (a replica that just joined, above all).  It needs
every replica's report at once, so the fleet has one board: a Ray actor the launcher makes
(`ray.remote(MoveBoard)`), plain Python here so it is tested without a cluster.

- A post replaces the poster's load, and the moves it gets back are its own: planned on its
  fresh list of movable requests, against the others' latest reports and what the board sent
  each of them since (`ReplicaLoad.routed_since`), so two replicas posting within one period
  do not both fill the same room.  The others' requests are theirs to offer when they post.
- A replica that has not posted for `STALE_PERIODS` periods (it died, or Serve stopped it) is
  no target; one that leaves withdraws at once.
- Every move it plans is kept (the latest 1,024, `planned`), with when its answer left the
  source and reached the target once the target tells it (`landed`): what a move takes on
  this fleet, which `benchmarks/move_cost.py` reads.
- Times are the board's `clock` (time.monotonic by default: on one host, comparable with any
  process's).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from tokenflow.core.load_report import RouteRequest
from tokenflow.core.rebalance import MigrateMode, Move, ReplicaLoad, plan_moves

# What may move unless the launcher is told otherwise: paused streams too.  At a join under slow
# readers (`benchmarks/move_cost.py --modes`, docs/replicas.md) moving them halves the mean stall
# that queued moves alone leave, at the same TTFT and throughput.
DEFAULT_MODE = MigrateMode.PAUSED
STALE_PERIODS = 3.0  # a replica silent this many report periods is taken to be gone
_NUM_LOGGED_MOVES = 1024  # the latest moves kept for `planned()`


@dataclass(frozen=True)
class PlannedMove:
    """A move the board handed its source, when, and, once its target says so, when the
    source handed the answer off and when it reached the target (the board's clock, seconds;
    None until then)."""

    move: Move
    planned_s: float
    handed_off_s: float | None = None
    landed_s: float | None = None


@dataclass(frozen=True)
class _Post:
    load: ReplicaLoad
    posted_s: float


class MoveBoard:
    """The latest load of every replica, and the moves each is to make (module docstring)."""

    def __init__(
        self,
        period_s: float,
        mode: MigrateMode,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not period_s > 0:
            raise ValueError(f"the report period must be > 0 s, got {period_s!r}")
        self._period_s = period_s
        self._mode = mode
        self._clock = clock
        self._posts: dict[str, _Post] = {}
        self._sent_since: dict[str, list[RouteRequest]] = {}  # moved to it since its post
        self._first_posted_s: dict[str, float] = {}
        self._planned: deque[PlannedMove] = deque(maxlen=_NUM_LOGGED_MOVES)

    def post(self, load: ReplicaLoad) -> list[Move]:
        """`load.replica_id`'s report and movable requests, as they are now: the moves it is to
        make (each from it, to the target the rule chose)."""
        now_s = self._clock()
        poster = load.replica_id
        self._posts[poster] = _Post(load=load, posted_s=now_s)
        self._sent_since[poster] = []  # (what was moved to it is in its report now)
        self._first_posted_s.setdefault(poster, now_s)
        self._forget_stale(now_s)
        loads = [
            load if replica_id == poster else self._as_target(replica_id)
            for replica_id in sorted(self._posts)  # (ties go to the replica listed first)
        ]
        moves = plan_moves(loads, self._mode, self._period_s)
        routes = {m.request_id: m.route for m in load.movable}
        for move in moves:
            self._sent_since[move.target_id].append(routes[move.request_id])
            self._planned.append(PlannedMove(move=move, planned_s=now_s))
        return moves

    def withdraw(self, replica_id: str) -> None:
        """`replica_id` leaves (it drains): no move goes to it any more."""
        self._posts.pop(replica_id, None)
        self._sent_since.pop(replica_id, None)

    def landed(self, request_id: str, handed_off_s: float | None, landed_s: float) -> None:
        """The answer of `request_id`, handed off by its source at `handed_off_s`, reached its
        target at `landed_s`: its latest planned move without a landing records both (a move
        the board did not plan, a leaving replica's, is not recorded)."""
        for index in range(len(self._planned) - 1, -1, -1):
            planned = self._planned[index]
            if planned.move.request_id == request_id and planned.landed_s is None:
                self._planned[index] = replace(
                    planned, handed_off_s=handed_off_s, landed_s=landed_s
                )
                return

    def first_posted_s(self) -> dict[str, float]:
        """When each replica first posted (it joined the board), by replica id."""
        return dict(self._first_posted_s)

    def planned(self) -> list[PlannedMove]:
        """The latest moves handed out (up to 1,024), oldest first."""
        return list(self._planned)

    def _as_target(self, replica_id: str) -> ReplicaLoad:
        """Another replica's latest report, with what was moved to it since; its requests are
        offered when it posts."""
        latest = self._posts[replica_id].load
        return replace(latest, movable=(), routed_since=tuple(self._sent_since[replica_id]))

    def _forget_stale(self, now_s: float) -> None:
        stale_s = STALE_PERIODS * self._period_s
        for replica_id in [r for r, p in self._posts.items() if now_s - p.posted_s > stale_s]:
            self.withdraw(replica_id)
