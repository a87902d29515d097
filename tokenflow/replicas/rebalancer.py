"""An engine replica's part in the fleet's moves of queued requests and paused streams
(board.py decides them).

Once a report period, from the first time Serve asks for the replica's routing stats (Serve
routes to it from then on), a `Rebalancer` reads its engine between two steps, its
`LoadReport` and the requests whose answers can move (listed in its `MoveBook`:
serving/moves.py) that are still queued or paused, posts them to the board, and exports the
requests the board says to move (the board's mode says whether paused streams may: `--migrate
queued|paused`), each only if it is still as the board saw it (one that started or resumed
meanwhile stays).  Each of those answers' bodies then ends, and its `StreamHandoff` goes to the
ingress naming the target the board chose (`take_target`); the ingress continues it there
(`resume_http`), in the response its client holds, as it does for a replica that leaves.

A request that reached this replica by a move counts its wait here from its landing, not from
its arrival in the fleet, as the simulator counts it: it is not sent on at once for the time it
waited elsewhere.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Protocol

import ray
from ray.actor import ActorHandle

from tokenflow.core.rebalance import Move, ReplicaLoad, stream_kind
from tokenflow.serving.moves import MoveBook

if TYPE_CHECKING:
    from tokenflow.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)


class Board(Protocol):
    """Where the replicas post (`board.MoveBoard`, or `RemoteBoard` in front of its actor)."""

    def post(self, load: ReplicaLoad) -> list[Move]: ...

    def withdraw(self, replica_id: str) -> None: ...

    def landed(self, request_id: str, handed_off_s: float | None, landed_s: float) -> None: ...


class RemoteBoard:
    """The board's actor, called as a `Board` (from a replica's rebalancing thread)."""

    def __init__(self, actor: ActorHandle, timeout_s: float) -> None:
        self._actor = actor
        self._timeout_s = timeout_s

    def post(self, load: ReplicaLoad) -> list[Move]:
        return ray.get(self._actor.post.remote(load), timeout=self._timeout_s)

    def withdraw(self, replica_id: str) -> None:
        self._actor.withdraw.remote(replica_id)  # (not awaited: a draining replica goes on)

    def landed(self, request_id: str, handed_off_s: float | None, landed_s: float) -> None:
        self._actor.landed.remote(request_id, handed_off_s, landed_s)  # (not awaited)


class Rebalancer:
    """Posts one replica's load every `period_s` and moves what the board says (see the module
    docstring).  `clock` (monotonic seconds) times moved requests' landings."""

    def __init__(
        self,
        engine: AsyncEngine,
        book: MoveBook,
        board: Board,
        replica_id: str,
        period_s: float,
        timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.replica_id = replica_id
        self._engine = engine
        self._book = book
        self._board = board
        self._period_s = period_s
        self._timeout_s = timeout_s  # for the engine to answer between two steps
        self._clock = clock
        self._lock = threading.Lock()  # the dicts below: the app's event loop and this thread
        self._targets: dict[str, str] = {}  # request id -> planned target, until its handoff
        self._landed_s: dict[str, float] = {}  # request id -> when it landed here (`clock`)
        self._routed = threading.Event()
        self._stopped = threading.Event()

    def start(self) -> None:
        """Post once a period from the replica's first routing stats (`routed`) until `stop`."""
        threading.Thread(target=self._run, name="tokenflow-rebalance", daemon=True).start()

    def routed(self) -> None:
        """Serve asked for the replica's routing stats: it routes requests to it now."""
        self._routed.set()

    def landed(self, request_id: str, handed_off_s: float | None = None) -> None:
        """A moved request (`resume_http`), handed off by its source at `handed_off_s`, reached
        this replica now; the board records both."""
        landed_s = self._clock()
        with self._lock:
            self._landed_s[request_id] = landed_s
        self._board.landed(request_id, handed_off_s, landed_s)

    def stop(self) -> None:
        """No more posts or moves (the replica drains): the board forgets this replica."""
        if not self._stopped.is_set():
            self._stopped.set()
            self._board.withdraw(self.replica_id)

    def take_target(self, request_id: str) -> str | None:
        """The replica the board chose for `request_id`, once; None when it was not moved by
        the board (a replica that leaves hands its answers to any other)."""
        with self._lock:
            return self._targets.pop(request_id, None)

    def rebalance(self) -> int:
        """Post this replica's load as it is now, and export the requests the board says to
        move, those still queued or paused as they were (their answers then hand off).  How
        many were exported."""
        movable_ids = self._book.movable_request_ids()
        loading = self._engine.replica_load(self.replica_id, movable_ids, self._landings)
        load = loading.result(timeout=self._timeout_s)
        moves = self._board.post(load)
        if self._stopped.is_set():  # (it began to drain meanwhile: no target, no source)
            self._board.withdraw(self.replica_id)
            return 0
        if not moves:
            return 0
        with self._lock:
            self._targets.update({m.request_id: m.target_id for m in moves})
        seen = {m.request_id: m.kind for m in moves}  # (each moves only if still as seen)
        exported = self._engine.export_streams(
            list(seen), only_if=lambda r: stream_kind(r) is seen[r.request_id]
        )
        states = exported.result(timeout=self._timeout_s)
        moved_ids = {s.request_id for s in states}
        with self._lock:  # (those that started or ended meanwhile stay)
            for move in moves:
                if move.request_id not in moved_ids:
                    self._targets.pop(move.request_id, None)
        logger.info("moving %d of %d queued or paused requests", len(states), len(load.movable))
        return len(states)

    def _run(self) -> None:
        """(Its own thread.)"""
        while not self._routed.wait(self._period_s):
            if self._stopped.is_set():
                return
        next_s = self._clock()
        while not self._stopped.is_set():
            try:
                self.rebalance()
            except Exception as err:  # noqa: BLE001 - the next period tries again
                logger.warning("rebalancing failed: %s: %s", type(err).__name__, err)
            next_s = max(next_s + self._period_s, self._clock())
            self._stopped.wait(next_s - self._clock())

    def _landings(self, now_s: float, unfinished: Collection[str]) -> dict[str, float]:
        """(On the engine thread, between two steps.)  When each request that moved here
        landed, on the engine's clock (`now_s` now); the ones that ended are forgotten (a
        landing newer than a period may not be in the engine yet)."""
        clock_s = self._clock()
        with self._lock:
            self._landed_s = {
                request_id: landed_s
                for request_id, landed_s in self._landed_s.items()
                if request_id in unfinished or clock_s - landed_s < self._period_s
            }
            return {r: now_s - (clock_s - landed_s) for r, landed_s in self._landed_s.items()}
