"""TokenFlow's buffer-aware preemptive policy (SPEC section 3).

Every `schedule_interval_s`, and only under stress (a request waits, or some stream's buffer is
within `critical_slack_s` of running dry), one decision runs in named phases:

1. schedulability  - if the working set's reading rates exceed the engine's capacity Gamma,
                     admit no one by preemption until they fit again: new requests start only
                     in free memory, FCFS (the members keep being balanced);
2. admission       - grow the working set while it is below W_sched and some running stream
                     can be paused safely (its buffer covers mu x an evict/load round trip);
3. balancing       - pick who is on the device: greedy by utility under device memory, then
                     adjacent-swap local search (see `balance.py`);
4. resume mode     - reload from the host tier or recompute, whichever is faster now.

Between decisions, the decided starts are carried out as memory frees, and FCFS fills what is
left.  The scheduler's mechanism does the rest (write-through copies ordered by buffer size).
"""

from __future__ import annotations

import math
from itertools import chain

from tokenflow.core.config import TokenFlowConfig
from tokenflow.core.policies.balance import Candidate, Survey, balance, survey
from tokenflow.core.policies.base import (
    Moves,
    Policy,
    Preemption,
    SchedulingView,
    Start,
    fcfs_starts,
)
from tokenflow.core.request import PreemptMode, Request, RequestState


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
        now, critical = view.now_s, self.config.critical_slack_s
        return any(r.slack_s(now) < critical for r in view.preempted) or any(
            r.slack_s(now) < critical for r in view.running if r.output_token_ids
        )

    def decide(self, view: SchedulingView) -> Moves:
        """One scheduling decision: schedulability, admission, balancing, resume modes."""
        self.num_decisions += 1
        growth = self.growth_tokens(view)
        started = self._survey_started(view, growth)
        capacity = self._capacity(view, started)
        self._degraded = started.sum_rate_tps > capacity
        if self._degraded:
            self.num_degraded_decisions += 1
            admitted: list[Request] = []
        else:
            admitted = self._admit(view, started, capacity - started.sum_rate_tps)
        newcomers = survey(self.config, view, admitted, growth).candidates
        selected = balance(
            started.candidates + newcomers,
            view.kv.config.num_device_blocks,
            view.config.max_num_seqs,
            self.config.local_search_passes,
        )
        chosen = {c.request.request_id for c in selected}
        preemptions = tuple(
            Preemption(r.request_id, PreemptMode.OFFLOAD)
            for r in view.running
            if r.request_id not in chosen
        )
        queued = self._queued_load_blocks(view)
        self._targets = [
            self.choose_resume_mode(view, c.request, queued) for c in selected if not c.is_resident
        ]
        return Moves(preemptions=preemptions, starts=tuple(self._targets))

    def _starts_between_decisions(self, view: SchedulingView) -> list[Start]:
        live = {r.request_id for r in view.waiting} | {r.request_id for r in view.preempted}
        self._targets = [s for s in self._targets if s.request_id in live]
        if self._targets:
            return list(self._targets)
        # Work-conserving: free memory goes to the preempted streams nearest to stalling, then
        # to waiting ones (memory-aware FCFS admission, also when degraded).
        if view.kv.num_free_device_blocks == 0:
            return []
        # A preempted stream gains no tokens, so ordering by the time its reader runs dry
        # (last consumption + 1/r) equals ordering by slack, without reading the clock.
        preempted = sorted(
            view.preempted, key=lambda r: (r.last_consume_s + 1.0 / r.rate_tps, r.sort_key)
        )
        return fcfs_starts(view, candidates=preempted + list(view.waiting))

    def _survey_started(self, view: SchedulingView, growth: int) -> Survey:
        return survey(self.config, view, chain(view.running, view.preempted), growth)

    # -- phase 1: schedulability ----------------------------------------------------------------
    def _capacity(self, view: SchedulingView, started: Survey) -> float:
        members = len(started.candidates)
        if members:
            mean_tokens = started.sum_tokens / members
        else:
            mean_tokens = sum(r.num_tokens for r in view.waiting) / max(len(view.waiting), 1)
        fit = int(view.kv.config.num_device_blocks / view.kv.blocks_for(int(mean_tokens) + 1))
        batch = max(1, min(view.config.max_num_seqs, fit, max(len(view.running), 1)))
        return view.estimator.capacity_tps(batch)

    def capacity_tps(self, view: SchedulingView) -> float:
        """Gamma: tokens/s the engine generates at the current batch (SPEC section 3): the
        device-resident count, or the count that fits at current contexts when smaller."""
        return self._capacity(view, self._survey_started(view, 1))

    def check_schedulable(self, view: SchedulingView, extra_rate_tps: float) -> bool:
        """True when the working set's total reading rate stays within capacity."""
        started = self._survey_started(view, 1)
        return started.sum_rate_tps + extra_rate_tps <= self._capacity(view, started)

    # -- phase 2: admission ---------------------------------------------------------------------
    def _working_set_limit(self, view: SchedulingView, started: Survey) -> int:
        if started.candidates:
            beta = started.sum_lifetime_blocks / len(started.candidates)
        else:
            waiting = survey(self.config, view, view.waiting, 1)
            beta = waiting.sum_lifetime_blocks / max(len(view.waiting), 1)
        total = view.kv.config.num_device_blocks + view.kv.config.num_host_blocks
        w_static = max(1, int(total / max(beta, 1.0)))
        num_running = len(view.running)
        if num_running < w_static:
            smoothing = self.config.working_set_smoothing
            return math.ceil(w_static - smoothing * (w_static - num_running))
        return w_static

    def working_set_limit(self, view: SchedulingView) -> int:
        """W_sched from W_static = floor(M / beta), smoothed toward the running count by lambda.

        M counts both tiers (members not selected live in host memory); beta is the mean
        lifetime footprint (prompt + half the output budget: KV grows linearly while decoding).
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
        pausable = started.num_pausable
        free = view.kv.num_free_device_blocks - sum(view.reserve_blocks(r) for r in view.running)
        extra_rate = 0.0
        admitted: list[Request] = []
        for request in view.waiting:
            if size >= limit or extra_rate + request.rate_tps > spare_rate_tps:
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

    def admit(self, view: SchedulingView) -> list[Request]:
        """Waiting requests that join the working set, in arrival order, while it is below
        W_sched, their rates fit in the spare capacity, and each finds free memory or a running
        stream that can be paused safely."""
        started = self._survey_started(view, 1)
        spare = self._capacity(view, started) - started.sum_rate_tps
        return self._admit(view, started, spare)

    # -- phase 3: buffer balancing --------------------------------------------------------------
    def growth_tokens(self, view: SchedulingView) -> int:
        """Tokens a running stream gains in one interval at the current step time."""
        step_s = view.estimator.decode_time_s(len(view.running) or 1)
        return int(self.config.schedule_interval_s / step_s)

    def candidate(self, view: SchedulingView, request: Request) -> Candidate:
        """Utility, device footprint over the next interval, and pinning of one member."""
        return survey(self.config, view, [request], self.growth_tokens(view)).candidates[0]

    def balance(self, view: SchedulingView, candidates: list[Candidate]) -> list[Candidate]:
        """Who is on the device next (see `balance.balance`)."""
        return balance(
            candidates,
            view.kv.config.num_device_blocks,
            view.config.max_num_seqs,
            self.config.local_search_passes,
        )

    # -- phase 4: reload or recompute -----------------------------------------------------------
    @staticmethod
    def _queued_load_blocks(view: SchedulingView) -> int:
        return sum(
            view.kv.blocks_for(r.num_computed_tokens)
            for r in view.running
            if r.state is RequestState.LOADING
        )

    def choose_resume_mode(
        self, view: SchedulingView, request: Request, queued_blocks: int | None = None
    ) -> Start:
        """Reload when t_IO (queued + own load traffic) beats the recompute time."""
        if not view.kv.has_host_copy(request.request_id, request.num_computed_tokens):
            return Start(request.request_id, by_load=False)
        if queued_blocks is None:
            queued_blocks = self._queued_load_blocks(view)
        own_blocks = view.kv.blocks_for(request.num_computed_tokens)
        bytes_per_s = view.config.link_bytes_per_s
        io_s = (queued_blocks + own_blocks) * view.kv.config.block_bytes / bytes_per_s
        recompute_s = view.estimator.prefill_time_s(request.num_tokens)
        return Start(request.request_id, by_load=io_s <= recompute_s)

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
