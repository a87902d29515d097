"""The paused members at a decision: their candidates, and how the chosen ones come back.

The loops run over every paused member, or every resumed one, at each decision, so they are
written out (the same arithmetic as `survey._candidates` and `TokenFlowPolicy.
choose_resume_mode`, in the same order of operations: the same floats).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from tokenflow.core.config import TokenFlowConfig
from tokenflow.core.policies.base import SchedulingView, Start
from tokenflow.core.policies.pricing import Costs, costs_of
from tokenflow.core.policies.survey import Candidate
from tokenflow.core.request import Request

# What is fixed while a member is paused (see `PausedPrices`): (its key (tokens, computed
# tokens, synced tokens), its resume time as `pricing.resume_time_s`, its device blocks over
# the next interval, its candidates ranked by arrival by urgent + 2 * overdue, built when first
# asked for).  A plain tuple: the loops index it, and indexing an exact tuple is the fast path.
_Fixed = tuple[tuple[int, int, int], float, int, list[Candidate | None]]


class PausedPrices:
    """What is fixed while a member is paused, kept across decisions: its resume time (the
    host copy and its tokens do not change while it waits), its footprint over the next
    interval, and its candidates when ranked by arrival (no utility; one per urgent / overdue
    flag pair).  An entry is keyed by the member's tokens, computed tokens and host copy, so a
    change of any (a failed recompute start drops the copy) reprices it; the whole cache is
    keyed by the prefill fit, the link, the block size and the growth, so it empties when any
    of those moves."""

    def __init__(self) -> None:
        self._fit: tuple = ()
        self._entries: dict[str, _Fixed] = {}

    def entries(self, view: SchedulingView, growth: int) -> dict[str, _Fixed]:
        """The entries valid for this view's fit (emptied if the fit moved; pruned to the
        paused members when it holds many more)."""
        est, kv = view.estimator, view.kv
        fit = (est.prefill_step_s, est.prefill_token_s, kv.config.block_bytes, kv.block_size)
        fit += (view.config.link_bytes_per_s, growth)
        entries = self._entries
        if fit != self._fit or len(entries) > 2 * len(view.preempted) + 64:
            self._fit = fit
            entries.clear()
        return entries


def price_paused(
    config: TokenFlowConfig,
    view: SchedulingView,
    growth: int,
    prices: PausedPrices | None = None,
    by_arrival: bool = False,
) -> tuple[Costs, list[Candidate]]:
    """The paused members priced in one pass: the decision's `Costs` (`pricing.
    decision_costs`) and a candidate per member, off the device, so neither pinned nor
    pausable, with its utility less the switch cost (0.0 when ranked `by_arrival`, where no
    utility is read) and its resume time (as `pricing.resume_time_s`).  What is fixed while
    a member waits comes from `prices` where it holds it."""
    entries = (prices or PausedPrices()).entries(view, growth)
    resume_of: dict[str, float] = {}
    price = _price_by_arrival if by_arrival else _price_by_utility
    candidates = price(config, view, entries, resume_of, _fresh_prices(view, growth))
    return costs_of(config, view, resume_of), candidates


_Fresh = Callable[[Request, tuple[int, int, int]], _Fixed]


def _price_by_utility(
    config: TokenFlowConfig,
    view: SchedulingView,
    entries: dict[str, _Fixed],
    resume_of: dict[str, float],
    fresh: _Fresh,
) -> list[Candidate]:
    """Candidates with utilities (`survey._candidates`' arithmetic, same order: same floats);
    each member's resume time into `resume_of`, its entry checked (and renewed) in `entries`."""
    now, synced_of, dt = view.now_s, view.kv.synced_tokens_of, config.schedule_interval_s
    inv_dt, inv_horizon = 1.0 / dt, 1.0 / config.value_horizon_s
    stall_dt, switch = config.stall_penalty * dt, config.switch_penalty * dt
    critical, max_stall = config.critical_slack_s, config.max_stall_s
    exp, new, get = math.exp, tuple.__new__, entries.get  # (new: Candidate._make, C-level)
    out: list[Candidate] = []
    for r in view.preempted:
        rid = r.request_id
        key = (r.num_tokens, r.num_computed_tokens, synced_of(rid, 0))
        entry = get(rid)
        if entry is None or entry[0] != key:
            entry = entries[rid] = fresh(r, key)
        resume_of[rid] = resume = entry[1]
        if r.output_token_ids:
            buffered = r.last_consume_s - now
            if buffered < 0.0:
                buffered = 0.0
            slack = r.dry_s - now
            urgent, overdue = slack < critical, slack <= -max_stall
        else:
            buffered, urgent, overdue = 0.0, False, False
        value = 1.0 - buffered * inv_horizon
        score = (value if value > 0.0 else 0.0) * dt + stall_dt * exp(-buffered * inv_dt)
        score -= switch
        cand = (r, score, entry[2], False, False, False, urgent, overdue, 0, 0, resume)
        out.append(new(Candidate, cand))
    return out


def _price_by_arrival(
    config: TokenFlowConfig,
    view: SchedulingView,
    entries: dict[str, _Fixed],
    resume_of: dict[str, float],
    fresh: _Fresh,
) -> list[Candidate]:
    """Candidates ranked by arrival, kept with the prices, one per urgent / overdue pair (a
    paused member's dry time is fixed, so only the flags move with the clock)."""
    now, synced_of = view.now_s, view.kv.synced_tokens_of
    critical, max_stall = config.critical_slack_s, config.max_stall_s
    get = entries.get
    out: list[Candidate] = []
    for r in view.preempted:
        rid = r.request_id
        key = (r.num_tokens, r.num_computed_tokens, synced_of(rid, 0))
        entry = get(rid)
        if entry is None or entry[0] != key:
            entry = entries[rid] = fresh(r, key)
        resume_of[rid] = entry[1]
        flags = 0
        if r.output_token_ids:
            slack = r.dry_s - now
            flags = (slack < critical) + 2 * (slack <= -max_stall)
        cand = entry[3][flags]  # (entry.by_flags)
        if cand is None:
            cand = entry[3][flags] = _arrival_candidate(r, entry, flags)
        out.append(cand)
    return out


def _arrival_candidate(r: Request, entry: _Fixed, flags: int) -> Candidate:
    urgent, overdue = flags in (1, 3), flags >= 2
    _, resume, footprint, _ = entry
    cand = (r, 0.0, footprint, False, False, False, urgent, overdue, 0, 0, resume)
    return tuple.__new__(Candidate, cand)  # (Candidate._make, C-level)


def _fresh_prices(view: SchedulingView, growth: int) -> _Fresh:
    """What prices a paused member afresh, from its (tokens, computed, synced tokens): its
    resume time (`pricing.resume_time_s`, with the estimator's `prefill_time_s` written out:
    the same floats) and footprint, in one call (a fresh policy prices every paused member)."""
    kv, est = view.kv, view.estimator
    bs, seconds_per_block = kv.block_size, kv.config.block_bytes / view.config.link_bytes_per_s
    step_s, token_s = est.prefill_step_s, est.prefill_token_s

    def fresh(r: Request, key: tuple[int, int, int]) -> _Fixed:
        num_tokens, computed, synced = key
        resume = step_s + num_tokens * token_s if num_tokens > 0 else 0.0  # (prefill_time_s)
        if computed > 0 and synced >= computed:  # a host copy: load it?
            load = -(-computed // bs) * seconds_per_block
            resume = load if load < resume else resume
        remaining = r.sampling_params.max_tokens - len(r.output_token_ids)
        extra = growth if growth < remaining else remaining
        footprint = -(-(num_tokens + (extra if extra > 1 else 1)) // bs)
        return key, resume, footprint, [None] * 4

    return fresh


def queued_io_blocks(view: SchedulingView) -> int:
    """Blocks the link must move before a new load: the eviction queue and the blocks of
    loads in flight not yet copied (the KV manager keeps that count on events)."""
    return view.kv.num_evicting_blocks + view.kv.num_queued_load_blocks


def resume_starts(view: SchedulingView, requests: list[Request], queued_blocks: int) -> list[Start]:
    """How each of `requests` comes back: reload when t_IO (`queued_blocks` + its own load
    traffic) beats the recompute time, or when the load lands before the reader runs dry;
    recompute when the host holds no copy."""
    kv, now = view.kv, view.now_s
    synced_of, bs = kv.synced_tokens_of, kv.block_size
    block_bytes, bytes_per_s = kv.config.block_bytes, view.config.link_bytes_per_s
    prefill_s = view.estimator.prefill_time_s
    starts: list[Start] = []
    for r in requests:
        rid, computed = r.request_id, r.num_computed_tokens
        if not (computed > 0 and synced_of(rid, 0) >= computed):  # kv.has_host_copy
            starts.append(Start(rid, False))
            continue
        io_s = (queued_blocks + -(-computed // bs)) * block_bytes / bytes_per_s
        slack = r.dry_s - now if r.output_token_ids else 0.0  # r.slack_s(now)
        in_time = io_s < slack
        starts.append(Start(rid, io_s <= prefill_s(r.num_tokens) or in_time))  # (by_load)
    return starts
