"""Capacity and schedulability (paper section 4.3): what the engine can generate, and whether
the working set's readers ask more than that.

Gamma is the engine's generation rate (tokens/s) at the feasible batch: as many streams as the
device tier holds at the members' mean lifetime footprint beta (capped by max_num_seqs), each
at that footprint's context.  The working set is schedulable while the sum of its requests'
demands stays within Gamma (`request_demand_tps`):

- a reader asks its rate whole: a reader faster than its slot's share of Gamma is demand no
  schedule at that batch meets, and counting it as only its share would hide a slow engine (20
  readers of 2-4 tok/s on an engine making 25 tok/s at a batch of 32 looked schedulable at
  0.8 tok/s each); at most what the engine gives one stream alone (`Capacity.solo_tps`): a
  reader faster than that stalls whatever the schedule, as an eager client waits;
- an eager or batch stream (an infinite rate) asks one stream's share of Gamma: it takes its
  slot and no more.

Gamma is trusted only as far as steps were measured (`trusted_batch`): until the estimator has
timed decode steps of a batch, the feasible batch counts as at most twice the largest batch it
has timed (Gamma at one stream before any step).  Admission spends Gamma, so the first burst on
a fresh engine joins in steps as measured step times arrive, not wholesale on the prior's guess
of the machine's speed at a full batch.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate

from tokenflow.core.estimator import StepTimeEstimator
from tokenflow.core.policies.base import SchedulingView
from tokenflow.core.policies.pricing import lifetime_blocks
from tokenflow.core.request import Request

SLOW_START_FACTOR = 2  # Gamma trusted up to this many times the largest batch timed


@dataclass(frozen=True)
class Capacity:
    """Gamma, the batch it is measured at, and what one stream alone gets."""

    gamma_tps: float  # tokens/s the engine generates at the feasible batch
    batch: int  # the feasible batch: streams the device tier holds at beta (`trusted_batch`)
    beta_blocks: float  # the members' mean lifetime footprint
    solo_tps: float  # tokens/s of one stream decoding alone at beta's context

    @property
    def share_tps(self) -> float:
        """One stream's share of Gamma: what an eager or batch stream asks."""
        return self.gamma_tps / self.batch

    def demand_tps(self, requests: Iterable[Request]) -> float:
        """The requests' demands (`request_demand_tps`), summed."""
        share_tps, solo_tps = self.share_tps, self.solo_tps
        return sum(request_demand_tps(r.rate_tps, share_tps, solo_tps) for r in requests)


def request_demand_tps(rate_tps: float, share_tps: float, solo_tps: float) -> float:
    """Tokens/s a request of `rate_tps` asks of the engine (module docstring): a reader its
    rate, at most `solo_tps`; an eager or batch request (infinite rate) `share_tps`."""
    return share_tps if math.isinf(rate_tps) else min(rate_tps, solo_tps)


def mean_lifetime_blocks(view: SchedulingView) -> float:
    """beta: the started members' mean lifetime footprint (the waiting's when none started),
    a shared block at its share (`SchedulingView.shared_blocks`)."""
    members = [*view.running, *view.preempted] or list(view.waiting)
    if not members:
        return 1.0
    bs = view.kv.block_size
    total = sum(lifetime_blocks(r, bs) - view.shared_blocks(r) for r in members)
    return max(total / len(members), 1.0)


def measure_capacity(view: SchedulingView, beta: float | None = None) -> Capacity:
    """Gamma at the feasible batch (module docstring); at footprint `beta` blocks if given."""
    beta = mean_lifetime_blocks(view) if beta is None else beta
    fit = int(view.kv.config.num_device_blocks / beta)
    estimator, context = view.estimator, beta * view.kv.block_size
    batch = trusted_batch(estimator, max(1, min(view.config.max_num_seqs, fit)))
    gamma = estimator.capacity_tps(batch, context)
    return Capacity(gamma, batch, beta, solo_tps=estimator.capacity_tps(1, context))


def trusted_batch(estimator: StepTimeEstimator, batch: int) -> int:
    """`batch`, at most `SLOW_START_FACTOR` x the largest decode batch the estimator has timed
    (1 before any): beyond that Gamma is the prior's guess, not a measurement."""
    return max(1, min(batch, SLOW_START_FACTOR * estimator.max_timed_batch))


