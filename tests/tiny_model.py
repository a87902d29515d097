"""A tiny random-weight Llama with the embedded SmolLM2 tokenizer, saved as an HF directory.

Real format (config.json + model.safetensors + tokenizer.json + tokenizer_config.json), real
tokenizer and chat template, and a model small enough that engine tests run in seconds.  The
tokenizer comes from the embedded GGUF, or from the files in `TOKENFLOW_TOKENIZER_DIR` where
the GGUF is not installed (a GPU machine: `python -m benchmarks.gpu_check --prepare` writes them).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tokenflow.model.loader import default_model_path
from tokenflow.model.tokenizer import Tokenizer

VOCAB_SIZE = 49152


def build_tiny_model_dir(directory: Path, seed: int = 0) -> Path:
    """Write the tiny model into `directory` and return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _write_tokenizer(directory)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


def _write_tokenizer(directory: Path) -> Tokenizer:
    """tokenizer.json and tokenizer_config.json into `directory`; the tokenizer they hold."""
    source = os.environ.get("TOKENFLOW_TOKENIZER_DIR")
    if source:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(source) / name, directory / name)
        tokenizer = Tokenizer.from_directory(directory)
        assert tokenizer is not None, f"no tokenizer.json in {source}"
        return tokenizer
    from gguf import GGUFReader

    reader = GGUFReader(default_model_path())
    metadata = {name: field.contents() for name, field in reader.fields.items()}
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    tokenizer.save_directory(directory)
    return tokenizer
