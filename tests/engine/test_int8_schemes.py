"""benchmarks/int8_schemes.py: the fbgemm int8 GEMM equals the dequantized reference within
int8 rounding, outlier channels stay exact, and per-token scales protect small rows."""

from __future__ import annotations

import torch

from benchmarks.int8_schemes import PackedInt8, quantize_rows

NO_OUTLIERS = torch.zeros(0, dtype=torch.long)


def _rounding_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # x^ W^ - x W = (x^ - x) W^ + x (W^ - W).  Activations: at most half a step of 1/127 of the
    # row's max |x| (fbgemm's uint8 over [min, max] of the row scaled into [-1, 1] has steps of
    # at most 2/255); weights: half a step of the row's scale.
    _, scales = quantize_rows(weight)
    x_half_step = x.abs().amax(dim=1, keepdim=True) / 127 / 2  # [T, 1]
    weight_row_sum = (weight.abs() + scales[:, None] / 2).sum(dim=1)  # [out]
    return x_half_step * weight_row_sum + x.abs().sum(dim=1, keepdim=True) * scales / 2 + 1e-4


def test_int8_kernel_equals_the_dequantized_reference_within_rounding():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 128, generator=gen)
    x = torch.randn(5, 128, generator=gen) * torch.tensor([[1.0], [10.0], [0.1], [3.0], [1.0]])
    packed = PackedInt8(weight, NO_OUTLIERS, per_token=True)
    out = packed.matmul(x)
    # the packed codes are the row-wise rounding of the weight
    assert (packed.dequantized() - weight).abs().max() <= quantize_rows(weight)[1].max() / 2 + 1e-6
    exact = x @ weight.t()
    assert ((out - exact).abs() <= _rounding_bound(x, weight)).all()
    # and the error is real rounding, not zero: the kernel computes in int8
    assert (out - exact).abs().max() > 1e-4


def test_outlier_channels_are_computed_in_float():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 96, generator=gen)
    outliers = torch.tensor([3, 40, 77])
    x = torch.zeros(4, 96)
    x[:, outliers] = torch.randn(4, 3, generator=gen) * 100
    out = PackedInt8(weight, outliers, per_token=True).matmul(x)
    torch.testing.assert_close(out, x @ weight.t(), rtol=1e-5, atol=1e-3)


def test_per_token_scales_keep_a_small_row_next_to_a_large_one():
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(64, 128, generator=gen)
    x = torch.randn(2, 128, generator=gen)
    x[0] *= 1000  # one token's activations 1000x the other's
    exact = x[1] @ weight.t()
    per_token = PackedInt8(weight, NO_OUTLIERS, per_token=True).matmul(x)[1]
    per_tensor = PackedInt8(weight, NO_OUTLIERS, per_token=False).matmul(x)[1]
    scale = exact.abs().max()
    assert (per_token - exact).abs().max() < 0.05 * scale
    assert (per_tensor - exact).abs().max() > 0.3 * scale  # one shared scale: ~1 level left
