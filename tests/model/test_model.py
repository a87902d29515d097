"""Our decoder against transformers on tiny random Llama / Llama-3-RoPE / Qwen2 checkpoints."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.model.helpers import (
    DEVICES,
    bf16_logit_bound,
    chunk,
    greedy_generate,
    hf_greedy,
    hf_next_logits,
    our_logits,
)
from tokenflow.engine import ModelExecutor
from tokenflow.model import TieredKVCache, load_model

KINDS = ("llama", "llama3", "qwen2")
BLOCK_SIZE = 4
PROMPTS = ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [20, 21], [30, 31, 32, 33, 34, 35, 36])
# Scattered, non-contiguous block tables: block order must not matter.
TABLES = (
    [3, 17, 9, 12, 30, 1, 22, 8],
    [5, 25, 14, 2, 19, 27, 11, 6],
    [0, 16, 21, 4, 28, 13, 7, 10],
)


def _setup(tiny_checkpoints, kind: str, device: str = "cpu") -> tuple[object, ModelExecutor]:
    """transformers' model and our executor, both on `device`, from one tiny checkpoint."""
    hf_model, directory = tiny_checkpoints[kind]
    if device != "cpu":
        hf_model = copy.deepcopy(hf_model).to(device)  # the session's model stays on the CPU
    model, config, tokenizer = load_model(str(directory), device, torch.float32)
    assert tokenizer is None  # a bare checkpoint directory has no tokenizer files
    kv_cache = TieredKVCache(config, 32, 8, BLOCK_SIZE, device, torch.float32)
    return hf_model, ModelExecutor(model, config, kv_cache, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_batched_prefill_and_decode_logits_match_transformers(tiny_checkpoints, kind, device):
    hf_model, executor = _setup(tiny_checkpoints, kind, device)
    model, kv_cache = executor.model, executor.kv_cache
    sequences = [list(p) for p in PROMPTS]
    chunks = [chunk(f"r{i}", p, 0, TABLES[i]) for i, p in enumerate(PROMPTS)]
    for step in range(4):
        logits = our_logits(model, kv_cache, chunks)  # [3, vocab]
        for i, seq in enumerate(sequences):
            expected = hf_next_logits(hf_model, seq)
            torch.testing.assert_close(logits[i], expected, atol=2e-4, rtol=1e-4)
            seq.append(int(expected.argmax()))
        chunks = [
            chunk(f"r{i}", [seq[-1]], len(seq) - 1, TABLES[i], step + 1)
            for i, seq in enumerate(sequences)
        ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generation_matches_transformers_token_for_token(tiny_checkpoints, kind, device):
    hf_model, executor = _setup(tiny_checkpoints, kind, device)
    ours = greedy_generate(executor, PROMPTS, TABLES, num_new=12)
    for prompt, tokens in zip(PROMPTS, ours, strict=True):
        assert tokens == hf_greedy(hf_model, prompt, 12)


def test_chunked_prefill_equals_whole_prefill(tiny_checkpoints):
    _, executor = _setup(tiny_checkpoints, "llama3")
    whole = greedy_generate(executor, PROMPTS, TABLES, num_new=6)
    chunked = greedy_generate(executor, PROMPTS, TABLES, num_new=6, prefill_chunk=3)
    assert chunked == whole


def test_prefill_and_decode_share_a_step(tiny_checkpoints):
    """A decode row and a prefill with a cached prefix in one flattened batch."""
    hf_model, executor = _setup(tiny_checkpoints, "qwen2")
    model, kv_cache = executor.model, executor.kv_cache
    first = our_logits(model, kv_cache, [chunk("a", PROMPTS[0], 0, TABLES[0])])
    token = int(first[0].argmax())
    our_logits(model, kv_cache, [chunk("b", PROMPTS[2][:3], 0, TABLES[2], samples_token=False)])
    mixed = [
        chunk("b", PROMPTS[2][3:], 3, TABLES[2]),  # prefill continuing from a cached prefix
        chunk("a", [token], len(PROMPTS[0]), TABLES[0], 1),  # a decode, listed second
    ]
    logits = our_logits(model, kv_cache, mixed)
    torch.testing.assert_close(logits[0], hf_next_logits(hf_model, PROMPTS[2]), atol=2e-4, rtol=0)
    expected = hf_next_logits(hf_model, [*PROMPTS[0], token])
    torch.testing.assert_close(logits[1], expected, atol=2e-4, rtol=0)


def test_block_table_too_short_is_rejected(tiny_checkpoints):
    _, executor = _setup(tiny_checkpoints, "llama")
    with pytest.raises(ValueError, match="cannot hold positions"):
        our_logits(executor.model, executor.kv_cache, [chunk("a", PROMPTS[0], 0, [1, 2])])


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_logits_stay_close_to_float32(tiny_checkpoints, device):
    _, directory = tiny_checkpoints["llama"]
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        model, config, _ = load_model(str(directory), device, dtype)
        kv_cache = TieredKVCache(config, 32, 1, BLOCK_SIZE, device, dtype)
        results.append(our_logits(model, kv_cache, [chunk("a", PROMPTS[0], 0, TABLES[0])]))
    fp32, bf16 = results
    assert (fp32 - bf16).abs().max() < bf16_logit_bound(fp32, config.num_layers)


def test_greedy_generation_reading_kv_in_place_matches_transformers(tiny_checkpoints):
    hf_model, executor = _setup(tiny_checkpoints, "llama3")
    executor.in_place_min_keys = 0  # every decode batch of 2+ through the in-place kernel
    ours = greedy_generate(executor, PROMPTS, TABLES, num_new=12)
    for prompt, tokens in zip(PROMPTS, ours, strict=True):
        assert tokens == hf_greedy(hf_model, prompt, 12)
