"""Which cached block no request holds is reused first, when a tier needs a free block.

A tier's prefix cache (prefix_cache.py) keeps the KV of blocks whose last owner let go, until
allocation needs the memory.  Two orders (`KVConfig.prefix_retention`):

- ``lru``: least recently released first (vLLM's rule).
- ``reading``: by when the block is expected back, from the readers' clocks.  Each owner that
  lets go of a block says when it expects to need it again (`expected_return_s`): a reader who
  has the answer to read comes back once it is read plus a think time; a paused stream comes
  back when its reader runs dry; a request that states no reader and no session is not expected
  back.  A block keeps every pending expectation (the soonest `MAX_PENDING`); one that is
  shared again fulfils its soonest.  Its next use is its soonest expectation not yet overdue
  (overdue: more than `patience_s` past, the reader presumably gone).  Reuse takes first a block
  with no next use (abandoned; least recently released first), then the block whose next use is
  furthest away.  A system prompt that many conversations share holds many expectations, so it
  stays longest; a conversation's tail blocks, expected back no sooner than its first blocks,
  go before them.

A free block's rank is fixed when it is released; its next use only moves later as time passes
(expectations fall overdue), so the soonest ranks are checked at each reuse and ranked again
once overdue.  Heap entries of blocks taken or ranked again since are skipped when they surface.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterator, Mapping
from itertools import count

MAX_PENDING = 16  # expectations kept per block (the soonest): enough to rank a shared prompt
NOT_EXPECTED = -math.inf  # what an owner that will not come back expects
_GONE = (-1, NOT_EXPECTED)  # a block no longer free (its heap entries are stale)


def expected_return_s(read_done_s: float, expects_next_turn: bool, think_s: float) -> float:
    """When an owner that finished will need its blocks again: its reader's next message,
    `think_s` after reading the answer (done at `read_done_s`); never, unless it expects a next
    turn (a reader, or a client that named its session)."""
    return read_done_s + think_s if expects_next_turn else NOT_EXPECTED


class _CachedFree:
    """What both orders are as a set: the cached-free blocks (`_free`'s keys)."""

    _free: Mapping[int, object]

    def __len__(self) -> int:
        return len(self._free)

    def __contains__(self, block: int) -> bool:
        return block in self._free

    def __iter__(self) -> Iterator[int]:
        return iter(self._free)


class LruRetention(_CachedFree):
    """Cached-free blocks, reused least recently released first."""

    def __init__(self) -> None:
        self._free: dict[int, None] = {}  # insertion order = release order

    def expect(self, block: int, return_s: float) -> None:
        """An owner let go of `block` (ignored: only the release order counts)."""

    def release(self, block: int, now_s: float) -> None:
        """`block` has no owner left: it joins the cached-free blocks."""
        self._free[block] = None

    def take(self, block: int) -> None:
        """A cached-free `block` is shared again."""
        del self._free[block]

    def forget(self, block: int) -> None:
        """`block`'s key is gone (it was reused): drop what is kept of it."""

    def pick(self, now_s: float) -> int:
        """The cached-free block to reuse now (it leaves the set)."""
        block = next(iter(self._free))
        del self._free[block]
        return block


class ReadingRetention(_CachedFree):
    """Cached-free blocks, reused by the readers' expected next use (module docstring)."""

    def __init__(self, patience_s: float) -> None:
        self._patience_s = patience_s
        self._pending: dict[int, list[float]] = {}  # keyed block -> expectations, soonest first
        self._free: dict[int, tuple[int, float]] = {}  # cached-free -> (order, next use)
        self._abandoned: list[tuple[int, int]] = []  # (order, block): no next use
        self._latest: list[tuple[float, int, int]] = []  # (-next use, order, block)
        self._soonest: list[tuple[float, int, int]] = []  # (next use, order, block)
        self._order = count()

    def next_use_s(self, block: int, now_s: float) -> float:
        """The soonest expectation of `block` not overdue at `now_s` (overdue ones are
        dropped); `NOT_EXPECTED` when none is left."""
        pending = self._pending.get(block)
        if not pending:
            return NOT_EXPECTED
        del pending[: bisect.bisect_left(pending, now_s - self._patience_s)]
        return pending[0] if pending else NOT_EXPECTED

    def expect(self, block: int, return_s: float) -> None:
        """An owner let go of `block` and expects it back at `return_s`."""
        if return_s == NOT_EXPECTED:
            return
        pending = self._pending.setdefault(block, [])
        bisect.insort(pending, return_s)
        del pending[MAX_PENDING:]

    def release(self, block: int, now_s: float) -> None:
        """`block` has no owner left: it joins the cached-free blocks, ranked now."""
        self._push(block, self.next_use_s(block, now_s))

    def _push(self, block: int, next_use_s: float) -> None:
        order = next(self._order)
        self._free[block] = (order, next_use_s)
        self._enter(block, order, next_use_s)
        if len(self._latest) + len(self._abandoned) > 4 * len(self._free) + 1024:
            self._compact()

    def _enter(self, block: int, order: int, next_use_s: float) -> None:
        if next_use_s == NOT_EXPECTED:
            heapq.heappush(self._abandoned, (order, block))
        else:
            heapq.heappush(self._latest, (-next_use_s, order, block))
            heapq.heappush(self._soonest, (next_use_s, order, block))

    def _compact(self) -> None:
        """Rebuild the heaps from the free blocks alone (stale entries pile up as blocks are
        taken: a bound on memory, not on time)."""
        self._abandoned, self._latest, self._soonest = [], [], []
        for block, (order, next_use_s) in self._free.items():
            self._enter(block, order, next_use_s)

    def take(self, block: int) -> None:
        """A cached-free `block` is shared again: it fulfils its soonest expectation (its heap
        entries go stale and are skipped when they surface)."""
        del self._free[block]
        pending = self._pending.get(block)
        if pending:
            del pending[0]

    def forget(self, block: int) -> None:
        """`block`'s key is gone (it was reused): its expectations go with it."""
        self._pending.pop(block, None)

    def pick(self, now_s: float) -> int:
        """The cached-free block to reuse now (it leaves the set): an abandoned one, least
        recently released first, else the one expected back latest."""
        self._abandon_overdue(now_s)
        for heap in (self._abandoned, self._latest):
            while heap:
                entry = heapq.heappop(heap)
                order, block = entry[-2], entry[-1]
                if self._free.get(block, _GONE)[0] == order:
                    del self._free[block]
                    return block
        raise LookupError("no cached-free block to reuse")

    def _abandon_overdue(self, now_s: float) -> None:
        """Rank again the free blocks whose next use fell overdue (soonest first): each moves
        to its next expectation, or joins the abandoned."""
        cutoff, soonest, free = now_s - self._patience_s, self._soonest, self._free
        while soonest and soonest[0][0] < cutoff:
            _, order, block = heapq.heappop(soonest)
            if free.get(block, _GONE)[0] == order:
                self._push(block, self.next_use_s(block, now_s))


Retention = LruRetention | ReadingRetention


def make_retention(name: str, patience_s: float) -> Retention:
    """The retention order `name` ("reading" or "lru")."""
    return ReadingRetention(patience_s) if name == "reading" else LruRetention()
