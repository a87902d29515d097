"""A snapshot of every unfinished stream and of the scheduler, for `GET /v1/tokenflow/streams`.

Taken on the engine thread between two steps (`AsyncEngine.streams()` posts a command to the
loop and awaits the reply), from what the scheduler already keeps: nothing is computed while
nobody asks, O(streams) when someone does.  The one thing watched every step is `MoveWatch`:
four counters compared, to remember the latest step that moved streams.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace

from tokenflow.core.policies.base import Policy
from tokenflow.core.policies.capacity import measure_capacity
from tokenflow.core.request import Consumption, Request, RequestState
from tokenflow.core.scheduler import Scheduler

# What the endpoint calls each state: a preempted stream is "paused" (off the device).
STATE_NAMES = {
    RequestState.WAITING: "waiting",
    RequestState.RUNNING: "running",
    RequestState.LOADING: "loading",
    RequestState.PREEMPTED: "paused",
}


@dataclass(frozen=True)
class StreamRow:
    """One unfinished request as its reader sees it at the snapshot's time."""

    request_id: str
    consumption: Consumption
    rate_tps: float  # math.inf for eager and batch requests
    state: str  # a value of STATE_NAMES
    is_kv_on_host: bool  # paused with its KV kept in the host tier (resumes by a load)
    num_output_tokens: int
    num_consumed_tokens: int  # by the reader model (all of them for eager and batch)
    buffered_s: float | None  # seconds of reading left in the buffer; None unless a reader
    slack_s: float  # until the reader wants a token that does not exist (the urgency order)
    ttft_s: float | None  # arrival to first token on the engine's clock; None before it
    stalled_s: float | None  # the reader's stalls so far, the current one included
    age_s: float  # since the engine received it
    num_preemptions: int
    wait_reason: str | None  # why it is off the device (`WaitReason`); None while on it


@dataclass(frozen=True)
class StepMoves:
    """What one step moved: the latest step that moved any stream."""

    at_s: float  # the engine clock at the end of that step
    num_preemptions: int
    num_starts: int  # waiting requests started
    num_loads: int  # paused streams resumed by loading their host KV
    num_recomputes: int  # paused streams resumed by recomputing their KV


@dataclass(frozen=True)
class StreamsSnapshot:
    """The most urgent streams (smallest slack first, ties by arrival), totals over all of
    them, and the engine-wide state the policy decides on."""

    taken_s: float  # the engine clock
    policy: str
    streams: tuple[StreamRow, ...]  # at most the `limit` asked for
    num_waiting: int
    num_running: int
    num_loading: int
    num_paused: int
    capacity_tps: float  # Gamma: what the engine generates at the feasible batch
    demand_tps: float  # the started streams' demand (`Capacity.demand_tps`)
    asked_tps: float  # every unfinished request's demand (`Capacity.demand_tps`)
    num_readers: int  # unfinished readers
    num_served_readers: int  # of them, on the device
    num_device_blocks_used: int
    num_device_blocks: int
    num_host_blocks_used: int
    num_host_blocks: int
    num_cached_device_blocks: int  # the prefix cache's keyed blocks, held or cached-free
    num_cached_host_blocks: int
    num_prefix_queried_tokens: int  # prompt tokens looked up in the prefix cache, since start
    num_prefix_hit_tokens: int  # of them, found cached on the device
    num_prefix_host_hit_tokens: int  # of them, found cached in the host tier after that
    num_preemptions_total: int
    num_loads_total: int
    num_recomputes_total: int
    last_moves: StepMoves | None  # None until a step moved a stream

    def top(self, limit: int) -> StreamsSnapshot:
        """The same snapshot with only its `limit` most urgent streams."""
        if len(self.streams) <= limit:
            return self
        return replace(self, streams=self.streams[:limit])


def stalled_s(request: Request, now_s: float) -> float:
    """Seconds the reader has spent on an empty buffer since its first token.

    The reader model's recurrence c_j = max(g_j, c_(j-1) + 1/r) gives, summed over its stalls,
    c_n = g_1 + (n - 1)/r + (stalls so far): so they are read off the last consumption time in
    O(1) (`tokenflow.eval.metrics` sums the same stalls from a finished trace); a reader
    waiting
    past
    its buffer now stalls for the time since it ran dry."""
    if not request.output_token_ids or not request.is_reader:
        return 0.0
    num = request.num_output_tokens
    past_s = request.last_consume_s - request.token_times_s[0] - (num - 1) / request.rate_tps
    return max(past_s, 0.0) + max(now_s - request.dry_s, 0.0)


