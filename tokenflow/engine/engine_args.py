"""Everything needed to build a real engine, in one validated dataclass that drives the CLI
(tokenflow/cli/engine_options.py declares its flags).

Defaults target the regime where TokenFlow matters on a CPU with the embedded SmolLM2: a device
KV pool that holds only part of a burst (so streams must take turns) and human reading rates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenflow.core.config import TokenFlowConfig, tokenflow_defaults
from tokenflow.core.consumption import DEFAULT_READER_RATE_TPS
from tokenflow.core.policies import POLICY_NAMES
from tokenflow.core.request import is_reader_rate, reader_rate_error

if TYPE_CHECKING:
    import torch

EXECUTORS = ("torch", "llama-cpp")
# CPU steps of fewer tokens run on one thread (tokenflow/model/threads.py has the numbers).
SERIAL_BELOW_TOKENS = 8


@dataclass(frozen=True)
class EngineArgs:
    """How to build the real engine (model, tiers, limits, policy)."""

    model: str | None = None  # GGUF file or HF safetensors directory; None: embedded SmolLM2
    device: str = "auto"  # "auto" (cuda if available), "cpu", "cuda", "cuda:1", ...
    dtype: str | None = None  # "float32", "bfloat16", "float16"; None: best for the device
    chat_template: str | None = None  # Jinja chat template text replacing the model's
    # torch: "auto" (on CPU with no dtype: the kernels this machine runs fastest, measured and
    # cached, tokenflow/model/kernels/), "int4", "dense" (dequantized); llama-cpp: "auto"
    # (the GGUF as shipped) or "q8_0" (its Q4_1 tensors rewritten as Q8_0, faster in batches)
    weights: str = "auto"
    kernel_cache: bool = True  # reuse this machine's stored kernel choice (False: probe again)
    policy: str = "tokenflow"
    block_size: int = 16
    device_kv_tokens: int = 8192  # device tier size, tokens (rounded down to whole blocks)
    device_kv_fraction: float | None = None  # or: this share of free device memory
    host_kv_tokens: int = 32768  # host tier size, tokens (4x the device tier)
    max_model_len: int | None = None  # prompt + output; None: the model's, capped at 8192
    max_num_seqs: int = 32  # streams in one batch
    max_prefill_tokens: int = 4096  # prefill tokens in one step, at most
    chunk_tokens: int = 512  # step budget of the chunked policy (simulator; see step_target_ms)
    step_target_ms: float = 250.0  # every policy prefills in chunks sized to about this step time
    max_num_requests: int = 256  # unfinished requests beyond this are refused (HTTP 429)
    default_rate_tps: float = DEFAULT_READER_RATE_TPS  # of a reader that states none (tokens/s)
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads; None: torch's default
    serial_below_tokens: int = SERIAL_BELOW_TOKENS  # smaller CPU steps run on one thread
    # Decode-only steps through compiled graphs: True always, False never, None where they
    # measured faster on this machine (with the automatic kernel choice; tokenflow/model/
    # decode_path.py).  Off by default: compiled decode steps crashed replica processes on Ray
    # Serve (an abort in the inductor-generated code) where the eager path never has.
    compile_decode: bool | None = False
    executor: str = "torch"  # "torch" (our PyTorch model) or "llama-cpp" (GGUF through llama.cpp)
    llama_cpp_repack: bool = False  # llama-cpp: let ggml repack weights for AMX/AVX kernels
    # Requests whose prompts begin alike share the KV of their common full blocks (vLLM's
    # automatic prefix caching; tokenflow/core/prefix_cache.py).
    enable_prefix_caching: bool = True
    # Which cached blocks no request holds are reused first: "reading" by when their readers
    # are expected back, "lru" least recently released (tokenflow/core/retention.py).
    prefix_retention: str = "reading"
    # Structured outputs' grammars compile in this many worker processes, each compile killed
    # past this deadline (tokenflow/model/grammar_compile.py).
    grammar_compile_workers: int = 1
    grammar_compile_timeout_s: float = 5.0
    tokenflow: TokenFlowConfig | None = None  # None: `tokenflow_defaults` of the device

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {POLICY_NAMES}")
        for name in (
            "block_size",
            "device_kv_tokens",
            "max_num_seqs",
            "max_prefill_tokens",
            "chunk_tokens",
            "max_num_requests",
            "grammar_compile_workers",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.host_kv_tokens < 0:
            raise ValueError(f"host_kv_tokens must be >= 0, got {self.host_kv_tokens}")
        if self.device_kv_fraction is not None and not 0 < self.device_kv_fraction <= 1:
            raise ValueError("device_kv_fraction must be in (0, 1]")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError("num_threads must be >= 1")
        if self.serial_below_tokens < 0:
            raise ValueError(f"serial_below_tokens must be >= 0, got {self.serial_below_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if not (math.isfinite(self.step_target_ms) and self.step_target_ms > 0):
            raise ValueError("step_target_ms must be a finite number > 0")
        timeout = self.grammar_compile_timeout_s
        if not (math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"grammar_compile_timeout_s must be finite and > 0, got {timeout}")
        if not is_reader_rate(self.default_rate_tps):
            raise ValueError(f"default_rate_tps: {reader_rate_error(self.default_rate_tps)}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {self.executor!r}")
        if self.llama_cpp_repack and self.executor != "llama-cpp":
            raise ValueError("llama_cpp_repack applies to the llama-cpp executor only")
        allowed = ("auto", "q8_0") if self.executor == "llama-cpp" else ("auto", "int4", "dense")
        if self.weights not in allowed:
            raise ValueError(
                f"weights must be one of {allowed} with the {self.executor} executor, "
                f"got {self.weights!r}"
            )
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

    @property
    def uses_prefix_cache(self) -> bool:
        """Whether the engine shares cached prefix blocks: asked for, and with the torch
        executor (llama.cpp's keeps its own context and starts every prompt at position 0)."""
        return self.enable_prefix_caching and self.executor == "torch"

    def tokenflow_for(self, device_type: str) -> TokenFlowConfig:
        """The TokenFlow policy these arguments run on a `device_type` engine."""
        return self.tokenflow or tokenflow_defaults(device_type)


def resolve_device(name: str) -> torch.device:
    """ "auto" picks CUDA when present; a CUDA device without CUDA is a clear error."""
    import torch  # (here, not at the top: the CLI parses arguments before torch loads)

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device
