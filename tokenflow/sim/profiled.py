"""A simulated deployment of the real engine from its profile: `tokenflow simulate --profile`.

The core is built as `LLMEngine` builds it, by `tokenflow.core.build` (the profile holds the
`SchedulerConfig` the engine made, its measured link rate and step-time priors included, and
`serve`'s `TokenFlowConfig`), on the deployment `serve`'s flags describe (tiers, limits, knobs).
What the real engine does around the core is charged too:

- the forward pass and the tier copies: the profile's fitted `StepCosts`
  (tokenflow/calibrate/costs.py);
- the scheduler's decision: the calibrated per-policy charge, as in every simulation
  (tokenflow/sim/overhead.py);
- the rest of the engine's step (inputs, detokenizing, delivering the deltas, the stats the
  server reads) and the serving path (HTTP frames, the interpreter lock, the client's share of
  the CPU): the profile's fixed + per-chunk charge, with the scheduler's, so the estimator
  sees it as the real one does;
- the step budget the engine gives every policy from `--step-target-ms`
  (`tokenflow.core.step_budget`, the one rule both pass to the scheduler);
- the prompt the server tokenizes: the bench client's n words plus the chat template's own
  tokens (the profile's `prompt` mapping);
- the server loop's pause after a step in which nothing could run (the serving engine's
  `NOTHING_RAN_WAIT_S`, 2 ms), instead of the simulator's usual 5 ms tick;
- each request's way through the server and the client (the profile's `request_path_s`): the
  engine sees it that much after its arrival, which its TTFT still counts from.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tokenflow.calibrate.costs import ProfiledCostModel
from tokenflow.calibrate.profile_file import Profile
from tokenflow.core.build import build_core
from tokenflow.core.clock import SimClock
from tokenflow.core.config import TokenFlowConfig
from tokenflow.core.engine_core import NOTHING_RAN_WAIT_S
from tokenflow.core.kv_manager import KVConfig
from tokenflow.core.plan import StepPlan
from tokenflow.core.step_budget import StepBudget
from tokenflow.sim.executor import SimExecutor
from tokenflow.sim.overhead import OverheadCharge, default_overhead
from tokenflow.sim.runner import SimEngine


@dataclass(frozen=True)
class ProfiledDeployment:
    """`serve`'s deployment flags over a profile (None: the profile's own value)."""

    profile: Profile
    device_kv_tokens: int | None = None
    host_kv_tokens: int | None = None
    max_num_seqs: int | None = None
    max_prefill_tokens: int | None = None
    step_target_ms: float | None = None
    tokenflow: TokenFlowConfig | None = None  # None: `serve`'s, as profiled
    endpoint: str = "chat"  # the bench endpoint whose prompt mapping applies
    prefix_caching: bool = False  # (as `serve --prefix-caching`; KVConfig's meaning)
    prefix_retention: str = "reading"

    def __post_init__(self) -> None:
        if self.endpoint not in self.profile.prompt:
            raise ValueError(
                f"the profile has no prompt mapping for endpoint {self.endpoint!r}; "
                f"it has {sorted(self.profile.prompt)}"
            )

    def value(self, name: str) -> int | float:
        """A deployment setting: the flag's, else the profiled engine's."""
        given = getattr(self, name)
        return getattr(self.profile.engine, name) if given is None else given


def build_profiled_engine(deployment: ProfiledDeployment, policy: str) -> SimEngine:
    """The core as the real engine builds it, on the profile's costs and a simulated clock."""
    profile = deployment.profile
    facts = profile.engine
    device_tokens = int(deployment.value("device_kv_tokens"))
    scheduler_config = replace(
        profile.scheduler,
        max_num_seqs=int(deployment.value("max_num_seqs")),
        max_prefill_tokens=int(deployment.value("max_prefill_tokens")),
        max_model_len=min(facts.max_model_len_cap, device_tokens),
    )
    kv_config = KVConfig(
        num_device_blocks=max(1, device_tokens // facts.block_size),
        num_host_blocks=int(deployment.value("host_kv_tokens")) // facts.block_size,
        block_size=facts.block_size,
        block_bytes=facts.block_bytes,
        prefix_caching=deployment.prefix_caching,
        prefix_retention=deployment.prefix_retention,
    )
    clock = SimClock()
    cost_model = ProfiledCostModel(profile.costs, facts.block_bytes // facts.block_size)
    executor = SimExecutor(cost_model, clock, facts.block_size)
    charge = OverheadCharge(
        default_overhead(policy),
        clock,
        lambda: core.scheduler.num_unfinished,  # (counted at each step, once `core` is built)
        engine_s=lambda plan: _server_step_s(profile, plan),
    )
    budget = StepBudget(
        float(deployment.value("step_target_ms")) / 1000,
        scheduler_config.max_prefill_tokens,
        facts.min_prefill_chunk_tokens,
    )
    core = build_core(
        scheduler_config,
        kv_config,
        policy,
        executor,
        clock,
        tokenflow=deployment.tokenflow or profile.tokenflow,
        step_budget=budget,
        before_execute=charge,
    )
    prompt = profile.prompt[deployment.endpoint]
    return SimEngine(
        core=core,
        executor=executor,
        prompt_tokens=prompt.tokens,
        idle_tick_s=NOTHING_RAN_WAIT_S,
        arrival_delay_s=profile.costs.request_path_s,
    )


def _server_step_s(profile: Profile, plan: StepPlan) -> float:
    costs = profile.costs
    return costs.server_step_s + costs.server_per_chunk_s * len(plan.chunks)
