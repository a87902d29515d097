"""Everything needed to build a real engine, in one validated dataclass that drives the CLI.

Defaults target the regime where TokenFlow matters on a CPU with the embedded SmolLM2: a device
KV pool that holds only part of a burst (so streams must take turns) and human reading rates.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields, replace

from tokenflow.core.config import TokenFlowConfig
from tokenflow.core.policies import POLICY_NAMES
from tokenflow.core.request import is_reader_rate, reader_rate_error

# The policy as `serve` runs it.  On a CPU steps are ~100x slower than on a GPU, so buffers grow
# by about one second of reading per second and newcomers wait for streams to become pausable:
# a pause margin (critical slack) of 1 s instead of 2, and an admission reserve of 0.3 of the
# residents' remaining output instead of SGLang's 0.7 (TokenFlow pauses a stream short of
# memory instead of retracting it), took the CPU reading burst's P99 TTFT from 13-17 s to
# 11-12 s.  In the GPU simulator the same values raised overload stalls, so the core's
# defaults keep 2 s and 0.7 (docs/design.md).
SERVE_TOKENFLOW = TokenFlowConfig(critical_slack_s=1.0, init_new_token_ratio=0.3)
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
    default_rate_tps: float = 4.0  # reading rate of a request that states none (tokens/s)
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads; None: torch's default
    serial_below_tokens: int = SERIAL_BELOW_TOKENS  # smaller CPU steps run on one thread
    compile_decode: bool = False  # decode-only steps through compiled graphs (slower start)
    executor: str = "torch"  # "torch" (our PyTorch model) or "llama-cpp" (GGUF through llama.cpp)
    llama_cpp_repack: bool = False  # llama-cpp: let ggml repack weights for AMX/AVX kernels
    tokenflow: TokenFlowConfig = SERVE_TOKENFLOW

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
        _add_policy_arguments(parser.add_argument_group("tokenflow policy"))

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> EngineArgs:
        """Build from parsed CLI options (ValueError on bad values)."""
        options = {field: getattr(args, dest) for dest, (field, _) in _POLICY_OPTIONS.items()}
        tokenflow = replace(SERVE_TOKENFLOW, **options, write_through=not args.no_write_through)
        names = {f.name for f in fields(cls)} - {"tokenflow"}
        return cls(**{n: getattr(args, n) for n in names}, tokenflow=tokenflow)


# `serve`'s policy options: destination -> (TokenFlowConfig field, help); defaults from
# SERVE_TOKENFLOW, which also supplies every field not listed here.
_POLICY_OPTIONS = {
    "schedule_interval": ("schedule_interval_s", None),
    "mu": ("buffer_conservativeness", None),
    "critical_slack": (
        "critical_slack_s",
        "seconds of buffer that mean stress, and a pause's margin (docs/design.md)",
    ),
    "new_token_ratio": (
        "init_new_token_ratio",
        "admission reserves this share of each resident's remaining output at first",
    ),
    "capacity_headroom": (
        "capacity_headroom",
        "admit while reading rates stay <= this share of capacity (docs/usage.md)",
    ),
    "queue_headroom": (
        "queue_headroom",
        "admit the whole queue while its reading rates stay <= this share of capacity "
        "(e.g. 1.15: shorter P99 TTFT, longer stalls; docs/usage.md)",
    ),
    "max_stall_s": ("max_stall_s", "a stream stalled this long goes on the device first"),
}


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
        "--default-rate",
        type=float,
        default=EngineArgs.default_rate_tps,
        dest="default_rate_tps",
        help="tokens/s of a reader that states no rate (see --default-class)",
    )


def _add_policy_arguments(group: argparse._ArgumentGroup) -> None:
    """The TokenFlow policy's options, defaulting to serve's profile of it."""
    for dest, (field_name, help_text) in _POLICY_OPTIONS.items():
        default = getattr(SERVE_TOKENFLOW, field_name)
        flag = f"--{dest.replace('_', '-')}"
        group.add_argument(flag, type=float, default=default, help=help_text)
    group.add_argument("--no-write-through", action="store_true")
