"""The scheduler's own CPU time, charged to the simulated clock on every step of every policy.

The real engine runs `schedule()` and `update()` on the CPU between forward passes, so a costly
policy delays every step.  The simulator cannot time the real calls (that would make runs depend
on the machine and its load), so it charges a model: fixed + per-active-request seconds per
step, where "active" counts every unfinished request (waiting, running, preempted): the
policies' decisions scan them all.

Calibration: `python benchmarks/scheduler_overhead.py --per-step --sizes 50,200,400,800` times
`schedule()` + `update()` of whole steps (full decisions included at their natural frequency)
while each policy serves a burst on a simulated H200, and fits the line by least squares.  The
defaults below are the mean of two such runs on the development machine (a 2-core VM, quiet,
Python 3.11; figures in docs/results.md).  A server CPU is faster; the charge is still small
beside a GPU step (~0.26 ms for FCFS, ~0.46 ms for TokenFlow at 500 active requests, against
steps of 20-60 ms), but no longer zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from tokenflow.core.plan import StepPlan
from tokenflow.sim.clock import SimClock


@dataclass(frozen=True)
class SchedulerOverhead:
    """CPU seconds per step: `fixed_s + per_request_s x active requests`."""

    fixed_s: float
    per_request_s: float

    def __post_init__(self) -> None:
        for name in ("fixed_s", "per_request_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    def step_s(self, num_active: int) -> float:
        """Seconds one step's scheduling takes with `num_active` unfinished requests."""
        return self.fixed_s + self.per_request_s * num_active


def default_overhead(policy: str) -> SchedulerOverhead:
    """The calibrated per-step charge of `policy` (see the module docstring)."""
    calibrated = {
        # benchmarks/scheduler_overhead.py --per-step --sizes 50,200,400,800 --steps 200, twice,
        # on a quiet development machine, with the O(changes) hot path of issue 9 (states with
        # waiting requests, 500 steps of service before timing):
        # fcfs 0.1414 ms + 0.249 us, 0.1370 + 0.245; chunked 0.1617 + 0.272, 0.1449 + 0.358;
        # andes 0.1399 + 0.242, 0.2472 + 0.105; tokenflow 0.2262 + 0.434, 0.2752 + 0.413.
        "fcfs": SchedulerOverhead(0.139e-3, 0.247e-6),
        "chunked": SchedulerOverhead(0.153e-3, 0.315e-6),
        "andes": SchedulerOverhead(0.194e-3, 0.174e-6),
        "tokenflow": SchedulerOverhead(0.251e-3, 0.424e-6),
    }
    if policy not in calibrated:
        raise ValueError(f"no calibrated scheduler overhead for policy {policy!r}")
    return calibrated[policy]


class OverheadCharge:
    """An `EngineCore.on_plan` hook: advances the clock by the step's scheduling time.

    It runs after `schedule()` and before the executor, where the CPU time is spent in a real
    engine, so the step-time estimator observes it too.
    """

    def __init__(
        self, overhead: SchedulerOverhead, clock: SimClock, count_active: Callable[[], int]
    ) -> None:
        self._overhead = overhead
        self._clock = clock
        self._count_active = count_active
        self.total_s = 0.0

    def __call__(self, plan: StepPlan) -> None:
        """Charge one step."""
        charge_s = self._overhead.step_s(self._count_active())
        self._clock.advance(charge_s)
        self.total_s += charge_s
