"""4-bit groupwise weights: GGUF blocks decoded to integer codes, packed for torch's CPU kernel.

A GGUF Q4_1 block holds 32 weights as w = d * q + m (q in [0, 15], d and m float16), Q4_0 as
w = d * (q - 8).  Both map exactly onto torch's int4 groupwise format (group size 32), whose CPU
kernel `aten._weight_int4pack_mm_for_cpu` computes w = (q - 8) * scale + zero: scale = d and
zero = m + 8 * d (Q4_1) or zero = 0 (Q4_0).  The codes are kept bit for bit; only the scales
and zeros are rounded to the activation dtype (bfloat16) by the kernel's contract.

4-bit K-quants (Q4_K, Q5_K is not 4-bit and stays dense) are dequantized by `gguf` and
requantized to this format (min/max per group of 32): a second, documented quantization.
Q8_0 and 6-bit tensors stay dense (bfloat16): `_weight_int8pack_mm` measured slower than a
bf16 GEMM from batch 8 on here (docs/design.md), and it only has per-row scales.

The packed kernel exists on CPU only; on CUDA the loader dequantizes (a bf16/fp16 dense path).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

GROUP_SIZE = 32
_Q4_1_BLOCK_BYTES = 20  # d (f16), m (f16), 16 bytes of nibbles
_Q4_0_BLOCK_BYTES = 18  # d (f16), 16 bytes of nibbles
PACKED_TYPES = ("Q4_0", "Q4_1")
REQUANTIZED_TYPES = ("Q4_K",)


@dataclass(frozen=True)
class Int4Weight:
    """A [rows, cols] weight as w = scales * codes + mins, per group of `GROUP_SIZE` columns.

    codes: uint8 [rows, cols] in [0, 15]; scales, mins: float32 [rows, cols / GROUP_SIZE].
    """

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.codes.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The float32 [rows, cols] weight the codes stand for."""
        groups = self.codes.float().view(self.shape[0], -1, GROUP_SIZE)
        weight = groups * self.scales[..., None] + self.mins[..., None]
        return weight.view(self.shape)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Int4Weight:
        """The same weight with `fn` (a row permutation) applied to codes, scales and mins."""
        return Int4Weight(fn(self.codes), fn(self.scales), fn(self.mins))

    @staticmethod
    def concat_rows(parts: Sequence[Int4Weight]) -> Int4Weight:
        """Stack weights along the row (output) axis, e.g. Q, K, V into one projection."""
        return Int4Weight(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scales for p in parts]),
            torch.cat([p.mins for p in parts]),
        )


def decode_q4(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> Int4Weight:
    """GGUF Q4_0 / Q4_1 bytes [rows, bytes_per_row] -> exact codes, scales and mins."""
    rows, cols = shape
    block_bytes = _Q4_1_BLOCK_BYTES if type_name == "Q4_1" else _Q4_0_BLOCK_BYTES
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, cols // GROUP_SIZE, -1)
    if blocks.shape[-1] != block_bytes:
        raise ValueError(f"{type_name} rows of {cols} weights need {block_bytes}-byte blocks")
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q4_1":
        mins = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        nibbles = blocks[..., 4:]
    else:
        mins = -8.0 * scales
        nibbles = blocks[..., 2:]
    # Byte j holds weight j (low nibble) and weight j + 16 (high nibble) of its block.
    codes = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-1).reshape(rows, cols)
    return Int4Weight(torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(mins))


def quantize_int4(weight: torch.Tensor) -> Int4Weight:
    """Min/max 4-bit quantization of a float [rows, cols] weight, per group of 32 columns."""
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
    low = groups.amin(dim=-1)
    high = groups.amax(dim=-1)
    scales = ((high - low) / 15).clamp_min(1e-12)
    codes = ((groups - low[..., None]) / scales[..., None]).round().clamp(0, 15)
    return Int4Weight(codes.to(torch.uint8).reshape(rows, cols), scales, low)


def can_pack(shape: tuple[int, int]) -> bool:
    """Whether the CPU kernel takes this [rows, cols] weight (rows % 16, cols % 32)."""
    return shape[0] % 16 == 0 and shape[1] % GROUP_SIZE == 0


class PackedInt4:
    """An Int4Weight in the CPU kernel's layout; `matmul(x)` is x @ w.T in x's dtype."""

    def __init__(self, weight: Int4Weight, dtype: torch.dtype) -> None:
        if not can_pack(weight.shape):
            raise ValueError(f"cannot pack a {weight.shape} weight into int4 groups")
        self.shape = weight.shape
        self.dtype = dtype  # of the activations it takes and returns
        codes = weight.codes.to(torch.int32)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        zeros = weight.mins + 8 * weight.scales  # the kernel computes (q - 8) * scale + zero
        # [groups, rows, 2]: (scale, zero) of each group of each output row
        self.scales_and_zeros = torch.stack((weight.scales.t(), zeros.t()), dim=-1).to(dtype)
        self.scales_and_zeros = self.scales_and_zeros.contiguous()

    def clone(self) -> PackedInt4:
        """The same weight in memory of its own (the kernel probe needs copies beyond caches)."""
        copy = object.__new__(PackedInt4)
        copy.shape, copy.dtype = self.shape, self.dtype
        copy.packed = self.packed.clone()
        copy.scales_and_zeros = self.scales_and_zeros.clone()
        return copy

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, cols] -> [T, rows] (the kernel needs contiguous rows)."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.contiguous(), self.packed, GROUP_SIZE, self.scales_and_zeros
        )

    def nbytes(self) -> int:
        """Bytes of packed codes plus scales and zeros."""
        return self.packed.nbytes + self.scales_and_zeros.nbytes
