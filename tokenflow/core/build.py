"""The core, wired from its configs: policy -> `Scheduler` -> `EngineCore`.

The real engine (`LLMEngine`), the simulator (`sim.runner.build_engine`) and the simulated
deployment of a profiled engine (`sim.profiled.build_profiled_engine`) all build their core
here, so they run the same core built the same way; only the executor and the clock (and the
hooks they hand the step loop) differ.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenflow.core.clock import Clock
from tokenflow.core.config import AndesConfig, SchedulerConfig, TokenFlowConfig
from tokenflow.core.engine_core import EngineCore, Executor
from tokenflow.core.kv_manager import KVConfig
from tokenflow.core.plan import StepPlan
from tokenflow.core.policies import make_policy
from tokenflow.core.scheduler import Scheduler
from tokenflow.core.step_budget import StepBudget


def build_core(
    scheduler_config: SchedulerConfig,
    kv_config: KVConfig,
    policy_name: str,
    executor: Executor,
    clock: Clock,
    *,
    tokenflow: TokenFlowConfig | None = None,
    andes: AndesConfig | None = None,
    step_budget: StepBudget | None = None,
    before_execute: Callable[[StepPlan], None] | None = None,
    check_integrity: bool = False,
) -> EngineCore:
    """The core running policy `policy_name` (`make_policy`: None configs are the policies'
    defaults) on `executor` and `clock`; the keywords as `EngineCore` takes them."""
    policy = make_policy(policy_name, scheduler_config, tokenflow, andes)
    scheduler = Scheduler(scheduler_config, kv_config, policy)
    return EngineCore(
        scheduler,
        executor,
        clock,
        step_budget=step_budget,
        before_execute=before_execute,
        check_integrity=check_integrity,
    )
