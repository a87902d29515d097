"""TokenFlow's buffer-aware preemptive policy (the paper's section 4), with an overload rule.

Every `schedule_interval_s`, and only under stress (a request waits, or some started stream's
reader is within `critical_slack_s` of running dry), one decision runs four phases, each in its
own module (each formula in `pricing.py`): capacity (`capacity.py`, section 4.3: Gamma; when the
members' rates exceed it the decision degrades to arrival order), admission (`admission.py`,
step 1), balancing (`balance.py`, step 2: who is on the device; resident members left out are
paused by offload) and resume modes (`resume.py`, step 3: reload or recompute, the faster).

A newcomer also waits while its prefill would stall a resident reader longer than
`prefill_stall_s` (`pricing.prefill_added_stall_s`, beyond the paper): a prefill step outlasts
the buffer of a reader paced close to its rate.

Overload rule (beyond the paper): a waiting request starts only while the working set's reading
rates fit the engine's capacity (the lower median of recent Gammas, `capacity.CapacityFloor`),
also between decisions, so a burst that wants more tokens/s than the engine makes waits in
arrival order instead of joining and stalling everyone; unless the whole queue fits in
`queue_headroom` x Gamma (off by default): then it all joins, the deficit spread as stalls.

Eager and batch requests (`Consumption`) read at an infinite rate: their buffer is always
empty, so they are never paused for it, rank as readers about to run dry, ask one stream's share
of Gamma, and yield the device only to a paused reader about to run dry (`balance.py`).

Between decisions the decided starts are carried out as memory frees; free memory then goes to
the paused streams nearest to running dry, then to waiting requests within the rate and prefill
budgets the last decision left (memory-aware FCFS; a drained queue refills the prefill budget),
never past the last decision's paced batch (`capacity.paced_batch`).  When every paused and
waiting request fits the device and all readers' rates fit Gamma, they all start at once, as
under FCFS: there is no decision to make.

Write-through copies go largest buffer first (section 5: the likeliest paused is synced first).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from tokenflow.core.config import SchedulerConfig, TokenFlowConfig
from tokenflow.core.policies.admission import (
    DemandOf,
    admit,
    refilled_prefill_budget_s,
    spare_engine_share,
    waiting_within_budget,
    working_set_limit,
)
from tokenflow.core.policies.balance import select
from tokenflow.core.policies.base import (
    Moves,
    Policy,
    Preemption,
    SchedulingView,
    Start,
    WaitReason,
    fcfs_starts,
)
from tokenflow.core.policies.capacity import (
    Capacity,
    CapacityFloor,
    degraded_served,
    measure_capacity,
    paced_batch,
    request_demand_tps,
)
from tokenflow.core.policies.pricing import (
    Member,
    Prices,
    decode_step_s,
    is_pausable,
    member,
    outlasts,
    prefill_hold_s,
    prefill_price_s,
)
from tokenflow.core.policies.resume import resume_start
from tokenflow.core.request import PreemptMode, Request, RequestState

_OFF_DEVICE = (RequestState.WAITING, RequestState.PREEMPTED)
logger = logging.getLogger(__name__)
_OVERLOAD_OVER = 0.9  # overload is logged as over once demand is this share of Gamma or less


@dataclass(frozen=True)
class Decision:
    """What the last decision left for the steps until the next one."""

    next_decision_s: float = 0.0  # no new decision before this time
    preemptions: tuple[Preemption, ...] = ()  # its pauses (carried out when it was made)
    # Its starts not carried out yet, with their requests (a start whose request has started
    # or finished since is dropped).
    starts: tuple[Start, ...] = ()
    start_requests: Mapping[str, Request] = field(default_factory=dict)
    spare_rate_tps: float = 0.0  # reading rate waiting requests may still add
    share_tps: float = math.inf  # what an eager or batch request asks (`Capacity.share_tps`)
    solo_tps: float = math.inf  # the most a reader's rate counts for (`Capacity.solo_tps`)
    max_batch: int = 1 << 30  # the most streams on the device (`capacity.paced_batch`)
    prefill_budget_s: float = 0.0  # prefill time newcomers may still take this interval
    is_overloaded: bool = False  # the started streams ask more than Gamma
    unserved: frozenset[str] = frozenset()  # started streams left out of the served set

    @property
    def moves(self) -> Moves:
        """The moves it makes when it is made."""
        return Moves(preemptions=self.preemptions, starts=self.starts)

    def demand_tps(self, request: Request) -> float:
        """What `request` asks of the engine, as the decision measured."""
        return request_demand_tps(request.rate_tps, self.share_tps, self.solo_tps)


@dataclass(frozen=True)
class _Admitted:
    """Admission's answer: who joins, and the budgets left for arrivals before the next
    decision."""

    requests: list[Request]
    spare_rate_tps: float
    prefill_budget_s: float


class TokenFlowPolicy(Policy):
    """Preempts streams with large buffers so waiting ones start; resumes before buffers run dry."""

    name = "tokenflow"

    def __init__(self, config: TokenFlowConfig) -> None:
        self.config = config
        self.last_decision = Decision()
        self._capacity_floor = CapacityFloor(config.capacity_window_s)  # recent Gammas
        self.num_decisions = 0
        self.num_degraded_decisions = 0
        self._logged_overload = False  # the overload state the log last said (`_note_overload`)

    def init_new_token_ratio(self, config: SchedulerConfig) -> float:
        """A smaller reserve than SGLang's (`TokenFlowConfig.init_new_token_ratio`): a
        resident short of memory is paused with its buffer, not retracted."""
        ratio = min(config.init_new_token_ratio, self.config.init_new_token_ratio)
        return max(ratio, config.min_new_token_ratio)

    def plan_moves(self, view: SchedulingView) -> Moves:
        """Room for everyone: FCFS; else a full decision at interval boundaries under stress,
        and between them carry out the last one."""
        last = self.last_decision
        if (view.waiting or view.preempted) and (everyone := self._room_for_everyone(view)):
            if view.now_s >= last.next_decision_s:  # (in place of the decision due)
                next_s = view.now_s + self.config.schedule_interval_s
                self.last_decision = replace(last, next_decision_s=next_s)
            return Moves(starts=tuple(everyone))
        if not view.waiting:
            refilled_s = refilled_prefill_budget_s(
                self.config.schedule_interval_s, last.prefill_budget_s, queue_drained=True
            )
            last = replace(last, prefill_budget_s=refilled_s)
        if view.now_s >= last.next_decision_s and self.is_stressed(view):
            self.last_decision = self.decide(view, last)
            return self.last_decision.moves
        self.last_decision, starts = self._between_decisions(view, last)
        return Moves(starts=tuple(starts))

    def _room_for_everyone(self, view: SchedulingView) -> list[Start]:
        """Every paused and waiting request's start when all fit the device beside the
        residents' reserve and all readers' rates fit `capacity_headroom` x Gamma: then FCFS
        serves them all at once, and no pause or pacing would buy any reader anything; else
        none."""
        everyone = fcfs_starts(view)
        if len(everyone) < len(view.waiting) + len(view.preempted):
            return []
        capacity = measure_capacity(view)
        requests = (*view.running, *view.preempted, *view.waiting)
        fits = capacity.demand_tps(requests) <= self.config.capacity_headroom * capacity.gamma_tps
        return everyone if fits else []

    def is_stressed(self, view: SchedulingView) -> bool:
        """Some request waits, or some started stream's reader is close to running dry."""
        if view.waiting:
            return True
        now, critical_s = view.now_s, self.config.critical_slack_s
        started = [*view.preempted, *(r for r in view.running if r.output_token_ids)]
        return any(r.slack_s(now) < critical_s for r in started)

    def decide(self, view: SchedulingView, last: Decision | None = None) -> Decision:
        """One scheduling decision: capacity, admission, balancing, resume modes (`last`: the
        decision before it, whose prefill budget carries over; default the policy's last)."""
        last = self.last_decision if last is None else last
        self.num_decisions += 1
        cfg = self.config
        growth = self.growth_tokens(view)
        prices = Prices.at(self.config, view)
        started_requests = (*view.running, *view.preempted)
        capacity = measure_capacity(view)
        demand_tps = capacity.demand_tps(started_requests)
        degraded = demand_tps > capacity.gamma_tps
        self.num_degraded_decisions += int(degraded)
        served = self._served(view, capacity, started_requests, demand_tps)
        self._note_overload(demand_tps, capacity.gamma_tps, len(served), started_requests)
        started = [member(cfg, view, r, growth, prices) for r in started_requests]
        admitted = self._admission(view, last, capacity, demand_tps, degraded, started)
        newcomers = [member(cfg, view, r, growth, prices) for r in admitted.requests]
        hold_s = prefill_hold_s(view, sum(map(view.start_tokens, admitted.requests)))
        kept = _kept(started, served, hold_s)
        served_requests = [m.request for m in kept]
        paced = [*served_requests, *admitted.requests]
        max_batch = paced_batch(view, paced, capacity.demand_tps(paced))
        selected = select(
            [*kept, *newcomers],
            view.kv.config.num_device_blocks,
            max_batch,
            by_arrival=degraded and len(served) == len(started_requests),
            resume_budget_s=cfg.schedule_interval_s,
        )
        chosen = {m.request.request_id for m in selected}
        left_out = [r for r in view.running if r.request_id not in chosen]
        queued = view.num_queued_io_blocks
        resumed = [m.request for m in selected if not m.is_resident]
        return Decision(
            next_decision_s=view.now_s + cfg.schedule_interval_s,
            preemptions=tuple(Preemption(r.request_id, PreemptMode.OFFLOAD) for r in left_out),
            starts=tuple(resume_start(view, r, queued) for r in resumed),
            start_requests={r.request_id: r for r in resumed},
            spare_rate_tps=admitted.spare_rate_tps,
            share_tps=capacity.share_tps,
            solo_tps=capacity.solo_tps,
            max_batch=max_batch,
            prefill_budget_s=admitted.prefill_budget_s,
            is_overloaded=degraded,
            unserved=frozenset(r.request_id for r in started_requests)
            - {r.request_id for r in served_requests},
        )

    def _note_overload(
        self, demand_tps: float, gamma_tps: float, num_served: int, started: Sequence[Request]
    ) -> None:
        """One log line as the engine enters overload (its started streams ask more than
        Gamma), one as it leaves it: once they ask at most `_OVERLOAD_OVER` of Gamma, so a
        demand hovering at Gamma logs once, not every decision."""
        if not self._logged_overload and demand_tps > gamma_tps:
            self._logged_overload = True
            num_readers = sum(1 for r in started if r.is_reader)
            logger.warning(
                "overloaded: streams ask %.1f tok/s of the %.1f the engine makes; serving %d of "
                "%d started streams (%d readers), new requests wait",
                demand_tps, gamma_tps, num_served, len(started), num_readers,
            )  # fmt: skip
        elif self._logged_overload and demand_tps <= _OVERLOAD_OVER * gamma_tps:
            self._logged_overload = False
            logger.info(
                "overload over: streams ask %.1f tok/s of the %.1f the engine makes",
                demand_tps, gamma_tps,
            )  # fmt: skip

    def _served(
        self,
        view: SchedulingView,
        capacity: Capacity,
        started: Sequence[Request],
        demand_tps: float,
    ) -> frozenset[str]:
        """The started streams the decision serves: all of them while their demand fits
        `queue_headroom` x Gamma (at most Gamma by default); past it, `capacity.degraded_served`
        in arrival order: still all of them while they fit the feasible batch (sharing it
        stalls the least reading), else the served set, so the readers served keep reading and
        the stalls fall on the fewest, the latest arrivals."""
        if demand_tps <= max(self.config.queue_headroom, 1.0) * capacity.gamma_tps:
            return frozenset(r.request_id for r in started)
        in_order = sorted(started, key=lambda r: r.sort_key)
        return frozenset(r.request_id for r in degraded_served(view, capacity, in_order))

    def growth_tokens(self, view: SchedulingView) -> int:
        """Tokens a running stream gains in one interval at the current step time."""
        return int(self.config.schedule_interval_s / decode_step_s(view))

    # -- admission and the overload rule ---------------------------------------------------------
    def _admission(
        self,
        view: SchedulingView,
        last: Decision,
        capacity: Capacity,
        demand_tps: float,
        degraded: bool,
        started: list[Member],
    ) -> _Admitted:
        """The waiting requests admitted, and the budgets left for starts between decisions."""
        trusted_tps = self._capacity_floor.observe(view.now_s, capacity.gamma_tps)
        share_tps, solo_tps = capacity.share_tps, capacity.solo_tps

        def demand_of(request: Request) -> float:
            return request_demand_tps(request.rate_tps, share_tps, solo_tps)

        queue_fits = self._queue_fits(view, trusted_tps, demand_tps, demand_of)
        if degraded and not queue_fits:
            return _Admitted([], spare_rate_tps=0.0, prefill_budget_s=last.prefill_budget_s)
        cfg = self.config
        headroom = cfg.queue_headroom if queue_fits else cfg.capacity_headroom
        spare_tps = headroom * trusted_tps - demand_tps
        if not view.waiting:  # (the last decision's prefill budget stands)
            return _Admitted([], max(spare_tps, 0.0), last.prefill_budget_s)
        budget_s = refilled_prefill_budget_s(
            cfg.schedule_interval_s,
            last.prefill_budget_s,
            queue_drained=False,
            spare_share=spare_engine_share(demand_tps, trusted_tps),
        )
        admission = admit(
            view,
            members=started,
            limit=working_set_limit(cfg, view, capacity.beta_blocks),
            spare_rate_tps=spare_tps,
            demand_of=demand_of,
            prefill_budget_s=budget_s,
            margin_s=cfg.critical_slack_s,
            prefill_stall_s=cfg.prefill_stall_s,
        )
        return _Admitted(
            admission.requests,
            spare_rate_tps=max(spare_tps - admission.rate_tps, 0.0),
            prefill_budget_s=admission.prefill_budget_s,
        )

    def _queue_fits(
        self, view: SchedulingView, gamma_tps: float, demand_tps: float, demand_of: DemandOf
    ) -> bool:
        """Whether members and queue ask at most `queue_headroom` x Gamma, where that is more
        than `capacity_headroom` allows: then the whole queue may join, even past Gamma."""
        room_tps = self.config.queue_headroom * gamma_tps - demand_tps
        wider = room_tps > self.config.capacity_headroom * gamma_tps - demand_tps
        return wider and sum(map(demand_of, view.waiting)) <= room_tps

    # -- between decisions -----------------------------------------------------------------------
    def _between_decisions(
        self, view: SchedulingView, last: Decision
    ) -> tuple[Decision, list[Start]]:
        """The last decision's starts not yet carried out; else work-conserving starts within
        its budgets.  Returns the decision as these starts leave it, and the starts."""
        requests = last.start_requests
        pending = tuple(s for s in last.starts if requests[s.request_id].state in _OFF_DEVICE)
        if pending:
            return replace(last, starts=pending), list(pending)
        last = replace(last, starts=(), start_requests={})
        if view.kv.num_free_device_blocks == 0:
            return last, []
        # (a paused stream gains no tokens: by when its reader runs dry is by slack; one the
        # decision left out of its served set waits for the next decision)
        served = [r for r in view.preempted if r.request_id not in last.unserved]
        preempted = sorted(served, key=lambda r: (r.dry_s, r.sort_key))
        has_other_work = bool(view.running or preempted)
        waiting = waiting_within_budget(
            view,
            last.spare_rate_tps,
            last.prefill_budget_s,
            last.demand_tps,
            has_other_work,
            self.config.prefill_stall_s,
        )
        starts = fcfs_starts(view, candidates=preempted + waiting, max_num_seqs=last.max_batch)
        new = waiting[: max(len(starts) - len(preempted), 0)]
        if new:
            last = replace(
                last,
                spare_rate_tps=last.spare_rate_tps - sum(map(last.demand_tps, new)),
                prefill_budget_s=last.prefill_budget_s
                - prefill_price_s(view, sum(map(view.start_tokens, new))),
            )
        return last, starts

    # -- mechanism hooks -------------------------------------------------------------------------
    def wait_reason(self, request: Request) -> WaitReason | None:
        """Off the device while the last decision found the engine overloaded: a waiting
        request, or a paused stream it left out of its served set, waits for the overload
        (`WaitReason.OVERLOAD`); otherwise a paused stream reads its buffer and a waiting one
        waits for admission."""
        last, state = self.last_decision, request.state
        if state is RequestState.WAITING:
            return WaitReason.OVERLOAD if last.is_overloaded else WaitReason.QUEUED
        if state is RequestState.PREEMPTED:
            is_unserved = request.request_id in last.unserved
            return WaitReason.OVERLOAD if is_unserved else WaitReason.BUFFERED
        return None

    def choose_oom_victim(self, candidates: list[Request], view: SchedulingView) -> Preemption:
        """Offload the pausable stream with the most reading buffered; else the decoding one
        with the most (its KV goes to the host, or is dropped when the host has no room: a
        recompute of a long prompt costs seconds of every stream's steps, a reload a few
        blocks of link); else SGLang's rule."""
        prices = Prices.at(self.config, view)
        pausable = [r for r in candidates if is_pausable(self.config, view, r, prices)]
        decoding = pausable or [r for r in candidates if r.is_decoding]
        if not decoding:
            return super().choose_oom_victim(candidates, view)
        victim = max(decoding, key=lambda r: (r.slack_s(view.now_s), r.sort_key))
        return Preemption(victim.request_id, PreemptMode.OFFLOAD)

    def write_through_order(
        self, view: SchedulingView, pending: Iterable[Request]
    ) -> list[Request]:
        """Running streams by buffered reading, largest first: likeliest to be paused (ties by
        arrival).  Runs every step, over the streams with a full block to copy."""
        if not self.config.write_through:
            return []
        now = view.now_s
        running = [r for r in pending if r.state is RequestState.RUNNING]
        return sorted(running, key=lambda r: (-r.slack_s(now), r.sort_key))


def _kept(started: Sequence[Member], served: frozenset[str], hold_s: float) -> list[Member]:
    """The started members the balancer may keep: those in the served set, and an unserved one
    mid-prefill (it cannot pause; an unserved decoding stream is paused however short its
    buffer).  One whose buffer does not outlast the newcomers' prefill (`hold_s`) cannot be
    paused for them: it stays pinned."""
    return [
        m if outlasts(m, hold_s) else replace(m, pause_margin_s=-math.inf)
        for m in started
        if m.request.request_id in served or (m.is_pinned and not m.request.is_decoding)
    ]
