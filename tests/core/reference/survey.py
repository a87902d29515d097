"""The reference survey: every member, one full candidate each, at every decision."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from tokenflow.core.config import TokenFlowConfig
from tokenflow.core.policies.base import SchedulingView
from tokenflow.core.policies.survey import Candidate, pause_threshold_s, resume_time_s
from tokenflow.core.request import Request, RequestState

_RUNNING = RequestState.RUNNING
_LOADING = RequestState.LOADING
_PREEMPTED = RequestState.PREEMPTED


@dataclass(frozen=True)
class Survey:
    candidates: list[Candidate]
    sum_rate_tps: float  # demand: reading rates of the surveyed members
    sum_tokens: int  # current sequence lengths
    sum_lifetime_blocks: int  # blocks at each member's mean lifetime footprint

    @property
    def num_pausable(self) -> int:
        return sum(1 for c in self.candidates if c.is_pausable)


def survey(
    config: TokenFlowConfig, view: SchedulingView, members: Iterable[Request], growth: int
) -> Survey:
    """One pass over `members`: candidates and the sums for capacity and W_static."""
    kv = view.kv
    bs = kv.block_size
    seconds_per_block = kv.config.block_bytes / view.config.link_bytes_per_s
    prefill_s = view.estimator.prefill_time_s
    resume_of = {
        r.request_id: resume_time_s(r, kv, seconds_per_block, prefill_s) for r in view.preempted
    }
    prices = _Prices(seconds_per_block, sum(resume_of.values()), resume_of)
    candidates: list[Candidate] = []
    sum_rate = 0.0
    sum_tokens = sum_lifetime = 0
    for r in members:
        candidates.append(_candidate(config, view, r, growth, prices))
        num_tokens = len(r.prompt_token_ids) + len(r.output_token_ids)
        sum_rate += r.rate_tps
        sum_tokens += num_tokens
        lifetime = len(r.prompt_token_ids) + r.sampling_params.max_tokens // 2
        sum_lifetime += -(-(num_tokens if num_tokens > lifetime else lifetime) // bs)
    return Survey(candidates, sum_rate, sum_tokens, sum_lifetime)


@dataclass(frozen=True)
class _Prices:
    seconds_per_block: float
    queue_s: float  # every paused member's resume time, summed
    resume_of: dict[str, float]  # paused member -> its resume time


def _candidate(
    config: TokenFlowConfig, view: SchedulingView, r: Request, growth: int, prices: _Prices
) -> Candidate:
    """One member's candidate, every field from its definition."""
    now, kv = view.now_s, view.kv
    bs = kv.block_size
    dt = config.schedule_interval_s
    num_out = len(r.output_token_ids)
    num_tokens = len(r.prompt_token_ids) + num_out
    buffered = max(r.last_consume_s - now, 0.0) if num_out else 0.0
    state = r.state
    resident = state is _RUNNING or state is _LOADING
    extra = min(growth, r.sampling_params.max_tokens - num_out)
    footprint = -(-(num_tokens + max(extra, 1)) // bs)
    decoding = state is _RUNNING and num_out > 0 and r.num_computed_tokens >= num_tokens - 1
    pausable = False
    reclaim = unsynced = 0
    min_threshold = pause_threshold_s(config, 0, 0, bs, prices.seconds_per_block, prices.queue_s)
    if decoding and buffered >= min_threshold:
        computed, synced = r.num_computed_tokens, kv.synced_tokens(r.request_id)
        unsynced = kv.blocks_for(computed) - synced // bs
        threshold = pause_threshold_s(
            config, computed, synced, bs, prices.seconds_per_block, prices.queue_s
        )
        # Pausing needs host room for the unsynced rest.
        pausable = unsynced <= kv.num_free_host_blocks and buffered >= threshold
        reclaim = kv.num_device_blocks_of(r.request_id) if pausable else 0
        unsynced = unsynced if pausable else 0
    resume = 0.0
    if state is _PREEMPTED:
        resume = prices.resume_of.get(r.request_id)
        if resume is None:  # a member surveyed outside the view's preempted list
            prefill_s = view.estimator.prefill_time_s
            resume = resume_time_s(r, kv, prices.seconds_per_block, prefill_s)
    # slack: seconds until the reader wants a token that does not exist (< 0: stalling)
    slack = r.last_consume_s + 1.0 / r.rate_tps - now if num_out else 0.0
    value = max(0.0, 1.0 - buffered * (1.0 / config.value_horizon_s))
    score = value * dt + config.stall_penalty * dt * math.exp(-buffered * (1.0 / dt))
    if not resident:
        score -= config.switch_penalty * dt
    urgent = num_out > 0 and slack < config.critical_slack_s
    overdue = num_out > 0 and slack <= -config.max_stall_s
    pinned = resident and not pausable
    head = (r, score, footprint, resident, pinned, pausable, urgent, overdue)
    return Candidate(*head, reclaim, unsynced, resume)
