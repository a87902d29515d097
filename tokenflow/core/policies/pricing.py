"""What a TokenFlow decision prices its members with (SPEC section 3): utility, the pause
threshold, resume times, and the link and queue figures of one decision."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from tokenflow.core.config import TokenFlowConfig
from tokenflow.core.kv_manager import KVTierManager
from tokenflow.core.policies.base import SchedulingView
from tokenflow.core.request import Request

PrefillTime = Callable[[int], float]


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
    """Time to bring a paused stream back: loading its host copy, or recomputing if faster.

    (Runs for every paused stream at every decision: `kv.has_host_copy` and `kv.blocks_for`
    are written out.)"""
    recompute = prefill_s(request.num_tokens)
    computed = request.num_computed_tokens
    if computed > 0 and kv.synced_tokens(request.request_id) >= computed:  # a host copy
        load = -(-computed // kv.block_size) * seconds_per_block
        return load if load < recompute else recompute
    return recompute


@dataclass(frozen=True)
class Costs:
    """What a decision prices every member with: link, queue of resumes, pause threshold."""

    seconds_per_block: float
    prefill_s: PrefillTime
    resume_of: dict[str, float]  # paused member -> time to bring it back
    queue_s: float  # all of those, summed
    min_threshold_s: float  # the least buffer any pause needs


def decision_costs(config: TokenFlowConfig, view: SchedulingView) -> Costs:
    """The link, resume and threshold prices of one decision (one pass over the paused)."""
    kv = view.kv
    seconds_per_block = kv.config.block_bytes / view.config.link_bytes_per_s
    prefill_s = view.estimator.prefill_time_s
    resume_of: dict[str, float] = {}
    synced_of, bs = kv.synced_tokens, kv.block_size
    for r in view.preempted:  # resume_time_s(), written out: it runs for every paused stream
        recompute = prefill_s(r.num_tokens)
        computed = r.num_computed_tokens
        if computed > 0 and synced_of(r.request_id) >= computed:
            load = -(-computed // bs) * seconds_per_block
            recompute = load if load < recompute else recompute
        resume_of[r.request_id] = recompute
    return costs_of(config, view, resume_of)


def costs_of(config: TokenFlowConfig, view: SchedulingView, resume_of: dict[str, float]) -> Costs:
    """The decision's `Costs` given each paused member's resume time (in the view's order)."""
    kv = view.kv
    seconds_per_block = kv.config.block_bytes / view.config.link_bytes_per_s
    queue_s = sum(resume_of.values())
    min_threshold = pause_threshold_s(config, 0, 0, kv.block_size, seconds_per_block, queue_s)
    prefill_s = view.estimator.prefill_time_s
    return Costs(seconds_per_block, prefill_s, resume_of, queue_s, min_threshold)
