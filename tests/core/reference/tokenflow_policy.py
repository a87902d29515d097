"""TokenFlow's buffer-aware preemptive policy (SPEC section 3), with an explicit overload rule.

Every `schedule_interval_s`, and only under stress (a request waits, or some stream's buffer is
within `critical_slack_s` of running dry), one decision runs in named phases:

1. schedulability  - Gamma is the engine's capacity (tokens/s) at the feasible batch: as many
                     streams as device memory holds at the members' mean lifetime footprint.
                     When the working set's reading rates exceed Gamma, the policy degrades:
                     no one is admitted and members are served by arrival (see 3);
2. admission       - waiting requests join the working set in arrival order while it is below
                     W_sched, their rates stay within `capacity_headroom` x Gamma, their
                     prefill finds free device blocks or blocks that safe pauses free (each
                     pause also needs host room for its unsynced tail), and their prefills fit
                     in one interval (so Gamma is measured as the batch fills, not guessed);
3. balancing       - who is on the device: pinned members, then streams stalled for
                     `max_stall_s` (the stall bound), then by utility - or, degraded, streams
                     about to stall before the others, each group first come, first served;
                     resumes share one interval of link time per decision;
4. resume mode     - reload from the host tier or recompute, whichever is faster now.

Overload rule (beyond the paper): a waiting request starts only while the working set's total
reading rate fits the engine's capacity with headroom, also between decisions; so a burst that
wants more tokens/s than the engine makes waits in arrival order (no later arrival passes it)
instead of joining and stalling everyone.  A started stream that stalls anyway (estimates were
off, contexts grew) goes first once it has stalled `max_stall_s`.

Between decisions, the decided starts are carried out as memory frees, and free memory goes to
the preempted streams nearest to running dry, then to waiting requests within the rate budget
the last decision left.  The scheduler's mechanism does the rest (write-through copies ordered
by buffer size).
"""

from __future__ import annotations

import math
from itertools import chain

from tests.core.reference.survey import Survey, survey
from tokenflow.core.config import SchedulerConfig, TokenFlowConfig
from tokenflow.core.policies.admission import CapacityFloor
from tokenflow.core.policies.balance import balance
from tokenflow.core.policies.base import (
    Moves,
    Policy,
    Preemption,
    SchedulingView,
    Start,
    fcfs_starts,
)
from tokenflow.core.policies.survey import Candidate
from tokenflow.core.request import PreemptMode, Request, RequestState


