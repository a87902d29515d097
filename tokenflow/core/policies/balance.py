"""Buffer balancing (paper section 4.2, step 2): which members are on the device next.

Members are taken greedily in priority order while device memory and `max_seqs` (the paced
batch, `capacity.paced_batch`) allow, pinned members whatever the batch:

- pinned members first (resident and not safely pausable: they stay whatever else holds),
  except that decoding eager and batch streams yield, latest first, to a paused reader about to
  run dry that finds no room: a pause only delays their answers, a reader's stall shows;
- then streams stalled for `max_stall_s` or longer (the stall bound, beyond the paper: an
  estimate that was off must not leave one reader stalled indefinitely);
- then by utility, highest first; on equal utility started streams before newcomers, the
  faster reader first among started ones (the paper's tie rule), the earlier arrival among
  newcomers (so none is passed over indefinitely);
- or, when the working set is over capacity (`by_arrival`, section 4.3: degrade to first come,
  first served), streams about to stall before the others, each group by arrival.

A newcomer ranked after a paused reader about to run dry that found no room is not picked (it
would take that room).  Resumes of paused members share `resume_budget_s` of link (or
recompute) time per decision, so
rotation never asks more of the link than it moves in an interval; a resume that does not fit
waits for the next decision (the first one always fits).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenflow.core.policies.pricing import Member


def utility_order(m: Member) -> tuple:
    """The balancer's rank of `m` when the working set is schedulable (lowest first)."""
    r = m.request
    is_newcomer = not r.output_token_ids
    tie = r.arrival_s if is_newcomer else -r.rate_tps
    key = (not m.is_pinned, not m.is_overdue, not m.is_urgent, -m.utility, is_newcomer, tie)
    return (*key, r.sort_key)


def arrival_order(m: Member) -> tuple:
    """The balancer's rank of `m` when degraded to first come, first served."""
    r = m.request
    return (not m.is_pinned, not m.is_overdue, not m.is_urgent, r.sort_key)


def select(
    members: Sequence[Member],
    capacity_blocks: int,
    max_seqs: int,
    by_arrival: bool,
    resume_budget_s: float,
) -> list[Member]:
    """Who is on the device next, in priority order (see the module docstring)."""
    order = sorted(members, key=arrival_order if by_arrival else utility_order)
    picked: list[Member] = []
    used_blocks, resume_s = 0, 0.0
    newcomers_blocked = False
    for m in order:
        if len(picked) >= max_seqs and not m.is_pinned:
            continue  # (a pinned member stays: leaving it out would pause it)
        if m.resume_s > 0.0 and resume_s > 0.0 and resume_s + m.resume_s > resume_budget_s:
            continue
        if newcomers_blocked and not m.request.output_token_ids:
            continue
        shortfall = used_blocks + m.footprint_blocks - capacity_blocks
        if not m.is_pinned and shortfall > 0:
            yielding = _yielding_for(m, picked, shortfall)
            if not yielding:
                # A newcomer never takes the room a paused reader about to run dry waits for:
                # its prefill would pin that room for longer than the reader's buffer lasts.
                newcomers_blocked |= m.is_urgent and not m.is_resident
                continue
            picked = [p for p in picked if p not in yielding]
            used_blocks -= sum(p.footprint_blocks for p in yielding)
        resume_s += m.resume_s
        picked.append(m)
        used_blocks += m.footprint_blocks
    return picked


def _yielding_for(m: Member, picked: list[Member], shortfall_blocks: int) -> list[Member]:
    """Decoding eager and batch members, latest picked first, that free `shortfall_blocks` for
    `m` if it is a paused reader about to run dry; else none."""
    if not m.is_urgent or m.is_resident or not m.request.is_reader:
        return []
    yielding, freed = [], 0
    for p in reversed(picked):
        r = p.request
        if freed < shortfall_blocks and not r.is_reader and r.is_decoding:
            yielding.append(p)
            freed += p.footprint_blocks
    return yielding if freed >= shortfall_blocks else []
