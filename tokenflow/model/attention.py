"""Paged attention: the per-step metadata that describes a flattened batch, and the kernel.

Row layout of a flattened batch of T tokens: single-token chunks (decodes) come first, one row
each, so that they share one batched SDPA call; multi-token chunks (prefills) follow, each a
contiguous run of rows with its own SDPA call.  Logits are computed only for `sample_rows`, in
the order of the sampling chunks in the plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenflow.core.plan import ScheduledChunk
from tokenflow.model.paged_decode import MIN_SEQS, paged_decode_attention


@dataclass(frozen=True)
class LayerKV:
    """One layer's device KV blocks: key and value are [num_blocks, block_size, kv_heads, dim]."""

    key: torch.Tensor
    value: torch.Tensor


@dataclass(frozen=True)
class DecodeGroup:
    """Rows [0, num_seqs) of the batch: one query token each, attended together."""

    num_seqs: int
    max_context_len: int  # num_blocks_per_seq * block_size: the padded key length
    block_table: torch.Tensor  # [num_seqs, num_blocks_per_seq] long, rows padded
    context_lens: torch.Tensor  # [num_seqs] long: keys each sequence attends
    key_mask: torch.Tensor | None  # [num_seqs, 1, 1, max_context_len] bool (True = attend)
    reads_in_place: bool  # paged_decode's kernel (True) or gather + SDPA (False)


@dataclass(frozen=True)
class PrefillSpan:
    """Rows [query_start, query_start + query_len) of one multi-token chunk."""

    query_start: int
    query_len: int
    context_len: int  # keys attended by the last query: start_position + query_len
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] long
    causal_mask: torch.Tensor | None  # [query_len, context_len] bool; None: no cached prefix


@dataclass(frozen=True)
class AttentionMetadata:
    """What every layer needs to write and read the paged KV of one step."""

    slot_mapping: torch.Tensor  # [T] long: block_id * block_size + offset for each token
    decode: DecodeGroup | None
    prefills: tuple[PrefillSpan, ...]
    sample_rows: torch.Tensor  # [num_sampled] long: the rows whose logits are sampled


@dataclass(frozen=True)
class ModelInputs:
    """A step's flattened batch, ready for `LlamaModel.forward`."""

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    attn: AttentionMetadata
    sampled_chunk_indices: tuple[int, ...]  # plan index of the chunk behind each sampled row
    chunk_last_rows: tuple[int, ...] = ()  # per plan chunk: the row of its last token


