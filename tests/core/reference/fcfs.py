"""The baselines: SGLang's default FCFS (prefill-first) and its chunked-prefill variant.

Both preempt only when decode growth finds no free device block; the victim is recomputed.
"""

from __future__ import annotations

from tests.core.reference.base import Moves, Policy, SchedulingView, fcfs_starts
from tokenflow.core.config import SchedulerConfig


class FcfsPolicy(Policy):
    """First come, first served; whole prompts prefilled before any decode step."""

    name = "fcfs"


class ChunkedPolicy(Policy):
    """FCFS with chunked prefill: each step mixes every decode with prefill chunks, all within
    a token budget (`SchedulerConfig.chunk_tokens`)."""

    name = "chunked"

    def __init__(self, config: SchedulerConfig) -> None:
        self.prefill_chunk_tokens = config.chunk_tokens

    def plan_moves(self, view: SchedulingView) -> Moves:
        """FCFS admission, not limited by the per-step prefill budget (prompts are chunked)."""
        return Moves(starts=tuple(fcfs_starts(view, max_prefill_tokens=1 << 62)))
