"""When a workload's requests reach a simulated engine: open loop, or closed loop for chats.

A request without `after_id` is sent at its `arrival_s` (open loop).  A conversation's later
turn (`after_id`, tokenflow/eval/conversation.py) is sent when its predecessor has finished and
its reader has read the whole answer, plus the turn's `think_s`: at the finished core request's
`last_consume_s` (the reader's consumption time of its last token; an eager or batch request
reads each token as it comes, so there it is the last token's time) + `think_s`.  Its prompt
repeats the earlier answers as the engine generated them (`answers`), as a chat client resends
the answers it received.  A turn whose predecessor was aborted, or ended without a token, is
never sent, nor are the session's later turns: the session ends there (`SessionStats`).

Order: open-loop requests in the order `order_key` sorts them (stably), released turns by send
time, then workload order; at equal times an open-loop request goes first.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from tokenflow.core.request import FinishReason, Request
from tokenflow.eval.conversation import turn_name
from tokenflow.eval.workload import WorkloadRequest


@dataclass(frozen=True)
class SessionStats:
    """A run's conversations: how many, how many a failed turn ended, the turns not sent."""

    num_sessions: int
    num_sessions_ended: int
    num_turns_unsent: int


def _by_arrival(item: WorkloadRequest) -> float:
    return item.arrival_s


class Arrivals:
    """The requests still to send, and the conversations' state between turns."""

    def __init__(
        self,
        workload: Sequence[WorkloadRequest],
        order_key: Callable[[WorkloadRequest], object] = _by_arrival,
    ) -> None:
        ordered = sorted(workload, key=order_key)  # type: ignore[arg-type]
        self._open = deque(item for item in ordered if item.after_id is None)
        self._order = {item.request_id: index for index, item in enumerate(ordered)}
        self._next_turn: dict[str, WorkloadRequest] = {}  # predecessor's id -> the next turn
        for item in ordered:
            if item.after_id is None:
                continue
            if item.after_id not in self._order or item.after_id in self._next_turn:
                raise ValueError(
                    f"request {item.request_id}: after_id {item.after_id!r} must name another "
                    "request of the workload, followed by this turn only"
                )
            self._next_turn[item.after_id] = item
        self._released: list[tuple[float, int, WorkloadRequest]] = []  # heap: (send s, order, _)
        self._in_flight: dict[str, WorkloadRequest] = {}  # conversation turns sent, by id
        self._answers: dict[str, dict[str, tuple[int, ...]]] = {}  # session -> turn -> ids
        self._session_ids = sorted({item.session_id for item in ordered if item.session_id})
        self._num_ended = 0  # sessions cut short by a turn that failed
        self._num_cut = 0  # their turns never sent

    @property
    def has_pending(self) -> bool:
        """Whether a request's send time is known and it has not been sent yet."""
        return bool(self._open or self._released)

    def session_stats(self) -> SessionStats | None:
        """The conversations so far (None if the workload has none).  After the run, the turns
        not sent are those of ended sessions and any whose predecessor never finished."""
        if not self._session_ids:
            return None
        return SessionStats(
            num_sessions=len(self._session_ids),
            num_sessions_ended=self._num_ended,
            num_turns_unsent=self._num_cut + len(self._next_turn),
        )

    def next_s(self) -> float:
        """When the next request is sent (infinity when none is known yet)."""
        open_s = self._open[0].arrival_s if self._open else float("inf")
        released_s = self._released[0][0] if self._released else float("inf")
        return min(open_s, released_s)

    def pop(self) -> WorkloadRequest:
        """The next request, its `arrival_s` the time it is sent."""
        if self._open and (not self._released or self._open[0].arrival_s <= self._released[0][0]):
            item = self._open.popleft()
        else:
            item = heapq.heappop(self._released)[2]
        if item.session_id is not None:
            self._in_flight[item.request_id] = item
        return item

    def answers(self, item: WorkloadRequest) -> Mapping[str, tuple[int, ...]]:
        """The answers its prompt repeats, as generated, by turn name (empty for turn 0)."""
        if item.session_id is None:
            return {}
        return self._answers.get(item.session_id, {})

    def finished(self, request: Request) -> None:
        """`request` ended (finished or aborted): release its session's next turn, if any."""
        item = self._in_flight.pop(request.request_id, None)
        if item is None or item.session_id is None:
            return
        successor = self._next_turn.pop(item.request_id, None)
        if successor is None:  # the session's last turn: its answers are no longer needed
            self._answers.pop(item.session_id, None)
            return
        if request.finish_reason is FinishReason.ABORT or not request.output_token_ids:
            self._end_session(item.session_id, successor)
            return
        answers = self._answers.setdefault(item.session_id, {})
        answers[turn_name(item.session_id, item.turn)] = tuple(request.output_token_ids)
        send_s = request.last_consume_s + successor.think_s
        order = self._order[successor.request_id]
        heapq.heappush(self._released, (send_s, order, replace(successor, arrival_s=send_s)))

    def _end_session(self, session_id: str, first_unsent: WorkloadRequest) -> None:
        self._num_ended += 1
        self._answers.pop(session_id, None)
        item: WorkloadRequest | None = first_unsent
        while item is not None:
            self._num_cut += 1
            item = self._next_turn.pop(item.request_id, None)
