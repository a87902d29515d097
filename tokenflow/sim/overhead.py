"""The scheduler's own CPU time, charged to the simulated clock on every step of every policy.

The real engine runs `schedule()` and `update()` on the CPU between forward passes, so a costly
policy delays every step.  The simulator cannot time the real calls (that would make runs depend
on the machine and its load), so it charges a model: fixed + per-active-request seconds per
step, where "active" counts every unfinished request (waiting, running, preempted): the
policies' decisions scan them all.

Calibration: `python benchmarks/scheduler_overhead.py --per-step --sizes 50,200,400,800` times
`schedule()` + `update()` of whole steps (full decisions included at their natural frequency)
while each policy serves a burst on a simulated H200, and fits the line by least squares.  On
the development machine (a 2-core VM, shared, Python 3.11), each default is a fit to the
per-size medians of several runs (see the comments below).  A server CPU is faster; the charge
is still small beside a GPU step (~0.28 ms for FCFS, ~0.39 ms for TokenFlow at 500 active
requests, against steps of 20-60 ms), but no longer zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from tokenflow.core.clock import SimClock
from tokenflow.core.plan import StepPlan


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
        # benchmarks/scheduler_overhead.py --per-step --sizes 50,200,400,800 --steps 200 on
        # the development machine, the line fitted to the per-size medians: the baselines over
        # six runs, TokenFlow over three (after its policy became one plain decision path;
        # per-step medians at 400 active: fcfs 0.311 ms, chunked 0.275, andes 0.224,
        # tokenflow 0.505).
        "fcfs": SchedulerOverhead(0.189e-3, 0.179e-6),
        "chunked": SchedulerOverhead(0.166e-3, 0.156e-6),
        "andes": SchedulerOverhead(0.134e-3, 0.134e-6),
        "tokenflow": SchedulerOverhead(0.176e-3, 0.426e-6),
    }
    if policy not in calibrated:
        raise ValueError(f"no calibrated scheduler overhead for policy {policy!r}")
    return calibrated[policy]


class OverheadCharge:
    """An `EngineCore.before_execute` hook: advances the clock by the step's scheduling time, and by
    `engine_s(plan)` for what else the engine spends on a step (a profiled engine's own CPU
    and serving path, tokenflow/sim/profiled.py).

    It runs after `schedule()` and before the executor, where the CPU time is spent in a real
    engine (or, for the serving path, overlaps its forward pass), so the step-time estimator
    observes it too.
    """

    def __init__(
        self,
        overhead: SchedulerOverhead,
        clock: SimClock,
        count_active: Callable[[], int],
        engine_s: Callable[[StepPlan], float] | None = None,
    ) -> None:
        self._overhead = overhead
        self._clock = clock
        self._count_active = count_active
        self._engine_s = engine_s
        self.total_s = 0.0  # the scheduler's share
        self.engine_total_s = 0.0

    def __call__(self, plan: StepPlan) -> None:
        """Charge one step."""
        charge_s = self._overhead.step_s(self._count_active())
        engine_s = self._engine_s(plan) if self._engine_s is not None and not plan.is_empty else 0.0
        self._clock.advance(charge_s + engine_s)
        self.total_s += charge_s
        self.engine_total_s += engine_s