def build_model_inputs(
    chunks: Sequence[ScheduledChunk],
    tables: Mapping[str, Sequence[int]],
    block_size: int,
    device: torch.device,
    in_place_min_keys: int | None = None,
) -> ModelInputs:
    """Flatten `chunks` into rows (decodes first) and build the attention metadata.

    `tables` holds each chunk's device block table (an executor keeps them with `BlockTables`).
    The decode rows attend through `paged_decode_attention`, which reads the KV blocks where
    they lie, when there are at least MIN_SEQS of them and they span at least
    `in_place_min_keys` padded keys in all (num_seqs * padded context); otherwise, and always
    when it is None, their blocks are gathered for SDPA.
    """
    order = [i for i, c in enumerate(chunks) if c.num_tokens == 1]
    order += [i for i, c in enumerate(chunks) if c.num_tokens > 1]
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    last_row: dict[int, int] = {}
    for index in order:
        chunk = chunks[index]
        table = tables[chunk.request_id]
        _check_block_table(chunk, table, block_size)
        for offset, token_id in enumerate(chunk.token_ids):
            position = chunk.start_position + offset
            token_ids.append(token_id)
            positions.append(position)
            slots.append(table[position // block_size] * block_size + position % block_size)
        last_row[index] = len(token_ids) - 1
    sampled = tuple(i for i, c in enumerate(chunks) if c.samples_token)
    num_decodes = sum(1 for c in chunks if c.num_tokens == 1)
    attn = AttentionMetadata(
        slot_mapping=_tensor(slots, device),
        decode=_decode_group(
            [chunks[i] for i in order[:num_decodes]], tables, block_size, device, in_place_min_keys
        ),
        prefills=_prefill_spans(
            [chunks[i] for i in order[num_decodes:]], tables, num_decodes, block_size, device
        ),
        sample_rows=_tensor([last_row[i] for i in sampled], device),
    )
    last_rows = tuple(last_row[i] for i in range(len(chunks)))
    return ModelInputs(
        _tensor(token_ids, device), _tensor(positions, device), attn, sampled, last_rows
    )


def _check_block_table(chunk: ScheduledChunk, table: Sequence[int], block_size: int) -> None:
    needed = -(-(chunk.start_position + chunk.num_tokens) // block_size)
    if chunk.num_tokens < 1 or len(table) < needed:
        raise ValueError(
            f"request {chunk.request_id}: {len(table)} blocks cannot hold positions "
            f"[0, {chunk.start_position + chunk.num_tokens}) with block_size {block_size}"
        )


def _tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def _decode_group(
    chunks: Sequence[ScheduledChunk],
    tables: Mapping[str, Sequence[int]],
    block_size: int,
    device: torch.device,
    in_place_min_keys: int | None,
) -> DecodeGroup | None:
    if not chunks:
        return None
    context_lens = [c.start_position + 1 for c in chunks]
    num_blocks = max(-(-n // block_size) for n in context_lens)
    block_ids: list[int] = []
    for chunk in chunks:
        table = list(tables[chunk.request_id][:num_blocks])
        block_ids += table + [table[0]] * (num_blocks - len(table))  # padding is masked out
    max_len = num_blocks * block_size
    in_place = (
        in_place_min_keys is not None
        and len(chunks) >= MIN_SEQS
        and len(chunks) * max_len >= in_place_min_keys
    )
    lens = torch.tensor(context_lens, dtype=torch.long)
    mask = None
    if not in_place and any(n != max_len for n in context_lens):
        mask = (torch.arange(max_len)[None, :] < lens[:, None]).view(len(chunks), 1, 1, max_len)
        mask = mask.to(device, non_blocking=True)
    table = _tensor(block_ids, device).view(len(chunks), num_blocks)
    lens = lens.to(device, non_blocking=True)
    return DecodeGroup(len(chunks), max_len, table, lens, mask, in_place)


def _prefill_spans(
    chunks: Sequence[ScheduledChunk],
    tables: Mapping[str, Sequence[int]],
    first_row: int,
    block_size: int,
    device: torch.device,
) -> tuple[PrefillSpan, ...]:
    spans = []
    row = first_row
    for chunk in chunks:
        start, length = chunk.start_position, chunk.num_tokens
        context_len = start + length
        mask = None
        if start > 0:
            # query i sits at position start + i and sees keys 0 .. start + i
            query_pos = torch.arange(start, context_len)[:, None]
            mask = (torch.arange(context_len)[None, :] <= query_pos).to(device, non_blocking=True)
        num_blocks = -(-context_len // block_size)
        block_ids = _tensor(list(tables[chunk.request_id][:num_blocks]), device)
        spans.append(PrefillSpan(row, length, context_len, block_ids, mask))
        row += length
    return tuple(spans)


def write_kv(
    layer_kv: LayerKV, key: torch.Tensor, value: torch.Tensor, attn: AttentionMetadata
) -> None:
    """Store this step's key/value [T, kv_heads, dim] into their cache slots."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    layer_kv.key.view(-1, num_kv_heads, head_dim).index_copy_(0, attn.slot_mapping, key)
    layer_kv.value.view(-1, num_kv_heads, head_dim).index_copy_(0, attn.slot_mapping, value)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_kv: LayerKV,
    attn: AttentionMetadata,
) -> torch.Tensor:
    """Write this step's K/V to the cache and attend; query [T, heads, dim] -> [T, heads, dim].

    key/value are this step's [T, kv_heads, dim]; grouped-query heads share a KV head
    (query head h uses KV head h // (heads // kv_heads)).
    """
    write_kv(layer_kv, key, value, attn)
    out = torch.empty_like(query)
    if attn.decode is not None:
        num = attn.decode.num_seqs
        out[:num] = decode_attention(query[:num], layer_kv, attn.decode)
    for span in attn.prefills:
        rows = slice(span.query_start, span.query_start + span.query_len)
        if span.causal_mask is None:
            ctx_key, ctx_value = key[rows], value[rows]  # no cached prefix: use the fresh K/V
        else:
            ctx_key = _gather(layer_kv.key, span.block_ids)[: span.context_len]
            ctx_value = _gather(layer_kv.value, span.block_ids)[: span.context_len]
        out[rows] = _prefill_attention(query[rows], ctx_key, ctx_value, span.causal_mask)
    return out


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, kv_heads, dim] at block_ids -> [len * block_size, kv_heads, dim]."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    flat = cache.view(num_blocks, -1).index_select(0, block_ids)
    return flat.view(-1, num_kv_heads, head_dim)


def decode_attention(query: torch.Tensor, layer_kv: LayerKV, group: DecodeGroup) -> torch.Tensor:
    """The decode rows' attention (K/V already written): query [B, heads, D] -> same."""
    if group.reads_in_place:
        return paged_decode_attention(
            query, layer_kv.key, layer_kv.value, group.block_table, group.context_lens
        )
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = layer_kv.key.shape[2]
    shape = (num_seqs, group.max_context_len, num_kv_heads, head_dim)
    block_ids = group.block_table.view(-1)
    key = _gather(layer_kv.key, block_ids).view(shape).transpose(1, 2)  # [B, kvh, S, D]
    value = _gather(layer_kv.value, block_ids).view(shape).transpose(1, 2)
    # Fold each KV head's query heads into the query-length axis: no K/V repetition needed.
    folded = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(folded, key, value, attn_mask=group.key_mask)
    return out.reshape(num_seqs, num_heads, head_dim)


def _prefill_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    # query [L, heads, D]; key/value [S, kv_heads, D] -> [L, heads, D]
    q = query.transpose(0, 1).unsqueeze(0)
    k = key.transpose(0, 1).unsqueeze(0)
    v = value.transpose(0, 1).unsqueeze(0)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=k.shape[1] != q.shape[1]
    )
    return out.squeeze(0).transpose(0, 1)
