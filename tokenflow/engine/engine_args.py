"""Everything needed to build a real engine, in one validated dataclass that drives the CLI.

Defaults target the regime where TokenFlow matters on a CPU with the embedded SmolLM2: a device
KV pool that holds only part of a burst (so streams must take turns) and human reading rates.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from tokenflow.core.config import (
    TokenFlowConfig,
    add_policy_arguments,
    has_policy_options,
    policy_config,
    tokenflow_defaults,
)
from tokenflow.core.consumption import DEFAULT_READER_RATE_TPS, add_default_rate_argument
from tokenflow.core.policies import POLICY_NAMES
from tokenflow.core.prefix_cache import RETENTIONS
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
    compile_decode: bool = False  # decode-only steps through compiled graphs (slower start)
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

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """CLI options for every field (help from the field comments above)."""
        group = parser.add_argument_group("engine")
        _add_model_arguments(group)
        _add_runtime_arguments(group)
        add_policy_arguments(parser.add_argument_group("tokenflow policy"), _device_defaults)

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> EngineArgs:
        """Build from parsed CLI options (ValueError on bad values).  The policy is the
        device's defaults with the knobs given; left None when none is given."""
        names = {f.name for f in fields(cls)} - {"tokenflow"}
        built = cls(**{n: getattr(args, n) for n in names})
        if not has_policy_options(args):
            return built
        base = tokenflow_defaults(resolve_device(built.device).type)
        return replace(built, tokenflow=policy_config(args, base))

    @property
    def uses_prefix_cache(self) -> bool:
        """Whether the engine shares cached prefix blocks: asked for, and with the torch
        executor (llama.cpp's keeps its own context and starts every prompt at position 0)."""
        return self.enable_prefix_caching and self.executor == "torch"

    def tokenflow_for(self, device_type: str) -> TokenFlowConfig:
        """The TokenFlow policy these arguments run on a `device_type` engine."""
        return self.tokenflow or tokenflow_defaults(device_type)


def _add_model_arguments(group: argparse._ArgumentGroup) -> None:
    """The model, where it runs, its weights, the policy and the integer sizes."""
    group.add_argument("--model", default=None, help="GGUF file or HF safetensors dir")
    group.add_argument("--device", default="auto")
    group.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    group.add_argument(
        "--weights",
        default="auto",
        choices=["auto", "int4", "dense", "q8_0"],
        help="auto: on CPU without --dtype, the kernels this machine runs fastest (measured "
        "once, then cached); int4: a GGUF's 4-bit weights packed (bf16 activations); dense: "
        "dequantize to --dtype; q8_0 (llama-cpp executor): Q4_1 rewritten as Q8_0",
    )
    group.add_argument(
        "--no-kernel-cache",
        action="store_false",
        dest="kernel_cache",
        help="measure the kernels again instead of reusing this machine's stored choice",
    )
    group.add_argument("--policy", default="tokenflow", choices=POLICY_NAMES)
    for name in (
        "block_size",
        "device_kv_tokens",
        "host_kv_tokens",
        "max_model_len",
        "max_num_seqs",
        "max_prefill_tokens",
        "chunk_tokens",
        "max_num_requests",
        "seed",
    ):
        default = next(f.default for f in fields(EngineArgs) if f.name == name)
        group.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)


def _add_runtime_arguments(group: argparse._ArgumentGroup) -> None:
    """How steps run (threads, chunk sizing, compiling, the executor) and the default rate."""
    group.add_argument("--device-kv-fraction", type=float, default=None)
    group.add_argument(
        "--step-target-ms",
        type=float,
        default=EngineArgs.step_target_ms,
        help="prefill chunks are sized so one step takes about this long",
    )
    group.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch CPU threads (default: all cores; 1 on a machine busy with other work)",
    )
    group.add_argument(
        "--serial-below-tokens",
        type=int,
        default=EngineArgs.serial_below_tokens,
        help="torch executor: CPU steps of fewer tokens (a few streams) run on one thread; "
        "waking idle OpenMP workers costs more than they add there (0: all threads always)",
    )
    group.add_argument(
        "--compile-decode",
        action="store_true",
        help="run decode-only steps through compiled graphs (a few percent faster here; "
        "about 30 s more at start with an empty compiler cache, 3 s with a warm one)",
    )
    group.add_argument(
        "--executor",
        default=EngineArgs.executor,
        choices=EXECUTORS,
        help="torch: our PyTorch model; llama-cpp: the GGUF through llama.cpp (needs the "
        "llamacpp extra; fastest at 1-8 streams on CPU, docs/results.md)",
    )
    group.add_argument(
        "--llama-cpp-repack",
        action="store_true",
        help="llama-cpp executor: let ggml repack weights into its CPU-specific layouts (AMX; "
        "AVX2/AVX-512 for Q4_0, Q4_K, IQ4_NL).  Off by default: it crashed on a CPU reporting "
        "AMX, and on x86 without AMX it leaves the shipped Q4_1 model's weights as they are",
    )
    group.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=EngineArgs.enable_prefix_caching,
        help="reuse the KV of a prompt's leading full blocks that an earlier request computed "
        "(a shared system prompt, a conversation's history); usage.prompt_tokens_details."
        "cached_tokens says how many (vLLM's flag pair)",
    )
    group.add_argument(
        "--prefix-retention",
        choices=RETENTIONS,
        default=EngineArgs.prefix_retention,
        help="which cached blocks no request holds are reused first, on both KV tiers: "
        "'reading' by when their readers are expected back (after reading the answer and a "
        "think time), 'lru' least recently released (vLLM's rule)",
    )
    group.add_argument(
        "--grammar-compile-timeout-s",
        type=float,
        default=EngineArgs.grammar_compile_timeout_s,
        help="a structured output whose grammar takes longer to compile is refused (400); "
        "its compile process is killed",
    )
    group.add_argument(
        "--grammar-compile-workers",
        type=int,
        default=EngineArgs.grammar_compile_workers,
        help="processes that compile structured outputs' grammars (off the server and engine)",
    )
    add_default_rate_argument(group)


def _device_defaults(field: str) -> str:
    on_cpu = getattr(tokenflow_defaults("cpu"), field)
    on_gpu = getattr(tokenflow_defaults("cuda"), field)
    return f"{on_cpu:g}" if on_cpu == on_gpu else f"{on_cpu:g} on a CPU, {on_gpu:g} on a GPU"


def resolve_device(name: str) -> torch.device:
    """ "auto" picks CUDA when present; a CUDA device without CUDA is a clear error."""
    import torch  # (here, not at the top: the CLI parses arguments before torch loads)

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device
