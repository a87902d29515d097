"""TokenFlow's buffer balancing (SPEC section 3, step 2), written for speed.

A decision looks at every working-set member once.  `survey()` is that single pass: per member a
`Candidate` (utility, device footprint over the next interval, residency, pinning), plus the
sums the other phases need.  The paper's scheduler spends ~0.4 ms per decision; the loop below
keeps per-member work to plain arithmetic on attributes so Python stays near that.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from tests.core.reference.base import SchedulingView
from tokenflow.core.config import TokenFlowConfig
from tokenflow.core.kv_manager import KVTierManager
from tokenflow.core.request import Request, RequestState

_RUNNING = RequestState.RUNNING
_LOADING = RequestState.LOADING
_PREEMPTED = RequestState.PREEMPTED
PrefillTime = Callable[[int], float]


class Candidate(NamedTuple):
    """One working-set member as the balancer sees it."""

    request: Request
    utility: float
    footprint_blocks: int  # device blocks to hold it through the next interval
    is_resident: bool  # on the device now (running or loading)
    is_pinned: bool  # must stay: mid-prefill, loading, or unsafe to pause
    is_pausable: bool  # running, decoding, and its buffer covers a safe pause
    is_urgent: bool  # started, and its reader runs dry within the critical slack
    is_overdue: bool  # started, and its reader has stalled for max_stall_s or longer
    reclaim_blocks: int  # device blocks a pause frees (0 unless pausable)
    unsynced_blocks: int  # host blocks a pause takes for its unsynced tail (0 unless pausable)
    resume_s: float  # link or compute time to bring a paused member back (0 otherwise)


@dataclass(frozen=True)
class Survey:
    candidates: list[Candidate]
    sum_rate_tps: float  # demand: reading rates of the surveyed members
    sum_tokens: int  # current sequence lengths
    sum_lifetime_blocks: int  # blocks at each member's mean lifetime footprint

    @property
    def num_pausable(self) -> int:
        return sum(1 for c in self.candidates if c.is_pausable)


def utility(config: TokenFlowConfig, buffered_s: float, is_resident: bool) -> float:
    """U = v*dt + gamma*dt*exp(-T/dt) - switch cost, T the seconds of reading buffered.

    v, a token's value, falls linearly from 1 (empty buffer) to 0 at value_horizon_s; the
    exponential term is the stall penalty: highest for a nearly empty buffer (SPEC convention).
    """
    dt = config.schedule_interval_s
    value = max(0.0, 1.0 - buffered_s / config.value_horizon_s)
    switch = 0.0 if is_resident else config.switch_penalty * dt
    return value * dt + config.stall_penalty * dt * math.exp(-buffered_s / dt) - switch


def pause_threshold_s(
    config: TokenFlowConfig,
    computed_tokens: int,
    synced_tokens: int,
    block_size: int,
    seconds_per_block: float,
    resume_queue_s: float = 0.0,
) -> float:
    """Buffer (seconds of reading) a stream needs to be paused safely: mu times the round trip
    (evict its unsynced blocks, wait behind the resumes already queued, load all back, one
    interval) plus the critical slack, so that a paused stream is not critical the moment it
    stops (which would thrash).  The queue term makes pausing self-limiting: the more streams
    wait off the device, the larger a buffer must be before another joins them."""
    blocks = -(-computed_tokens // block_size)
    unsynced = blocks - synced_tokens // block_size
    round_trip_s = (
        (unsynced + blocks) * seconds_per_block + resume_queue_s + config.schedule_interval_s
    )
    return config.buffer_conservativeness * round_trip_s + config.critical_slack_s


def resume_time_s(
    request: Request, kv: KVTierManager, seconds_per_block: float, prefill_s: PrefillTime
) -> float:
    """Time to bring a paused stream back: loading its host copy, or recomputing if faster."""
    recompute = prefill_s(request.num_tokens)
    if kv.has_host_copy(request.request_id, request.num_computed_tokens):
        load = kv.blocks_for(request.num_computed_tokens) * seconds_per_block
        return load if load < recompute else recompute
    return recompute


def survey(
    config: TokenFlowConfig, view: SchedulingView, members: Iterable[Request], growth: int
) -> Survey:
    """One pass over `members`: candidates and the sums for capacity and W_static."""
    now = view.now_s
    kv = view.kv
    bs = kv.block_size
    seconds_per_block = kv.config.block_bytes / view.config.link_bytes_per_s
    dt = config.schedule_interval_s
    inv_dt, inv_horizon = 1.0 / dt, 1.0 / config.value_horizon_s
    stall_dt, switch = config.stall_penalty * dt, config.switch_penalty * dt
    exp = math.exp
    free_host = kv.num_free_host_blocks
    critical, max_stall = config.critical_slack_s, config.max_stall_s
    prefill_s = view.estimator.prefill_time_s
    resume_of = {
        r.request_id: resume_time_s(r, kv, seconds_per_block, prefill_s) for r in view.preempted
    }
    queue_s = sum(resume_of.values())
    min_threshold = pause_threshold_s(config, 0, 0, bs, seconds_per_block, queue_s)
    candidates: list[Candidate] = []
    sum_rate = 0.0
    sum_tokens = sum_lifetime = 0
    for r in members:
        num_out = len(r.output_token_ids)
        num_tokens = len(r.prompt_token_ids) + num_out
        max_tokens = r.sampling_params.max_tokens
        buffered = r.last_consume_s - now if num_out else 0.0
        if buffered < 0.0:
            buffered = 0.0
        state = r.state
        resident = state is _RUNNING or state is _LOADING
        remaining = max_tokens - num_out
        extra = growth if growth < remaining else remaining
        footprint = -(-(num_tokens + (extra if extra > 1 else 1)) // bs)
        decoding = state is _RUNNING and num_out > 0 and r.num_computed_tokens >= num_tokens - 1
        pausable = False
        reclaim = unsynced = 0
        if decoding and buffered >= min_threshold:
            computed, synced = r.num_computed_tokens, kv.synced_tokens(r.request_id)
            unsynced = kv.blocks_for(computed) - synced // bs
            # Pausing needs host room for the unsynced rest, or the KV would be dropped and
            # recomputed (a preemption then costs compute instead of link time).
            pausable = unsynced <= free_host and buffered >= (
                pause_threshold_s(config, computed, synced, bs, seconds_per_block, queue_s)
            )
            if pausable:
                reclaim = kv.num_device_blocks_of(r.request_id)
            else:
                unsynced = 0
        resume = 0.0
        if state is _PREEMPTED:
            resume = resume_of.get(r.request_id)
            if resume is None:  # a member surveyed outside the view's preempted list
                resume = resume_time_s(r, kv, seconds_per_block, prefill_s)
        # slack: seconds until the reader wants a token that does not exist (< 0: stalling)
        slack = r.last_consume_s + 1.0 / r.rate_tps - now if num_out else 0.0
        # utility(), inlined: this loop runs over every member at every decision
        value = 1.0 - buffered * inv_horizon
        score = (value if value > 0.0 else 0.0) * dt + stall_dt * exp(-buffered * inv_dt)
        if not resident:
            score -= switch
        candidates.append(
            Candidate(
                r,
                score,
                footprint,
                resident,
                resident and not pausable,
                pausable,
                num_out > 0 and slack < critical,
                num_out > 0 and slack <= -max_stall,
                reclaim,
                unsynced,
                resume,
            )
        )
        sum_rate += r.rate_tps
        sum_tokens += num_tokens
        lifetime = len(r.prompt_token_ids) + max_tokens // 2
        sum_lifetime += -(-(num_tokens if num_tokens > lifetime else lifetime) // bs)
    return Survey(candidates, sum_rate, sum_tokens, sum_lifetime)


def balance(
    candidates: list[Candidate],
    capacity_blocks: int,
    max_seqs: int,
    by_arrival: bool = False,
    resume_budget_s: float = math.inf,
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
    """
    order = sorted(candidates, key=_arrival_order if by_arrival else _utility_order)
    picked: list[Candidate] = []
    used = 0
    resume_s = 0.0
    for cand in order:
        if len(picked) >= max_seqs:
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
