"""4-bit weights: GGUF codes decode exactly, the packed kernel equals the dense matmul, and the
embedded SmolLM2 with packed weights keeps the dense model's greedy tokens."""

from __future__ import annotations

import pytest
import torch

from tests.model.helpers import (
    BF16_ROUNDINGS_PER_INT4_PROJECTION,
    DECISIVE_PROMPT,
    bf16_error_bound,
    bf16_logit_bound,
    loaded_greedy,
    loaded_prefill_logits,
)
from tokenflow.model import default_model_path, load_model
from tokenflow.model.kernels import EXPLICIT_INT4_MAX_ROWS as INT4_MAX_ROWS
from tokenflow.model.quant import GROUP_SIZE, Int4Weight, PackedInt4, decode_q4, quantize_int4

PROMPT = "The capital of France is Paris. The capital of Germany is"
# PROMPT has a greedy step led by 0.3, which bf16's rounding may swap: DECISIVE_PROMPT has none.


def _random_int4(rows: int, cols: int, seed: int = 0) -> Int4Weight:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
    scales = torch.rand(rows, cols // GROUP_SIZE, generator=gen) * 0.1 + 0.01
    mins = torch.randn(rows, cols // GROUP_SIZE, generator=gen) * 0.5
    return Int4Weight(codes, scales, mins)


def test_q4_1_codes_dequantize_to_ggufs_own_values():
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(default_model_path())
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    assert tensor.tensor_type.name == "Q4_1"
    shape = (int(tensor.shape[1]), int(tensor.shape[0]))
    decoded = decode_q4(tensor.data, "Q4_1", shape)
    assert decoded.codes.max() <= 15
    reference = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy())
    assert torch.equal(decoded.dequantize(), reference)  # bit for bit


def test_packed_kernel_equals_the_dense_matmul_in_float32():
    weight = _random_int4(48, 128)
    x = torch.randn(5, 128)
    packed = PackedInt4(weight, torch.float32)
    expected = x @ weight.dequantize().t()
    torch.testing.assert_close(packed.matmul(x), expected, atol=1e-4, rtol=1e-5)
    # the codes survive packing: the identity matrix reads the weight back
    torch.testing.assert_close(packed.matmul(torch.eye(128)).t(), weight.dequantize())


def test_packed_kernel_in_bfloat16_stays_within_bf16_rounding():
    weight = _random_int4(64, 256, seed=1)
    x = torch.randn(3, 256)
    out = PackedInt4(weight, torch.bfloat16).matmul(x.bfloat16()).float()
    expected = x @ weight.dequantize().t()
    # x rounded to bf16, then the roundings of one int4 projection
    bound = bf16_error_bound(float(expected.abs().max()), 1 + BF16_ROUNDINGS_PER_INT4_PROJECTION)
    assert (out - expected).abs().max() < bound


def test_requantized_weights_are_within_half_a_step():
    weight = torch.randn(32, 96)
    quantized = quantize_int4(weight)
    step = quantized.scales.repeat_interleave(GROUP_SIZE, dim=1)
    assert ((quantized.dequantize() - weight).abs() <= step / 2 + 1e-6).all()


def test_only_packable_shapes_are_packed():
    with pytest.raises(ValueError):
        PackedInt4(_random_int4(24, 64), torch.float32)  # rows must be a multiple of 16


@pytest.fixture(scope="module")
def int4_models() -> dict[torch.dtype, object]:
    """The embedded SmolLM2 with packed 4-bit weights, float32 and bfloat16 activations."""
    return {
        dtype: load_model(None, "cpu", dtype, weights="int4")
        for dtype in (torch.float32, torch.bfloat16)
    }


def test_auto_weights_pack_the_gguf_on_cpu(int4_models):
    model = int4_models[torch.bfloat16].model
    assert model.layers[0].mlp.gate_up_proj.int4 is not None
    assert model.layers[0].self_attn.qkv_proj.int4 is not None
    assert model.lm_head.weight.dtype == torch.bfloat16  # the Q8_0 tied embedding stays dense
    assert model.dtype == torch.bfloat16


def test_int4_model_in_float32_equals_the_dequantized_model(smollm, int4_models):
    # Same weights (the kernel dequantizes exactly), so only summation order differs.
    packed = int4_models[torch.float32]
    prompt = smollm.tokenizer.encode(PROMPT)
    dense_logits = loaded_prefill_logits(smollm, prompt)
    assert (loaded_prefill_logits(packed, prompt) - dense_logits).abs().max() < 1e-3
    assert loaded_greedy(packed, prompt, 16) == loaded_greedy(smollm, prompt, 16)


def test_int4_model_in_bfloat16_keeps_the_dense_greedy_tokens(smollm, int4_models):
    # The dense float32 model is the transformers oracle (test_real_model); the packed one
    # differs from it only by bf16 roundings (activations, group scales and zeros).
    packed = int4_models[torch.bfloat16]
    prompt = smollm.tokenizer.encode(DECISIVE_PROMPT)
    assert len(prompt) <= INT4_MAX_ROWS  # the prefill runs the int4 kernel too
    assert loaded_greedy(packed, prompt, 12) == loaded_greedy(smollm, prompt, 12)
    dense_logits = loaded_prefill_logits(smollm, prompt)
    diff = (loaded_prefill_logits(packed, prompt) - dense_logits).abs().max()
    assert diff < bf16_logit_bound(dense_logits, smollm.config.num_layers), diff


def test_int4_is_refused_where_the_cpu_kernel_cannot_run(tiny_checkpoints):
    # CUDA keeps the dequantized bf16/fp16 path; a safetensors directory has no 4-bit codes.
    with pytest.raises(ValueError, match="int4"):
        load_model(None, "cuda", weights="int4")
    with pytest.raises(ValueError, match="int4"):
        load_model(str(tiny_checkpoints["llama"][1]), "cpu", weights="int4")
    with pytest.raises(ValueError, match="weights"):
        load_model(None, "cpu", weights="int3")
