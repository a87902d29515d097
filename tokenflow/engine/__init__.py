"""The real engine: the step loop over the model (`LLMEngine`), its executor, the async engine
and its client, the offline `LLM`, and the engine's arguments."""

from tokenflow.engine.executor import ModelExecutor

__all__ = ["ModelExecutor"]
