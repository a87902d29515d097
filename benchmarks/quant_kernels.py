"""Micro-benchmark of torch's CPU matmul kernels at SmolLM2-135M's projection shapes.

Dense float32 and bfloat16 GEMMs (the weight stored [in, out], a plain GEMM; bf16/NT: stored
[out, in] as nn.Linear does) against `aten._weight_int8pack_mm` (int8, per-row scales) and
`aten._weight_int4pack_mm_for_cpu` (int4, groups of 32), each with float32 and bfloat16
activations, and against fbgemm's dynamic int8 GEMM (`quantized::linear_dynamic`, one activation
scale per call: "fbgemm8") and the int8 schemes built on it (`int8_schemes.PackedInt8`:
per-token scales: "int8/tok"; plus 64 float outlier channels: "int8/o64", 16: "int8/o16"), at
several row counts (batch sizes).  Best of `--repeats` calls, microseconds.

    .venv/bin/python benchmarks/quant_kernels.py --threads 1 --rows 1 8 32
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from int8_schemes import PackedInt8

# name -> (out_features, in_features) of SmolLM2-135M's fused projections and its LM head
SHAPES = {
    "qkv": (960, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}


def best_us(fn: Callable[[], object], repeats: int) -> float:
    """Fastest of `repeats` calls after 3 warm-ups, in microseconds."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def kernels(rows: int, out_features: int, in_features: int) -> dict[str, Callable[[], object]]:
    """Every kernel variant for x [rows, in] @ w [out, in].T."""
    x = torch.randn(rows, in_features)
    xb = x.bfloat16()
    weight_t = torch.randn(in_features, out_features)
    weight_tb = weight_t.bfloat16()
    weight_b = weight_tb.t().contiguous()  # [out, in]: nn.Linear's layout, the NT GEMM
    int8 = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8)
    row_scales = torch.rand(out_features)
    codes = torch.randint(0, 16, (out_features, in_features), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scales_zeros = torch.rand(in_features // 32, out_features, 2)
    int4 = torch.ops.aten._weight_int4pack_mm_for_cpu
    weight = weight_t.t().contiguous()
    int8_o64 = PackedInt8(weight, torch.randperm(in_features)[:64], per_token=True)
    int8_o16 = PackedInt8(weight, torch.randperm(in_features)[:16], per_token=True)
    no_outliers = torch.zeros(0, dtype=torch.long)
    fbgemm8 = PackedInt8(weight, no_outliers, per_token=False).packed
    int8_token = PackedInt8(weight, no_outliers, per_token=True)
    dynamic = torch.ops.quantized.linear_dynamic
    return {
        "fp32": lambda: torch.mm(x, weight_t),
        "bf16": lambda: torch.mm(xb, weight_tb),
        "bf16/NT": lambda: torch.nn.functional.linear(xb, weight_b),
        "int8/fp32": lambda: torch.ops.aten._weight_int8pack_mm(x, int8, row_scales),
        "int8/bf16": lambda: torch.ops.aten._weight_int8pack_mm(xb, int8, row_scales.bfloat16()),
        "int4/fp32": lambda: int4(x, packed, 32, scales_zeros),
        "int4/bf16": lambda: int4(xb, packed, 32, scales_zeros.bfloat16()),
        "fbgemm8": lambda: dynamic(x, fbgemm8, False),
        "int8/tok": lambda: int8_token.matmul(x),
        "int8/o16": lambda: int8_o16.matmul(x),
        "int8/o64": lambda: int8_o64.matmul(x),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = list(kernels(1, 16, 32))
    print(f"best of {args.repeats}, microseconds, {args.threads} thread(s)")
    print(f"{'rows':>4} {'shape':>8} " + " ".join(f"{n:>10}" for n in names))
    for rows in args.rows:
        for shape_name in args.shapes:
            out_features, in_features = SHAPES[shape_name]
            variants = kernels(rows, out_features, in_features)
            cells = " ".join(f"{best_us(fn, args.repeats):>10.0f}" for fn in variants.values())
            print(f"{rows:>4} {shape_name:>8} {cells}", flush=True)


if __name__ == "__main__":
    main()