def served_set(
    view: SchedulingView, capacity: Capacity, requests: Sequence[Request]
) -> list[Request]:
    """Of `requests`, in the order given, each that still lets every one taken keep reading:
    the smallest batch up to the feasible one that generates their demands' sum (it gives each
    stream the most) still gives one stream the largest demand.  The first is always taken
    (its demand is at most what one stream alone gets); a request that does not fit is passed
    over, not the ones after it.  O(log batch) a request: Gamma grows with the batch."""
    context = capacity.beta_blocks * view.kv.block_size
    steps_s = [view.estimator.decode_time_s(b, context) for b in range(1, capacity.batch + 1)]
    rates_tps = list(accumulate((b / s for b, s in enumerate(steps_s, 1)), max))
    share_tps, solo_tps = capacity.share_tps, capacity.solo_tps
    served: list[Request] = []
    total_tps = fastest_tps = 0.0
    for request in requests:
        demand_tps = request_demand_tps(request.rate_tps, share_tps, solo_tps)
        total, fastest = total_tps + demand_tps, max(fastest_tps, demand_tps)
        index = bisect_left(rates_tps, total)  # (the smallest batch, less one, generating it)
        fits = index < len(steps_s) and 1.0 / steps_s[index] >= fastest
        if fits or not served:
            served.append(request)
            total_tps, fastest_tps = total, fastest
    return served


def degraded_served(
    view: SchedulingView, capacity: Capacity, requests: Sequence[Request]
) -> list[Request]:
    """Of `requests` (started, in arrival order, asking more than Gamma), those an overloaded
    decision serves: all of them while they fit the feasible batch, else the served set
    (`served_set`).

    Within the batch, serving all stalls less reading than any served set: the batch of all
    makes more tokens/s than a smaller one, the balancer gives them to the readers nearest to
    running dry, and a reader fed a share f of its rate stalls 1 - f of its time while one
    left out stalls all of it (the summed stall share falls with every token generated).
    Andes' QoE agrees: a reader fed at f for its whole stream scores about 1 / (2 - f), at
    least 0.5; one that waits its reading time and then reads at pace, 1/3 (docs/design.md
    has what the served set lost on a CPU).  Past the feasible batch a spread would rotate
    streams over the link; the served set keeps the ones served fed and pauses the rest."""
    if len(requests) <= capacity.batch:
        return list(requests)
    return served_set(view, capacity, requests)


def paced_batch(view: SchedulingView, requests: Iterable[Request], demand_tps: float) -> int:
    """The most streams one decode step may hold: the largest batch whose predicted step keeps
    one token per step within the fastest started reader among `requests` that the batch
    generating `demand_tps` still feeds (each stream added slows every step), and at least
    that batch (a pace that leaves the readers' total rate unserved stalls them all).  A reader
    faster than its slot at that batch stalls at any pace that serves the rest: it gets its
    slot, and the pace is kept for the readers who can keep reading.  At least 1; max_num_seqs
    when no started reader has a finite rate."""
    limit = view.config.max_num_seqs
    rates = [r.rate_tps for r in requests if r.is_reader and r.output_token_ids]
    if not rates:
        return limit
    estimator = view.estimator
    needed = 1  # the smallest batch that generates the demand
    while needed < limit and estimator.capacity_tps(needed) < demand_tps:
        needed += 1
    needed_step_s = estimator.decode_time_s(needed)
    step_s = 1.0 / max((r for r in rates if r * needed_step_s <= 1.0), default=min(rates))
    batch = needed
    while batch < limit and estimator.decode_time_s(batch + 1) <= step_s:
        batch += 1
    return batch


class CapacityFloor:
    """The lower median of Gamma over the last `window_s` of decisions: what admission trusts.
    One high estimate would admit a whole burst whose readers then stall; so a rise is trusted
    once it holds for most of the window, a fall once it holds for half (docs/design.md)."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._recent: deque[tuple[float, float]] = deque()  # (decision time, Gamma)
        self._sorted: list[float] = []  # the window's Gamma values, ascending

    def observe(self, now_s: float, gamma_tps: float) -> float:
        """Record this decision's Gamma; the window's lower median (`statistics.median_low`)."""
        while self._recent and self._recent[0][0] < now_s - self._window_s:
            _, old = self._recent.popleft()
            del self._sorted[bisect_left(self._sorted, old)]
        self._recent.append((now_s, gamma_tps))
        insort(self._sorted, gamma_tps)
        return self._sorted[(len(self._sorted) - 1) // 2]
