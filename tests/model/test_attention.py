"""Paged attention on random layouts against a dense, per-sequence reference.

Each case scatters sequences over random cache blocks, stores their cached K/V there, and runs
one step (decodes of various lengths, prefills with and without a cached prefix) through
`paged_attention` with decode K/V gathered (the eager reference) and read in place.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.model.helpers import bf16_error_bound
from tokenflow.core.plan import ScheduledChunk
from tokenflow.core.request import SamplingParams
from tokenflow.model.attention import (
    LayerKV,
    ModelInputs,
    build_model_inputs,
    paged_attention,
)

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 8, 4
CPU = torch.device("cpu")


def _dense_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, start: int):
    """query [L, heads, D] at positions start.. over key/value [start + L, kv_heads, D]."""
    group = HEADS // KV_HEADS
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scores = torch.einsum("lhd,shd->hls", query, key) / math.sqrt(DIM)
    positions = torch.arange(key.shape[0])
    visible = positions[None, :] <= (start + torch.arange(query.shape[0]))[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hls,shd->lhd", probs, value)


def _case(seed: int, starts: list[int], lengths: list[int]):
    """Random cache, chunks, this step's Q/K/V, and the dense expected output per chunk."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-(s + n) // BLOCK) + 1 for s, n in zip(starts, lengths, strict=True)]
    num_blocks = sum(blocks_needed) + 3
    cache = LayerKV(*(torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen) for _ in "kv"))
    order = torch.randperm(num_blocks, generator=gen).tolist()
    params = SamplingParams(max_tokens=8)
    chunks, queries, keys, values, expected = [], [], [], [], []
    for index, (start, length) in enumerate(zip(starts, lengths, strict=True)):
        table = order[: blocks_needed[index]]  # one spare block beyond the context
        order = order[blocks_needed[index] :]
        history = [torch.randn(start, KV_HEADS, DIM, generator=gen) for _ in "kv"]
        for position in range(start):  # the cached prefix lives in the paged blocks
            block, offset = table[position // BLOCK], position % BLOCK
            cache.key[block, offset], cache.value[block, offset] = (h[position] for h in history)
        query = torch.randn(length, HEADS, DIM, generator=gen)
        key, value = (torch.randn(length, KV_HEADS, DIM, generator=gen) for _ in "kv")
        tokens = tuple(range(length))
        chunks.append(
            ScheduledChunk(
                request_id=f"r{index}",
                token_ids=tokens,
                start_position=start,
                new_block_ids=tuple(table),
                block_table_start=0,
                samples_token=True,
                sampling_params=params,
                num_output_tokens=1,
            )
        )
        full_key, full_value = torch.cat((history[0], key)), torch.cat((history[1], value))
        expected.append(_dense_attention(query, full_key, full_value, start))
        queries.append(query)
        keys.append(key)
        values.append(value)
    return cache, chunks, queries, keys, values, expected


def _inputs(chunks: list[ScheduledChunk], in_place_min_keys: int | None) -> ModelInputs:
    tables = {c.request_id: c.new_block_ids for c in chunks}  # whole tables (deltas from 0)
    return build_model_inputs(chunks, tables, BLOCK, CPU, in_place_min_keys=in_place_min_keys)


def _run(seed: int, starts: list[int], lengths: list[int], in_place: bool) -> None:
    cache, chunks, queries, keys, values, expected = _case(seed, starts, lengths)
    inputs = _inputs(chunks, 0 if in_place else None)
    # Rows are decodes first, then prefills, each in plan order.
    order = [i for i, c in enumerate(chunks) if c.num_tokens == 1]
    order += [i for i, c in enumerate(chunks) if c.num_tokens > 1]
    query, key, value = (torch.cat([parts[i] for i in order]) for parts in (queries, keys, values))
    with torch.inference_mode():
        out = paged_attention(query, key, value, cache, inputs.attn)
    torch.testing.assert_close(out, torch.cat([expected[i] for i in order]), atol=1e-5, rtol=1e-5)
    decode = inputs.attn.decode
    if decode is not None:  # a lone decode always gathers
        assert decode.reads_in_place == (in_place and decode.num_seqs > 1)


CASES = {
    # decodes of unequal lengths: padded block tables, masked tails, block-aligned ends
    "decodes": ([0, 3, 4, 7, 15, 16], [1] * 6),
    "one block each": ([0, 1, 2], [1] * 3),
    "single decode": ([9], [1]),
    "prefill with cached prefix": ([6, 0, 11], [5, 1, 1]),
    "prefills and decodes": ([0, 9, 2, 13, 4], [7, 1, 1, 3, 1]),
}


@pytest.mark.parametrize("in_place", [False, True], ids=["gather", "in-place"])
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_paged_attention_matches_dense_reference(name, in_place, seed):
    starts, lengths = CASES[name]
    _run(seed, starts, lengths, in_place)


def test_in_place_decode_equals_gather_in_bfloat16():
    cache, chunks, queries, keys, values, _ = _case(5, [3, 8, 21, 30], [1, 1, 1, 1])
    cache = LayerKV(cache.key.bfloat16(), cache.value.bfloat16())
    query, key, value = (torch.cat(p).bfloat16() for p in (queries, keys, values))
    outs = []
    for in_place in (False, True):
        min_keys = 0 if in_place else None
        attn = _inputs(chunks, min_keys).attn
        assert attn.decode is not None and attn.decode.reads_in_place == in_place
        with torch.inference_mode():
            outs.append(paged_attention(query, key, value, cache, attn))
    # Each output is a convex combination of the values, so it is at most their largest size;
    # each path rounds its scores, probabilities and output to bf16: 6 roundings apart.
    bound = bf16_error_bound(float(cache.value.abs().max()), 6)
    torch.testing.assert_close(outs[1], outs[0], atol=bound, rtol=0)


def test_small_decode_batches_gather():
    _, chunks, *_ = _case(0, [3, 8, 21, 30], [1, 1, 1, 1])  # 4 x 32 padded keys
    for min_keys, expected in ((None, False), (129, False), (128, True), (0, True)):
        decode = _inputs(chunks, min_keys).attn.decode
        assert decode is not None and decode.reads_in_place == expected


def test_warm_up_compiles_for_the_real_cache_so_the_first_step_does_not():
    # The executor warms the kernel up on a layer's real cache; a later decode over other
    # batch sizes and tables must reuse that compilation (it took seconds inside the first
    # burst's first step when the warm-up used made-up head shapes).
    from torch._dynamo.utils import counters

    from tokenflow.model.paged_decode import can_read_in_place, paged_decode_attention

    cache = torch.zeros(2, 2, 37, BLOCK, KV_HEADS, DIM, dtype=torch.bfloat16)  # [layer, K/V, ..]
    assert can_read_in_place(cache[0, 0], cache[0, 1], HEADS)
    compiled = counters["stats"]["unique_graphs"]
    with torch.inference_mode():  # as the executor builds its inputs
        query = torch.randn(5, HEADS, DIM, dtype=torch.bfloat16)
        table = torch.randint(0, 37, (5, 6))
        paged_decode_attention(query, cache[1, 0], cache[1, 1], table, torch.full((5,), 21))
    assert counters["stats"]["unique_graphs"] == compiled
