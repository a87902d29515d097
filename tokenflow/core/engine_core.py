"""The step loop shared by the real engine and the simulator.

    plan    = scheduler.schedule(now)        # pure Python decisions
    result  = executor.execute(plan)         # a model forward pass, or a cost model
    outputs = scheduler.update(plan, result, now)

Only the executor and the clock differ between a real run and a simulated one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from tokenflow.core.plan import RequestOutput, StepPlan, StepResult
from tokenflow.core.request import FinishReason, Request
from tokenflow.core.scheduler import Scheduler


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on this run's time line."""
        ...


class Executor(Protocol):
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step (see tokenflow.core.plan for the contract)."""
        ...


class EngineCore:
    """Drives a scheduler and an executor with an injected clock."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        clock: Clock,
        check_integrity: bool = False,
        on_plan: Callable[[StepPlan], None] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.clock = clock
        self.check_integrity = check_integrity
        self.on_plan = on_plan
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
        """Run one step; an empty plan means nothing could run now (the caller waits)."""
        plan = self.scheduler.schedule(self.clock.now())
        if self.on_plan is not None:
            self.on_plan(plan)
        result = self.executor.execute(plan)
        outputs = self.scheduler.update(plan, result, self.clock.now())
        if self.check_integrity:
            self.scheduler.kv.check_integrity()
        self.num_steps += 1
        return plan, outputs
