"""A Llama-family decoder (Llama, Qwen2) over a flattened batch and a paged KV cache.

Weights are fused where the maths allows it (Q/K/V into one projection, gate/up into one), so a
layer is four matrix multiplies.  Checkpoint tensors are named as in transformers
(`model.layers.0.self_attn.q_proj.weight`, ...); `load_weights` fuses them on the way in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tokenflow.model.attention import AttentionMetadata, LayerKV, paged_attention
from tokenflow.model.config import ModelConfig, ModelLoadError, RopeScaling
from tokenflow.model.kernels import BFLOAT16, KernelChoice, KernelPlan, explicit_plan
from tokenflow.model.quant import Int4Weight, PackedInt4, can_pack

# A checkpoint accessor: HF tensor name -> tensor; raises ModelLoadError when it is missing.
TensorGetter = Callable[[str], torch.Tensor]
# HF weight name -> its 4-bit codes, or None where the checkpoint stores it otherwise.
Int4Getter = Callable[[str], Int4Weight | None]


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32 as transformers does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, with llama3 scaling when configured."""
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if config.rope_scaling is not None:
        inv_freq = _llama3_scale(inv_freq, config.rope_scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos, signed sin [T, 1, head_dim] (float32 angles, cast to dtype).

    The sine's first half is negated so that `apply_rope` needs no negation of its own.
    """
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = angles.cos()
    sin = angles.sin()
    return (
        torch.cat((cos, cos), dim=-1)[:, None, :].to(dtype),
        torch.cat((-sin, sin), dim=-1)[:, None, :].to(dtype),
    )


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE, x * cos + rotate_half(x) * sin, for x [T, heads, D].

    cos and signed_sin are [T, 1, D] from `rope_cos_sin`: rotate_half(x) * sin equals
    cat(x2, x1) * signed_sin.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, signed_sin)


class Projection(nn.Module):
    """y = x @ weight_t (+ bias), the weight stored transposed as [in, out].

    On CPU, MKL's plain (NN) GEMM measured 1.4-2.2x faster than nn.Linear's transposed (NT)
    GEMM for 8-32 rows, the decode batch sizes; equal for 1 row and for prefill-sized inputs.
    With `set_int4` the weight is also held as packed 4-bit groups (CPU kernel), used for inputs
    of at most `int4_max_rows` rows: small decode steps, where reading the weight dominates.
    Larger inputs are compute-bound and use the dense copy.  Where the crossover lies depends on
    the CPU, so the kernel plan measured at start sets it (tokenflow.model.kernels).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.int4: PackedInt4 | None = None
        self.int4_max_rows = 0

    def set_int4(self, weight: Int4Weight, max_rows: int, dtype: torch.dtype) -> None:
        """Use `weight` [out, in]: packed for the int4 kernel (activations in `dtype`) for
        inputs of up to `max_rows` rows, and dequantized as the dense one."""
        if weight.shape != tuple(self.weight.shape):
            raise ModelLoadError(
                f"4-bit weight {weight.shape}, expected {tuple(self.weight.shape)}"
            )
        self.int4 = PackedInt4(weight, dtype)
        self.int4_max_rows = max_rows
        self.weight.copy_(weight.dequantize())

    @property
    def weight(self) -> torch.Tensor:
        """The [out, in] view (transformers' layout) of the stored weight, for loading."""
        return self.weight_t.t()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in] -> [T, out], plus `residual` [T, out] when given (fused into the GEMM)."""
        if self.int4 is not None and x.shape[0] <= self.int4_max_rows:
            out = self.int4.matmul(x.to(self.int4.dtype)).to(x.dtype)
            if self.bias is not None:
                out = out.add_(self.bias)
            return out if residual is None else out.add_(residual)
        if residual is not None:
            out = torch.addmm(residual, x, self.weight_t)
            return out if self.bias is None else out.add_(self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)


class LMHead(nn.Module):
    """logits = x @ weight.T, the weight kept as [vocab, H] (transformers' layout).

    Unlike the layers' projections, this one wide output runs faster as nn.Linear's transposed
    (NT) GEMM on CPU: 3.4 against 5.4 ms for one row, 4.3 against 6.3 for 8, 7.4 against 9.3
    for 32 (SmolLM2's [49152, 576] in bfloat16, 2 threads).  A tied embedding reads its rows.
    For few rows the head is memory-bound, so a float32 model may keep a bfloat16 copy of it for
    inputs of up to `bf16_max_rows` rows (the kernel plan decides; half the bytes to read).
    """

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.bf16_weight: torch.Tensor | None = None
        self.bf16_max_rows = 0

    def keep_bf16_copy(self, max_rows: int) -> None:
        """Compute inputs of up to `max_rows` rows on a bfloat16 copy of the (loaded) weight."""
        self.bf16_weight = self.weight.detach().bfloat16() if max_rows else None
        self.bf16_max_rows = max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> logits [T, vocab] (the bf16 copy's in bfloat16)."""
        if self.bf16_weight is not None and x.shape[0] <= self.bf16_max_rows:
            return F.linear(x.bfloat16(), self.bf16_weight)
        return F.linear(x, self.weight)


class Attention(nn.Module):
    """Grouped-query attention with a fused QKV projection and a paged KV cache."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        qkv_size = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv_proj = Projection(config.hidden_size, qkv_size, bias=config.attention_bias)
        self.o_proj = Projection(
            config.num_heads * config.head_dim,
            config.hidden_size,
            config.attention_output_bias,
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
        layer_kv: LayerKV,
        residual: torch.Tensor,
    ) -> torch.Tensor:
        """x [T, H] (normed) -> residual + attention output [T, H]."""
        query, key, value = self.project(x, cos, sin)
        out = paged_attention(query, key, value, layer_kv, attn)  # [T, heads, D]
        return self.o_proj(out.reshape(x.shape[0], -1), residual)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] (normed) -> rotated query [T, heads, D], rotated key and value [T, kvh, D]."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (heads + 2 * kv_heads) * D]
        num_qk = self.num_heads + self.num_kv_heads
        qk = qkv[:, : num_qk * self.head_dim].view(num_tokens, num_qk, self.head_dim)
        qk = apply_rope(qk, cos, sin)  # Q and K rotated together: [T, heads + kv_heads, D]
        query, key = qk[:, : self.num_heads], qk[:, self.num_heads :]
        value = qkv[:, num_qk * self.head_dim :].view(num_tokens, self.num_kv_heads, self.head_dim)
        return query, key, value


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)) with gate and up fused."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Projection(config.hidden_size, 2 * config.intermediate_size, False)
        self.down_proj = Projection(config.intermediate_size, config.hidden_size, False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """x [T, H] (normed) -> residual + MLP output [T, H]."""
        gate_up = self.gate_up_proj(x)  # [T, 2 * I]
        gate, up = gate_up.split(self.intermediate_size, dim=-1)  # strided [T, I] views
        # In place: no [T, I] temporaries; the GEMM reads the strided rows directly.
        return self.down_proj(F.silu(gate, inplace=True).mul_(up), residual)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks, each added to the residual stream."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
        layer_kv: LayerKV,
    ) -> torch.Tensor:
        """hidden [T, H] (the residual stream) -> [T, H]."""
        normed = self.input_layernorm(hidden)
        hidden = self.self_attn(normed, cos, sin, attn, layer_kv, residual=hidden)
        return self.mlp(self.post_attention_layernorm(hidden), residual=hidden)

    def project(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer up to attention: hidden [T, H] -> query [T, heads, D], key, value."""
        return self.self_attn.project(self.input_layernorm(hidden), cos, sin)

    def finish(self, attn_out: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The layer after attention: attn_out [T, heads * D], hidden [T, H] -> [T, H]."""
        hidden = self.self_attn.o_proj(attn_out, hidden)
        return self.mlp(self.post_attention_layernorm(hidden), residual=hidden)


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head; logits only for the sampled rows."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Tied models keep one table, the LM head's [V, H]; embedding reads its rows.
        self.embed_tokens = (
            None
            if config.tie_word_embeddings
            else nn.Embedding(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size)
        self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)
        self.kernel_plan = KernelPlan()  # set by load_weights (tokenflow.model.kernels)
        self.kernel_choice = KernelChoice(self.kernel_plan, "flags")  # set by the loader
        self.requires_grad_(False)

    @classmethod
    def empty(cls, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> LlamaModel:
        """A model with uninitialised weights on `device` (fill them with `load_weights`)."""
        with torch.device("meta"):
            model = cls(config)
        model = model.to_empty(device=device).to(dtype)
        model.inv_freq = rope_inverse_frequencies(config).to(device)  # float32 angles
        return model.eval()

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> embeddings [T, H]."""
        if self.embed_tokens is None:
            return self.lm_head.weight.index_select(0, input_ids)
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: Sequence[LayerKV],
    ) -> torch.Tensor:
        """input_ids, positions [T] -> logits [num_sampled, vocab] (float32).

        Writes the K/V of all T tokens into `kv_cache` (one LayerKV per layer) as a side effect.
        """
        hidden = self.embed(input_ids)  # [T, H]
        cos, sin = rope_cos_sin(self.inv_freq, positions, hidden.dtype)  # [T, 1, D]
        for layer, layer_kv in zip(self.layers, kv_cache, strict=True):
            hidden = layer(hidden, cos, sin, attn, layer_kv)
        hidden = self.norm(hidden.index_select(0, attn.sample_rows))  # [S, H]
        return self.lm_head(hidden).float()  # [S, V]

    def load_weights(
        self, get: TensorGetter, get_int4: Int4Getter | None = None, plan: KernelPlan | None = None
    ) -> None:
        """Copy every weight from a checkpoint with transformers names; fuse Q/K/V, gate/up.

        With `get_int4` and a plan that uses the 4-bit kernel, the layers' projections whose
        parts all come back as 4-bit codes are packed for it; the rest (and embeddings, norms)
        are loaded dense.  The plan also sets the LM head's bf16 copy.
        """
        config = self.config
        plan = plan or explicit_plan(self.dtype, use_int4=get_int4 is not None)
        self.kernel_plan = plan
        if not plan.uses_int4:
            get_int4 = None
        if self.embed_tokens is None:
            _copy(self.lm_head.weight, get, "model.embed_tokens.weight")
        else:
            _copy(self.embed_tokens.weight, get, "model.embed_tokens.weight")
            _copy(self.lm_head.weight, get, "lm_head.weight")
        _copy(self.norm.weight, get, "model.norm.weight")
        for index, layer in enumerate(self.layers):
            _load_layer(layer, get, f"model.layers.{index}.", config, get_int4, plan)
        self.lm_head.keep_bf16_copy(plan.head_bf16_max_rows)


def _load_layer(
    layer: DecoderLayer,
    get: TensorGetter,
    prefix: str,
    config: ModelConfig,
    get_int4: Int4Getter | None,
    plan: KernelPlan,
) -> None:
    attn, mlp = layer.self_attn, layer.mlp
    int4 = _Int4Packing(get_int4, plan) if get_int4 is not None else None
    _copy(layer.input_layernorm.weight, get, prefix + "input_layernorm.weight")
    _copy(layer.post_attention_layernorm.weight, get, prefix + "post_attention_layernorm.weight")
    qkv = [f"{prefix}self_attn.{p}_proj" for p in ("q", "k", "v")]
    kv_rows = config.num_kv_heads * config.head_dim
    qkv_rows = (config.num_heads * config.head_dim, kv_rows, kv_rows)
    _load_projection(attn.qkv_proj, get, int4, [name + ".weight" for name in qkv], qkv_rows)
    if config.attention_bias:
        _copy_fused(attn.qkv_proj.bias, get, [name + ".bias" for name in qkv], qkv_rows)
    o_name = prefix + "self_attn.o_proj.weight"
    _load_projection(attn.o_proj, get, int4, [o_name], [config.hidden_size])
    if config.attention_output_bias:
        _copy(attn.o_proj.bias, get, prefix + "self_attn.o_proj.bias")
    gate_up = [prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight"]
    _load_projection(mlp.gate_up_proj, get, int4, gate_up, [config.intermediate_size] * 2)
    down = prefix + "mlp.down_proj.weight"
    _load_projection(mlp.down_proj, get, int4, [down], [config.hidden_size])


class _Int4Packing(NamedTuple):
    """Where a layer's 4-bit codes come from, and the plan that says how to run them."""

    get: Int4Getter
    plan: KernelPlan


def _load_projection(
    proj: Projection,
    get: TensorGetter,
    int4: _Int4Packing | None,
    names: Sequence[str],
    rows: Sequence[int],
) -> None:
    """Pack the parts as one int4 weight when all are 4-bit and the kernel takes the shape."""
    parts = [int4.get(name) for name in names] if int4 is not None else []
    if int4 is not None and parts and all(p is not None for p in parts):
        fused = Int4Weight.concat_rows([p for p in parts if p is not None])
        if can_pack(fused.shape):
            dtype = torch.bfloat16 if int4.plan.int4_dtype == BFLOAT16 else torch.float32
            proj.set_int4(fused, int4.plan.int4_max_rows, dtype)
            return
    _copy_fused(proj.weight, get, names, rows)


def _copy(dst: torch.Tensor, get: TensorGetter, name: str) -> None:
    src = get(name)
    if tuple(src.shape) != tuple(dst.shape):
        raise ModelLoadError(
            f"tensor {name} has shape {tuple(src.shape)}, the config expects {tuple(dst.shape)}"
        )
    dst.copy_(src)


def _copy_fused(
    dst: torch.Tensor, get: TensorGetter, names: Sequence[str], rows: Sequence[int]
) -> None:
    # The parts are stacked along dim 0 in `names` order (q, k, v or gate, up).
    offset = 0
    for name, num_rows in zip(names, rows, strict=True):
        _copy(dst[offset : offset + num_rows], get, name)
        offset += num_rows
