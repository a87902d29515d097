"""The tiered KV cache: block copies between tiers, sizing, and offload/resume with a model."""

from __future__ import annotations

import pytest
import torch

from tests.model.helpers import DEVICES, GREEDY_NO_EOS, chunk, greedy_generate, plan
from tokenflow.core.plan import BlockCopy, CopyKind
from tokenflow.engine import ModelExecutor
from tokenflow.model import (
    ModelConfig,
    TieredKVCache,
    blocks_for_bytes,
    bytes_per_block,
    load_model,
)

CONFIG = ModelConfig(
    architecture="llama",
    num_layers=3,
    hidden_size=32,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=64,
    vocab_size=100,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=None,
    max_position_embeddings=128,
    tie_word_embeddings=True,
    attention_bias=False,
)


def _copies(kind: CopyKind, pairs: list[tuple[int, int]]) -> list[BlockCopy]:
    return [BlockCopy("r", kind, src, dst) for src, dst in pairs]


def test_block_copies_move_every_layer_k_and_v():
    cache = TieredKVCache(CONFIG, 6, 4, 2, "cpu", torch.float32)
    cache.device_kv.copy_(torch.randn_like(cache.device_kv))
    original = cache.device_kv.clone()
    cache.apply_copies(_copies(CopyKind.EVICT, [(1, 3), (4, 0)]), ())
    torch.testing.assert_close(cache.host_kv[:, :, 3], original[:, :, 1], rtol=0, atol=0)
    torch.testing.assert_close(cache.host_kv[:, :, 0], original[:, :, 4], rtol=0, atol=0)
    cache.device_kv.zero_()
    cache.apply_copies((), _copies(CopyKind.LOAD, [(3, 5), (0, 2)]))
    torch.testing.assert_close(cache.device_kv[:, :, 5], original[:, :, 1], rtol=0, atol=0)
    torch.testing.assert_close(cache.device_kv[:, :, 2], original[:, :, 4], rtol=0, atol=0)
    assert cache.device_kv[:, :, [0, 1, 3, 4]].abs().sum() == 0  # nothing else written


def test_layer_views_share_storage_with_the_tier_tensor():
    cache = TieredKVCache(CONFIG, 5, 1, 4, "cpu", torch.float32)
    layer = cache.device_layers[2]
    assert layer.key.shape == (5, 4, 2, 8)  # [num_blocks, block_size, kv_heads, head_dim]
    layer.value[3, 1] = 1.0
    assert cache.device_kv[2, 1, 3, 1].eq(1.0).all()


def test_out_of_range_block_ids_are_rejected():
    cache = TieredKVCache(CONFIG, 4, 2, 2, "cpu", torch.float32)
    with pytest.raises(IndexError, match="dst block ids \\[2\\]"):
        cache.apply_copies(_copies(CopyKind.EVICT, [(0, 2)]), ())


def test_blocks_for_bytes():
    per_block = bytes_per_block(CONFIG, 16, torch.bfloat16)
    assert per_block == 2 * 3 * 2 * 8 * 16 * 2  # K+V x layers x kv_heads x dim x tokens x bytes
    assert blocks_for_bytes(CONFIG, 16, torch.bfloat16, 10 * per_block + 5) == 10
    assert blocks_for_bytes(CONFIG, 16, torch.bfloat16, per_block - 1) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_offload_scribble_and_reload_elsewhere_continues_identically(tiny_checkpoints, device):
    """Evict a request to the host tier mid-decode, trash its device blocks, load it back into
    different device blocks, and keep decoding: the tokens equal an uninterrupted run (on CUDA:
    real copies between the device and the pinned host tier, on the copy stream)."""
    _, directory = tiny_checkpoints["llama"]
    model, config, _ = load_model(str(directory), device, torch.float32)
    cache = TieredKVCache(config, 16, 8, 4, device, torch.float32)
    executor = ModelExecutor(model, config, cache, device)
    prompt, table = [3, 14, 15, 92, 65, 35, 89, 79, 32], [1, 4, 6, 9, 11]
    [expected] = greedy_generate(executor, [prompt], [table], num_new=10)

    [tokens] = greedy_generate(executor, [prompt], [table], num_new=4)
    num_tokens = len(prompt) + 3  # KV computed so far; the 4th sampled token is not yet fed
    used = table[: -(-num_tokens // 4)]
    host = [7, 2, 5]
    evict = _copies(CopyKind.EVICT, list(zip(used, host, strict=True)))
    executor.execute(plan([], device_to_host=evict))
    cache.device_kv.normal_()  # scribble over every device block
    moved = [12, 0, 15, 3, 8]  # device blocks for the whole sequence; the first 3 get loaded
    loads = _copies(CopyKind.LOAD, list(zip(host, moved[:3], strict=True)))
    executor.execute(plan([], host_to_device=loads))
    while len(tokens) < 10:
        position = len(prompt) + len(tokens) - 1
        step = [chunk("r0", [tokens[-1]], position, moved, len(tokens), True, GREEDY_NO_EOS)]
        tokens.append(executor.execute(plan(step)).sampled[0].token_id)
    assert tokens == expected
