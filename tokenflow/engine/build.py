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

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from tokenflow.core.plan import StepPlan, StepResult
from tokenflow.engine.engine_args import EngineArgs
from tokenflow.engine.executor import ModelExecutor
from tokenflow.model.config import ModelConfig, ModelLoadError
from tokenflow.model.decode_path import DecodePathSettings, decode_path_key
from tokenflow.model.grammar import Grammars
from tokenflow.model.kernels import ProbeSettings
from tokenflow.model.kv_cache import TieredKVCache, available_memory_bytes, bytes_per_block
from tokenflow.model.loader import default_model_path, load_model
from tokenflow.model.tokenizer import Tokenizer
from tokenflow.model.transformer import LlamaModel

logger = logging.getLogger(__name__)

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
    """Our PyTorch model and its tiered KV cache.  Each phase of the start says at INFO what it
    does and how long it took: on a first start they take a minute or more."""
    dtype = _DTYPES[args.dtype] if args.dtype else None
    probe = ProbeSettings(args.serial_below_tokens, use_cache=args.kernel_cache)
    path = Path(args.model) if args.model is not None else Path(default_model_path())
    loading = f"loading the model {path} ({_size_text(_size_bytes(path))})"
    with timed_phase(loading, "loaded the model"):
        model, config, tokenizer = load_model(str(path), device, dtype, args.weights, probe)
    if tokenizer is None:
        raise ModelLoadError(f"model {args.model} has no tokenizer (tokenizer.json) beside it")
    dtype = next(model.parameters()).dtype
    block_bytes = bytes_per_block(config, args.block_size, dtype)
    num_device_blocks, max_model_len = size_device_tier(args, device, block_bytes, config)
    num_host_blocks = args.host_kv_tokens // args.block_size
    tiers = _tiers_text(args.block_size, block_bytes, num_device_blocks, num_host_blocks)
    with timed_phase(tiers, "built the KV tiers"):
        kv_cache = TieredKVCache(
            config, num_device_blocks, num_host_blocks, args.block_size, device, dtype
        )
    # (where the executor times compiled decode steps, decode_path.py says so as it starts)
    preparing = "preparing the executor (on CPU a first start compiles its attention kernel)"
    decode_settings = _decode_settings(args, path, model)
    with timed_phase(preparing, "prepared the executor"):
        executor, grammars = _executor(
            args, device, model, config, tokenizer, kv_cache, decode_settings
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


def _executor(
    args: EngineArgs,
    device: torch.device,
    model: LlamaModel,
    config: ModelConfig,
    tokenizer: Tokenizer,
    kv_cache: TieredKVCache,
    decode_settings: DecodePathSettings | None,
) -> tuple[ModelExecutor, Grammars]:
    """The executor over the loaded model and its KV tiers, and its structured outputs."""
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
        decode_settings,
    )
    return executor, grammars


def _decode_settings(args: EngineArgs, path: Path, model: LlamaModel) -> DecodePathSettings | None:
    """How to choose the decode path when no flag does: with the kernels, by measurement (None
    where the kernels were given by flags or fixed by the checkpoint: eager)."""
    if model.kernel_choice.source not in ("probe", "cache") or not path.is_file():
        return None
    key = decode_path_key(
        path, model.kernel_plan, torch.get_num_threads(), args.serial_below_tokens
    )
    return DecodePathSettings(key, use_cache=args.kernel_cache)


@contextmanager
def timed_phase(doing: str, done: str) -> Iterator[None]:
    """Log `doing` at INFO, then `done` and the seconds it took once the block ends (nothing
    when it raises: the error says what went wrong)."""
    logger.info("%s", doing)
    started = time.perf_counter()
    yield
    logger.info("%s in %.1f s", done, time.perf_counter() - started)


def _tiers_text(block_size: int, block_bytes: int, num_device: int, num_host: int) -> str:
    """'building the KV tiers: device 8192 tokens (512 blocks of 16, 96.0 MiB), host ...'."""
    tiers = [
        f"{name} {n * block_size} tokens ({n} blocks of {block_size}, "
        f"{_size_text(n * block_bytes)})"
        for name, n in (("device", num_device), ("host", num_host))
    ]
    return f"building the KV tiers: {', '.join(tiers)}"


def _size_bytes(path: Path) -> int:
    """A model file's bytes, or a checkpoint directory's files' (0 where it does not exist:
    the loader says why)."""
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size if path.exists() else 0


def _size_text(num_bytes: int) -> str:
    return (
        f"{num_bytes / (1 << 30):.1f} GiB"
        if num_bytes >= 1 << 30
        else f"{num_bytes / (1 << 20):.1f} MiB"
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
