"""A per-step roofline cost model: how long one engine iteration takes on a given GPU.

A step runs three kinds of kernels one after another, and each is bound either by the tensor
cores or by device memory, so each is charged its own roofline and the three are added:

- linear layers (q/k/v/o projections, MLP, lm_head): FLOPs = 2 * params * tokens, bytes = the
  weights, read once per step however many tokens the batch holds.  The lm_head runs only for
  tokens that sample (every decode sequence, plus prefill chunks that end their sequence).
- prefill attention: FLOPs = 4 * layers * heads * head_dim * (query, key) pairs (QK^T and PV,
  causal), bytes = the KV written.  Compute-bound for any real chunk.
- decode attention: bytes = the KV of every decode context, read once.  Memory-bound.

time = step overhead + sum over components of max(FLOPs / (peak * eff), bytes / (bw * eff)).

Host <-> device copies: a KV block is not one contiguous piece.  With the usual layer-major
layout (one K and one V tensor per layer, as vLLM and SGLang allocate them) a block's KV is
2 x num_layers pieces, each its own copy operation, so one block costs
pieces x (per-operation latency + piece bytes / effective PCIe bandwidth).
`copy_pieces_per_block=1` models a block-contiguous layout (or a gather kernel).

Ignored: activations traffic, norms/rotary/softmax elementwise work, kernel-launch gaps inside a
step (folded into `step_overhead_s`), tensor parallelism.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenflow.core.plan import attention_pairs
from tokenflow.sim.hardware import GpuSpec, ModelSpec

_GIB = 2**30


@dataclass(frozen=True)
class CostModelConfig:
    """Knobs of the roofline: achieved fractions of peak and fixed per-step costs."""

    compute_efficiency: float = 0.6  # achieved / peak tensor FLOP/s of large GEMMs
    bandwidth_efficiency: float = 0.8  # achieved / peak device-memory bandwidth
    # Fixed CPU-side cost of one iteration (input preparation, sampling, output processing,
    # launch gaps; the scheduler's own decision time is charged apart, see sim/overhead.py).
    # Engines are not free here: vLLM's profile of Llama 3 8B on one H100 found the GPU busy
    # only 38% of the time before v0.6.0 (blog.vllm.ai/2024/09/05/perf-update.html), and
    # SGLang/vLLM decode steps still carry a few ms beyond the kernels.
    step_overhead_s: float = 0.004
    prefill_token_overhead_s: float = 0.0  # extra CPU cost per prefill token (input building)
    # Host <-> device copies; None takes the GPU preset's figure.
    pcie_bytes_per_s: float | None = None  # effective bandwidth per direction
    copy_latency_s: float | None = None  # fixed cost of one copy operation
    copy_pieces_per_block: int | None = None  # copy operations per KV block (None: 2 x layers)

    def __post_init__(self) -> None:
        for name in ("compute_efficiency", "bandwidth_efficiency"):
            value = getattr(self, name)
            if not (0 < value <= 1):
                raise ValueError(f"{name} must be in (0, 1], got {value!r}")
        for name in ("step_overhead_s", "prefill_token_overhead_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.pcie_bytes_per_s is not None and not self.pcie_bytes_per_s > 0:
            raise ValueError(f"pcie_bytes_per_s must be > 0, got {self.pcie_bytes_per_s!r}")
        if self.copy_latency_s is not None and not self.copy_latency_s >= 0:
            raise ValueError(f"copy_latency_s must be >= 0, got {self.copy_latency_s!r}")
        if self.copy_pieces_per_block is not None and self.copy_pieces_per_block < 1:
            raise ValueError(
                f"copy_pieces_per_block must be >= 1, got {self.copy_pieces_per_block}"
            )


class CostModel:
    """Predicts step and copy times of `model` on `gpu`."""

    def __init__(
        self, gpu: GpuSpec, model: ModelSpec, config: CostModelConfig | None = None
    ) -> None:
        self.gpu = gpu
        self.model = model
        self.config = config if config is not None else CostModelConfig()
        # Precomputed so that compute_time_s is a handful of multiplications.
        flops_per_s = gpu.bf16_flops_per_s * self.config.compute_efficiency
        bytes_per_s = gpu.hbm_bytes_per_s * self.config.bandwidth_efficiency
        self._s_per_flop = 1.0 / flops_per_s
        self._s_per_byte = 1.0 / bytes_per_s
        self._layer_flops_per_token = 2.0 * model.num_layer_params
        self._lm_head_flops_per_token = 2.0 * model.num_lm_head_params
        self._layer_weight_s = model.num_layer_params * model.dtype_bytes * self._s_per_byte
        self._lm_head_weight_s = model.num_lm_head_params * model.dtype_bytes * self._s_per_byte
        self._attention_flops_per_pair = (
            4.0 * model.num_layers * model.num_attention_heads * model.head_dim
        )
        self._kv_bytes_per_token = model.kv_bytes_per_token
        cfg = self.config
        self.pcie_bytes_per_s = cfg.pcie_bytes_per_s or gpu.pcie_bytes_per_s
        self.copy_latency_s = (
            gpu.copy_latency_s if cfg.copy_latency_s is None else cfg.copy_latency_s
        )
        self.copy_pieces_per_block = cfg.copy_pieces_per_block or 2 * model.num_layers

    def compute_time_s(
        self,
        num_prefill_tokens: int,
        prefill_attention_pairs: int,
        decode_context_tokens: int,
        num_decode_seqs: int,
        num_prefill_samples: int = 0,
        padded_decode_keys: int = 0,
    ) -> float:
        """Seconds one forward pass takes; 0 when there is nothing to compute.

        `prefill_attention_pairs` sums, over prefill tokens, the context each attends to (itself
        and everything before it); `decode_context_tokens` sums the decode sequences' contexts
        (a paged kernel reads each one's own keys, so `padded_decode_keys` is not charged).
        Every decode sequence samples; `num_prefill_samples` prefill chunks also sample.
        """
        num_tokens = num_prefill_tokens + num_decode_seqs
        if num_tokens == 0:
            return 0.0
        s_per_flop = self._s_per_flop
        num_samples = num_decode_seqs + num_prefill_samples
        linear_s = max(num_tokens * self._layer_flops_per_token * s_per_flop, self._layer_weight_s)
        if num_samples:
            linear_s += max(
                num_samples * self._lm_head_flops_per_token * s_per_flop, self._lm_head_weight_s
            )
        prefill_attention_s = max(
            prefill_attention_pairs * self._attention_flops_per_pair * s_per_flop,
            num_prefill_tokens * self._kv_bytes_per_token * self._s_per_byte,
        )
        decode_attention_s = max(
            decode_context_tokens * self._attention_flops_per_pair * s_per_flop,
            decode_context_tokens * self._kv_bytes_per_token * self._s_per_byte,
        )
        return (
            self.config.step_overhead_s
            + num_prefill_tokens * self.config.prefill_token_overhead_s
            + linear_s
            + prefill_attention_s
            + decode_attention_s
        )

    def copy_time_s(self, num_bytes: int, num_ops: int = 1) -> float:
        """Seconds to move `num_bytes` over PCIe in one direction in `num_ops` copy operations."""
        return num_ops * self.copy_latency_s + num_bytes / self.pcie_bytes_per_s

    def block_copy_time_s(self, block_bytes: int) -> float:
        """Seconds to copy one KV block of `block_bytes` (all its pieces) in one direction."""
        return self.copy_time_s(block_bytes, self.copy_pieces_per_block)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, in the model's dtype."""
        return self._kv_bytes_per_token

    def copies_time_s(self, num_d2h_blocks: int, num_h2d_blocks: int, block_bytes: int) -> float:
        """A step's copies: PCIe is full duplex, so the two directions overlap each other."""
        return max(num_d2h_blocks, num_h2d_blocks) * self.block_copy_time_s(block_bytes)

    def kv_pool_bytes(self, memory_fraction: float) -> int:
        """KV memory left when `memory_fraction` of the GPU holds the weights and the KV pool."""
        if not (0 < memory_fraction <= 1):
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
        budget_bytes = int(self.gpu.memory_bytes * memory_fraction)
        pool_bytes = budget_bytes - self.model.weight_bytes
        if pool_bytes <= 0:
            raise ValueError(
                f"{self.model.name} does not fit in {memory_fraction:.0%} of {self.gpu.name} "
                f"memory ({budget_bytes / _GIB:.1f} GiB): its weights alone take "
                f"{self.model.weight_bytes / _GIB:.1f} GiB"
            )
        return pool_bytes

    def decode_tokens_per_s(self, batch_size: int, context_tokens: int) -> float:
        """Tokens/s of the whole batch when `batch_size` streams decode at `context_tokens` each."""
        if batch_size < 1 or context_tokens < 1:
            raise ValueError("batch_size and context_tokens must be >= 1")
        step_s = self.compute_time_s(
            num_prefill_tokens=0,
            prefill_attention_pairs=0,
            decode_context_tokens=batch_size * context_tokens,
            num_decode_seqs=batch_size,
        )
        return batch_size / step_s

    def prefill_tokens_per_s(self, chunk_tokens: int, start_position: int = 0) -> float:
        """Tokens/s of one prefill chunk of `chunk_tokens` after `start_position` cached tokens."""
        if chunk_tokens < 1 or start_position < 0:
            raise ValueError("chunk_tokens must be >= 1 and start_position >= 0")
        step_s = self.compute_time_s(
            num_prefill_tokens=chunk_tokens,
            prefill_attention_pairs=attention_pairs(start_position, chunk_tokens),
            decode_context_tokens=0,
            num_decode_seqs=0,
            num_prefill_samples=1,
        )
        return chunk_tokens / step_s
