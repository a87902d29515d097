"""Scheduling policies, plugged in by name."""

from __future__ import annotations

from collections.abc import Callable

from tokenflow.core.config import AndesConfig, SchedulerConfig, TokenFlowConfig
from tokenflow.core.policies.andes import AndesPolicy
from tokenflow.core.policies.base import Moves, Policy, Preemption, SchedulingView, Start
from tokenflow.core.policies.fcfs import ChunkedPolicy, FcfsPolicy
from tokenflow.core.policies.tokenflow import TokenFlowPolicy

POLICY_NAMES = ("fcfs", "chunked", "andes", "tokenflow")


def make_policy(
    name: str,
    scheduler_config: SchedulerConfig,
    tokenflow_config: TokenFlowConfig | None = None,
    andes_config: AndesConfig | None = None,
) -> Policy:
    """Build a policy by name; ValueError names the valid ones."""
    builders: dict[str, Callable[[], Policy]] = {
        "fcfs": FcfsPolicy,
        "chunked": lambda: ChunkedPolicy(scheduler_config),
        "andes": lambda: AndesPolicy(andes_config or AndesConfig()),
        "tokenflow": lambda: TokenFlowPolicy(tokenflow_config or TokenFlowConfig()),
    }
    if name not in builders:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    return builders[name]()


def parse_policy_names(text: str) -> list[str]:
    """ "fcfs,tokenflow" -> ["fcfs", "tokenflow"]; ValueError naming unknown ones."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in POLICY_NAMES]
    if unknown or not names:
        raise ValueError(f"unknown policy {unknown}; choose from {', '.join(POLICY_NAMES)}")
    return names


__all__ = [
    "POLICY_NAMES",
    "Moves",
    "Policy",
    "Preemption",
    "SchedulingView",
    "Start",
    "make_policy",
    "parse_policy_names",
]
