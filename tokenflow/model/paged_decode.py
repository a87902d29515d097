"""Decode attention that reads the paged KV cache in place: no per-step gather of K/V.

The eager path (attention.py) copies every decoding sequence's blocks into a dense
[B, S, kv_heads, D] tensor per layer and step, then runs SDPA on it.  Here the attention is
written as gathers feeding elementwise products and reductions, which the compiler (inductor)
fuses into one loop nest: each key and value row is loaded from its cache block where it lies,
and nothing of size B x D x S is written.  On this project's 2-core CPU one layer ran 1.2-2.8x
faster than gather + SDPA at 8-32 sequences and 1k-4k context (docs/design.md).

Shapes are compiled once as dynamic (batch, blocks per sequence, cache blocks).  Blocks per
sequence are padded to at least 2 so that the compiler's special-casing of size 1 does not cost
a second compilation; a single sequence, and batches of fewer than MIN_KEYS padded keys, are
left to the eager path, which was as fast or faster there.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)
MIN_SEQS = 2  # fewer decoding sequences use gather + SDPA
# Below this many padded keys in a decode batch (sequences x padded context) gather + SDPA was
# as fast or faster (e.g. 8 x 128: 0.80x with 2 threads; 32 x 128: 1.25x in place).
MIN_KEYS = 2048


def attend_blocks(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor:
    """The attention maths, to be compiled: query [B, kvh, G, D] -> [B, kvh, G, D].

    key/value_cache [N, bs, kvh, D]; block_table [B, nb] long; context_lens [B] long (>= 1).
    Query group g of KV head h attends to that head's keys; the result is in query's dtype.
    """
    num_seqs, num_blocks = block_table.shape
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    max_len = num_blocks * block_size
    shape = (num_seqs, max_len, num_kv_heads, head_dim)
    # Indexing views: the compiler turns these into loads at block_table's blocks.
    key = key_cache[block_table].view(shape).permute(0, 2, 1, 3).unsqueeze(2)  # [B,kvh,1,S,D]
    value = value_cache[block_table].view(shape).permute(0, 2, 1, 3).unsqueeze(2)
    q = query.float().unsqueeze(3) * head_dim**-0.5  # [B, kvh, G, 1, D]
    scores = (q * key.float()).sum(-1)  # [B, kvh, G, S], float32
    is_pad = torch.arange(max_len, device=query.device)[None, :] >= context_lens[:, None]
    scores = scores.masked_fill(is_pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).unsqueeze(-1)  # [B, kvh, G, S, 1]
    return (probs * value.float()).sum(3).to(query.dtype)  # [B, kvh, G, D]


# Shapes are marked dynamic by the caller, so one compilation serves every batch.
_attend = torch.compile(attend_blocks, dynamic=False)


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor:
    """One query token per sequence against its paged keys: query [B, heads, D] -> same.

    key/value_cache [num_blocks, block_size, kv_heads, D]; block_table [B, blocks_per_seq] long
    (rows padded with any valid block id); context_lens [B] long, the keys each sequence sees;
    B >= MIN_SEQS.
    Query head h uses KV head h // (heads // kv_heads).
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    folded = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if num_seqs < MIN_SEQS:
        raise ValueError(f"in-place decode attention takes >= {MIN_SEQS} sequences, got {num_seqs}")
    if block_table.shape[1] == 1:  # likewise a second, fully masked block column
        block_table = block_table.expand(-1, 2)
    folded, block_table, context_lens = (
        t.contiguous() for t in (folded, block_table, context_lens)
    )
    for tensor, dims in ((folded, (0,)), (block_table, (0, 1)), (context_lens, (0,))):
        torch._dynamo.mark_dynamic(tensor, dims)
    if key_cache.shape[0] > 1:
        torch._dynamo.mark_dynamic(key_cache, 0)
        torch._dynamo.mark_dynamic(value_cache, 0)
    out = _attend(folded, key_cache, value_cache, block_table, context_lens)
    return out[:num_seqs].reshape(num_seqs, num_heads, head_dim)


def can_read_in_place(key_cache: torch.Tensor, value_cache: torch.Tensor, num_heads: int) -> bool:
    """Compile (or load from the compiler's cache) the kernel on the real cache of one layer.

    Head counts, head size, block size and the cache's strides are static in the compiled
    graph, so warming up on any other tensors would leave the real compilation (seconds) to the
    first decode step that reads in place: the first burst's requests would wait for it, and
    the step-time estimator would learn it as a step's cost.  Nothing is written to the cache.
    False, with a warning, when compiling fails (e.g. no C++ compiler): callers then gather.
    """
    head_dim = key_cache.shape[-1]
    try:
        device = key_cache.device
        with torch.inference_mode():  # inputs made as the executor makes them (guards differ)
            query = torch.zeros(3, num_heads, head_dim, dtype=key_cache.dtype, device=device)
            table = torch.zeros(3, 2, dtype=torch.long, device=device)
            lens = torch.tensor([3, 4, 1], device=device)
            paged_decode_attention(query, key_cache, value_cache, table, lens)
    except Exception as err:  # noqa: BLE001 - any compiler failure means: use the eager path
        logger.warning("in-place paged decode attention unavailable (%s); gathering K/V", err)
        return False
    return True
