"""Settings of the vLLM integration, read from vLLM's `--additional-config '{"tokenflow": {...}}'`.

Keys (all optional)::

    default_rate       reading rate (tokens/s) of requests without `vllm_xargs.stream_rate`;
                       absent: such requests are left to vLLM's own behaviour
    host_factor        host tier, in multiples of the device pool (default 3): the host KV
                       connector's buffer, or without it a virtual tier; bounds the working set
    policy             overrides of `TokenFlowConfig` fields, e.g. {"critical_slack_s": 1.0},
                       over the defaults for the device vLLM runs on (`tokenflow_defaults`)
    scheduler          overrides of the core `SchedulerConfig` fields that vLLM does not set
                       (vLLM sets max_num_seqs, max_prefill_tokens and max_model_len), e.g.
                       {"init_new_token_ratio": 0.7}; by default the admission reserve is
                       small, like vLLM's own admission (which keeps none); the policy's
                       `init_new_token_ratio` caps the scheduler's (0.3 on a CPU)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

from tokenflow.core.config import SchedulerConfig, TokenFlowConfig, tokenflow_defaults
from tokenflow.core.request import is_reader_rate, reader_rate_error

CONFIG_KEY = "tokenflow"
FROM_VLLM = ("max_num_seqs", "max_prefill_tokens", "max_model_len")
# vLLM admits without reserving room for a request's future tokens (it preempts on
# out-of-memory instead); the core's SGLang-like default reserves 70% of the remaining budget,
# which would leave much of vLLM's pool idle.  The reserve is whole blocks of
# ratio x remaining tokens: at 0.01 it is none for fewer than 100 remaining tokens, like vLLM.
# (At 0.1, a 32-token stream held back a whole 32-token block: 6 of 16 blocks sat idle while
# paused streams waited, in a traced burst.)
VLLM_LIKE_RESERVE = {"init_new_token_ratio": 0.01, "min_new_token_ratio": 0.01}


@dataclass(frozen=True)
class IntegrationSettings:
    """What `TokenFlowScheduler` takes beyond vLLM's own configuration."""

    default_rate_tps: float | None = None
    host_factor: float = 3.0
    policy: dict[str, float | bool] = field(default_factory=dict)  # `TokenFlowConfig` overrides
    scheduler: dict[str, float] = field(default_factory=lambda: dict(VLLM_LIKE_RESERVE))

    def __post_init__(self) -> None:
        rate = self.default_rate_tps
        if rate is not None and not is_reader_rate(rate):
            raise ValueError(f"tokenflow default_rate: {reader_rate_error(rate)}")
        if not (math.isfinite(self.host_factor) and self.host_factor >= 0):
            raise ValueError(f"tokenflow host_factor must be >= 0, got {self.host_factor!r}")
        allowed = {f.name for f in fields(SchedulerConfig)} - set(FROM_VLLM)
        if set(self.scheduler) - allowed:
            raise ValueError(f"tokenflow scheduler overrides must be among: {sorted(allowed)}")
        self.core_config(max_num_seqs=1, max_prefill_tokens=1, max_model_len=1)  # validates
        names = {f.name for f in fields(TokenFlowConfig)}
        if set(self.policy) - names:
            known = ", ".join(sorted(names))
            raise ValueError(f"tokenflow policy overrides must be among: {known}")
        for device_type in ("cpu", "cuda"):  # validates on either device's defaults
            self.policy_config(device_type)

    def core_config(self, **from_vllm: int) -> SchedulerConfig:
        """The core SchedulerConfig: the limits vLLM sets, plus these overrides."""
        return SchedulerConfig(**from_vllm, **self.scheduler)

    def policy_config(self, device_type: str) -> TokenFlowConfig:
        """The TokenFlow policy's config on `device_type` (vLLM's `current_platform`'s: "cpu",
        "cuda", ...): the defaults every command uses there, plus these overrides."""
        return replace(tokenflow_defaults(device_type), **self.policy)

    @classmethod
    def from_additional_config(cls, additional_config: object) -> IntegrationSettings:
        """Parse vLLM's `additional_config`; ValueError names an unknown or bad key."""
        raw = additional_config.get(CONFIG_KEY, {}) if isinstance(additional_config, dict) else {}
        if not isinstance(raw, dict):
            raise ValueError(f"additional_config[{CONFIG_KEY!r}] must be an object")
        unknown = set(raw) - {"default_rate", "host_factor", "policy", "scheduler"}
        if unknown:
            raise ValueError(f"unknown tokenflow settings: {', '.join(sorted(unknown))}")
        overrides = raw.get("policy", {})
        if not isinstance(overrides, dict):
            raise ValueError("tokenflow policy overrides must be an object")
        rate = raw.get("default_rate")
        return cls(
            default_rate_tps=None if rate is None else float(rate),
            host_factor=float(raw.get("host_factor", 3.0)),
            policy=dict(overrides),
            scheduler={**VLLM_LIKE_RESERVE, **raw.get("scheduler", {})},
        )
