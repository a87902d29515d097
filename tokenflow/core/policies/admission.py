"""Admission (paper section 4.1, step 1): which waiting requests join the working set.

Strictly in arrival order (no later request passes an earlier one), a waiting request joins
while the working set is below W_sched, its reader's rate fits in the capacity the members
leave, its prefill fits in this interval's prefill budget (so Gamma is measured as the batch
fills, not guessed), its prefill stalls no resident reader longer than `prefill_stall_s`
(beyond the paper: a prefill step stalls every reader with a shorter buffer, so a newcomer
waits while the residents' buffers grow (not for a reader the decodes feed no faster than
it reads: its buffer cannot), unless the queued prompts' prefill outlasts the
residents' reading: then a wait only idles the engine's bottleneck), and it finds free
device blocks or blocks that safe pauses free.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokenflow.core.config import TokenFlowConfig
from tokenflow.core.policies.base import SchedulingView
from tokenflow.core.policies.pricing import (
    Member,
    outlasts,
    prefill_added_stall_s,
    prefill_hold_s,
    prefill_outlasts_reading,
    prefill_price_s,
    unsynced_blocks,
)
from tokenflow.core.request import Request

DemandOf = Callable[[Request], float]  # tokens/s a request asks of the engine


def working_set_limit(config: TokenFlowConfig, view: SchedulingView, beta_blocks: float) -> int:
    """W_sched from W_static = floor(M / beta), smoothed toward the running count by lambda: M
    is the device tier plus `working_set_host_share` of it in the host tier (the share bounds
    how far rotation stretches the device), beta the members' mean lifetime footprint."""
    kv = view.kv.config
    host = min(config.working_set_host_share * kv.num_device_blocks, kv.num_host_blocks)
    w_static = max(1, int((kv.num_device_blocks + host) / beta_blocks))
    num_running = len(view.running)
    if num_running >= w_static:
        return w_static
    return math.ceil(w_static - config.working_set_smoothing * (w_static - num_running))


def refilled_prefill_budget_s(
    interval_s: float, left_s: float, *, queue_drained: bool, spare_share: float = 1.0
) -> float:
    """Prefill time newcomers may take, a token bucket: each decision adds `spare_share` of one
    interval to what the last left, up to two intervals (prompts over half an interval still
    start in pairs); a drained queue refills it to one, so a lone arrival starts at once, not
    at the last queue's pace.  The share is what the members' readers leave of the engine
    (`spare_engine_share`): a prefill's steps are taken from their decodes."""
    if queue_drained:
        return max(left_s, interval_s)
    return spare_share * interval_s + min(max(left_s, 0.0), interval_s)


def spare_engine_share(demand_tps: float, gamma_tps: float) -> float:
    """The share of the engine's time the members' readers leave: 1 - demand / Gamma (>= 0)."""
    return max(0.0, 1.0 - demand_tps / gamma_tps) if gamma_tps > 0 else 0.0


@dataclass(frozen=True)
class Admission:
    """What admission decided, and the budgets it leaves."""

    requests: list[Request]  # admitted, in arrival order
    rate_tps: float  # their demand, summed
    prefill_budget_s: float  # prefill time later newcomers may still take this interval


class _PauseQueue:
    """Pauses that free device memory for admission, least utility first (they lose least);
    each needs host room for its unsynced tail or frees nothing, and a buffer that outlasts the
    newcomers' prefill beyond a safe pause: a newcomer's blocks are pinned while it prefills, so
    a stream paused for it cannot come back sooner.  Sorted when first asked."""

    def __init__(self, members: Sequence[Member], view: SchedulingView) -> None:
        self._members = members
        self._pending: list[Member] | None = None  # still to take, the next one last
        self._host_room = view.kv.num_free_host_blocks
        self._view = view

    def free_blocks(self, shortfall_blocks: int, hold_s: float) -> int:
        """Take pauses until they free `shortfall_blocks` device blocks or none is left, each
        that `outlasts` `hold_s`, the newcomers' prefill (it only grows as they join, so a
        pause passed over is never taken later); returns the blocks freed
        (its device blocks, plus the reserve it no longer needs)."""
        if self._pending is None:
            pausable = [m for m in self._members if m.is_pausable]
            pausable.sort(key=lambda m: (m.utility, m.request.sort_key), reverse=True)
            self._pending = pausable
        kv, freed = self._view.kv, 0
        while freed < shortfall_blocks and self._pending:
            taken = self._pending.pop()
            if not outlasts(taken, hold_s):
                continue
            paused = taken.request
            tail_blocks = unsynced_blocks(kv, paused)
            if tail_blocks <= self._host_room:
                self._host_room -= tail_blocks
                freed += kv.num_private_device_blocks(paused.request_id)
                freed += self._view.reserve_blocks(paused)
        return freed


