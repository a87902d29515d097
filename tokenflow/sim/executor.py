"""An executor that runs no model: it charges a step's time to a simulated clock.

Timing of one step (plan.py's contract: copies and the forward pass run concurrently):

- compute: the cost model's time for the step's chunks (a GPU roofline, or a fit to a profile
  of the real engine);
- device -> host and host -> device copies: the cost model's time for the step's blocks (on a
  GPU each block is its pieces, a per-operation latency plus bytes over the effective PCIe
  bandwidth; PCIe is full duplex, so the two directions overlap each other), beside the
  compute: duration = max(compute, copies).  (The real CPU executor copies before its forward
  pass, at memory speed; charging them beside the compute errs by their share of a step,
  docs/design.md, "The KV tiers".)
- With `blocking_evictions=True` (write-back: the "without write-through" ablation) the step
  that preempts waits for its eviction copies before it computes:
  duration = evict + max(compute, the other copies).

Chunks are costed by shape, not role: a single-token chunk is memory-bound attention over its
context (a decode), a longer one is a compute-bound prefill.  Every single-token chunk is
assumed to run the lm_head (a decode always samples).  Decode attention is given two ways: the
contexts' sum (what paged kernels read, the GPU roofline's charge) and the padded keys, every
decode padded to the longest in whole blocks (what this project's engine reads: its decode batch
is dense, tokenflow/model/attention.py; the profiled model's charge).

Token ids: the simulator does not model text.  A sampled token is a deterministic function of the
seed and the request's output position, in [1, 1000): no EOS of the supported models (Llama 3:
128001/128009, Qwen2: 151643/151645) lies there, so requests end by `max_tokens`.  A request's
own `stop_token_ids` are skipped too.
"""

from __future__ import annotations

from typing import Protocol

from tokenflow.core.clock import SimClock
from tokenflow.core.plan import (
    CopyKind,
    SampledToken,
    StepPlan,
    StepResult,
    attention_pairs,
)

_TOKEN_ID_RANGE = 999  # ids 1 .. 999


class StepCostModel(Protocol):
    """What the executor charges: the roofline `CostModel` of a GPU, or the
    `ProfiledCostModel` fitted to a real engine (tokenflow/calibrate/costs.py)."""

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        ...

    def compute_time_s(
        self,
        num_prefill_tokens: int,
        prefill_attention_pairs: int,
        decode_context_tokens: int,
        num_decode_seqs: int,
        num_prefill_samples: int = 0,
        padded_decode_keys: int = 0,
    ) -> float:
        """Seconds of one forward pass of that shape.  `padded_decode_keys`: the keys a dense
        decode batch reads, every sequence padded to the longest in whole blocks."""
        ...

    def block_copy_time_s(self, block_bytes: int) -> float:
        """Seconds per block of a long copy in one direction."""
        ...

    def copies_time_s(self, num_d2h_blocks: int, num_h2d_blocks: int, block_bytes: int) -> float:
        """Seconds a step's copies take, both directions."""
        ...


