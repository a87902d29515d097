"""Decode-only steps through compiled graphs: each layer's small ops fused, attention between.

An eager decode step runs some 25 small torch ops per layer (norms, RoPE, SiLU * up, residual
adds, views) around its four matrix multiplies, and at small batches their dispatch costs as
much as the multiplies.  Here a step is 31 compiled calls (inductor): the first embeds and
projects layer 0's Q/K/V; each middle one finishes layer i from its attention output and
projects layer i + 1; the last finishes layer L-1 and computes the logits.  Every middle call
runs the same compiled code with another layer's weights.

Between the calls, eagerly: the KV write and the attention (`attention.decode_attention`:
gather + SDPA, or the in-place kernel of paged_decode, as in the eager model).  A compiled
graph that writes into a view of the shared KV tensor has its whole storage copied back (a
mutated graph input), far slower than the step.  Shapes are dynamic (the batch); the compiler
still specialises batch 1 and each row threshold of the model's kernel plan (the 4-bit
kernel's, the LM head's bf16 copy's), so `warm_up` compiles a shape on either side of each.
Prefills, and steps mixing them with decodes, keep `LlamaModel`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenflow.model.attention import DecodeGroup, LayerKV, decode_attention
from tokenflow.model.transformer import DecoderLayer, LlamaModel, rope_cos_sin


def _first(
    model: LlamaModel, layer: DecoderLayer, input_ids: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    hidden = model.embed(input_ids)  # [B, H]
    cos, sin = rope_cos_sin(model.inv_freq, positions, hidden.dtype)  # [B, 1, D]
    return (hidden, cos, sin, *layer.project(hidden, cos, sin))


def _middle(
    done: DecoderLayer,
    next_layer: DecoderLayer,
    hidden: torch.Tensor,
    attn_out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    hidden = done.finish(attn_out.flatten(1), hidden)
    return (hidden, *next_layer.project(hidden, cos, sin))


def _last(
    model: LlamaModel, done: DecoderLayer, hidden: torch.Tensor, attn_out: torch.Tensor
) -> torch.Tensor:
    hidden = done.finish(attn_out.flatten(1), hidden)
    return model.lm_head(model.norm(hidden)).float()  # [B, V]


class CompiledDecoder:
    """`forward` = `LlamaModel.forward` for steps whose every row is a decode that samples."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        # Rounding each op's result to the model dtype as eager does keeps the logits equal to
        # the eager model's; single-threaded kernels spare the small ops a thread wake-up each.
        options = {"emulate_precision_casts": True, "cpp.threads": 1}
        self._first = torch.compile(_first, dynamic=False, options=options)
        self._middle = torch.compile(_middle, dynamic=False, options=options)
        self._last = torch.compile(_last, dynamic=False, options=options)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        decode: DecodeGroup,
        kv_cache: Sequence[LayerKV],
    ) -> torch.Tensor:
        """input_ids, positions, slot_mapping [B] -> logits [B, vocab] (float32).

        Row i is decode row i of `decode`; writes each layer's K/V at `slot_mapping` as
        `LlamaModel.forward` does.
        """
        _mark_batch(input_ids, positions)
        layers = self.model.layers
        hidden, cos, sin, query, key, value = self._first(
            self.model, layers[0], input_ids, positions
        )
        for index, layer_kv in enumerate(kv_cache):
            _write(layer_kv, key, value, slot_mapping)
            attn_out = decode_attention(query, layer_kv, decode)  # [B, heads, D]
            _mark_batch(hidden, attn_out, cos, sin)
            if index + 1 == len(layers):
                return self._last(self.model, layers[index], hidden, attn_out)
            hidden, query, key, value = self._middle(
                layers[index], layers[index + 1], hidden, attn_out, cos, sin
            )
        raise ValueError(f"{len(kv_cache)} KV layers for {len(layers)} model layers")

    def warm_up(self, kv_cache: Sequence[LayerKV], reads_in_place: bool) -> None:
        """Compile the specialisations: batch 1, 2, and one batch past each plan threshold."""
        device = kv_cache[0].key.device
        block_size = kv_cache[0].key.shape[1]
        plan = self.model.kernel_plan
        thresholds = (plan.int4_max_rows, plan.head_bf16_max_rows)
        for batch in sorted({1, 2, *(rows + 1 for rows in thresholds if rows)}):
            table = torch.zeros(batch, 2, dtype=torch.long, device=device)
            lens = torch.full((batch,), 2 * block_size, dtype=torch.long, device=device)
            in_place = reads_in_place and batch > 1
            group = DecodeGroup(batch, 2 * block_size, table, lens, None, in_place)
            zeros = [torch.zeros(batch, dtype=torch.long, device=device) for _ in range(3)]
            self.forward(*zeros, group, kv_cache)


def _write(layer_kv: LayerKV, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    layer_kv.key.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key)
    layer_kv.value.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value)


def _mark_batch(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        torch._dynamo.maybe_mark_dynamic(tensor, 0)
