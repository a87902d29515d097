"""Streams that leave this server mid-answer for another one, and streams that arrive so.

Only a fleet moves streams (tokenflow/replicas: the ingress in front of the engine replicas);
an app built without a `MoveBook` (`tokenflow serve`) ignores all of this.  The ingress marks
each request it forwards with a ticket (`MOVE_HEADER`), the same for the whole life of the
answer whichever replica serves it.

- A streamed answer with one choice whose request carries a ticket is *movable* (the serving
  layer withholds the ticket where the answer's format reads its text into tool calls: a
  forced call, or tool_choice "auto"): the app lists its engine request in the book while it
  streams.
- When the replica leaves, it exports those requests from its engine (`StreamMoved`); so it
  does with a queued one the fleet moves to a replica with room.  Each answer's body then ends
  without `[DONE]`, and the book keeps a `StreamHandoff` under its ticket: the engine's
  `StreamExport` and what the client has been sent so far (nothing, for a queued one).
- The ingress opens the continuation on another replica, whose book is told to expect that
  ticket (`expect_resume`); the request, its body unchanged, is then served from the handoff:
  same `id` and `created`, no opening chunks again, and the usage counts every token.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace

from tokenflow.core.migration import StreamExport
from tokenflow.serving.prepared import PreparedRequest, Progress

MOVE_HEADER = "X-TokenFlow-Move"  # the ingress's ticket for one answer


@dataclass(frozen=True)
class StreamHandoff:
    """One answer, as it leaves a replica mid-stream: where the engine goes on from, and what
    the client holds already (the continuation sends only what follows)."""

    state: StreamExport  # times relative to the export
    response_id: str  # the answer's `id`
    created_s: int  # its `created` (wall-clock seconds)
    num_sent_tokens: int  # output tokens the client has been sent
    num_sent_chars: int  # characters of the choice's text sent (the next text offset)
    num_sent_deltas: int  # chunks with output sent (0: the opening chunks are still due)
    # The replica the fleet chose for the continuation (a queued request moved to a replica
    # with room); None: any replica but those it left.
    target_replica_id: str | None = None
    # When its replica handed it off (time.monotonic: on one host, comparable with any
    # process's), for the fleet's record of how long a move takes.
    handed_off_s: float | None = None


def is_movable(prepared: PreparedRequest) -> bool:
    """Whether the answer can move: streamed, with one choice (a grammar's state moves: the
    target's engine rebuilds it from the tokens generated)."""
    return prepared.stream and len(prepared.choices) == 1


def handoff_of(prepared: PreparedRequest, progress: Progress, state: StreamExport) -> StreamHandoff:
    """The handoff of the answer's one choice, exported as `state` after `progress`."""
    return StreamHandoff(
        state=state,
        response_id=prepared.request_id,
        created_s=prepared.created_s,
        num_sent_tokens=progress.num_output_tokens,
        num_sent_chars=progress.num_sent_chars,
        num_sent_deltas=progress.num_deltas,
        handed_off_s=time.monotonic(),
    )


def resumed_request(prepared: PreparedRequest, handoff: StreamHandoff) -> PreparedRequest:
    """The request that continues `handoff`: its answer's `id` and `created`, its engine
    request's id (an unseeded stream draws from it: tokenflow/core/migration.py)."""
    choice = replace(prepared.choices[0], engine_request_id=handoff.state.request_id)
    return replace(
        prepared, request_id=handoff.response_id, created_s=handoff.created_s, choices=(choice,)
    )


def resumed_progress(handoff: StreamHandoff, now_s: float) -> Progress:
    """The choice's progress on the replica that continues it: the client's count of tokens,
    characters and chunks, and a last delta `now_s` (no second TTFT is observed)."""
    return Progress(
        num_output_tokens=handoff.num_sent_tokens,
        num_deltas=handoff.num_sent_deltas,
        num_sent_chars=handoff.num_sent_chars,
        last_delta_s=now_s if handoff.num_sent_tokens else None,
    )


class MoveBook:
    """One replica's movable streams, handoffs and expected continuations, by ticket.  Touched
    by the app's event loop and by the thread that drains the replica, so under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._movable: dict[str, str] = {}  # ticket -> engine request id
        self._handoffs: dict[str, StreamHandoff] = {}
        self._resumes: dict[str, StreamHandoff] = {}

    def register(self, ticket: str, engine_request_id: str) -> None:
        """A movable answer started streaming."""
        with self._lock:
            self._movable[ticket] = engine_request_id

    def forget(self, ticket: str) -> None:
        """The answer ended here (finished, failed, its client left, or it moved)."""
        with self._lock:
            self._movable.pop(ticket, None)

    def movable_request_ids(self) -> list[str]:
        """The engine requests of the movable answers streaming now, in ticket order."""
        with self._lock:
            return [self._movable[ticket] for ticket in sorted(self._movable)]

    def handed_off(self, ticket: str, handoff: StreamHandoff) -> None:
        """The answer left its engine; its replica hands `handoff` to the ingress."""
        with self._lock:
            self._movable.pop(ticket, None)
            self._handoffs[ticket] = handoff

    def take_handoff(self, ticket: str) -> StreamHandoff | None:
        """The handoff of the answer with `ticket`, once (None: it did not move)."""
        with self._lock:
            return self._handoffs.pop(ticket, None)

    def expect_resume(self, ticket: str, handoff: StreamHandoff) -> None:
        """The next request with `ticket` continues `handoff`."""
        with self._lock:
            self._resumes[ticket] = handoff

    def take_resume(self, ticket: str) -> StreamHandoff | None:
        """The handoff the request with `ticket` continues, once (None: a new answer)."""
        with self._lock:
            return self._resumes.pop(ticket, None)


@dataclass(frozen=True)
class MoveTicket:
    """A request's ticket and the book of the app that serves it."""

    ticket: str
    book: MoveBook
