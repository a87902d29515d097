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
instead of joining and stalling everyone; unless the whole queue fits in `queue_headroom` x
Gamma (off by default), when it may all join, even past Gamma, and the small deficit is
spread as short stalls.  A started stream that stalls anyway (estimates were off, contexts
grew) goes first once it has stalled `max_stall_s`.

Between decisions, the decided starts are carried out as memory frees, and free memory goes to
the preempted streams nearest to running dry, then to waiting requests within the rate budget
the last decision left.  The scheduler's mechanism does the rest (write-through copies ordered
by buffer size).
"""

from __future__ import annotations

import math
from itertools import chain
from operator import itemgetter

from tokenflow.core.config import SchedulerConfig, TokenFlowConfig
from tokenflow.core.policies.admission import (
    Admitted,
    CapacityFloor,
    admit,
    carried_prefill_budget_s,
    newcomer_candidates,
    prefill_batch_time_s,
    waiting_within_budget,
    working_set_limit,
)
from tokenflow.core.policies.balance import balance
from tokenflow.core.policies.base import (
    Moves,
    Policy,
    Preemption,
    SchedulingView,
    Start,
    fcfs_starts,
)
from tokenflow.core.policies.counted import balance_counted
from tokenflow.core.policies.paused import (
    PausedPrices,
    price_paused,
    queued_io_blocks,
    resume_starts,
)
from tokenflow.core.policies.pricing import Costs, decision_costs
from tokenflow.core.policies.residents import Residents
from tokenflow.core.policies.started import StartedMembers
from tokenflow.core.policies.survey import (
    Candidate,
    Survey,
    lifetime_blocks,
    survey,
    survey_started,
)
from tokenflow.core.request import PreemptMode, Request, RequestState

_NOT_STARTED = (RequestState.WAITING, RequestState.PREEMPTED)
_LAST = itemgetter(-1)
Started = Survey | StartedMembers


class TokenFlowPolicy(Policy):
    """Preempts streams with large buffers so waiting ones start; resumes before buffers run dry."""

    name = "tokenflow"

    def __init__(self, config: TokenFlowConfig) -> None:
        self.config = config
        self._next_decision_s = 0.0
        self._targets: list[Start] = []
        self._target_requests: dict[str, Request] = {}
        self._calm_until_s = -math.inf  # no stream can come within the critical slack before
        self._spare_rate_tps = 0.0  # reading rate waiting requests may still add
        self._rate_cap_tps = math.inf  # one stream's share of capacity at the feasible batch
        self._prefill_budget_s = 0.0  # prefill time newcomers may still take this interval
        self._capacity_floor = CapacityFloor(config.capacity_window_s)  # Gamma admission trusts
        self._paused_prices = PausedPrices()  # what is fixed while a member waits
        self.num_decisions = 0
        self.num_degraded_decisions = 0

    def init_new_token_ratio(self, config: SchedulerConfig) -> float:
        """A smaller reserve than SGLang's (`TokenFlowConfig.init_new_token_ratio`): a
        resident short of memory is paused with its buffer, not retracted."""
        ratio = min(config.init_new_token_ratio, self.config.init_new_token_ratio)
        return max(ratio, config.min_new_token_ratio)

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
        now, critical = view.now_s, self.config.critical_slack_s
        if now < self._calm_until_s:
            return False
        if any(r.slack_s(now) < critical for r in view.preempted) or any(
            r.slack_s(now) < critical for r in view.running if r.output_token_ids
        ):
            return True
        # Calm: until the earliest reader could be within the critical slack, no need to look
        # again (a stream's dry time only grows while it runs and is fixed while paused; a new
        # stream needs a waiting request, or a first token, which ends the calm at once).
        if any(not r.output_token_ids for r in view.running):
            return False
        dry = min((r.dry_s for r in chain(view.running, view.preempted)), default=math.inf)
        self._calm_until_s = dry - critical - 1e-9
        return False

    def decide(self, view: SchedulingView) -> Moves:
        """One scheduling decision: schedulability, admission, balancing, resume modes."""
        self.num_decisions += 1
        self._calm_until_s = -math.inf  # starts follow: look again at the next boundary
        growth = self.growth_tokens(view)
        started, costs, capacity, demand = self._started(view, growth)
        trusted = self._capacity_floor.observe(view.now_s, capacity)
        degraded = demand > capacity
        if degraded:
            self.num_degraded_decisions += 1
        admitted: list[Request] = []
        self._spare_rate_tps = 0.0
        queue_fits = self._queue_fits(view, trusted, demand)  # (then even past Gamma)
        if queue_fits or not degraded:
            spare = self._headroom(queue_fits) * trusted - demand
            admission = self._admission(view, started, spare)
            admitted = admission.requests  # (their demands: `_demand_tps` of each)
            self._spare_rate_tps = max(spare - sum(admission.demands_tps), 0.0)
        newcomers = newcomer_candidates(self.config, view, admitted, growth, costs)
        resumed, paused = self._balance(view, started, newcomers, degraded)
        offload = PreemptMode.OFFLOAD
        preemptions = tuple([Preemption(r.request_id, offload) for r in paused])
        self._targets = resume_starts(view, resumed, queued_io_blocks(view))
        self._target_requests = {r.request_id: r for r in resumed}
        return Moves(preemptions=preemptions, starts=tuple(self._targets))

    def _started(self, view: SchedulingView, growth: int) -> tuple[Started, Costs, float, float]:
        """The started members, the decision's costs, and (Gamma, the members' demand): the
        running members counted by buffer (`Residents`) and the paused ones priced for the
        rank the demand sets, where the view keeps the unsettled residents and the host can
        take any tail; else surveyed."""
        kv = view.kv
        if view.unsettled is None or kv.num_free_host_blocks < kv.config.num_device_blocks:
            costs = decision_costs(self.config, view)
            started = survey_started(self.config, view, growth, costs)
            return started, costs, *self._capacity_and_demand(view, started)
        members = StartedMembers(view)  # (count, footprint and demand from the view)
        capacity, demand = self._capacity_and_demand(view, members)
        by_arrival = demand > capacity
        costs, paused = price_paused(self.config, view, growth, self._paused_prices, by_arrival)
        members.fill(Residents(self.config, view, costs, growth), paused)
        return members, costs, capacity, demand

    def _balance(
        self,
        view: SchedulingView,
        started: Started,
        newcomers: list[Candidate],
        by_arrival: bool,
    ) -> tuple[list[Request], list[Request]]:
        """(Members to bring on, in priority order; residents to pause, in running order)."""
        blocks, max_seqs = view.kv.config.num_device_blocks, view.config.max_num_seqs
        budget_s = self.config.schedule_interval_s
        if isinstance(started, StartedMembers):
            residents, paused_members = started.residents, started.paused
            counted = balance_counted(
                paused_members, newcomers, residents, blocks, max_seqs, by_arrival, budget_s
            )
            if counted is not None:
                left_out = set(counted[1])
                paused = list(filter(left_out.__contains__, view.running)) if left_out else []
                return [c.request for c in counted[0]], paused
            # More pinned than slots: the greedy over every candidate (it raises).
            listed = residents.candidates() + paused_members
            num_pinned, pinned_blocks = residents.num_pinned, residents.pinned_footprint_blocks()
        else:
            listed = started.candidates
            num_pinned, pinned_blocks = started.num_implicit_pinned, started.implicit_pinned_blocks
        selected = balance(
            listed + newcomers, blocks, max_seqs, by_arrival, budget_s, num_pinned, pinned_blocks
        )
        chosen = {id(c.request) for c in selected}
        left = {c.request for c in listed if c.is_resident and id(c.request) not in chosen}
        paused = list(filter(left.__contains__, view.running)) if left else []
        return [c.request for c in selected if not c.is_resident], paused

    def _demand_tps(self, request: Request) -> float:
        """Tokens/s a member asks of the engine: its reading rate, at most one stream's share."""
        return min(request.rate_tps, self._rate_cap_tps)

    def _starts_between_decisions(self, view: SchedulingView) -> list[Start]:
        requests = self._target_requests  # started or finished since the decision: dropped
        self._targets = [s for s in self._targets if requests[s.request_id].state in _NOT_STARTED]
        if self._targets:
            self._calm_until_s = -math.inf
            return list(self._targets)
        # Work-conserving: free memory goes to the preempted streams nearest to stalling, then
        # to waiting ones within the rate budget (memory-aware FCFS admission).
        if view.kv.num_free_device_blocks == 0:
            return []
        # A preempted stream gains no tokens, so ordering by the time its reader runs dry
        # equals ordering by slack; the scheduler keeps that order (it is fixed while paused).
        preempted = view.preempted_by_dry
        waiting = waiting_within_budget(
            view,
            self._spare_rate_tps,
            self._prefill_budget_s,
            self._demand_tps,
            has_other_work=bool(view.running or preempted),
        )
        starts = fcfs_starts(view, candidates=preempted + waiting)
        if starts:
            self._calm_until_s = -math.inf
        num_new = len(starts) - len(preempted)
        if num_new > 0:
            self._spare_rate_tps -= sum(map(self._demand_tps, waiting[:num_new]))
            self._prefill_budget_s -= prefill_batch_time_s(
                view, sum(r.num_tokens for r in waiting[:num_new])
            )
        return starts

    def _survey_started(self, view: SchedulingView, growth: int) -> Survey:
        return survey_started(self.config, view, growth)

    # -- phase 1: schedulability ----------------------------------------------------------------
    def _lifetime_blocks(self, view: SchedulingView, started: Started) -> float:
        """beta: mean device blocks of a member over its life (of the waiting if no member)."""
        if started.num_members:
            return max(started.sum_lifetime_blocks / started.num_members, 1.0)
        waiting = lifetime_blocks(view.waiting, view.kv.block_size)
        return max(waiting / max(len(view.waiting), 1), 1.0)

    def _capacity(self, view: SchedulingView, started: Started) -> tuple[float, int]:
        """(Gamma, the feasible batch it is measured at)."""
        beta = self._lifetime_blocks(view, started)
        batch = max(1, min(view.config.max_num_seqs, int(view.kv.config.num_device_blocks / beta)))
        return view.estimator.capacity_tps(batch, beta * view.kv.block_size), batch

    def _capacity_and_demand(self, view: SchedulingView, started: Started) -> tuple[float, float]:
        """(Gamma, the members' demand); sets the per-reader cap `_demand_tps` applies: no
        reader takes more than one stream's share of the feasible batch."""
        capacity, batch = self._capacity(view, started)
        self._rate_cap_tps = capacity / batch
        return capacity, started.demand_tps(self._rate_cap_tps)

    def capacity_tps(self, view: SchedulingView) -> float:
        """Gamma: tokens/s the engine generates at the feasible batch, the number of members
        the device tier holds at their mean lifetime footprint (capped by max_num_seqs), each
        at that footprint's context."""
        return self._capacity(view, self._survey_started(view, 1))[0]

    def check_schedulable(self, view: SchedulingView, extra_rate_tps: float) -> bool:
        """True when the working set's total reading rate stays within capacity."""
        capacity, demand = self._capacity_and_demand(view, self._survey_started(view, 1))
        return demand + extra_rate_tps <= capacity

    # -- phase 2: admission (see admission.py) -------------------------------------------------
    def working_set_limit(self, view: SchedulingView) -> int:
        """W_sched (see `admission.working_set_limit`)."""
        started = self._survey_started(view, 1)
        return working_set_limit(self.config, view, self._lifetime_blocks(view, started))

    def can_pause(self, view: SchedulingView, request: Request) -> bool:
        """b_j >= mu * r_j * (tau_evict + tau_load + tau_schedule) (+ the critical slack)."""
        return survey(self.config, view, [request], 1).candidates[0].is_pausable

    def _admit(
        self, view: SchedulingView, started: Started, spare_rate_tps: float
    ) -> list[Request]:
        return self._admission(view, started, spare_rate_tps).requests

    def _admission(self, view: SchedulingView, started: Started, spare_rate_tps: float) -> Admitted:
        limit = working_set_limit(self.config, view, self._lifetime_blocks(view, started))
        budget_s = carried_prefill_budget_s(self.config.schedule_interval_s, self._prefill_budget_s)
        admitted = admit(view, started, limit, spare_rate_tps, self._rate_cap_tps, budget_s)
        if view.waiting:  # (with none waiting, the last decision's prefill budget stands)
            self._prefill_budget_s = admitted.prefill_budget_s
        return admitted

    def admit(self, view: SchedulingView) -> list[Request]:
        """Waiting requests that join the working set (see `admission.admit`), with the spare
        capacity (with headroom) this view leaves."""
        started = self._survey_started(view, 1)
        capacity, demand = self._capacity_and_demand(view, started)
        headroom = self._headroom(self._queue_fits(view, capacity, demand))
        return self._admit(view, started, headroom * capacity - demand)

    def _queue_fits(self, view: SchedulingView, capacity: float, demand: float) -> bool:
        """Whether the members and every waiting request ask at most `queue_headroom` x
        Gamma, where that exceeds `capacity_headroom`: then the whole queue may join, even
        past Gamma (where Gamma is right, a small deficit is cheaper spread as short stalls
        than paid by the last requests as one long wait; docs/overload.md).  Reads no more
        of the queue than fits."""
        room = self.config.queue_headroom * capacity - demand
        if room <= self.config.capacity_headroom * capacity - demand:
            return False
        queued = 0.0
        for request in view.waiting:
            queued += self._demand_tps(request)
            if queued > room:
                return False
        return queued <= room

    def _headroom(self, queue_fits: bool) -> float:
        """The share of Gamma admission may fill."""
        return self.config.queue_headroom if queue_fits else self.config.capacity_headroom

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
    def choose_resume_mode(
        self, view: SchedulingView, request: Request, queued_blocks: int | None = None
    ) -> Start:
        """Reload when t_IO (queued + own load traffic) beats the recompute time, or when the
        load lands before the reader runs dry: recomputing takes the whole batch's compute,
        a load only this stream's time (beyond the paper, whose rule is the first clause)."""
        if queued_blocks is None:
            queued_blocks = queued_io_blocks(view)
        return resume_starts(view, [request], queued_blocks)[0]

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
        """Running streams by buffered reading, largest first: likeliest to be preempted (ties
        by arrival).  Runs every step: `has_unsynced_full_block` and `slack_s` are written
        out, and the sort compares plain tuples (arrival indices are unique)."""
        if not self.config.write_through:
            return []
        now, kv, running = view.now_s, view.kv, RequestState.RUNNING
        bs, synced_of = kv.block_size, kv.synced_tokens_of
        keyed = [
            (-(r.dry_s - now) if r.output_token_ids else -0.0, r.arrival_s, r.arrival_index, r)
            for r in view.write_candidates
            if r.state is running and r.num_computed_tokens // bs > synced_of(r.request_id, 0) // bs
        ]
        keyed.sort()
        return list(map(_LAST, keyed))
