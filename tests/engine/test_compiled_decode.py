"""Decode steps through compiled graphs give the eager model's tokens and logits."""

from __future__ import annotations

import torch

from tests.engine.helpers import chunk, greedy_generate, hf_greedy, our_logits
from tests.engine.test_model import PROMPTS, TABLES
from tokenflow.engine import ModelExecutor, TieredKVCache, build_model_inputs, load_model

SMOLLM_PROMPTS = ([504, 3458, 282, 4649, 314, 7042], [1780, 2365, 30], [19, 20, 21, 22])
SMOLLM_TABLES = ([7, 2, 5, 0], [1, 3, 4, 6], [8, 9, 10, 11])


def _executors(loaded, num_blocks: int, block_size: int) -> list[ModelExecutor]:
    """An eager and a compiling executor over one model, each with its own KV cache."""
    model, config, _ = loaded
    return [
        ModelExecutor(
            model,
            config,
            TieredKVCache(config, num_blocks, 1, block_size, "cpu", model.dtype),
            "cpu",
            compile_decode=compiled,
        )
        for compiled in (False, True)
    ]


def test_compiled_greedy_decode_matches_transformers(tiny_checkpoints):
    hf_model, directory = tiny_checkpoints["llama3"]
    eager, compiled = _executors(load_model(str(directory), "cpu", torch.float32), 32, 4)
    assert compiled.decoder is not None and eager.decoder is None
    ours = greedy_generate(compiled, PROMPTS, TABLES, num_new=12)
    assert ours == greedy_generate(eager, PROMPTS, TABLES, num_new=12)
    for prompt, tokens in zip(PROMPTS, ours, strict=True):
        assert tokens == hf_greedy(hf_model, prompt, 12)


def test_compiled_decode_logits_equal_eager_on_the_int4_model():
    """The default CPU model (4-bit weights, bfloat16): batch 1 and 3, one step's logits."""
    loaded = load_model(None, "cpu", None)
    eager, compiled = _executors(loaded, 16, 16)
    for executor in (eager, compiled):  # the prompts' KV, through the eager prefill
        for i, prompt in enumerate(SMOLLM_PROMPTS):
            chunks = [chunk(f"r{i}", prompt, 0, SMOLLM_TABLES[i])]
            our_logits(loaded.model, executor.kv_cache, chunks)
    for rows in ([0], [0, 1, 2]):
        chunks = [
            chunk(f"r{i}", [42 + i], len(SMOLLM_PROMPTS[i]), SMOLLM_TABLES[i], 1) for i in rows
        ]
        logits = []
        for executor in (eager, compiled):
            tables = {c.request_id: c.new_block_ids for c in chunks}
            inputs = build_model_inputs(chunks, tables, 16, torch.device("cpu"))
            with torch.inference_mode():
                logits.append(executor._forward(inputs))
        torch.testing.assert_close(logits[1], logits[0], atol=2e-2, rtol=2e-2)
        assert torch.equal(logits[1].argmax(-1), logits[0].argmax(-1))
