"""The paused members at a decision: their candidates, and how the chosen ones come back.

Both loops run over every paused member, or every resumed one, at each decision, so they are
written out (the same arithmetic as `survey._candidates` and `TokenFlowPolicy.
choose_resume_mode`, in the same order of operations: the same floats).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

from tokenflow.core.config import TokenFlowConfig
from tokenflow.core.policies.base import SchedulingView, Start
from tokenflow.core.policies.pricing import Costs, costs_of
from tokenflow.core.policies.survey import Candidate
from tokenflow.core.request import Request, RequestState

_PREEMPTED = RequestState.PREEMPTED


class _Fixed(NamedTuple):
    """What is fixed while a member is paused (see `PausedPrices`)."""

    key: tuple[int, int, int]  # (tokens, computed tokens, synced tokens)
    resume_s: float  # as `pricing.resume_time_s`
    footprint_blocks: int  # device blocks over the next interval
    recompute_s: float  # prefill of its tokens
    has_host_copy: bool
    load_blocks: int  # blocks a load moves (its computed tokens)
    by_flags: list[Candidate | None]  # ranked by arrival, (urgent + 2 * overdue) -> candidate


class PausedPrices:
    """What is fixed while a member is paused, kept across decisions: its resume time (the
    host copy and its tokens do not change while it waits), its recompute time and blocks to
    load (for its resume mode), its footprint over the next interval, and its candidates when
    ranked by arrival (no utility; one per urgent / overdue flag pair).  An entry is keyed by
    the member's tokens, computed tokens and host copy, so a change of any (a failed recompute
    start drops the copy) reprices it; the whole cache is keyed by the prefill fit, the link,
    the block size and the growth, so it empties when any of those moves."""

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


class PausedMembers:
    """The paused members of one decision, priced (`price_paused`): their resume times are
    known at once (they enter every pause threshold), their candidates once the decision
    knows how it ranks (`candidates`)."""

    def __init__(
        self,
        config: TokenFlowConfig,
        view: SchedulingView,
        fixed: list[_Fixed],
        entries: dict[str, _Fixed],
        costs: Costs,
    ) -> None:
        self.config, self.view, self.costs = config, view, costs
        self.fixed = fixed  # each member's entry, in the view's order (checked this decision)
        self._entries = entries  # by request id: every paused member's is `fixed`'s

    def __len__(self) -> int:
        return len(self.fixed)

    def candidates(self, by_arrival: bool) -> list[Candidate]:
        """A candidate per paused member, in the view's order: off the device, so neither
        pinned nor pausable, its utility less the switch cost (0.0 when ranked `by_arrival`,
        where no utility is used), its resume time (as `pricing.resume_time_s`)."""
        if by_arrival:
            return _arrival_candidates(self.config, self.view, self.fixed)
        return _utility_candidates(self.config, self.view, self.fixed)

    def fixed_of(self, request: Request) -> _Fixed | None:
        """`request`'s entry if it is a paused member of this decision."""
        if request.state is not _PREEMPTED:  # (a paused member is in the view's list)
            return None
        return self._entries.get(request.request_id)


def price_paused(
    config: TokenFlowConfig,
    view: SchedulingView,
    growth: int,
    prices: PausedPrices | None = None,
) -> PausedMembers:
    """The paused members priced in one pass, with the decision's `Costs` (`pricing.
    decision_costs`); what is fixed while a member waits comes from `prices` where it holds
    it."""
    kv = view.kv
    bs, synced_of = kv.block_size, kv.synced_tokens_of
    seconds_per_block = kv.config.block_bytes / view.config.link_bytes_per_s
    prefill_s = view.estimator.prefill_time_s
    entries = (prices or PausedPrices()).entries(view, growth)
    get = entries.get
    resume_of: dict[str, float] = {}
    fixed: list[_Fixed] = []
    keep = fixed.append
    for r in view.preempted:
        rid = r.request_id
        key = (r.num_tokens, r.num_computed_tokens, synced_of(rid, 0))
        entry = get(rid)
        if entry is None or entry.key != key:
            entry = entries[rid] = _fixed_prices(r, key, growth, bs, seconds_per_block, prefill_s)
        resume_of[rid] = entry.resume_s
        keep(entry)
    return PausedMembers(config, view, fixed, entries, costs_of(config, view, resume_of))


def paused_candidates(
    config: TokenFlowConfig,
    view: SchedulingView,
    growth: int,
    prices: PausedPrices | None = None,
    by_arrival: bool = False,
) -> tuple[Costs, list[Candidate]]:
    """The decision's `Costs` and a candidate per paused member (`PausedMembers.candidates`)."""
    paused = price_paused(config, view, growth, prices)
    return paused.costs, paused.candidates(by_arrival)


