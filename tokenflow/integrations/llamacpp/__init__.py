"""llama.cpp as the engine's executor (optional: `pip install tokenflow[llamacpp]`).

`serve --executor llama-cpp` runs the same core (scheduler, policies, tiers) with llama.cpp's
forward pass on the GGUF file's own quantized weights; see `executor.py`.
"""

from __future__ import annotations

import os
from pathlib import Path

from tokenflow.engine.engine_args import EngineArgs
from tokenflow.engine.model_config import ModelConfig


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
