import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama (HF safetensors directory) with the SmolLM2 tokenizer."""
    from tests.tiny_model import build_tiny_model_dir

    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama")))
