"""What TokenFlow prices its working set with (paper section 4): each formula once, and the
`Member` record that carries them for one stream to every phase."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenflow.core.config import TokenFlowConfig
from tokenflow.core.estimator import StepTimeEstimator
from tokenflow.core.policies.base import KVState, SchedulingView
from tokenflow.core.request import Request, RequestState

_RUNNING, _LOADING, _PREEMPTED = RequestState.RUNNING, RequestState.LOADING, RequestState.PREEMPTED


def utility(config: TokenFlowConfig, buffered_s: float, is_resident: bool) -> float:
    """U = v*dt + gamma*dt*exp(-T/dt) - switch cost, T the seconds of reading buffered.

    v, a token's value, falls linearly from 1 (empty buffer) to 0 at `value_horizon_s`; the
    exponential is the stall penalty, highest for a nearly empty buffer (the paper's phi(b)
    with the buffer normalised to one interval of reading); a stream off the device pays
    `switch_penalty` to come back, so rotation needs a real gain."""
    dt = config.schedule_interval_s
    value = 1.0 - buffered_s / config.value_horizon_s
    u = (value if value > 0.0 else 0.0) * dt + config.stall_penalty * dt * math.exp(
        -buffered_s / dt
    )
    return u if is_resident else u - config.switch_penalty * dt


def lifetime_blocks(request: Request, block_size: int) -> int:
    """beta's term: blocks at max(tokens now, prompt + max_tokens // 2), a stream's mean
    footprint over its life (output lengths are unknown; half the budget is the guess)."""
    now, lifetime = request.num_tokens, request.lifetime_tokens
    return -(-(now if now > lifetime else lifetime) // block_size)


def interval_footprint_blocks(request: Request, growth_tokens: int, block_size: int) -> int:
    """Device blocks that hold a stream through the next interval: its tokens plus what it
    generates meanwhile (at most its remaining budget, at least one token)."""
    remaining = request.num_remaining_output_tokens
    ahead = growth_tokens if growth_tokens < remaining else remaining
    return -(-(request.num_tokens + (ahead if ahead > 1 else 1)) // block_size)


def pause_threshold_s(
    config: TokenFlowConfig,
    num_blocks: int,
    num_unsynced_blocks: int,
    seconds_per_block: float,
    resume_queue_s: float,
) -> float:
    """Buffer (seconds of reading) a stream needs to be paused safely: mu times the round trip
    (evict its unsynced blocks, wait behind the resumes already queued, load all back, one
    interval) plus the critical slack, so that a paused stream is not critical the moment it
    stops (it would thrash).  The queue term makes pausing self-limiting: the more streams
    wait off the device, the larger a buffer must be before another joins them."""
    link_s = (num_unsynced_blocks + num_blocks) * seconds_per_block
    round_trip_s = link_s + resume_queue_s + config.schedule_interval_s
    return config.buffer_conservativeness * round_trip_s + config.critical_slack_s


def recompute_price_s(estimator: StepTimeEstimator, request: Request) -> float:
    """Time to prefill a stream's prompt and outputs again."""
    return estimator.prefill_time_s(request.num_tokens)


def resume_price_s(
    request: Request, kv: KVState, seconds_per_block: float, estimator: StepTimeEstimator
) -> float:
    """Time to bring a paused stream back: loading its host copy, or recomputing if faster."""
    recompute_s, computed = recompute_price_s(estimator, request), request.num_computed_tokens
    if not kv.has_host_copy(request.request_id, computed):
        return recompute_s
    return min(kv.blocks_for(computed) * seconds_per_block, recompute_s)


def prefill_price_s(view: SchedulingView, num_tokens: int) -> float:
    """Time to prefill `num_tokens` prompt tokens started together (steps of max_prefill_tokens)."""
    return view.estimator.prefill_batch_time_s(num_tokens, view.config.max_prefill_tokens)


@dataclass(frozen=True)
class _Arrivals:
    """When a resident decoding through prefill steps gets its next tokens: one at the end of
    each of `num_steps` steps of `step_s` (decodes and a chunk), then one each `decode_s`."""

    num_steps: int
    step_s: float
    decode_s: float

    @property
    def hold_s(self) -> float:
        return self.num_steps * self.step_s

    def at(self, k: int) -> float:
        """When the k-th token (k >= 1) arrives."""
        if k <= self.num_steps:
            return k * self.step_s
        return self.hold_s + (k - self.num_steps) * self.decode_s

    def stall_s(self, slack_s: float, r: Request) -> float:
        """The stall reader `r`, `slack_s` from running dry, suffers until its last token: its
        k-th token is late by at(k) - slack - (k - 1) / r, largest at a breakpoint (the first,
        the last step's, the last it needs) since at(k) is piecewise linear."""
        needed = max(r.num_remaining_output_tokens, 1)
        ks = {1, min(self.num_steps, needed), needed}
        late_s = max(self.at(k) - slack_s - (k - 1) / r.rate_tps for k in ks if k >= 1)
        return late_s if late_s > 0.0 else 0.0


