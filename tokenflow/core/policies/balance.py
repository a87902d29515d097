"""TokenFlow's buffer balancing (SPEC section 3, step 2): who is on the device next."""

from __future__ import annotations

import math
from operator import attrgetter

from tokenflow.core.policies.survey import Candidate


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
    return greedy(
        order,
        capacity_blocks,
        max_seqs,
        resume_budget_s,
        implicit_pinned_blocks,
        num_implicit_pinned,
    )


def greedy(
    order: list[Candidate],
    capacity_blocks: int,
    max_seqs: int,
    resume_budget_s: float,
    used_blocks: int = 0,
    num_taken: int = 0,
    resume_s: float = 0.0,
) -> list[Candidate]:
    """The balancer's walk over `order` (priority order) from a state: `used_blocks` of device
    memory and `num_taken` slots already taken, `resume_s` of the resume budget spent."""
    picked: list[Candidate] = []
    used = used_blocks
    for cand in order:
        if len(picked) + num_taken >= max_seqs:
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


_ARRIVAL_S = attrgetter("request.arrival_s")
_INDEX = attrgetter("request.arrival_index")
_RATE = attrgetter("request.rate_tps")


def priority_order(
    candidates: list[Candidate], by_arrival: bool, in_arrival_order: bool = False
) -> list[Candidate]:
    """`candidates` sorted by `_arrival_order` / `_utility_order`, in stable C-level sorts
    (least significant key first, so the result is the tuple key's order); the first two
    are skipped when the caller knows `candidates` are in (arrival_s, arrival_index) order."""
    if in_arrival_order:
        order = list(candidates)
    else:
        order = sorted(candidates, key=_INDEX)
        order.sort(key=_ARRIVAL_S)  # (arrival_s, arrival_index) order
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
