"""Loading checkpoints: GGUF and sharded safetensors round trips, and clear errors on bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.model.helpers import chunk, hf_next_logits, our_logits, write_tiny_gguf
from tokenflow.model import ModelLoadError, TieredKVCache, load_model

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]


def _assert_matches_transformers(hf_model, path: Path) -> None:
    model, config, _ = load_model(str(path), "cpu", torch.float32)
    kv_cache = TieredKVCache(config, 8, 1, 4, "cpu", torch.float32)
    logits = our_logits(model, kv_cache, [chunk("a", PROMPT, 0, [0, 1, 2])])
    torch.testing.assert_close(logits[0], hf_next_logits(hf_model, PROMPT), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_gguf_round_trip_undoes_the_llama_cpp_rope_permutation(tiny_checkpoints, tmp_path, kind):
    hf_model, _ = tiny_checkpoints[kind]
    path = write_tiny_gguf(hf_model, tmp_path / f"{kind}.gguf")
    _assert_matches_transformers(hf_model, path)
    _, config, tokenizer = load_model(str(path))
    assert config.tie_word_embeddings == hf_model.config.tie_word_embeddings
    assert config.attention_bias == (kind == "qwen2")
    assert tokenizer.encode("ab") == [config.vocab_size - 2]  # the one merge
    assert tokenizer.eos_token_id == config.vocab_size - 1


def test_sharded_safetensors_load(tiny_checkpoints, tmp_path):
    hf_model, _ = tiny_checkpoints["llama"]
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    _assert_matches_transformers(hf_model, tmp_path)


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nowhere.gguf"))


def test_random_bytes_are_not_a_gguf(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8).numpy().tobytes())
    with pytest.raises(ModelLoadError, match=r"junk\.gguf is not a valid GGUF file"):
        load_model(str(path))


def test_truncated_gguf(tiny_checkpoints, tmp_path):
    path = write_tiny_gguf(tiny_checkpoints["llama"][0], tmp_path / "cut.gguf")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 5000])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf"):
        load_model(str(path))


def _copy_checkpoint(tiny_checkpoints, tmp_path: Path, kind: str = "llama") -> Path:
    directory = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints[kind][1], directory)
    return directory


def test_truncated_safetensors(tiny_checkpoints, tmp_path):
    directory = _copy_checkpoint(tiny_checkpoints, tmp_path)
    weights = directory / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        load_model(str(directory))


def test_missing_tensor_is_named(tiny_checkpoints, tmp_path):
    directory = _copy_checkpoint(tiny_checkpoints, tmp_path)
    weights = directory / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, weights)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(directory))


def test_wrong_shape_is_named(tiny_checkpoints, tmp_path):
    directory = _copy_checkpoint(tiny_checkpoints, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["intermediate_size"] = 100
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="gate_proj.weight has shape"):
        load_model(str(directory))


def test_unsupported_architecture_names_the_supported_ones(tiny_checkpoints, tmp_path):
    directory = _copy_checkpoint(tiny_checkpoints, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["model_type"] = "gpt_neox"
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"'gpt_neox'.*supported: llama, qwen2"):
        load_model(str(directory))


def test_directory_without_weights(tiny_checkpoints, tmp_path):
    directory = _copy_checkpoint(tiny_checkpoints, tmp_path)
    (directory / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="neither model.safetensors"):
        load_model(str(directory))


def test_corrupt_config_json(tiny_checkpoints, tmp_path):
    directory = _copy_checkpoint(tiny_checkpoints, tmp_path)
    (directory / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"cannot parse .*config\.json"):
        load_model(str(directory))
