"""TokenFlow's admission (SPEC section 3, step 1): which waiting requests join the working set.

Pure functions of a view and a survey; the policy keeps the budgets they return between
decisions.  Admission is in strict arrival order (no later request passes an earlier one).
The admitted requests join the balance as candidates (`newcomer_candidates`).
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tokenflow.core.config import TokenFlowConfig
from tokenflow.core.policies.base import SchedulingView
from tokenflow.core.policies.pricing import Costs
from tokenflow.core.policies.started import StartedMembers
from tokenflow.core.policies.survey import Candidate, Survey, survey
from tokenflow.core.request import Request, RequestState

DemandOf = Callable[[Request], float]  # tokens/s a request asks of the engine


@dataclass(frozen=True)
class Admitted:
    requests: list[Request]  # in arrival order
    prefill_budget_s: float  # prefill time later newcomers may still take this interval
    demands_tps: list[float]  # each request's demand (its rate, capped), in the same order


class CapacityFloor:
    """The lower median of Gamma over the decisions of the last `window_s`, which admission
    trusts.

    Gamma is an estimate, and one high estimate is enough to admit a whole burst: in the
    simulator one decision of h200-a saw 7615 tok/s between figures of 5300-5900 and admitted
    the last 69 requests at once, and those readers then stalled 38 s each.  Admitting too far
    costs stalls until the burst drains; admitting too little costs one window of waiting.  So
    a single estimate either way is ignored: a rise is trusted once it holds for most of the
    window, a fall once it holds for half of it."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._recent: deque[tuple[float, float]] = deque()  # (decision time, Gamma)
        self._sorted: list[float] = []  # the window's Gamma values, ascending

    def observe(self, now_s: float, capacity_tps: float) -> float:
        """Record this decision's Gamma; the lower median of the window's (as
        `statistics.median_low`: the middle value of an odd count, else the lower middle)."""
        recent, ordered = self._recent, self._sorted
        while recent and recent[0][0] < now_s - self._window_s:
            del ordered[bisect_left(ordered, recent.popleft()[1])]  # (an equal value: same list)
        recent.append((now_s, capacity_tps))
        insort(ordered, capacity_tps)
        return ordered[(len(ordered) - 1) // 2]


def working_set_limit(config: TokenFlowConfig, view: SchedulingView, beta_blocks: float) -> int:
    """W_sched from W_static = floor(M / beta), smoothed toward the running count by lambda.

    M is the device tier plus `working_set_host_share` of it in the host tier (members not on
    the device wait there; the share bounds how far rotation stretches the device); beta is the
    mean lifetime footprint (prompt + half the output budget).
    """
    kv = view.kv.config
    host = min(config.working_set_host_share * kv.num_device_blocks, kv.num_host_blocks)
    w_static = max(1, int((kv.num_device_blocks + host) / beta_blocks))
    num_running = len(view.running)
    if num_running < w_static:
        return math.ceil(w_static - config.working_set_smoothing * (w_static - num_running))
    return w_static


def admit(
    view: SchedulingView,
    started: Survey | StartedMembers,
    limit: int,
    spare_rate_tps: float,
    rate_cap_tps: float,
    prefill_budget_s: float,
) -> Admitted:
    """Waiting requests that join, in arrival order, while the working set is below `limit`,
    their demand (reading rate, at most `rate_cap_tps` each) fits in `spare_rate_tps`, their
    prefills, started together, fit in `prefill_budget_s` (about one interval, so Gamma is
    measured as the batch fills; the first always starts), and each finds free device memory
    or memory that safe pauses free (each pause also needs host room for its unsynced tail)."""
    if not view.waiting:
        return Admitted([], prefill_budget_s, [])
    size = started.num_members
    free = view.kv.num_free_device_blocks - view.running_reserve_blocks()
    pauses = started.pauses(view)  # most reading buffered first (they lose least)
    # `prefill_batch_time_s`, `view.start_blocks` and `view.reserve_blocks` written out (the
    # same int and float operations): this loop runs over every newcomer at every decision.
    est, bs, ratio = view.estimator, view.kv.block_size, view.new_token_ratio
    step_s, token_s = est.prefill_step_s, est.prefill_token_s
    max_step = max(view.config.max_prefill_tokens, 1)
    extra_rate, prefill_tokens = 0.0, 0
    admitted: list[Request] = []
    rates: list[float] = []  # their demands
    for request in view.waiting:
        rate = request.rate_tps if request.rate_tps <= rate_cap_tps else rate_cap_tps  # (min)
        if size >= limit or (size and extra_rate + rate > spare_rate_tps):
            break  # (an empty working set always takes the head, whatever its rate)
        num_tokens = request.num_tokens
        tokens = prefill_tokens + num_tokens  # > 0: a prompt is never empty
        if admitted and -(-tokens // max_step) * step_s + tokens * token_s > prefill_budget_s:
            break  # paced: what one interval can prefill
        # Never computed (the common case): no host copy, so the start recomputes it all.
        need = view.start_blocks(request) if request.num_computed_tokens else -(-num_tokens // bs)
        if need > free:
            free += pauses.take(need - free)
            if need > free:
                break
        remaining = request.sampling_params.max_tokens - len(request.output_token_ids)
        free -= need + -(-int(remaining * ratio) // bs)
        prefill_tokens = tokens
        admitted.append(request)
        rates.append(rate)
        size += 1
        extra_rate += rate
    unused_s = prefill_budget_s - prefill_batch_time_s(view, prefill_tokens)
    return Admitted(admitted, unused_s, rates)


def carried_prefill_budget_s(interval_s: float, unused_s: float) -> float:
    """One interval of prefill time plus what the last interval left unused, at most one more
    interval: a token bucket.  Without the carry, prompts that each take over half an interval
    (128 tokens on a 2-core CPU) started one per decision and left the rest of it idle."""
    return interval_s + min(max(unused_s, 0.0), interval_s)


def waiting_within_budget(
    view: SchedulingView,
    spare_rate_tps: float,
    prefill_budget_s: float,
    demand_of: DemandOf,
    has_other_work: bool,
) -> list[Request]:
    """The head of the waiting queue that fits the budgets a decision left (between
    decisions; their prefills start together); an idle engine (`has_other_work` false) always
    takes the head."""
    waiting: list[Request] = []
    tokens = 0
    for request in view.waiting:
        idle = not (waiting or has_other_work)
        prefill_s = prefill_batch_time_s(view, tokens + request.num_tokens)
        if not idle and (demand_of(request) > spare_rate_tps or prefill_s > prefill_budget_s):
            break
        spare_rate_tps -= demand_of(request)
        tokens += request.num_tokens
        waiting.append(request)
    return waiting


def prefill_batch_time_s(view: SchedulingView, num_tokens: int) -> float:
    """Predicted time to prefill `num_tokens` prompt tokens started together."""
    return view.estimator.prefill_batch_time_s(num_tokens, view.config.max_prefill_tokens)


def newcomer_candidates(
    config: TokenFlowConfig,
    view: SchedulingView,
    members: Iterable[Request],
    growth: int,
    costs: Costs,
) -> list[Candidate]:
    """`survey(...).candidates` of requests just admitted, written for speed: a request never
    started (waiting, no output) has no buffer, no slack and no KV, so all its fields but the
    footprint are the same for each (computed once, with the survey's operations: the same
    floats); any other member is surveyed."""
    bs, waiting = view.kv.block_size, RequestState.WAITING
    dt = config.schedule_interval_s
    inv_dt, inv_horizon = 1.0 / dt, 1.0 / config.value_horizon_s
    stall_dt, switch = config.stall_penalty * dt, config.switch_penalty * dt
    buffered = 0.0
    value = 1.0 - buffered * inv_horizon
    score = (value if value > 0.0 else 0.0) * dt + stall_dt * math.exp(-buffered * inv_dt)
    score -= switch
    new = tuple.__new__  # (Candidate._make, C-level)
    out: list[Candidate] = []
    for r in members:
        if r.state is not waiting or r.output_token_ids:
            out += survey(config, view, [r], growth, costs).candidates
            continue
        remaining = r.sampling_params.max_tokens
        extra = growth if growth < remaining else remaining
        footprint = -(-(r.num_tokens + (extra if extra > 1 else 1)) // bs)
        out.append(
            new(Candidate, (r, score, footprint, False, False, False, False, False, 0, 0, 0.0))
        )
    return out
