"""Buffer balancing over the pausable residents counted, not listed (`balance` decides the same).

A pausable resident is not pinned and needs no resume, so the greedy takes every one it
reaches while memory lasts; which paused members and newcomers (the others) it takes depends
only on the others before them (the resume budget).  So the walk is known from counts: how
many pausable residents the balancer ranks before each other (`Residents.num_before`, a
bisection), and, where memory binds, prefix sums of the residents' footprints in rank order.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterable
from itertools import accumulate, compress
from operator import attrgetter, mul

from tokenflow.core.policies.balance import greedy, priority_order
from tokenflow.core.policies.residents import Residents
from tokenflow.core.policies.survey import Candidate
from tokenflow.core.request import Request

Result = tuple[list[Candidate], list[Request]]
_RESUME = attrgetter("resume_s")
_FOOTPRINT = attrgetter("footprint_blocks")
_UTILITY = attrgetter("utility")
_RATE = attrgetter("request.rate_tps")
_STARTED = attrgetter("request.output_token_ids")
_OVERDUE = attrgetter("is_overdue")


class _Others:
    """The others in the balancer's order and what the greedy takes of them while memory does
    not bind: whether each is taken when reached (the resume budget only), and before each
    the picks, the resume time and the device blocks taken."""

    def __init__(
        self, order: list[Candidate], budget_s: float, num_before: Callable, num_pausable: int
    ) -> None:
        self.order = order
        self.flags, self.resume_before = _resume_flags(map(_RESUME, order), budget_s)
        self.picks_before = list(accumulate(self.flags, initial=0))
        self._blocks_before: list[int] | None = None
        self._num_before, self._num_pausable = num_before, num_pausable
        self._counts: dict[int, int] = {}

    @property
    def blocks_before(self) -> list[int]:
        """Device blocks the picks before each other take (computed once, where asked)."""
        if self._blocks_before is None:
            footprints = map(mul, map(_FOOTPRINT, self.order), self.flags)  # 0 where not taken
            self._blocks_before = list(accumulate(footprints, initial=0))
        return self._blocks_before

    def residents_before(self, k: int) -> int:
        """Pausable residents ranked before other `k` (all of them past the last other)."""
        count = self._counts.get(k)
        if count is None:
            order = self.order
            count = self._num_before(order[k]) if k < len(order) else self._num_pausable
            self._counts[k] = count
        return count

    @staticmethod
    def first(hi: int, test: Callable[[int], bool]) -> int:
        """The first k in [0, hi) with `test(k)` (false, then true along k), else hi."""
        lo = 0
        while lo < hi:
            mid = (lo + hi) // 2
            if test(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo


def _resume_flags(costs: Iterable[float], budget_s: float) -> tuple[list[bool], list[float]]:
    """(Whether the greedy takes each other when reached, the resume time spent before each
    and after the last) for resume times `costs` in order: a resume is taken while it fits
    `budget_s` with those taken before (the first always)."""
    resume_s = 0.0
    flags: list[bool] = []
    resume_before = [resume_s]
    take, spent = flags.append, resume_before.append
    for cost in costs:
        if cost > 0.0:
            if resume_s > 0.0 and resume_s + cost > budget_s:
                take(False)
                spent(resume_s)
                continue
            resume_s += cost
        take(True)
        spent(resume_s)
    return flags, resume_before


def balance_counted(
    paused: list[Candidate],
    newcomers: list[Candidate],
    residents: Residents,
    capacity_blocks: int,
    max_seqs: int,
    by_arrival: bool,
    resume_budget_s: float,
) -> Result | None:
    """`balance` over the others (paused members and newcomers, each list in arrival order)
    and the pausable residents, counted: returns (the others picked, in priority order; the
    pausable residents left out), or None where the shortcut cannot vouch for the result.

    The first other the greedy does not reach (the slots are full) is found by bisection on
    the others (one resident's utility per probe: `Residents.has_before`); the residents left
    out are the last ones.  Memory is checked against the residents' footprints bounded from
    above, less those left out (bounded from below first, then exact), plus the others
    picked: if that fits, no step of the greedy was short of memory (picks only add); else
    `memory_walk` finds where memory binds.
    """
    num_pinned = residents.num_pinned
    if num_pinned > max_seqs:
        return None  # (`balance` raises; let it)
    num_before = residents.num_before_by_arrival if by_arrival else residents.num_before
    order = _others_order(paused, newcomers, by_arrival)
    others = _Others(order, resume_budget_s, num_before, residents.num_pausable)
    limit = max_seqs - num_pinned
    lo = _first_not_reached(others, residents, limit, by_arrival)
    picked = list(compress(order[:lo], others.flags))
    kept = max(min(residents.num_pausable, limit - len(picked)), 0)
    left_out = residents.last(residents.num_pausable - kept, by_arrival)
    bound = residents.footprint_bound_blocks() + sum(map(_FOOTPRINT, picked))
    if bound - residents.footprint_floor(left_out) <= capacity_blocks or (
        bound - residents.footprint_total(left_out) <= capacity_blocks
    ):
        return picked, left_out
    return memory_walk(
        by_arrival,
        others,
        residents,
        capacity_blocks,
        max_seqs,
        resume_budget_s,
        (picked, left_out),
    )


def _first_not_reached(others: _Others, residents: Residents, limit: int, by_arrival: bool) -> int:
    """The first other the greedy does not reach: `limit` slots were filled before it."""
    order, picks_before = others.order, others.picks_before
    if by_arrival:
        return others.first(
            len(order), lambda k: others.residents_before(k) + picks_before[k] >= limit
        )
    has_before = residents.has_before  # (one resident's utility per probe, not a count)
    return others.first(len(order), lambda k: has_before(order[k], limit - picks_before[k]))


def _others_order(
    paused: list[Candidate], newcomers: list[Candidate], by_arrival: bool
) -> list[Candidate]:
    """`priority_order` of the others (each list in arrival order).  Ranked by utility, where
    every paused member has a token and no newcomer has one, in fewer sorts: on equal
    utility the started go first, by the faster reader, then arrival, and the newcomers by
    arrival, so the paused members by the faster reader, then the newcomers, sorted by
    utility (stable sorts keep the ties' order), then by the overdue flag where any is set.
    The others are off the device, so none is pinned (`num_before` assumes it too)."""
    if by_arrival or not all(map(_STARTED, paused)) or any(map(_STARTED, newcomers)):
        return priority_order(paused + newcomers, by_arrival, _in_arrival_order(paused, newcomers))
    order = sorted(paused, key=_RATE, reverse=True)
    order += newcomers
    order.sort(key=_UTILITY, reverse=True)
    if any(map(_OVERDUE, order)):
        order.sort(key=_OVERDUE, reverse=True)
    return order  # (off the device, none is pinned)


def _in_arrival_order(paused: list[Candidate], newcomers: list[Candidate]) -> bool:
    """Each list is in arrival order (the view's and the waiting queue's): so is the two
    together when the last paused member arrived before the first newcomer."""
    if not (paused and newcomers):
        return True
    return paused[-1].request.sort_key < newcomers[0].request.sort_key


def memory_walk(
    by_arrival: bool,
    others: _Others,
    residents: Residents,
    capacity_blocks: int,
    max_seqs: int,
    resume_budget_s: float,
    slot_result: Result,
) -> Result:
    """The greedy in utility order where memory may bind: bulk up to the first miss, exact after.

    The pausable residents are ranked by buffer (smallest first: utility falls along it), or
    by arrival (degraded), with prefix sums of their footprints; the first item the greedy
    cannot fit is found by bisection (on the others, then on the sums between two of them).
    Before it everything reached is taken.  Buffer order is the balancer's order except
    within a run of equal utility, so the walk goes back to the start of that run (arrival
    order has no ties) and the greedy runs, exactly, from there over candidates for the
    rest; if the slots fill before that point, the counted result (`slot_result`) stands.
    """
    ranked = residents.arrival_order() if by_arrival else residents.pausable()[::-1]
    sums = residents.footprint_sums(ranked)
    room = capacity_blocks - residents.pinned_footprint_blocks()
    start = _first_miss(others, sums, room)
    if start is None:
        return slot_result  # memory never binds
    utility = residents.utility
    while (
        not by_arrival
        and 0 < start < len(ranked)
        and utility(ranked[start - 1]) == utility(ranked[start])
    ):
        start -= 1
    before, blocks_before = others.residents_before, others.blocks_before
    split = others.first(len(others.order), lambda k: before(k) >= start)
    num_taken = residents.num_pinned + start + others.picks_before[split]
    if num_taken >= max_seqs:
        return slot_result  # the slots fill before memory binds
    used = capacity_blocks - room + sums[start] + blocks_before[split]
    tail = ranked[start:]
    order = priority_order(residents.candidates(tail) + others.order[split:], by_arrival)
    resume_s = others.resume_before[split]
    picked = greedy(order, capacity_blocks, max_seqs, resume_budget_s, used, num_taken, resume_s)
    kept = {id(c.request) for c in picked if c.is_resident}
    taken = list(compress(others.order[:split], others.flags))
    return taken + [c for c in picked if not c.is_resident], [r for r in tail if id(r) not in kept]


def _first_miss(others: _Others, sums: list[int], room: int) -> int | None:
    """Where the walk first finds no room (memory not binding before): the residents ranked
    before that item (a resident's index, or the count before an other), or None if nowhere.
    `sums` are the ranked residents' footprint prefix sums; `room` the blocks for them and
    the others."""
    before, blocks_before = others.residents_before, others.blocks_before
    num_others = len(others.order)
    # The first other through which the walk is past the room ...
    k = others.first(num_others, lambda k: sums[before(k)] + blocks_before[k + 1] > room)
    lo, hi = (before(k - 1) if k else 0), before(k)
    # ... and the first resident before it past the room, else that other itself.
    miss = bisect_right(sums, room - blocks_before[k], lo + 1, hi + 1) - 1
    if miss >= hi and k == num_others:
        return None
    return min(miss, hi)
