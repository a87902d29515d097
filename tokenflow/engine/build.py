"""How the engine gets its executor: a factory it is handed, and the PyTorch one it ships.

`LLMEngine` never names an executor's implementation: it calls an `ExecutorFactory` with its
arguments and device, and the factory returns the executor with what the engine must know of
the model (config, tokenizer) and of the KV tier (bytes per block, device blocks, the context it
serves).  The PyTorch factory lives here; other executors (llama.cpp) live in integrations and
are chosen by name above the
engine
(`tokenflow.integrations.executors`), so no engine module imports one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tokenflow.core.plan import StepPlan, StepResult
from tokenflow.engine.engine_args import EngineArgs
from tokenflow.engine.executor import ModelExecutor
from tokenflow.model.config import ModelConfig, ModelLoadError
from tokenflow.model.grammar import Grammars
from tokenflow.model.kernels import ProbeSettings
from tokenflow.model.kv_cache import TieredKVCache, available_memory_bytes, bytes_per_block
from tokenflow.model.loader import load_model
from tokenflow.model.tokenizer import Tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Executor(Protocol):
    """What the engine's step loop calls (the core's seam, plus the engine's own needs)."""

    def execute(self, plan: StepPlan) -> StepResult: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class BuiltExecutor:
    """An executor and what the engine must know to serve with it."""

    executor: Executor
    model_config: ModelConfig
    tokenizer: Tokenizer
    block_bytes: int  # one KV block, all layers, K and V
    num_device_blocks: int
    max_model_len: int  # the served context: what the device tier holds, at most
    kernels: str | None = None  # the kernel choice in one line (our PyTorch model's)
    grammars: Grammars | None = None  # the executor's structured outputs (None: not supported)


class ExecutorFactory(Protocol):
    def __call__(self, args: EngineArgs, device: torch.device) -> BuiltExecutor: ...


def build_torch_executor(args: EngineArgs, device: torch.device) -> BuiltExecutor:
    """Our PyTorch model and its tiered KV cache."""
    dtype = _DTYPES[args.dtype] if args.dtype else None
    probe = ProbeSettings(args.serial_below_tokens, use_cache=args.kernel_cache)
    model, config, tokenizer = load_model(args.model, device, dtype, args.weights, probe)
    if tokenizer is None:
        raise ModelLoadError(f"model {args.model} has no tokenizer (tokenizer.json) beside it")
    dtype = next(model.parameters()).dtype
    block_bytes = bytes_per_block(config, args.block_size, dtype)
    num_device_blocks, max_model_len = size_device_tier(args, device, block_bytes, config)
    kv_cache = TieredKVCache(
        config,
        num_device_blocks,
        args.host_kv_tokens // args.block_size,
        args.block_size,
        device,
        dtype,
    )
    grammars = Grammars(
        tokenizer,
        config.vocab_size,
        config.eos_token_ids,
        compile_workers=args.grammar_compile_workers,
        compile_timeout_s=args.grammar_compile_timeout_s,
    )
    executor = ModelExecutor(
        model,
        config,
        kv_cache,
        device,
        args.seed,
        args.compile_decode,
        args.serial_below_tokens,
        grammars,
    )
    return BuiltExecutor(
        executor,
        config,
        tokenizer,
        block_bytes,
        num_device_blocks,
        max_model_len,
        model.kernel_choice.describe(),
        grammars,
    )


def size_device_tier(
    args: EngineArgs, device: torch.device, block_bytes: int, config: ModelConfig
) -> tuple[int, int]:
    """(Device blocks, the served context length): `--device-kv-fraction` of free memory or
    `--device-kv-tokens`, and the context that fits it."""
    if args.device_kv_fraction is not None:
        free = available_memory_bytes(device)
        num_blocks = max(1, int(free * args.device_kv_fraction) // block_bytes)
    else:
        num_blocks = max(1, args.device_kv_tokens // args.block_size)
    max_model_len = context_length(
        args.max_model_len, config.max_position_embeddings, num_blocks * args.block_size
    )
    return num_blocks, max_model_len


def context_length(requested: int | None, model_limit: int, device_pool_tokens: int) -> int:
    """The served context (prompt + output): the request, else the model's capped at 8192 and at
    what the device KV tier holds; an explicit request the tier cannot hold is refused."""
    if requested is not None:
        if requested > device_pool_tokens:
            raise ValueError(
                f"max_model_len {requested} does not fit the device KV tier "
                f"({device_pool_tokens} tokens): raise --device-kv-tokens or lower --max-model-len"
            )
        return min(requested, model_limit)
    return min(8192, model_limit, device_pool_tokens)