def _utility_candidates(
    config: TokenFlowConfig, view: SchedulingView, fixed: list[_Fixed]
) -> list[Candidate]:
    """Candidates with utilities (`survey._candidates`' arithmetic, same order: same floats)."""
    now, dt = view.now_s, config.schedule_interval_s
    inv_dt, inv_horizon = 1.0 / dt, 1.0 / config.value_horizon_s
    stall_dt, switch = config.stall_penalty * dt, config.switch_penalty * dt
    critical, max_stall = config.critical_slack_s, config.max_stall_s
    exp, new = math.exp, tuple.__new__  # (Candidate._make without its Python frame)
    out: list[Candidate] = []
    for r, entry in zip(view.preempted, fixed, strict=True):
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
        cand = (r, score, entry.footprint_blocks, False, False, False, urgent, overdue, 0, 0)
        out.append(new(Candidate, (*cand, entry.resume_s)))
    return out


def _arrival_candidates(
    config: TokenFlowConfig, view: SchedulingView, fixed: list[_Fixed]
) -> list[Candidate]:
    """Candidates ranked by arrival: kept with the prices, one per urgent / overdue pair (a
    paused member's dry time is fixed, so only the flags move with the clock)."""
    now = view.now_s
    critical, max_stall = config.critical_slack_s, config.max_stall_s
    new = tuple.__new__
    out: list[Candidate] = []
    add = out.append
    for r, entry in zip(view.preempted, fixed, strict=True):
        flags = 0
        if r.output_token_ids:
            slack = r.dry_s - now
            flags = (slack < critical) + 2 * (slack <= -max_stall)
        cand = entry.by_flags[flags]
        if cand is None:
            urgent, overdue = flags in (1, 3), flags >= 2
            cand = (r, 0.0, entry.footprint_blocks, False, False, False, urgent, overdue, 0, 0)
            cand = entry.by_flags[flags] = new(Candidate, (*cand, entry.resume_s))
        add(cand)
    return out


def _fixed_prices(
    r: Request,
    key: tuple[int, int, int],
    growth: int,
    bs: int,
    seconds_per_block: float,
    prefill_s: Callable[[int], float],
) -> _Fixed:
    """The fixed prices of a paused member whose (tokens, computed, synced tokens) are `key`."""
    num_tokens, computed, synced = key
    recompute = resume = prefill_s(num_tokens)
    has_copy = computed > 0 and synced >= computed  # kv.has_host_copy
    load_blocks = -(-computed // bs)
    if has_copy:  # load it?
        load = load_blocks * seconds_per_block
        resume = load if load < resume else resume
    remaining = r.sampling_params.max_tokens - len(r.output_token_ids)
    extra = growth if growth < remaining else remaining
    footprint = -(-(num_tokens + (extra if extra > 1 else 1)) // bs)
    return _Fixed(key, resume, footprint, recompute, has_copy, load_blocks, [None] * 4)


def queued_io_blocks(view: SchedulingView) -> int:
    """Blocks the link must move before a new load: the eviction queue and the blocks of
    loads in flight not yet copied (the KV manager keeps that count on events)."""
    return view.kv.num_evicting_blocks + view.kv.num_queued_load_blocks


def resume_starts(
    view: SchedulingView,
    requests: list[Request],
    queued_blocks: int,
    paused: PausedMembers | None = None,
) -> list[Start]:
    """How each of `requests` comes back: reload when t_IO (`queued_blocks` + its own load
    traffic) beats the recompute time, or when the load lands before the reader runs dry;
    recompute when the host holds no copy.  A paused member of this decision's `paused`
    takes its copy, blocks and recompute time from its kept prices (the same figures)."""
    kv, now = view.kv, view.now_s
    synced_of, bs = kv.synced_tokens_of, kv.block_size
    block_bytes, bytes_per_s = kv.config.block_bytes, view.config.link_bytes_per_s
    prefill_s = view.estimator.prefill_time_s
    fixed_of = paused.fixed_of if paused is not None and requests else _no_entry
    starts: list[Start] = []
    for r in requests:
        rid, entry = r.request_id, fixed_of(r)
        if entry is None:
            computed = r.num_computed_tokens
            if not (computed > 0 and synced_of(rid, 0) >= computed):  # kv.has_host_copy
                starts.append(Start(rid, False))
                continue
            blocks, recompute_s = -(-computed // bs), prefill_s(r.num_tokens)
        elif not entry.has_host_copy:
            starts.append(Start(rid, False))
            continue
        else:
            blocks, recompute_s = entry.load_blocks, entry.recompute_s
        io_s = (queued_blocks + blocks) * block_bytes / bytes_per_s
        slack = r.dry_s - now if r.output_token_ids else 0.0  # r.slack_s(now)
        in_time = io_s < slack
        starts.append(Start(rid, io_s <= recompute_s or in_time))  # (by_load)
    return starts


def _no_entry(request: Request) -> None:
    return None
