"""Decode steps through compiled graphs give the eager model's tokens and logits."""

from __future__ import annotations

import torch

from tests.model.helpers import bf16_logit_bound, chunk, greedy_generate, hf_greedy, our_logits
from tests.model.test_model import PROMPTS, TABLES
from tokenflow.engine import ModelExecutor
from tokenflow.model import TieredKVCache, build_model_inputs, load_model

# Texts whose next token is decided by a wide margin (the top logit leads the next by 3.3 or
# more), so comparing argmaxes does not hang on a near tie.  Each is prefilled but for its last
# token, the decode step's input.
DECISIVE_TEXTS = (
    "The alphabet: a, b, c, d, e,",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "The capital of France is Paris. The capital of Germany is",
)
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
    texts = [loaded.tokenizer.encode(text) for text in DECISIVE_TEXTS]
    eager, compiled = _executors(loaded, 16, 16)
    for executor in (eager, compiled):  # the prompts' KV, through the eager prefill
        for i, ids in enumerate(texts):
            chunks = [chunk(f"r{i}", ids[:-1], 0, SMOLLM_TABLES[i])]
            our_logits(loaded.model, executor.kv_cache, chunks)
    for rows in ([0], [0, 1, 2]):
        chunks = [
            chunk(f"r{i}", texts[i][-1:], len(texts[i]) - 1, SMOLLM_TABLES[i], 1) for i in rows
        ]
        logits = []
        for executor in (eager, compiled):
            tables = {c.request_id: c.new_block_ids for c in chunks}
            inputs = build_model_inputs(chunks, tables, 16, torch.device("cpu"))
            with torch.inference_mode():
                logits.append(executor._forward(inputs))
        # The graphs round where eager does (emulate_precision_casts), so the logits agree to
        # the bit here; where another CPU's kernels round a value the other way, each path
        # stays within the bf16 bound of the exact logits, so the two within twice that.
        bound = 2 * bf16_logit_bound(logits[0], loaded.config.num_layers)
        torch.testing.assert_close(logits[1], logits[0], atol=bound, rtol=0)
        assert torch.equal(logits[1].argmax(-1), logits[0].argmax(-1))
