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