class TokenFlowPolicy(Policy):
    """Preempts streams with large buffers so waiting ones start; resumes before buffers run dry."""

    name = "tokenflow"

    def __init__(self, config: TokenFlowConfig) -> None:
        self.config = config
        self._next_decision_s = 0.0
        self._targets: list[Start] = []
        self._spare_rate_tps = 0.0  # reading rate waiting requests may still add
        self._rate_cap_tps = math.inf  # one stream's share of capacity at the feasible batch
        self._prefill_budget_s = 0.0  # prefill time newcomers may still take this interval
        self._capacity_floor = CapacityFloor(config.capacity_window_s)  # Gamma admission trusts
        self.num_decisions = 0
        self.num_degraded_decisions = 0

    # -- entry point ------------------------------------------------------------------------------

    def init_new_token_ratio(self, config: SchedulerConfig) -> float:
        """The smaller admission reserve (`TokenFlowConfig.init_new_token_ratio`)."""
        ratio = min(config.init_new_token_ratio, self.config.init_new_token_ratio)
        return max(ratio, config.min_new_token_ratio)

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
        now, critical = view.now_s, self.config.critical_slack_s
        return any(r.slack_s(now) < critical for r in view.preempted) or any(
            r.slack_s(now) < critical for r in view.running if r.output_token_ids
        )

    def decide(self, view: SchedulingView) -> Moves:
        """One scheduling decision: schedulability, admission, balancing, resume modes."""
        self.num_decisions += 1
        growth = self.growth_tokens(view)
        started = self._survey_started(view, growth)
        capacity, demand = self._capacity_and_demand(view, started)
        trusted = self._capacity_floor.observe(view.now_s, capacity)
        degraded = demand > capacity
        admitted: list[Request] = []
        self._spare_rate_tps = 0.0
        if degraded:
            self.num_degraded_decisions += 1
        queue_fits = self._queue_fits(view, trusted, demand)
        if queue_fits or not degraded:
            headroom = self.config.queue_headroom if queue_fits else self.config.capacity_headroom
            spare = headroom * trusted - demand
            admitted = self._admit(view, started, spare)
            self._spare_rate_tps = max(spare - sum(map(self._demand_tps, admitted)), 0.0)
        newcomers = survey(self.config, view, admitted, growth).candidates
        selected = balance(
            started.candidates + newcomers,
            view.kv.config.num_device_blocks,
            view.config.max_num_seqs,
            by_arrival=degraded,
            resume_budget_s=self.config.schedule_interval_s,
        )
        chosen = {c.request.request_id for c in selected}
        preemptions = tuple(
            Preemption(r.request_id, PreemptMode.OFFLOAD)
            for r in view.running
            if r.request_id not in chosen
        )
        queued = self._queued_io_blocks(view)
        self._targets = [
            self.choose_resume_mode(view, c.request, queued) for c in selected if not c.is_resident
        ]
        return Moves(preemptions=preemptions, starts=tuple(self._targets))

    def _demand_tps(self, request: Request) -> float:
        """Tokens/s a member asks of the engine: its reading rate, at most one stream's share."""
        return min(request.rate_tps, self._rate_cap_tps)

    def _starts_between_decisions(self, view: SchedulingView) -> list[Start]:
        live = {r.request_id for r in view.waiting} | {r.request_id for r in view.preempted}
        self._targets = [s for s in self._targets if s.request_id in live]
        if self._targets:
            return list(self._targets)
        # Work-conserving: free memory goes to the preempted streams nearest to stalling, then
        # to waiting ones within the rate budget (memory-aware FCFS admission).
        if view.kv.num_free_device_blocks == 0:
            return []
        # A preempted stream gains no tokens, so ordering by the time its reader runs dry
        # (last consumption + 1/r) equals ordering by slack, without reading the clock.
        preempted = sorted(
            view.preempted, key=lambda r: (r.last_consume_s + 1.0 / r.rate_tps, r.sort_key)
        )
        waiting: list[Request] = []
        budget = self._spare_rate_tps
        batch_s = view.estimator.prefill_batch_time_s
        step_tokens = view.config.max_prefill_tokens
        for request in view.waiting:  # arrival order; no later request passes an earlier one
            idle = not (waiting or view.running or preempted)
            tokens = sum(r.num_tokens for r in waiting) + request.num_tokens
            prefill_s = batch_s(tokens, step_tokens)  # prefills started together
            if not idle and (
                self._demand_tps(request) > budget or prefill_s > self._prefill_budget_s
            ):
                break  # (an idle engine always takes the head, whatever its rate)
            budget -= self._demand_tps(request)
            waiting.append(request)
        starts = fcfs_starts(view, candidates=preempted + waiting)
        num_new = len(starts) - len(preempted)
        if num_new > 0:
            self._spare_rate_tps -= sum(map(self._demand_tps, waiting[:num_new]))
            tokens = sum(r.num_tokens for r in waiting[:num_new])
            self._prefill_budget_s -= batch_s(tokens, step_tokens)
        return starts

    def _survey_started(self, view: SchedulingView, growth: int) -> Survey:
        return survey(self.config, view, chain(view.running, view.preempted), growth)

    # -- phase 1: schedulability ----------------------------------------------------------------
    def _lifetime_blocks(self, view: SchedulingView, started: Survey) -> float:
        """beta: mean device blocks of a member over its life (of the waiting if no member)."""
        if started.candidates:
            return max(started.sum_lifetime_blocks / len(started.candidates), 1.0)
        waiting = survey(self.config, view, view.waiting, 1)
        return max(waiting.sum_lifetime_blocks / max(len(view.waiting), 1), 1.0)

    def _capacity(self, view: SchedulingView, started: Survey) -> tuple[float, int]:
        """(Gamma, the feasible batch it is measured at)."""
        beta = self._lifetime_blocks(view, started)
        batch = max(1, min(view.config.max_num_seqs, int(view.kv.config.num_device_blocks / beta)))
        return view.estimator.capacity_tps(batch, beta * view.kv.block_size), batch

    def _capacity_and_demand(self, view: SchedulingView, started: Survey) -> tuple[float, float]:
        """(Gamma, the members' demand); sets the per-reader cap `_demand_tps` applies: no
        reader takes more than one stream's share of the feasible batch."""
        capacity, batch = self._capacity(view, started)
        self._rate_cap_tps = capacity / batch
        return capacity, sum(self._demand_tps(c.request) for c in started.candidates)

    def capacity_tps(self, view: SchedulingView) -> float:
        """Gamma: tokens/s the engine generates at the feasible batch, the number of members
        the device tier holds at their mean lifetime footprint (capped by max_num_seqs), each
        at that footprint's context."""
        return self._capacity(view, self._survey_started(view, 1))[0]

    def check_schedulable(self, view: SchedulingView, extra_rate_tps: float) -> bool:
        """True when the working set's total reading rate stays within capacity."""
        capacity, demand = self._capacity_and_demand(view, self._survey_started(view, 1))
        return demand + extra_rate_tps <= capacity

    # -- phase 2: admission ---------------------------------------------------------------------
    def _working_set_limit(self, view: SchedulingView, started: Survey) -> int:
        kv = view.kv.config
        host = min(self.config.working_set_host_share * kv.num_device_blocks, kv.num_host_blocks)
        w_static = max(1, int((kv.num_device_blocks + host) / self._lifetime_blocks(view, started)))
        num_running = len(view.running)
        if num_running < w_static:
            smoothing = self.config.working_set_smoothing
            return math.ceil(w_static - smoothing * (w_static - num_running))
        return w_static

    def working_set_limit(self, view: SchedulingView) -> int:
        """W_sched from W_static = floor(M / beta), smoothed toward the running count by lambda.

        M is the device tier plus `working_set_host_share` of it in the host tier (members not
        on the device wait there; the share bounds how far rotation stretches the device);
        beta is the mean lifetime footprint (prompt + half the output budget).
        """
        return self._working_set_limit(view, self._survey_started(view, 1))

    def can_pause(self, view: SchedulingView, request: Request) -> bool:
        """b_j >= mu * r_j * (tau_evict + tau_load + tau_schedule) (+ the critical slack)."""
        return survey(self.config, view, [request], 1).candidates[0].is_pausable

    def _admit(self, view: SchedulingView, started: Survey, spare_rate_tps: float) -> list[Request]:
        if not view.waiting:
            return []
        limit = self._working_set_limit(view, started)
        size = len(started.candidates)
        free = view.kv.num_free_device_blocks - view.running_reserve_blocks()
        host_room = view.kv.num_free_host_blocks
        # Pauses that would free memory, most reading buffered first (they lose least).
        pausable = sorted(
            (c for c in started.candidates if c.is_pausable),
            key=lambda c: (c.utility, c.request.sort_key),
        )
        extra_rate = 0.0
        interval_s = self.config.schedule_interval_s
        batch_s = view.estimator.prefill_batch_time_s
        step_tokens = view.config.max_prefill_tokens
        # token bucket: one interval plus the last one's unused prefill time, at most one more
        budget_s = interval_s + min(max(self._prefill_budget_s, 0.0), interval_s)
        self._prefill_budget_s = budget_s
        admitted: list[Request] = []
        for request in view.waiting:
            rate = self._demand_tps(request)
            if size >= limit or (size and extra_rate + rate > spare_rate_tps):
                break  # (an empty working set always takes the head, whatever its rate)
            tokens = sum(r.num_tokens for r in admitted) + request.num_tokens
            if admitted and batch_s(tokens, step_tokens) > budget_s:
                break  # paced: what one interval can prefill, so Gamma is measured as it fills
            need = view.start_blocks(request)
            while need > free and pausable:
                pause = pausable.pop(0)
                if pause.unsynced_blocks <= host_room:
                    host_room -= pause.unsynced_blocks
                    free += pause.reclaim_blocks + view.reserve_blocks(pause.request)
            if need > free:
                break
            free -= need + view.reserve_blocks(request)
            self._prefill_budget_s = budget_s - batch_s(tokens, step_tokens)
            admitted.append(request)
            size += 1
            extra_rate += rate
        return admitted

    def admit(self, view: SchedulingView) -> list[Request]:
        """Waiting requests that join the working set, in arrival order, while it is below
        W_sched, their rates fit in the spare capacity (with headroom), and each finds free
        memory or memory that safe pauses free (with host room for their unsynced tails)."""
        started = self._survey_started(view, 1)
        capacity, demand = self._capacity_and_demand(view, started)
        queue_fits = self._queue_fits(view, capacity, demand)
        headroom = self.config.queue_headroom if queue_fits else self.config.capacity_headroom
        return self._admit(view, started, headroom * capacity - demand)

    def _queue_fits(self, view: SchedulingView, capacity: float, demand: float) -> bool:
        """Every waiting request's demand, summed in arrival order, fits in `queue_headroom`
        x Gamma less the members' demand, and that is more than `capacity_headroom` allows."""
        room = self.config.queue_headroom * capacity - demand
        wider = room > self.config.capacity_headroom * capacity - demand
        return wider and sum(map(self._demand_tps, view.waiting)) <= room

    # -- phase 3: buffer balancing --------------------------------------------------------------
    def growth_tokens(self, view: SchedulingView) -> int:
        """Tokens a running stream gains in one interval at the current step time."""
        step_s = view.estimator.decode_time_s(len(view.running) or 1)
        return int(self.config.schedule_interval_s / step_s)

    def balance(
        self, view: SchedulingView, candidates: list[Candidate], by_arrival: bool = False
    ) -> list[Candidate]:
        """Who is on the device next (see `balance.balance`)."""
        return balance(
            candidates,
            view.kv.config.num_device_blocks,
            view.config.max_num_seqs,
            by_arrival,
            self.config.schedule_interval_s,
        )

    # -- phase 4: reload or recompute -----------------------------------------------------------
    @staticmethod
    def _queued_io_blocks(view: SchedulingView) -> int:
        """Blocks the link must move before a new load: the eviction queue and the blocks
        of loads in flight not yet copied."""
        kv = view.kv
        loading = sum(
            kv.num_blocks_to_load(r.request_id, r.num_computed_tokens)
            for r in view.running
            if r.state is RequestState.LOADING
        )
        return kv.num_evicting_blocks + loading

    def choose_resume_mode(
        self, view: SchedulingView, request: Request, queued_blocks: int | None = None
    ) -> Start:
        """Reload when t_IO (queued + own load traffic) beats the recompute time, or when the
        load lands before the reader runs dry: recomputing takes the whole batch's compute,
        a load only this stream's time (beyond the paper, whose rule is the first clause)."""
        if not view.kv.has_host_copy(request.request_id, request.num_computed_tokens):
            return Start(request.request_id, by_load=False)
        if queued_blocks is None:
            queued_blocks = self._queued_io_blocks(view)
        own_blocks = view.kv.blocks_for(request.num_computed_tokens)
        bytes_per_s = view.config.link_bytes_per_s
        io_s = (queued_blocks + own_blocks) * view.kv.config.block_bytes / bytes_per_s
        recompute_s = view.estimator.prefill_time_s(request.num_tokens)
        in_time = io_s < request.slack_s(view.now_s)
        return Start(request.request_id, by_load=io_s <= recompute_s or in_time)

    # -- mechanism hooks ------------------------------------------------------------------------
    def choose_oom_victim(self, candidates: list[Request], view: SchedulingView) -> Preemption:
        """Offload the pausable stream with the most reading buffered; else SGLang's rule."""
        pausable = [
            c.request for c in survey(self.config, view, candidates, 1).candidates if c.is_pausable
        ]
        if not pausable:
            return super().choose_oom_victim(candidates, view)
        victim = max(pausable, key=lambda r: (r.slack_s(view.now_s), r.sort_key))
        return Preemption(victim.request_id, PreemptMode.OFFLOAD)

    def write_through_order(self, view: SchedulingView) -> list[Request]:
        """Running streams by buffered reading, largest first: likeliest to be preempted."""
        if not self.config.write_through:
            return []
        now, kv = view.now_s, view.kv
        pending = [
            r
            for r in view.running
            if r.state is RequestState.RUNNING
            and kv.has_unsynced_full_block(r.request_id, r.num_computed_tokens)
        ]
        return sorted(pending, key=lambda r: (-r.slack_s(now), r.sort_key))
