"""TokenFlow's buffer balancing (SPEC section 3, step 2): who is on the device next."""

from __future__ import annotations

import math
from itertools import accumulate, compress
from operator import attrgetter

from tokenflow.core.policies.residents import Residents
from tokenflow.core.policies.survey import Candidate
from tokenflow.core.request import Request


def balance(
    candidates: list[Candidate],
    capacity_blocks: int,
    max_seqs: int,
    by_arrival: bool = False,
    resume_budget_s: float = math.inf,
    num_implicit_pinned: int = 0,
    implicit_pinned_blocks: int = 0,
) -> list[Candidate]:
    """Who is on the device next: greedy in priority order while memory and max_seqs allow.

    Priority: pinned members, then streams stalled for `max_stall_s` or longer (the stall
    bound), then by utility (ties: see `_utility_order`) or, when the working set is over
    capacity (`by_arrival`), streams about to stall before the others, each group in arrival
    order (SPEC section 3: degrade to first come, first served).

    Resumes of paused members share `resume_budget_s` of link (or recompute) time per
    decision, so rotation never asks more of the link than it moves in an interval; a resume
    that does not fit waits for the next decision (the first one always fits).

    The paper follows the greedy pick with adjacent-swap local search.  In a list ordered by the
    same utility the search maximises, no swap can help: an unselected member that precedes a
    selected one was skipped for lack of room, and swapping it in needs more room still.  So
    there is none here.

    Members pinned for sure may be left out of `candidates` and given as a count and a
    footprint: they go first (all of them: they are resident, so within max_seqs) and are not
    returned.
    """
    if num_implicit_pinned > max_seqs:
        raise ValueError(f"{num_implicit_pinned} pinned members exceed max_seqs {max_seqs}")
    order = priority_order(candidates, by_arrival)
    picked: list[Candidate] = []
    used = implicit_pinned_blocks
    resume_s = 0.0
    for cand in order:
        if len(picked) + num_implicit_pinned >= max_seqs:
            break
        if not cand.is_pinned and used + cand.footprint_blocks > capacity_blocks:
            continue
        if cand.resume_s > 0.0:
            if resume_s > 0.0 and resume_s + cand.resume_s > resume_budget_s:
                continue
            resume_s += cand.resume_s
        picked.append(cand)
        used += cand.footprint_blocks
    return picked


def _utility_order(c: Candidate) -> tuple[bool, bool, float, bool, float, float, int]:
    """Ties on utility: started streams before newcomers; among started, the faster reader
    (SPEC), among newcomers the earlier arrival (so none is passed over indefinitely)."""
    r = c.request
    newcomer = not r.output_token_ids
    tie = r.arrival_s if newcomer else -r.rate_tps
    return (
        not c.is_pinned,
        not c.is_overdue,
        -c.utility,
        newcomer,
        tie,
        r.arrival_s,
        r.arrival_index,
    )


def _arrival_order(c: Candidate) -> tuple[bool, bool, bool, float, int]:
    r = c.request
    return (not c.is_pinned, not c.is_overdue, not c.is_urgent, r.arrival_s, r.arrival_index)


def balance_counted(
    paused: list[Candidate],
    newcomers: list[Candidate],
    residents: Residents,
    capacity_blocks: int,
    max_seqs: int,
    by_arrival: bool,
    resume_budget_s: float,
) -> tuple[list[Candidate], list[Request]] | None:
    """`balance` over the paused members and the newcomers (the others; each list in
    arrival order) and the pausable residents, counted, not listed: returns (the others
    picked, in priority order; the pausable residents left out), or None where the shortcut
    cannot vouch for the result.

    A pausable resident is not pinned and needs no resume, so the greedy takes every one it
    reaches while memory lasts; which others it takes depends only on the others before them
    (the resume budget).  So the first other the greedy does not reach (the slots are full)
    is found by bisection on the others, from how many residents rank before each; the
    residents left out are the last ones.  Memory is checked once, at the end: the residents'
    footprints (bounded from above), less those left out, plus the others picked; if that
    fits, no step of the greedy was short of memory (picks only add), else None.
    """
    num_pinned = residents.num_pinned
    if num_pinned > max_seqs:
        return None  # (`balance` raises; let it)
    order = priority_order(paused + newcomers, by_arrival)
    flags: list[bool] = []  # taken when reached: the resume budget only
    resume_s = 0.0
    for cand in order:
        fits = True
        if cand.resume_s > 0.0:
            fits = not (resume_s > 0.0 and resume_s + cand.resume_s > resume_budget_s)
            if fits:
                resume_s += cand.resume_s
        flags.append(fits)
    picks_before = list(accumulate(flags, initial=0))
    num_before = residents.num_before_by_arrival if by_arrival else residents.num_before
    limit = max_seqs - num_pinned
    lo, hi = 0, len(order)  # the first other not reached: the slots were filled before it
    while lo < hi:
        mid = (lo + hi) // 2
        if num_before(order[mid]) + picks_before[mid] >= limit:
            hi = mid
        else:
            lo = mid + 1
    picked = list(compress(order[:lo], flags))
    kept = max(min(residents.num_pausable, limit - len(picked)), 0)
    left_out = residents.last(residents.num_pausable - kept, by_arrival)
    change = sum(c.footprint_blocks for c in picked)
    change -= sum(map(residents.footprint_blocks, left_out))
    if residents.footprint_bound_blocks() + change <= capacity_blocks:
        return picked, left_out
    return None


_ARRIVAL = attrgetter("request.arrival_s", "request.arrival_index")
_RATE = attrgetter("request.rate_tps")


def priority_order(candidates: list[Candidate], by_arrival: bool) -> list[Candidate]:
    """`candidates` sorted by `_arrival_order` / `_utility_order`, in stable C-level sorts
    (least significant key first, so the result is the tuple key's order)."""
    order = sorted(candidates, key=_ARRIVAL)
    if by_arrival:
        order.sort(key=attrgetter("is_urgent"), reverse=True)
    else:
        # On equal utility: started streams by the faster reader (then arrival), then the
        # others (a paused stream without a token counts as a newcomer) by arrival.
        started = [c for c in order if c.request.output_token_ids]
        started.sort(key=_RATE, reverse=True)
        if len(started) < len(order):
            started += [c for c in order if not c.request.output_token_ids]
        order = started
        order.sort(key=attrgetter("utility"), reverse=True)
    order.sort(key=attrgetter("is_overdue"), reverse=True)
    order.sort(key=attrgetter("is_pinned"), reverse=True)
    return order
