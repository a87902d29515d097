"""The real engine: model loading, the paged-KV decoder, tier copies, sampling, the executor."""

from tokenflow.engine.attention import AttentionMetadata, LayerKV, ModelInputs, build_model_inputs
from tokenflow.engine.executor import ModelExecutor
from tokenflow.engine.kv_cache import (
    TieredKVCache,
    available_memory_bytes,
    blocks_for_bytes,
    bytes_per_block,
)
from tokenflow.engine.loader import (
    LoadedModel,
    build_model,
    default_dtype,
    default_model_path,
    load_model,
)
from tokenflow.engine.model import LlamaModel
from tokenflow.engine.model_config import ModelConfig, ModelLoadError, RopeScaling
from tokenflow.engine.sampler import Sampler, SamplingRow
from tokenflow.engine.tokenizer import (
    IncrementalDetokenizer,
    Tokenizer,
    find_stop,
    partial_stop_length,
)

__all__ = [
    "AttentionMetadata",
    "IncrementalDetokenizer",
    "LayerKV",
    "LlamaModel",
    "LoadedModel",
    "ModelConfig",
    "ModelExecutor",
    "ModelInputs",
    "ModelLoadError",
    "RopeScaling",
    "Sampler",
    "SamplingRow",
    "TieredKVCache",
    "Tokenizer",
    "available_memory_bytes",
    "blocks_for_bytes",
    "build_model",
    "build_model_inputs",
    "bytes_per_block",
    "default_dtype",
    "default_model_path",
    "find_stop",
    "load_model",
    "partial_stop_length",
]
