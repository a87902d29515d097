"""TokenFlow: a buffer-aware, preemptive LLM text-streaming server.

`from tokenflow import LLM, SamplingParams` gives the offline API (vLLM's, with its
`RequestOutput` and `CompletionOutput`); those three load (with torch) only when first used.
"""

from typing import Any

from tokenflow.core.request import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
_OFFLINE = ("LLM", "CompletionOutput", "RequestOutput")


def __getattr__(name: str) -> Any:
    if name in _OFFLINE:
        from tokenflow import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'tokenflow' has no attribute {name!r}")
