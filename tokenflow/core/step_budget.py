"""How many tokens one step may compute: the rule that keeps a step near a target time.

One unchunked 2,016-token prompt among eight decoding streams once made a 14.5-18.5 s step on
the CPU; budgeting every step cut the longest step 5-12x at the same total time.  The real
engine and its profiled simulation pass this rule to `Scheduler.schedule` for every policy, so
there a prefill-first policy (`fcfs`) also prefills in chunks of this budget; the paper-setup
simulator passes none, and each policy keeps its own (`Policy.prefill_chunk_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenflow.core.estimator import StepTimeEstimator

# A budgeted step's prefill chunk, at least: below this a chunk's fixed cost (one pass over the
# weights) dominates its step, so smaller chunks would multiply the steps a long prompt takes
# without shortening any step much.
MIN_PREFILL_CHUNK_TOKENS = 128


@dataclass(frozen=True)
class StepBudget:
    """A step takes about `step_target_s`: the decodes plus a prefill chunk priced by the
    step-time estimator."""

    step_target_s: float
    max_prefill_tokens: int
    min_chunk_tokens: int = MIN_PREFILL_CHUNK_TOKENS

    def tokens(self, estimator: StepTimeEstimator, num_decodes: int) -> int:
        """The step's token budget: the decodes plus a prefill chunk that takes about the step
        target at the measured prefill cost (or as long as the decodes alone when they exceed
        the target, so a long prompt still moves at no worse than half speed on a slow
        machine); a step's fixed prefill cost takes at most half of that time from the chunk.
        The chunk is clamped to [min_chunk_tokens, max_prefill_tokens]."""
        budget_s = max(self.step_target_s, estimator.decode_time_s(num_decodes))
        budget_s = max(budget_s - estimator.prefill_step_s, budget_s / 2)
        chunk = int(budget_s / max(estimator.prefill_token_s, 1e-9))
        return num_decodes + min(max(chunk, self.min_chunk_tokens), self.max_prefill_tokens)
