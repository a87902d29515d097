"""Executors by name, above the engine: `EngineArgs.executor` -> the factory `LLMEngine` takes.

The engine imports no integration; this module (used by the CLI, the server and the offline
`tokenflow.LLM`) is where "llama-cpp" meets `tokenflow.integrations.llamacpp`, imported only
when asked for.
"""

from __future__ import annotations

from tokenflow.engine.build import ExecutorFactory, build_torch_executor
from tokenflow.engine.engine_args import EXECUTORS


def executor_factory(name: str) -> ExecutorFactory:
    """The factory of the executor `name` ("torch" or "llama-cpp"); ValueError otherwise."""
    if name == "torch":
        return build_torch_executor
    if name == "llama-cpp":
        from tokenflow.integrations.llamacpp import build_llamacpp_executor

        return build_llamacpp_executor
    raise ValueError(f"executor must be one of {EXECUTORS}, got {name!r}")
