"""The real engine: the step loop over the model (`LLMEngine`), its executor, the async engine
and its client, and the engine's arguments (the offline `LLM` above it is `tokenflow/llm.py`).

`ModelExecutor` is imported on first use, not with the package: it loads torch, and the
command line imports `engine_args` from here to build its parser (`tokenflow --help` answers
without torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenflow.engine.executor import ModelExecutor

__all__ = ["ModelExecutor"]


def __getattr__(name: str) -> Any:
    if name == "ModelExecutor":
        from tokenflow.engine.executor import ModelExecutor

        return ModelExecutor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
