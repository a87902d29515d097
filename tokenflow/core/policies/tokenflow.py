"""TokenFlow's buffer-aware preemptive policy (SPEC section 3).

Every `schedule_interval_s`, and only under stress (a request waits, or some stream's buffer is
within `critical_slack_s` of running dry), one decision runs in named phases:

1. `check_schedulable`  - if the working set's reading rates exceed the engine's capacity,
                          admit no one by preemption until they fit again: new requests start
                          only in free memory, FCFS (the members keep being balanced);
2. `admit`              - grow the working set while it is below W_sched and some running stream
                          can be paused safely (its buffer covers mu x an evict/load round trip);
3. `balance`            - pick who is on the device: greedy by utility under device memory,
                          then adjacent-swap local search;
4. `choose_resume_mode` - reload from the host tier or recompute, whichever is faster now.

Between decisions, the decided starts are carried out as memory frees, and FCFS fills what is
left.  The scheduler's mechanism does the rest (write-through copies ordered by buffer size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenflow.core.config import TokenFlowConfig
from tokenflow.core.policies.base import (
    Moves,
    Policy,
    Preemption,
    SchedulingView,
    Start,
    fcfs_starts,
)
from tokenflow.core.request import PreemptMode, Request, RequestState


@dataclass(frozen=True)
class Candidate:
    """One working-set member as the balancer sees it."""

    request: Request
    utility: float
    footprint_blocks: int
    is_resident: bool
    is_pinned: bool  # must stay on the device (mid-prefill, loading, or unsafe to pause)


class TokenFlowPolicy(Policy):
    """Preempts streams with large buffers so waiting ones start; resumes before buffers run dry."""

    name = "tokenflow"

    def __init__(self, config: TokenFlowConfig) -> None:
        self.config = config
        self._next_decision_s = 0.0
        self._targets: list[Start] = []
        self._degraded = False
        self.num_decisions = 0
        self.num_degraded_decisions = 0

    # -- entry point ------------------------------------------------------------------------------
    def plan_moves(self, view: SchedulingView) -> Moves:
        """A full decision at interval boundaries under stress; otherwise carry out the last one."""
        if view.now_s >= self._next_decision_s and self.is_stressed(view):
            self._next_decision_s = view.now_s + self.config.schedule_interval_s
            return self.decide(view)
        return Moves(starts=tuple(self._starts_between_decisions(view)))

    def is_stressed(self, view: SchedulingView) -> bool:
        """Some request waits, or some started stream is close to stalling."""
        if view.waiting:
            return True
        critical = self.config.critical_slack_s
        return any(r.slack_s(view.now_s) < critical for r in view.preempted) or any(
            r.slack_s(view.now_s) < critical for r in view.running if r.output_token_ids
        )

    def decide(self, view: SchedulingView) -> Moves:
        """One scheduling decision: schedulability, admission, balancing, resume modes."""
        self.num_decisions += 1
        self._degraded = not self.check_schedulable(view, extra_rate_tps=0.0)
        if self._degraded:
            self.num_degraded_decisions += 1
        admitted = [] if self._degraded else self.admit(view)
        members = list(view.running) + list(view.preempted) + admitted
        selected = self.balance(view, [self.candidate(view, r) for r in members])
        chosen = {c.request.request_id for c in selected}
        victims = [r for r in view.running if r.request_id not in chosen]
        preemptions = tuple(Preemption(r.request_id, PreemptMode.OFFLOAD) for r in victims)
        self._targets = [
            self.choose_resume_mode(view, c.request) for c in selected if not c.is_resident
        ]
        return Moves(preemptions=preemptions, starts=tuple(self._targets))

    def _starts_between_decisions(self, view: SchedulingView) -> list[Start]:
        live = {r.request_id for r in view.waiting} | {r.request_id for r in view.preempted}
        self._targets = [s for s in self._targets if s.request_id in live]
        if self._targets:
            return list(self._targets)
        # Work-conserving: free memory goes to the preempted streams nearest to stalling, then
        # to waiting ones (memory-aware FCFS admission, also when degraded).
        now = view.now_s
        preempted = sorted(view.preempted, key=lambda r: (r.slack_s(now), r.sort_key))
        return fcfs_starts(view, candidates=preempted + list(view.waiting))

    # -- phase 1: schedulability ----------------------------------------------------------------
    def capacity_tps(self, view: SchedulingView) -> float:
        """Gamma: tokens/s the engine generates at the current batch (SPEC section 3), taken as
        the device-resident count, or the count that fits at current contexts when smaller."""
        members = list(view.running) + list(view.preempted) or list(view.waiting)
        mean_blocks = _mean(view.kv.blocks_for(r.num_tokens + 1) for r in members) or 1.0
        fit = int(view.kv.config.num_device_blocks / mean_blocks)
        batch = max(1, min(view.config.max_num_seqs, fit, max(len(view.running), 1)))
        return view.estimator.capacity_tps(batch)

    def check_schedulable(self, view: SchedulingView, extra_rate_tps: float) -> bool:
        """True when the working set's total reading rate stays within capacity."""
        demand = sum(r.rate_tps for r in view.running) + sum(r.rate_tps for r in view.preempted)
        return demand + extra_rate_tps <= self.capacity_tps(view)

    # -- phase 2: admission ---------------------------------------------------------------------
    def working_set_limit(self, view: SchedulingView) -> int:
        """W_sched from W_static = floor(M / beta), smoothed toward the running count by lambda.

        M counts both tiers: members that are not selected live in host memory.
        """
        members = list(view.running) + list(view.preempted) or list(view.waiting)
        beta = _mean(view.kv.blocks_for(_lifetime_tokens(r)) for r in members) or 1.0
        total = view.kv.config.num_device_blocks + view.kv.config.num_host_blocks
        w_static = max(1, int(total / beta))
        num_running = len(view.running)
        if num_running < w_static:
            smoothing = self.config.working_set_smoothing
            return math.ceil(w_static - smoothing * (w_static - num_running))
        return w_static

    def round_trip_s(self, view: SchedulingView, request: Request) -> float:
        """tau_evict + tau_load + tau_schedule for pausing `request` now."""
        bytes_per_s = view.config.link_bytes_per_s
        block_bytes = view.kv.config.block_bytes
        tokens = request.num_computed_tokens
        evict_s = view.kv.unsynced_blocks(request.request_id, tokens) * block_bytes / bytes_per_s
        load_s = view.kv.blocks_for(tokens) * block_bytes / bytes_per_s
        return evict_s + load_s + self.config.schedule_interval_s

    def can_pause(self, view: SchedulingView, request: Request) -> bool:
        """b_j >= mu * r_j * (tau_evict + tau_load + tau_schedule), in seconds of reading, on
        top of the critical slack: a paused stream must not be critical the moment it stops,
        or it would be resumed at once (thrashing)."""
        if request.state is not RequestState.RUNNING or request.is_prefilling:
            return False
        buffered_s = request.buffer_tokens(view.now_s) / request.rate_tps
        round_trip_s = self.config.buffer_conservativeness * self.round_trip_s(view, request)
        return buffered_s >= round_trip_s + self.config.critical_slack_s

    def admit(self, view: SchedulingView) -> list[Request]:
        """Waiting requests that join the working set, in arrival order."""
        limit = self.working_set_limit(view)
        size = len(view.running) + len(view.preempted)
        pausable = sum(1 for r in view.running if self.can_pause(view, r))
        free = view.kv.num_free_device_blocks - sum(view.reserve_blocks(r) for r in view.running)
        extra_rate = 0.0
        admitted: list[Request] = []
        for request in view.waiting:
            if size >= limit or not self.check_schedulable(view, extra_rate + request.rate_tps):
                break
            need = view.start_blocks(request)
            if need <= free:
                free -= need
            elif pausable > 0:
                pausable -= 1
            else:
                break
            admitted.append(request)
            size += 1
            extra_rate += request.rate_tps
        return admitted

    # -- phase 3: buffer balancing --------------------------------------------------------------
    def utility(self, view: SchedulingView, request: Request, is_resident: bool) -> float:
        """U_i = v_i * dt + gamma * dt * exp(-T_i / dt) - switch cost, with T_i the seconds of
        reading buffered (0 before the first token: an empty buffer).

        v_i, the value of a token, falls linearly from 1 (empty buffer) to 0 at value_horizon_s.
        """
        cfg = self.config
        interval = cfg.schedule_interval_s
        buffered_s = max(request.slack_s(view.now_s), 0.0)
        value = max(0.0, 1.0 - buffered_s / cfg.value_horizon_s)
        stall = math.exp(-buffered_s / interval)
        switch = 0.0 if is_resident else cfg.switch_penalty * interval
        return value * interval + cfg.stall_penalty * interval * stall - switch

    def candidate(self, view: SchedulingView, request: Request) -> Candidate:
        """Utility, device footprint over the next interval, and pinning of one member."""
        is_resident = request.state in (RequestState.RUNNING, RequestState.LOADING)
        step_s = view.estimator.decode_time_s(len(view.running) or 1)
        growth = int(self.config.schedule_interval_s / step_s)
        remaining = request.sampling_params.max_tokens - request.num_output_tokens
        tokens = request.num_tokens + max(1, min(growth, remaining))
        pinned = is_resident and (
            request.state is RequestState.LOADING
            or request.is_prefilling
            or not self.can_pause(view, request)
        )
        return Candidate(
            request=request,
            utility=self.utility(view, request, is_resident),
            footprint_blocks=view.kv.blocks_for(tokens),
            is_resident=is_resident,
            is_pinned=pinned,
        )

    def balance(self, view: SchedulingView, candidates: list[Candidate]) -> list[Candidate]:
        """Who is on the device next: pinned members, then greedy by utility while memory and
        max_num_seqs allow, improved by swapping adjacent (selected, unselected) pairs."""
        capacity = view.kv.config.num_device_blocks
        max_seqs = view.config.max_num_seqs
        order = sorted(
            candidates,
            key=lambda c: (
                not c.is_pinned,
                -c.utility,
                -c.request.rate_tps,
                c.request.sort_key,
            ),
        )
        chosen = [False] * len(order)
        used = count = 0
        for i, cand in enumerate(order):
            if count < max_seqs and (cand.is_pinned or used + cand.footprint_blocks <= capacity):
                chosen[i] = True
                used += cand.footprint_blocks
                count += 1
        for _ in range(self.config.local_search_passes):
            if not self._improve_by_swaps(order, chosen, used, capacity):
                break
            used = sum(c.footprint_blocks for c, keep in zip(order, chosen, strict=True) if keep)
        return [c for c, keep in zip(order, chosen, strict=True) if keep]

    @staticmethod
    def _improve_by_swaps(
        order: list[Candidate], chosen: list[bool], used: int, capacity: int
    ) -> bool:
        """One pass of adjacent swaps; True if any swap raised the total utility."""
        improved = False
        for i in range(len(order) - 1):
            a, b = i, i + 1
            if chosen[a] == chosen[b]:
                continue
            inside, outside = (a, b) if chosen[a] else (b, a)
            if order[inside].is_pinned:
                continue
            gain = order[outside].utility - order[inside].utility
            new_used = used - order[inside].footprint_blocks + order[outside].footprint_blocks
            if gain > 0 and new_used <= capacity:
                chosen[inside], chosen[outside] = False, True
                used = new_used
                improved = True
        return improved

    # -- phase 4: reload or recompute -----------------------------------------------------------
    def choose_resume_mode(self, view: SchedulingView, request: Request) -> Start:
        """Reload when t_IO (queued + own evict and load traffic) beats recompute time."""
        if not view.kv.has_host_copy(request.request_id, request.num_computed_tokens):
            return Start(request.request_id, by_load=False)
        block_bytes = view.kv.config.block_bytes
        queued_blocks = sum(
            view.kv.blocks_for(r.num_computed_tokens)
            for r in view.running
            if r.state is RequestState.LOADING
        )
        own_blocks = view.kv.blocks_for(request.num_computed_tokens)
        io_s = (queued_blocks + own_blocks) * block_bytes / view.config.link_bytes_per_s
        recompute_s = view.estimator.prefill_time_s(request.num_tokens)
        return Start(request.request_id, by_load=io_s <= recompute_s)

    # -- mechanism hooks ------------------------------------------------------------------------
    def choose_oom_victim(self, candidates: list[Request], view: SchedulingView) -> Preemption:
        """Offload the pausable stream with the most reading buffered; else SGLang's rule."""
        pausable = [r for r in candidates if self.can_pause(view, r)]
        if not pausable:
            return super().choose_oom_victim(candidates, view)
        victim = max(pausable, key=lambda r: (r.slack_s(view.now_s), r.sort_key))
        return Preemption(victim.request_id, PreemptMode.OFFLOAD)

    def write_through_order(self, view: SchedulingView) -> list[Request]:
        """Running streams by buffered reading, largest first: likeliest to be preempted."""
        if not self.config.write_through:
            return []
        now = view.now_s
        running = [r for r in view.running if r.state is RequestState.RUNNING]
        return sorted(running, key=lambda r: (-r.slack_s(now), r.sort_key))


def _lifetime_tokens(request: Request) -> int:
    """Mean KV footprint over a request's life: its prompt plus half its output budget (the
    footprint grows linearly while it decodes), or its current size if already larger."""
    half_output = request.sampling_params.max_tokens // 2
    return max(request.num_tokens, request.num_prompt_tokens + half_output)


def _mean(values: object) -> float:
    items = list(values)  # type: ignore[call-overload]
    return sum(items) / len(items) if items else 0.0
