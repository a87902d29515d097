"""Server-side pacing ("buffered response"): a reader's tokens sent at its rate, not as made.

Unpaced, each token goes out the moment the engine makes it, and the scheduler *assumes* that
its reader consumes the stream at rate r from the first token on (tokenflow/core/request.py):
token j at c_1 = g_1, c_j = max(g_j, c_(j-1) + 1/r), with g_j the time it was made.  A paced
stream is sent on that very schedule, so the tokens the scheduler counts as the reader's buffer
are the tokens held here: its model of the client is exact, not assumed, and a UI that shows
text as it comes shows it at reading speed instead of in bursts.

- The schedule is the core's own: each choice has a core `Request` as its reader model
  (`ReaderSchedule`), fed each token when it reaches the server, so the rule is not written
  twice.  Several choices (`n > 1`) are paced each on its own schedule.
- What is sent is the engine's delta (one token per step on the real engine): a delta goes out
  when its last token is due.  Deltas of one choice due together (the stream fell behind: its
  client read slowly) go out as one chunk (`GenerationDelta.followed_by`).
- The engine's deltas are taken as they come while earlier ones are held, so each is timed on
  arrival, not when the one before it was sent, and the engine never merges them.
- Waiting is an await on `PaceClock.sleep`: it holds back this answer only, never the engine
  loop or another stream, and a client that leaves cancels it (its requests are aborted as
  ever: responder.py).
- Everything held goes out at once, and pacing ends for the rest of the answer, when a choice
  fails or moves (its error or handoff follows the text before it) and when the server begins
  to drain (`flush_when`): a shutdown is not delayed by reading time.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import reduce

import anyio

from tokenflow.core.request import Request
from tokenflow.engine.client import GenerationDelta
from tokenflow.serving.choices import DeltaOrFailure
from tokenflow.serving.prepared import PreparedChoice

# One choice's delta or failure, by its position among the answer's choices.
PositionedDelta = tuple[int, DeltaOrFailure]


def _loop_time() -> float:
    return asyncio.get_running_loop().time()


@dataclass(frozen=True)
class PaceClock:
    """What a paced stream waits on: `now_s()` in seconds, and `sleep(seconds)` on that same
    clock.  The default is the running event loop's (what `asyncio.sleep` counts), so a test
    whose loop keeps virtual time has a fake clock here too."""

    now_s: Callable[[], float] = _loop_time
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep


class ReaderSchedule:
    """When each token of one choice is due at its reader: the core's reader model
    (`Request.append_token`), fed each token as it reaches the server."""

    def __init__(self, choice: PreparedChoice, rate_tps: float) -> None:
        self._reader = Request(
            request_id=choice.engine_request_id,
            prompt_token_ids=choice.prompt_token_ids,
            sampling_params=choice.sampling_params,
            rate_tps=rate_tps,
            arrival_s=0.0,  # not read: the reader starts at its first token
        )

    def due_s(self, delta: GenerationDelta, arrived_s: float) -> float:
        """When the reader takes the last token of `delta`, which reached the server at
        `arrived_s`; a delta without tokens (a finish alone) is due with the token before it."""
        for token_id in delta.token_ids:
            self._reader.append_token(token_id, arrived_s)
        return self._reader.last_consume_s if self._reader.output_token_ids else arrived_s


@dataclass(order=True)
class _Held:
    due_s: float
    seq: int  # arrival order: ties in due time keep it
    position: int = field(compare=False)
    item: DeltaOrFailure = field(compare=False)


class HeldDeltas:
    """The deltas a paced answer holds, in the order they are due (a failure after all)."""

    def __init__(self, schedules: Sequence[ReaderSchedule]) -> None:
        self._schedules = schedules
        self._heap: list[_Held] = []
        self._seqs = itertools.count()
        self.is_flushing = False  # everything goes out at once from now on

    @property
    def is_empty(self) -> bool:
        """Nothing is held."""
        return not self._heap

    @property
    def next_due_s(self) -> float:
        """When the first held delta is due (only while something is held)."""
        return self._heap[0].due_s

    def hold(self, position: int, item: DeltaOrFailure, arrived_s: float) -> None:
        """Hold what arrived at `arrived_s` until it is due; a failure (or a move) flushes."""
        if isinstance(item, BaseException):
            self.flush()
            due_s = float("inf")  # after every delta held
        else:
            due_s = self._schedules[position].due_s(item, arrived_s)
        heapq.heappush(self._heap, _Held(due_s, next(self._seqs), position, item))

    def flush(self) -> None:
        """Release everything held at once, and whatever arrives later as it comes."""
        self.is_flushing = True

    def release(self, now_s: float) -> list[PositionedDelta]:
        """What is due at `now_s`: each choice's due deltas as one, in due order."""
        due: list[_Held] = []
        while self._heap and (self.is_flushing or self._heap[0].due_s <= now_s):
            due.append(heapq.heappop(self._heap))
        joined: dict[int, list[DeltaOrFailure]] = {}
        failures: list[PositionedDelta] = []
        for held in due:
            if isinstance(held.item, BaseException):
                failures.append((held.position, held.item))
            else:
                joined.setdefault(held.position, []).append(held.item)
        deltas = [(p, reduce(GenerationDelta.followed_by, items)) for p, items in joined.items()]
        return [*deltas, *failures]


