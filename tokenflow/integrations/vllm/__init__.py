"""TokenFlow's core policy as a vLLM scheduler (`pip install tokenflow[vllm]`).

`--scheduler-cls tokenflow.integrations.vllm.TokenFlowScheduler` loads it; importing this package
does not import vLLM until the scheduler class is asked for.
"""

from __future__ import annotations

VLLM_VERSION = "0.32.0"  # the version this integration is written and tested against


def __getattr__(name: str) -> object:
    if name == "TokenFlowScheduler":
        from tokenflow.integrations.vllm.scheduler import TokenFlowScheduler

        return TokenFlowScheduler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
