"""llama.cpp as the engine's executor (optional: `pip install tokenflow[llamacpp]`).

`serve --executor llama-cpp` runs the same core (scheduler, policies, tiers) with llama.cpp's
forward pass on the GGUF file's own quantized weights; see `executor.py`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tokenflow.engine.build import BuiltExecutor, size_device_tier
from tokenflow.engine.engine_args import EngineArgs
from tokenflow.model.config import ModelConfig
from tokenflow.model.kv_cache import bytes_per_block
from tokenflow.model.loader import read_gguf_header


def build_llamacpp_executor(args: EngineArgs, device: torch.device) -> BuiltExecutor:
    """The engine's executor factory for `--executor llama-cpp`: llama.cpp on the GGUF file,
    its pool of KV cells sized like the device tier (llama.cpp keeps float16 KV)."""
    if device.type != "cpu":
        raise ValueError("the llama-cpp executor runs on CPU (--device cpu)")
    path, config, tokenizer = read_gguf_header(args.model)
    block_bytes = bytes_per_block(config, args.block_size, torch.float16)
    num_device_blocks, max_model_len = size_device_tier(args, device, block_bytes, config)
    executor = build_executor(path, config, args, num_device_blocks * args.block_size)
    return BuiltExecutor(executor, config, tokenizer, block_bytes, num_device_blocks, max_model_len)


def build_executor(path: Path, config: ModelConfig, args: EngineArgs, pool_tokens: int):
    """A LlamaCppExecutor for `args`, whose pool of KV cells holds `pool_tokens`."""
    try:
        from tokenflow.integrations.llamacpp.context import ContextSpec
        from tokenflow.integrations.llamacpp.executor import LlamaCppExecutor
        from tokenflow.integrations.llamacpp.requant import as_q8_0
    except ImportError as err:
        raise RuntimeError(
            "the llama-cpp executor needs llama-cpp-python: pip install 'tokenflow[llamacpp]' "
            f"({err})"
        ) from err
    spec = ContextSpec(
        num_ctx_tokens=pool_tokens,
        max_batch_tokens=args.max_prefill_tokens + args.max_num_seqs,
        num_seqs=min(256, 4 * args.max_num_seqs),
        num_threads=args.num_threads or os.cpu_count() or 1,
        repack_weights=args.llama_cpp_repack,
    )
    if args.weights == "q8_0":
        path = as_q8_0(path)
    return LlamaCppExecutor(path, spec, config.eos_token_ids, args.seed)
