"""Capacity and schedulability (paper section 4.3): what the engine can generate, and whether
the working set's readers ask more than that.

Gamma is the engine's generation rate (tokens/s) at the feasible batch: as many streams as the
device tier holds at the members' mean lifetime footprint beta (capped by max_num_seqs), each
at that footprint's context.  The working set is schedulable while the sum of its readers'
rates stays within Gamma; each reader counts at most one stream's share of Gamma (a reader
faster than the engine can serve it cannot take more than its slot).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from tokenflow.core.policies.base import SchedulingView
from tokenflow.core.policies.pricing import lifetime_blocks
from tokenflow.core.request import Request


@dataclass(frozen=True)
class Capacity:
    """Gamma and the batch it is measured at."""

    gamma_tps: float  # tokens/s the engine generates at the feasible batch
    batch: int  # the feasible batch: streams the device tier holds at beta
    beta_blocks: float  # the members' mean lifetime footprint

    @property
    def rate_cap_tps(self) -> float:
        """One stream's share of Gamma: the most a single reader's rate counts for."""
        return self.gamma_tps / self.batch

    def demand_tps(self, requests: Iterable[Request]) -> float:
        """The readers' demands, summed."""
        cap_tps = self.rate_cap_tps
        return sum(reader_demand_tps(r, cap_tps) for r in requests)

    def asked_tps(self, requests: Iterable[Request]) -> float:
        """What the requests ask, whole: a reader its stated rate, past its slot's share too
        (that part no schedule meets: it shows a slow engine), an eager or batch stream one
        share.  Above Gamma the engine is overloaded, whatever `demand_tps` says."""
        cap_tps = self.rate_cap_tps
        return sum(r.rate_tps if r.is_reader else cap_tps for r in requests)


def reader_demand_tps(request: Request, rate_cap_tps: float) -> float:
    """Tokens/s a reader asks of the engine: its rate, at most one stream's share of Gamma."""
    return min(request.rate_tps, rate_cap_tps)


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
    batch = max(1, min(view.config.max_num_seqs, fit))
    gamma = view.estimator.capacity_tps(batch, beta * view.kv.block_size)
    return Capacity(gamma, batch, beta)


def paced_batch(view: SchedulingView, requests: Iterable[Request], demand_tps: float) -> int:
    """The most streams one decode step may hold: the largest batch whose predicted step keeps
    one token per step within the fastest started reader among `requests` (a reader faster than
    the engine's per-stream rate stalls however the device is shared, and each stream added
    slows every step), or, if larger, the smallest batch that generates `demand_tps` (a pace
    that leaves the readers' total rate unserved stalls them all).  At least 1; max_num_seqs
    when no started reader has a finite rate."""
    limit = view.config.max_num_seqs
    rates = [r.rate_tps for r in requests if r.is_reader and r.output_token_ids]
    if not rates:
        return limit
    step_s, estimator = 1.0 / max(rates), view.estimator
    batch = 1
    while batch < limit and (
        estimator.decode_time_s(batch + 1) <= step_s or estimator.capacity_tps(batch) < demand_tps
    ):
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
