"""The embedded SmolLM2-135M GGUF: our greedy continuation equals transformers' generate."""

from __future__ import annotations

import torch

from tests.model.helpers import greedy_generate, hf_greedy
from tokenflow.engine import ModelExecutor
from tokenflow.model import TieredKVCache


def test_config_of_the_embedded_model(smollm):
    config = smollm.config
    assert (config.architecture, config.num_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_heads, config.num_kv_heads, config.vocab_size) == (9, 3, 49152)
    assert config.tie_word_embeddings
    assert smollm.model.embed_tokens is None  # tied: one [H, V] table serves both ends


def test_greedy_continuation_matches_transformers(smollm, hf_smollm):
    model, config, tokenizer = smollm
    prompt = tokenizer.encode("The capital of France is Paris. The capital of Germany is")
    assert len(prompt) == 12
    kv_cache = TieredKVCache(config, 8, 1, 4, "cpu", torch.float32)
    executor = ModelExecutor(model, config, kv_cache, "cpu")
    [ours] = greedy_generate(executor, [prompt], [[7, 2, 5, 0, 3, 6]], num_new=12)
    assert ours == hf_greedy(hf_smollm, prompt, 12)
    assert tokenizer.decode(ours).startswith(" Berlin")
