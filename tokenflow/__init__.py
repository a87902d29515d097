"""TokenFlow: a buffer-aware, preemptive LLM text-streaming server."""

__version__ = "0.1.0"
