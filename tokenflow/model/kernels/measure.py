"""Timing the model's shapes under each kernel with torch: what the probe's `Measure` is on a
real machine."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from tokenflow.model.kernels.plan import (
    BFLOAT16,
    FLOAT32,
    INT4,
    INT4_FROM_FP32,
    ModelShapes,
)

# The probe cycles through distinct copies of a layer's weights up to this many bytes (or the
# model's layer count), so that, as in the model, weights stream from memory rather than
# staying in the CPU's caches: one cached layer would flatter the largest (float32) weights at
# small, memory-bound batches.
PROBE_WEIGHT_BYTES = 128 << 20


class TorchMeasure:
    """Times random weights of the model's shapes with the kernels the model would call.

    Each measurement runs on the threads the engine would give a step of that many rows
    (`threads_for_rows`), best of a few repeats after a warm-up, over distinct copies of one
    layer's weights (PROBE_WEIGHT_BYTES), scaled to the model's layer count.
    """

    def __init__(self, shapes: ModelShapes, threads_for_rows: Callable[[int], int]) -> None:
        from tokenflow.model.quant import Int4Weight, PackedInt4

        self.shapes = shapes
        self.threads_for_rows = threads_for_rows
        gen = torch.Generator().manual_seed(0)
        fp32 = [torch.randn(i, o, generator=gen) * 0.02 for i, o in shapes.projections]
        self._dense = {
            FLOAT32: _layer_copies(fp32, lambda w: w.clone(), shapes.num_layers),
            BFLOAT16: _layer_copies(
                [w.bfloat16() for w in fp32], lambda w: w.clone(), shapes.num_layers
            ),
        }
        int4 = [
            PackedInt4(
                Int4Weight(
                    torch.randint(0, 16, (o, i), generator=gen, dtype=torch.uint8),
                    torch.full((o, i // 32), 0.01),
                    torch.full((o, i // 32), -0.08),
                ),
                torch.bfloat16,
            )
            for i, o in shapes.projections
        ]
        self._int4 = _layer_copies(int4, lambda w: w.clone(), shapes.num_layers)
        head = torch.randn(shapes.vocab_size, shapes.hidden_size, generator=gen) * 0.02
        self._head = {FLOAT32: head, BFLOAT16: head.bfloat16()}

    def __call__(self, part: str, kernel: str, rows: int) -> float:
        previous = torch.get_num_threads()
        torch.set_num_threads(self.threads_for_rows(rows))
        try:
            if part == "head":
                x = torch.randn(rows, self.shapes.hidden_size).to(getattr(torch, kernel))
                weight = self._head[kernel]
                return _best_of(lambda: torch.nn.functional.linear(x, weight))
            copies = self._int4 if kernel in (INT4, INT4_FROM_FP32) else self._dense[kernel]
            per_copy_s = _best_of(self._layers(kernel, rows, copies)) / len(copies)
            return self.shapes.num_layers * per_copy_s
        finally:
            torch.set_num_threads(previous)

    def _layers(self, kernel: str, rows: int, copies: list[list]) -> Callable[[], object]:
        """One pass over every copy: each layer's four projections of a [rows, in] input."""
        if kernel in (FLOAT32, BFLOAT16):
            dtype = getattr(torch, kernel)
            inputs = [torch.randn(rows, i).to(dtype) for i, _ in self.shapes.projections]
            return lambda: [
                torch.mm(x, w) for layer in copies for x, w in zip(inputs, layer, strict=True)
            ]
        source = torch.float32 if kernel == INT4_FROM_FP32 else torch.bfloat16
        inputs = [torch.randn(rows, i).to(source) for i, _ in self.shapes.projections]
        if kernel == INT4_FROM_FP32:
            return lambda: [
                p.matmul(x.bfloat16()).float()
                for layer in copies
                for x, p in zip(inputs, layer, strict=True)
            ]
        return lambda: [p.matmul(x) for layer in copies for x, p in zip(inputs, layer, strict=True)]


def _layer_copies(layer: list, clone: Callable, num_layers: int) -> list[list]:
    """`layer` and clones of it: as many as PROBE_WEIGHT_BYTES holds, at most `num_layers`."""
    layer_bytes = sum(_nbytes(w) for w in layer)
    count = max(1, min(num_layers, math.ceil(PROBE_WEIGHT_BYTES / max(layer_bytes, 1))))
    return [layer] + [[clone(w) for w in layer] for _ in range(count - 1)]


def _nbytes(weight: object) -> int:
    if isinstance(weight, torch.Tensor):
        return weight.nbytes
    return weight.nbytes()  # PackedInt4


def _best_of(fn: Callable[[], object], min_total_s: float = 0.05, max_repeats: int = 7) -> float:
    """Best time of `fn` after one warm-up: repeats until `min_total_s` passed (2 at least,
    `max_repeats` at most), so cheap kernels are timed often and slow ones few times."""
    fn()
    best, total, repeats = math.inf, 0.0, 0
    while repeats < 2 or (total < min_total_s and repeats < max_repeats):
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best, total, repeats = min(best, took), total + took, repeats + 1
    return best
