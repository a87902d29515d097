"""Session fixtures: a tiny random Llama directory, tiny random checkpoints (cheap) and the
embedded SmolLM2 with its transformers oracles (loaded once)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from tests.model.helpers import make_hf_model, save_hf_model
from tokenflow.model import LoadedModel, default_model_path, load_model


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, Path]]:
    """kind -> (transformers model, its safetensors directory) for llama, llama3, qwen2."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        kind: (model, save_hf_model(model, root / kind))
        for kind, model in ((k, make_hf_model(k)) for k in ("llama", "llama3", "qwen2"))
    }


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    """Our load of the embedded SmolLM2-135M GGUF (float32)."""
    return load_model(None, "cpu", torch.float32)


@pytest.fixture(scope="session")
def hf_smollm_tokenizer() -> object:
    """transformers' tokenizer built from the same GGUF: the oracle for ours."""
    from transformers import AutoTokenizer

    path = Path(default_model_path())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="session")
def hf_smollm() -> torch.nn.Module:
    """transformers' model dequantized from the same GGUF (float32): the oracle for ours."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = Path(default_model_path())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    return model.eval()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama (HF safetensors directory) with the SmolLM2 tokenizer."""
    from tests.tiny_model import build_tiny_model_dir

    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama")))
