"""Rewrite a GGUF's Q4_1 tensors as Q8_0, for llama.cpp's faster batched kernels.

ggml multiplies Q4_1 weights by a batch one row at a time (no tiled GEMM on x86: neither its
repacked layouts nor its tiled kernels cover Q4_1), so the shipped SmolLM2 decodes 8 and 32
streams at about the speed of one.  Q8_0 has a tiled kernel.  Each Q4_1 block (32 weights
d * q + m, q in 0..15) becomes a Q8_0 block (s * k, k in -127..127, s = max|w| / 127, stored in
float16): the new rounding error is at most about 0.56 s (half a step, plus the scale's float16
rounding; for a block whose weights straddle zero, under 1/15 of Q4_1's own step d), and the
weights take twice the memory (145 against 75 MB here).  Every other tensor is copied as it is.
The rewritten file goes to `cache_dir`, named after the source's name, size and mtime; the
drift it adds is measured in docs/results.md.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

DEFAULT_CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenflow"


def as_q8_0(source: Path, cache_dir: Path = DEFAULT_CACHE_DIR) -> Path:
    """The path of `source` with its Q4_1 tensors as Q8_0 (written once, then reused)."""
    stat = source.stat()
    target = cache_dir / f"{source.stem}.{stat.st_size}-{int(stat.st_mtime)}.q8_0.gguf"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.partial")
    try:
        _rewrite(source, partial)
        partial.replace(target)  # atomic: a reader never sees half a file
    finally:
        partial.unlink(missing_ok=True)
    return target


def _rewrite(source: Path, target: Path) -> None:
    reader = GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(target), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # written by the writer itself
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            writer.add_key_value(name, field.contents(), kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, field.contents(), kind)
    for tensor in reader.tensors:
        if tensor.tensor_type == GGMLQuantizationType.Q4_1:
            shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first
            dense = quants.dequantize(tensor.data, GGMLQuantizationType.Q4_1).reshape(shape)
            data = quants.quantize(dense.astype(np.float32), GGMLQuantizationType.Q8_0)
            writer.add_tensor(tensor.name, data, raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
