"""The model: its configuration, the paged-KV decoder and its kernels, loading, tokenizing and
sampling.  Everything here is torch and tensors; the step loop that drives it is
`tokenflow.engine`."""

from tokenflow.model.attention import AttentionMetadata, LayerKV, ModelInputs, build_model_inputs
from tokenflow.model.config import ModelConfig, ModelLoadError, RopeScaling
from tokenflow.model.kv_cache import (
    TieredKVCache,
    available_memory_bytes,
    blocks_for_bytes,
    bytes_per_block,
)
from tokenflow.model.loader import (
    LoadedModel,
    build_model,
    default_dtype,
    default_model_path,
    load_model,
)
from tokenflow.model.sampler import Sampler, SamplingRow
from tokenflow.model.tokenizer import (
    IncrementalDetokenizer,
    Tokenizer,
    find_stop,
    partial_stop_length,
)
from tokenflow.model.transformer import LlamaModel

__all__ = [
    "AttentionMetadata",
    "IncrementalDetokenizer",
    "LayerKV",
    "LlamaModel",
    "LoadedModel",
    "ModelConfig",
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