class _Returns:
    """The paused members by when their readers run dry, soonest first: those that run dry
    within a newcomers' prefill (plus `margin_s`) must find their room when it ends, so
    admission keeps it for them (their blocks pinned, a newcomer would strand them)."""

    def __init__(self, members: Sequence[Member], view: SchedulingView, margin_s: float) -> None:
        paused = [m.request for m in members if not m.is_resident]
        now_s = view.now_s
        self._pending = sorted(paused, key=lambda r: (r.slack_s(now_s), r.sort_key), reverse=True)
        self._view, self._margin_s = view, margin_s

    def blocks_due(self, hold_s: float) -> int:
        """Device blocks of the paused members not yet counted whose readers run dry within
        `hold_s` + the margin (it only grows, so each is counted once)."""
        view, blocks = self._view, 0
        deadline_s = view.now_s + hold_s + self._margin_s
        while self._pending and self._pending[-1].dry_s < deadline_s:
            blocks += view.start_blocks(self._pending.pop())
        return blocks


def admit(
    view: SchedulingView,
    members: Sequence[Member],
    limit: int,
    spare_rate_tps: float,
    demand_of: DemandOf,
    prefill_budget_s: float,
    margin_s: float = 0.0,
    prefill_stall_s: float = math.inf,
) -> Admission:
    """Waiting requests that join (see the module docstring).  An empty working set always
    takes the head, whatever its rate; the first newcomer always fits the prefill budget.
    Room is kept for the paused members that run dry before the newcomers' prefill ends
    (`margin_s`: how long before running dry a resume is needed)."""
    size = len(members)
    free = view.kv.num_free_device_blocks - view.num_reserved_blocks
    pauses = _PauseQueue(members, view)
    returns = _Returns(members, view, margin_s)
    admitted: list[Request] = []
    rate = tokens = 0
    for request in view.waiting:
        demand_tps = demand_of(request)
        if size >= limit or (size and rate + demand_tps > spare_rate_tps):
            break
        batch_tokens = tokens + view.start_tokens(request)
        if admitted and prefill_price_s(view, batch_tokens) > prefill_budget_s:
            break
        if stalls_residents(view, batch_tokens, prefill_stall_s):
            break
        hold_s = prefill_hold_s(view, batch_tokens)
        need = view.start_blocks(request)
        free -= returns.blocks_due(hold_s)
        if need > free:
            free += pauses.free_blocks(need - free, hold_s)
            if need > free:
                break
        free -= need + view.reserve_blocks(request)
        admitted.append(request)
        size, rate, tokens = size + 1, rate + demand_tps, batch_tokens
    unused_s = prefill_budget_s - prefill_price_s(view, tokens) if admitted else prefill_budget_s
    return Admission(admitted, rate, unused_s)


def stalls_residents(view: SchedulingView, num_new_tokens: int, prefill_stall_s: float) -> bool:
    """Whether newcomers whose prefill is `num_new_tokens` prompt tokens wait for the resident
    readers: it would stall some of them longer than `prefill_stall_s`
    (`pricing.prefill_added_stall_s`), unless the engine's prefill is the bottleneck
    (`pricing.prefill_outlasts_reading`), where a wait delays every prompt queued as long and
    the readers' buffers cannot cover the prefills to come."""
    if prefill_stall_s == math.inf:
        return False
    if prefill_added_stall_s(view, num_new_tokens) <= prefill_stall_s:
        return False
    return not prefill_outlasts_reading(view)


def waiting_within_budget(
    view: SchedulingView,
    spare_rate_tps: float,
    prefill_budget_s: float,
    demand_of: DemandOf,
    has_other_work: bool,
    prefill_stall_s: float = math.inf,
) -> list[Request]:
    """Between decisions: the head of the waiting queue that fits the rate and prefill budgets
    the last decision left (their prefills start together; the first fits any budget left, as
    the first newcomer of a decision fits any budget) and stalls no resident reader longer
    than `prefill_stall_s`.  An idle engine (no other work) always takes the head."""
    waiting: list[Request] = []
    tokens = 0
    for request in view.waiting:
        idle = not (waiting or has_other_work)
        start_tokens = view.start_tokens(request)
        prefill_s = prefill_price_s(view, tokens + start_tokens) if waiting else 0.0
        if not idle and (demand_of(request) > spare_rate_tps or prefill_s > prefill_budget_s):
            break
        if not idle and not waiting and prefill_budget_s <= 0.0:
            break
        if stalls_residents(view, tokens + start_tokens, prefill_stall_s):
            break
        spare_rate_tps -= demand_of(request)
        tokens += start_tokens
        waiting.append(request)
    return waiting
