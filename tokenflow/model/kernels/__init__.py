"""Which kernels the model's matrix multiplies take on a CPU: measured on the machine at hand.

The same GGUF can run through very different kernels, and which is fastest depends on the CPU
more than on anything else: on a CPU with native bfloat16 (AVX-512-bf16, AMX) a bf16 GEMM beats
float32 by 2-3x, while on one without (AVX2 only) the same bf16 GEMM is emulated and runs
10-100x slower than float32.  So the engine does not guess from flags; it times the loaded
model's own shapes under each kernel and keeps what is fastest in each regime.

A `KernelPlan` is the choice.  It names
- the activation dtype (and that of every dense weight): float32 or bfloat16;
- `int4_max_rows`: the layers' projections take torch's packed 4-bit kernel (bf16 inside it)
  for inputs of at most this many rows, their dense copy above (0: no 4-bit kernel at all);
- `head_bf16_max_rows`: in a float32 model, the LM head reads a bfloat16 copy of its weight for
  inputs of at most this many rows (the head is one wide memory-bound matrix: half the bytes).

The probe (`probe_kernels`) times, for the row counts in `PROBE_ROWS` (decode batches 1/8/32,
prefill chunks 64/256), every layer's four projections under each kernel and the LM head in
each dtype, each on the thread count the engine would use for such a step; a kernel more than
`PRUNE_FACTOR` times slower than the best at some size is not timed at larger ones.
`choose_plan` then takes, among the plans whose weights fit the memory the host has, the one
whose worst regime is closest to that regime's best kernel.  The choice is cached per machine,
torch, model and threads (`KernelCache`), so a second start does not probe again.

Numerics: only dense float32 reproduces transformers' float32 logits; the 4-bit kernel and any
bfloat16 path round activations to bf16.  So automatic choice never goes below the precision a
checkpoint is stored in: an HF checkpoint stored in float32 runs dense float32 and is not probed;
a quantized GGUF or a bf16 checkpoint may run in bf16.  `--dtype` / `--weights` given explicitly
skip the probe (`explicit_plan`).
"""

from tokenflow.model.kernels.cache import KernelCache, default_cache_dir, machine_key, model_key
from tokenflow.model.kernels.choose import ProbeSettings, choose_kernels
from tokenflow.model.kernels.measure import PROBE_WEIGHT_BYTES, TorchMeasure
from tokenflow.model.kernels.plan import (
    BFLOAT16,
    DECODE_ROWS,
    EQUAL_FACTOR,
    EXPLICIT_INT4_MAX_ROWS,
    FLOAT32,
    INT4,
    INT4_FROM_FP32,
    MEMORY_SHARE,
    PROBE_ROWS,
    PRUNE_ABOVE_S,
    PRUNE_FACTOR,
    KernelChoice,
    KernelPlan,
    KernelTiming,
    Measure,
    ModelShapes,
    RegimeCost,
    candidate_plans,
    choose_plan,
    explicit_plan,
    footprint_bytes,
    head_rows,
    plan_costs,
    probe_kernels,
    probe_sizes,
)

__all__ = [
    "BFLOAT16", "DECODE_ROWS", "EQUAL_FACTOR", "EXPLICIT_INT4_MAX_ROWS", "FLOAT32", "INT4",
    "INT4_FROM_FP32", "MEMORY_SHARE", "PROBE_ROWS", "PROBE_WEIGHT_BYTES", "PRUNE_ABOVE_S",
    "PRUNE_FACTOR", "KernelCache", "KernelChoice", "KernelPlan", "KernelTiming", "Measure",
    "ModelShapes", "ProbeSettings", "RegimeCost", "TorchMeasure", "candidate_plans",
    "choose_kernels", "choose_plan", "default_cache_dir", "explicit_plan", "footprint_bytes",
    "head_rows", "machine_key", "model_key", "plan_costs", "probe_kernels", "probe_sizes",
]  # fmt: skip