def stream_row(request: Request, now_s: float, policy: Policy) -> StreamRow:
    """What the endpoint tells of one unfinished request at `now_s` (why it waits: `policy`'s
    reason)."""
    is_reader = request.is_reader
    reason = policy.wait_reason(request)
    has_token = bool(request.output_token_ids)
    num_output = request.num_output_tokens
    return StreamRow(
        request_id=request.request_id,
        consumption=request.consumption,
        rate_tps=request.rate_tps,
        state=STATE_NAMES[request.state],
        is_kv_on_host=request.state is RequestState.PREEMPTED and request.num_computed_tokens > 0,
        num_output_tokens=num_output,
        num_consumed_tokens=num_output - request.buffer_tokens(now_s) if is_reader else num_output,
        buffered_s=request.buffered_s(now_s) if is_reader else None,
        slack_s=request.slack_s(now_s),
        ttft_s=request.token_times_s[0] - request.arrival_s if has_token else None,
        stalled_s=stalled_s(request, now_s) if is_reader and has_token else None,
        age_s=max(now_s - request.arrival_s, 0.0),
        num_preemptions=request.num_preemptions,
        wait_reason=None if reason is None else reason.value,
    )


def take_snapshot(
    scheduler: Scheduler, now_s: float, limit: int, policy: str, last_moves: StepMoves | None
) -> StreamsSnapshot:
    """The snapshot at `now_s`: O(streams log limit).  Call it between steps only."""
    started = [*scheduler.running, *scheduler.preempted]
    requests = [*started, *scheduler.waiting]
    urgent = heapq.nsmallest(limit, requests, key=lambda r: (r.slack_s(now_s), r.sort_key))
    capacity = measure_capacity(scheduler.view(now_s))  # (the policy's own rule and function)
    kv = scheduler.kv
    num_loading = len(scheduler.queues.loading)
    return StreamsSnapshot(
        taken_s=now_s,
        policy=policy,
        streams=tuple(stream_row(r, now_s, scheduler.policy) for r in urgent),
        num_waiting=len(scheduler.waiting),
        num_running=len(scheduler.running) - num_loading,
        num_loading=num_loading,
        num_paused=len(scheduler.preempted),
        capacity_tps=capacity.gamma_tps,
        demand_tps=capacity.demand_tps(started),
        asked_tps=capacity.demand_tps(requests),
        num_readers=sum(1 for r in requests if r.is_reader),
        num_served_readers=sum(1 for r in scheduler.running if r.is_reader),
        num_device_blocks_used=kv.config.num_device_blocks - kv.num_free_device_blocks,
        num_device_blocks=kv.config.num_device_blocks,
        num_host_blocks_used=kv.config.num_host_blocks - kv.num_free_host_blocks,
        num_host_blocks=kv.config.num_host_blocks,
        num_cached_device_blocks=kv.num_cached_device_blocks,
        num_cached_host_blocks=kv.num_cached_host_blocks,
        num_prefix_queried_tokens=scheduler.num_prefix_queried_tokens,
        num_prefix_hit_tokens=scheduler.num_prefix_hit_tokens,
        num_prefix_host_hit_tokens=scheduler.num_prefix_host_hit_tokens,
        num_preemptions_total=scheduler.num_preemptions_total,
        num_loads_total=scheduler.num_loads_total,
        num_recomputes_total=scheduler.num_recomputes_total,
        last_moves=last_moves,
    )


class MoveWatch:
    """Remembers the latest step that moved streams: `before_step` and `after_step` read four
    counters of the scheduler (O(1) a step).  Within a step the waiting queue only shrinks by
    starts (arrivals and aborts happen between steps), so its drop counts them."""

    def __init__(self) -> None:
        self.last: StepMoves | None = None
        self._preemptions = self._loads = self._recomputes = self._waiting = 0

    def before_step(self, scheduler: Scheduler) -> None:
        """Read the counters as a step begins."""
        self._preemptions = scheduler.num_preemptions_total
        self._loads = scheduler.num_loads_total
        self._recomputes = scheduler.num_recomputes_total
        self._waiting = len(scheduler.waiting)

    def after_step(self, scheduler: Scheduler, now_s: float) -> None:
        """Compare them as it ends; remember the step if it moved anything."""
        num_preemptions = scheduler.num_preemptions_total - self._preemptions
        num_starts = max(self._waiting - len(scheduler.waiting), 0)
        num_loads = scheduler.num_loads_total - self._loads
        num_recomputes = scheduler.num_recomputes_total - self._recomputes
        if num_preemptions or num_starts or num_loads or num_recomputes:
            self.last = StepMoves(
                at_s=now_s,
                num_preemptions=num_preemptions,
                num_starts=num_starts,
                num_loads=num_loads,
                num_recomputes=num_recomputes,
            )