@dataclass(frozen=True)
class _Arrival:
    position: int
    item: DeltaOrFailure
    arrived_s: float


async def _next_arrival(
    deltas: AsyncIterator[PositionedDelta], clock: PaceClock
) -> _Arrival | None:
    """The next delta, timed as it arrives (None: the answer's deltas have ended)."""
    try:
        position, item = await anext(deltas)
    except StopAsyncIteration:
        return None
    return _Arrival(position, item, clock.now_s())


async def paced(
    deltas: AsyncGenerator[PositionedDelta],
    schedules: Sequence[ReaderSchedule],
    clock: PaceClock,
    flush_when: Callable[[], Awaitable[None]] | None = None,
) -> AsyncGenerator[PositionedDelta]:
    """`deltas` (choices.merged_deltas) released as their readers' `schedules` say; from the
    moment `flush_when()` returns (the server drains), all at once.  Closes `deltas` however
    the iteration ends."""
    held = HeldDeltas(schedules)
    arrival: asyncio.Future[_Arrival | None] | None = asyncio.ensure_future(
        _next_arrival(deltas, clock)
    )
    flush: asyncio.Future[None] | None = None
    if flush_when is not None:
        flush = asyncio.ensure_future(flush_when())
    try:
        while True:
            for released in held.release(clock.now_s()):
                yield released
            if arrival is None and held.is_empty:
                return
            await _wait(arrival, flush, None if held.is_empty else held.next_due_s, clock)
            if flush is not None and flush.done():
                held.flush()
                flush = None
            if arrival is not None and arrival.done():
                got = arrival.result()
                arrival = None
                if got is not None:
                    held.hold(got.position, got.item, got.arrived_s)
                    arrival = asyncio.ensure_future(_next_arrival(deltas, clock))
    finally:
        await _cancelled(arrival, flush)
        with anyio.CancelScope(shield=True):
            await deltas.aclose()


async def _wait(
    arrival: asyncio.Future[_Arrival | None] | None,
    flush: asyncio.Future[None] | None,
    due_s: float | None,
    clock: PaceClock,
) -> None:
    """Until the next delta arrives, the drain begins, or (if one is held) `due_s` comes."""
    if any(f is not None and f.done() for f in (arrival, flush)):
        return  # (no timer to start and cancel for a delta that is already here)
    timer = None
    if due_s is not None:
        timer = asyncio.ensure_future(clock.sleep(max(due_s - clock.now_s(), 0.0)))
    waits = [f for f in (arrival, flush, timer) if f is not None]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await _cancelled(timer)


async def _cancelled(*futures: asyncio.Future[object] | None) -> None:
    """Cancel the unfinished `futures` and let them unwind (even while being cancelled)."""
    pending = [f for f in futures if f is not None and not f.done()]
    for future in pending:
        future.cancel()
    if pending:
        with anyio.CancelScope(shield=True):
            await asyncio.wait(pending)  # does not raise
