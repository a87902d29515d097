"""The step loop shared by the real engine and the simulator.

    plan    = scheduler.schedule(now, step_budget)   # pure Python decisions
    before_execute(plan)                             # the simulator charges CPU time here
    result  = executor.execute(plan)                 # a model forward pass, or a cost model
    outputs = scheduler.update(plan, result, now)

Only the executor and the clock differ between a real run and a simulated one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from tokenflow.core.clock import Clock
from tokenflow.core.plan import RequestOutput, StepPlan, StepResult
from tokenflow.core.request import FinishReason, Request
from tokenflow.core.scheduler import Scheduler
from tokenflow.core.step_budget import StepBudget

# How long the serving engine's loop pauses after a step in which nothing could run (an empty
# plan: its requests wait, on a copy over the link for one) before it plans again; the
# simulation of a profiled deployment ticks as often, so it idles as the server does.
NOTHING_RAN_WAIT_S = 0.002


class Executor(Protocol):
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step (see tokenflow.core.plan for the contract)."""
        ...


class StepFailed(Exception):
    """The executor raised on `plan`; the error is this exception's `__cause__`.  The caller
    decides whom to blame (the real engine ends the plan's requests only)."""

    def __init__(self, plan: StepPlan) -> None:
        super().__init__(f"step {plan.step_index} failed")
        self.plan = plan


class EngineCore:
    """Drives a scheduler and an executor with an injected clock.

    `step_budget`, when given, sizes every step's tokens (tokenflow.core.step_budget);
    `before_execute` sees each plan between scheduling and execution (the simulator advances
    its clock there by the CPU time a real engine spends on the step)."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        clock: Clock,
        *,
        step_budget: StepBudget | None = None,
        before_execute: Callable[[StepPlan], None] | None = None,
        check_integrity: bool = False,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.clock = clock
        self.step_budget = step_budget
        self.before_execute = before_execute
        self.check_integrity = check_integrity
        self.num_steps = 0

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError if it can never be served."""
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> bool:
        """Abort a request and free its KV in both tiers; False if it had already ended."""
        return self.scheduler.finish_request(request_id, FinishReason.ABORT)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> tuple[StepPlan, list[RequestOutput]]:
        """Run one step; an empty plan means nothing could run now (the caller waits).
        StepFailed if the executor raised (the scheduler's own errors propagate as they are)."""
        plan = self.scheduler.schedule(self.clock.now(), self.step_budget)
        if self.before_execute is not None:
            self.before_execute(plan)
        try:
            result = self.executor.execute(plan)
        except Exception as err:
            raise StepFailed(plan) from err
        outputs = self.scheduler.update(plan, result, self.clock.now())
        if self.check_integrity:
            self.scheduler.kv.check_integrity()
        self.num_steps += 1
        return plan, outputs
