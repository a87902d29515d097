"""TokenFlow: a buffer-aware, preemptive LLM text-streaming server.

`from tokenflow import LLM, SamplingParams` gives the offline API; `LLM` (and torch) load only
when first used.
"""

from typing import Any

from tokenflow.core.request import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from tokenflow.integrations.executors import LLM

        return LLM
    raise AttributeError(f"module 'tokenflow' has no attribute {name!r}")