def decode_step_s(view: SchedulingView) -> float:
    """The predicted decode step over the streams on the device now (one at least)."""
    return view.estimator.decode_time_s(len(view.running) or 1)


def _arrivals(view: SchedulingView, num_new_tokens: int) -> _Arrivals:
    """Token arrivals while the residents' prompt tokens still to compute and `num_new_tokens`
    more are prefilled: steps of the recent prefill chunk (at most max_prefill_tokens), each
    with the residents' decodes."""
    est = view.estimator
    ahead = sum(r.num_tokens - r.num_computed_tokens for r in view.running if r.is_prefilling)
    chunk = max(1, int(min(est.prefill_step_tokens or math.inf, view.config.max_prefill_tokens)))
    tokens = ahead + num_new_tokens
    decode_s = decode_step_s(view)
    if tokens <= 0:
        return _Arrivals(0, decode_s, decode_s)
    num_steps = -(-tokens // chunk)
    hold_s = num_steps * decode_s + est.prefill_batch_time_s(tokens, chunk)
    return _Arrivals(num_steps, hold_s / num_steps, decode_s)


def prefill_hold_s(view: SchedulingView, num_new_tokens: int) -> float:
    """Wall time until `num_new_tokens` more prompt tokens are prefilled behind the residents'
    prompt tokens still to compute: steps of the recent prefill chunk (at most
    max_prefill_tokens), each with the residents' decodes.  (An engine that budgets its steps
    chunks every prompt; pricing the tokens as one prefill would miss those steps.)"""
    if num_new_tokens <= 0:
        return 0.0
    return _arrivals(view, num_new_tokens).hold_s


def _exposed_readers(view: SchedulingView) -> list[Request]:
    """The residents a prefill step can stall: started readers on the device that the decodes
    feed faster than they read.  A reader fed no faster than it reads grows no buffer while
    newcomers wait; holding them for it would only wait until it finishes (docs/design.md)."""
    decode_s = decode_step_s(view)
    return [
        r
        for r in view.running
        if r.is_reader and r.output_token_ids and r.rate_tps * decode_s < 1.0
    ]


def prefill_added_stall_s(view: SchedulingView, num_new_tokens: int) -> float:
    """The longest stall that prefilling `num_new_tokens` more prompt tokens adds to an exposed
    reader (`_exposed_readers`): its stall until its last token with them (`_Arrivals.stall_s`)
    less its stall with only the prompts already prefilling (one an earlier prefill stalls,
    stalls either way; only the difference counts).  0 when none is exposed."""
    if num_new_tokens <= 0:
        return 0.0
    with_new, without = _arrivals(view, num_new_tokens), _arrivals(view, 0)
    now_s, worst_s = view.now_s, 0.0
    for r in _exposed_readers(view):
        slack_s = r.slack_s(now_s)
        added_s = with_new.stall_s(slack_s, r) - without.stall_s(slack_s, r)
        worst_s = max(worst_s, added_s)
    return worst_s


def prefill_outlasts_reading(view: SchedulingView) -> bool:
    """Whether the waiting prompts take longer to prefill than any exposed reader
    (`_exposed_readers`) has left to read (its remaining output at its rate, after its buffer):
    timed as the engine runs them (`prefill_hold_s`: chunks of the recent step, each with the
    residents' decodes, behind the prompts already prefilling), not as one batch's compute.
    Then the engine's prefill is its bottleneck: a newcomer held for the readers idles it and
    delays every prompt queued behind as long, while the prefills still to come would outlast
    the readers' buffers anyway."""
    now_s = view.now_s
    reading_s = max(
        (
            r.num_remaining_output_tokens / r.rate_tps + max(r.slack_s(now_s), 0.0)
            for r in _exposed_readers(view)
        ),
        default=0.0,
    )
    queued_tokens = sum(view.start_tokens(r) for r in view.waiting)
    return prefill_hold_s(view, queued_tokens) > reading_s


@dataclass(frozen=True)
class Prices:
    """What a decision prices every member with: the link, and the paused members' resumes."""

    seconds_per_block: float
    resume_s: dict[str, float]  # paused member -> time to bring it back
    resume_queue_s: float  # all of those, summed: the queue a new pause waits behind
    least_pause_threshold_s: float  # `pause_threshold_s` of a stream with no blocks

    @classmethod
    def at(cls, config: TokenFlowConfig, view: SchedulingView) -> Prices:
        """The prices in `view`'s state."""
        per_block_s = view.seconds_per_block
        resume_s = {
            r.request_id: resume_price_s(r, view.kv, per_block_s, view.estimator)
            for r in view.preempted
        }
        queue_s = sum(resume_s.values())
        least_s = pause_threshold_s(
            config,
            num_blocks=0,
            num_unsynced_blocks=0,
            seconds_per_block=per_block_s,
            resume_queue_s=queue_s,
        )
        return cls(per_block_s, resume_s, queue_s, least_s)


@dataclass(slots=True)
class Member:
    """One working-set member as the balancer and admission see it (read-only once built)."""

    request: Request
    utility: float
    # Device blocks to hold it through the next interval, a shared block at its share
    # (`SchedulingView.shared_blocks`)
    footprint_blocks: float
    is_resident: bool  # on the device now (running or loading)
    # Seconds of reading buffered beyond a safe pause (`pause_margin_s`); -inf: not pausable
    pause_margin_s: float
    is_urgent: bool  # started, and its reader runs dry within the critical slack
    is_overdue: bool  # started, and its reader has stalled for max_stall_s or longer
    resume_s: float  # time to bring a paused member back (0 unless paused)

    @property
    def is_pausable(self) -> bool:
        """Decoding, and its buffer covers a safe pause (with host room)."""
        return self.pause_margin_s >= 0.0

    @property
    def is_pinned(self) -> bool:
        """Must stay on the device: resident and not safely pausable (prefill, load, buffer)."""
        return self.is_resident and not self.is_pausable


def unsynced_blocks(kv: KVState, r: Request) -> int:
    """Blocks of a stream's computed KV with no host copy yet (what its eviction copies)."""
    return kv.blocks_for(r.num_computed_tokens) - kv.synced_tokens(r.request_id) // kv.block_size


def pause_margin_s(
    config: TokenFlowConfig, view: SchedulingView, r: Request, prices: Prices
) -> float:
    """Seconds of reading a running, decoding stream has buffered beyond `pause_threshold_s`;
    -inf when it does not decode, its buffer is short of the threshold, or its unsynced tail
    finds no host room (the pause would drop its KV and cost a recompute)."""
    buffered_s = r.buffered_s(view.now_s)
    if not r.is_decoding or buffered_s < prices.least_pause_threshold_s:
        return -math.inf  # (the threshold only grows with the stream's blocks)
    kv = view.kv
    blocks, unsynced = kv.blocks_for(r.num_computed_tokens), unsynced_blocks(kv, r)
    threshold_s = pause_threshold_s(
        config, blocks, unsynced, prices.seconds_per_block, prices.resume_queue_s
    )
    if unsynced > kv.num_free_host_blocks or buffered_s < threshold_s:
        return -math.inf
    return buffered_s - threshold_s


def is_pausable(config: TokenFlowConfig, view: SchedulingView, r: Request, prices: Prices) -> bool:
    """Whether `r` may be paused safely: a `pause_margin_s` of at least zero."""
    return pause_margin_s(config, view, r, prices) >= 0.0


def outlasts(m: Member, hold_s: float) -> bool:
    """Whether `m` may be paused for newcomers whose prefill ends in `hold_s`
    (`prefill_hold_s`): its buffer covers a safe pause plus that wait (their blocks are pinned
    while they prefill, so a stream paused for them cannot come back sooner)."""
    return m.pause_margin_s >= hold_s


def member(
    config: TokenFlowConfig, view: SchedulingView, r: Request, growth: int, prices: Prices
) -> Member:
    """The member record of `r` at this decision."""
    now, state = view.now_s, r.state
    resident = state is _RUNNING or state is _LOADING
    started = bool(r.output_token_ids)
    slack_s, buffered_s = r.slack_s(now), r.buffered_s(now)
    return Member(
        request=r,
        utility=utility(config, buffered_s, resident),
        footprint_blocks=interval_footprint_blocks(r, growth, view.kv.block_size)
        - view.shared_blocks(r),
        is_resident=resident,
        pause_margin_s=pause_margin_s(config, view, r, prices),
        is_urgent=started and slack_s < config.critical_slack_s,
        is_overdue=started and slack_s <= -config.max_stall_s,
        resume_s=prices.resume_s[r.request_id] if state is _PREEMPTED else 0.0,
    )