class SimExecutor:
    """Charges each plan's predicted duration to `clock` and returns placeholder tokens."""

    def __init__(
        self,
        cost_model: StepCostModel,
        clock: SimClock,
        block_size: int,
        seed: int = 0,
        blocking_evictions: bool = False,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size!r}")
        self._cost_model = cost_model
        self._clock = clock
        self._block_size = block_size
        self._seed = seed
        self._blocking_evictions = blocking_evictions
        block_bytes = block_size * cost_model.kv_bytes_per_token
        self._block_bytes = block_bytes
        self._block_copy_s = cost_model.block_copy_time_s(block_bytes)
        self._total_compute_s = 0.0
        self._total_d2h_bytes = 0
        self._total_h2d_bytes = 0
        self._num_steps = 0
        self._last_step_duration_s = 0.0

    # -- counters ------------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block (all layers, K and V)."""
        return self._block_bytes

    @property
    def total_compute_s(self) -> float:
        """Sum of the forward-pass times of all steps (copies excluded)."""
        return self._total_compute_s

    @property
    def block_copy_s(self) -> float:
        """Seconds to copy one KV block in one direction (latency of its pieces included)."""
        return self._block_copy_s

    @property
    def total_d2h_bytes(self) -> int:
        return self._total_d2h_bytes

    @property
    def total_h2d_bytes(self) -> int:
        return self._total_h2d_bytes

    @property
    def num_steps(self) -> int:
        """Plans executed, empty ones included."""
        return self._num_steps

    @property
    def last_step_duration_s(self) -> float:
        return self._last_step_duration_s

    # -- the seam ------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        """Advance the clock by the plan's duration and sample one token per sampling chunk.

        An empty plan takes no time: waiting for work is the step loop's business.
        """
        compute_s = self._compute_time_s(plan)
        num_d2h = len(plan.device_to_host)
        num_h2d = len(plan.host_to_device)
        copies_s = self._cost_model.copies_time_s
        if self._blocking_evictions and num_d2h:
            num_evict = sum(1 for c in plan.device_to_host if c.kind is CopyKind.EVICT)
            evict_s = copies_s(num_evict, 0, self._block_bytes)
            rest_s = copies_s(num_d2h - num_evict, num_h2d, self._block_bytes)
            duration_s = evict_s + max(compute_s, rest_s)
        else:
            duration_s = max(compute_s, copies_s(num_d2h, num_h2d, self._block_bytes))

        self._clock.advance(duration_s)
        self._num_steps += 1
        self._total_compute_s += compute_s
        self._total_d2h_bytes += num_d2h * self._block_bytes
        self._total_h2d_bytes += num_h2d * self._block_bytes
        self._last_step_duration_s = duration_s

        # The hot path of the simulator (up to ~300 chunks a step): ids are inlined, and the
        # rare request with stop_token_ids takes the slow path.
        seed = self._seed
        sampled = []
        for chunk in plan.chunks:
            if chunk.samples_token:
                stop_ids = chunk.sampling_params.stop_token_ids
                if stop_ids:
                    token_id = self._token_id(chunk.num_output_tokens, stop_ids)
                else:
                    token_id = 1 + (seed + chunk.num_output_tokens) % _TOKEN_ID_RANGE
                sampled.append(SampledToken(chunk.request_id, token_id))
        return StepResult(sampled=tuple(sampled))

    def _compute_time_s(self, plan: StepPlan) -> float:
        num_prefill_tokens = 0
        prefill_pairs = 0
        num_prefill_samples = 0
        decode_context_tokens = 0
        longest_decode_context = 0
        num_decode_seqs = 0
        for chunk in plan.chunks:
            n = len(chunk.token_ids)
            start = chunk.start_position
            if n == 1:
                num_decode_seqs += 1
                decode_context_tokens += start + 1
                longest_decode_context = max(longest_decode_context, start + 1)
            else:
                num_prefill_tokens += n
                prefill_pairs += attention_pairs(start, n)
                num_prefill_samples += chunk.samples_token
        return self._cost_model.compute_time_s(
            num_prefill_tokens=num_prefill_tokens,
            prefill_attention_pairs=prefill_pairs,
            decode_context_tokens=decode_context_tokens,
            num_decode_seqs=num_decode_seqs,
            num_prefill_samples=num_prefill_samples,
            padded_decode_keys=num_decode_seqs * self._whole_blocks(longest_decode_context),
        )

    def _whole_blocks(self, num_tokens: int) -> int:
        """`num_tokens` rounded up to whole KV blocks."""
        return -(-num_tokens // self._block_size) * self._block_size

    def _token_id(self, position: int, stop_token_ids: tuple[int, ...]) -> int:
        """Deterministic placeholder id in [1, 1000) for output `position`, not a stop token."""
        offset = self._seed + position
        for step in range(_TOKEN_ID_RANGE):
            token_id = 1 + (offset + step) % _TOKEN_ID_RANGE
            if token_id not in stop_token_ids:
                return token_id
        raise ValueError(f"stop_token_ids cover every simulated token id 1..{_TOKEN_ID_RANGE}")
