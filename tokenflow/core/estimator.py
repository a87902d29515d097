"""Step-time and capacity estimates learned from the executor's measured step durations.

A decode step over B streams is modelled as t = a + b*B, fitted by ridge least squares over a
sliding window of recent decode-only steps.  Because the window is recent, b carries the current
attention cost per stream (it grows with context), so capacity B / t(B) is "at the current
batch", as the policy needs.  The ridge pulls toward the configured guesses, so a window without
variety in B still gives sane values.  Prefill cost is a per-token mean over recent prefills.
"""

from __future__ import annotations

from collections import deque


class StepTimeEstimator:
    """Predicts step durations and the engine's generation capacity (tokens/s)."""

    _RIDGE = 0.05  # weight of the prior, per observation

    def __init__(
        self,
        decode_step_s: float,
        prefill_token_s: float,
        window: int = 64,
        per_seq_s: float | None = None,
    ) -> None:
        # Prior: a batch-1 decode takes decode_step_s; each stream adds per_seq_s (default: 10%
        # of it, the rest fixed: weights, overhead).
        if per_seq_s is None:
            per_seq_s = decode_step_s * 0.1
        self._prior = (decode_step_s - per_seq_s, per_seq_s)
        self._base_s, self._per_seq_s = self._prior
        self._prefill_token_s = prefill_token_s
        self._decode_obs: deque[tuple[int, float]] = deque(maxlen=window)
        self._prefill_obs: deque[float] = deque(maxlen=32)

    def observe(self, num_decode: int, num_prefill_tokens: int, duration_s: float) -> None:
        """Record one step's measured duration."""
        if duration_s <= 0:
            return
        if num_prefill_tokens == 0 and num_decode > 0:
            self._decode_obs.append((num_decode, duration_s))
            self._refit()
        elif num_prefill_tokens > 0:
            rest = max(duration_s - self.decode_time_s(num_decode), 0.0)
            self._prefill_obs.append(rest / num_prefill_tokens)
            self._prefill_token_s = sum(self._prefill_obs) / len(self._prefill_obs)

    def _refit(self) -> None:
        """Ridge regression of t on (1, B), centred, with the prior slope as the ridge target."""
        n = len(self._decode_obs)
        mean_b = sum(b for b, _ in self._decode_obs) / n
        mean_t = sum(t for _, t in self._decode_obs) / n
        var_b = sum((b - mean_b) ** 2 for b, _ in self._decode_obs)
        cov = sum((b - mean_b) * (t - mean_t) for b, t in self._decode_obs)
        ridge = self._RIDGE * n * max(mean_b, 1.0)
        slope = (cov + ridge * self._per_seq_s) / (var_b + ridge)
        self._per_seq_s = max(slope, 0.0)
        self._base_s = max(mean_t - self._per_seq_s * mean_b, 0.0)

    def decode_time_s(self, num_decode: int) -> float:
        """Predicted duration of a decode step over `num_decode` streams."""
        return max(self._base_s + self._per_seq_s * num_decode, 1e-6)

    def prefill_time_s(self, num_tokens: int) -> float:
        """Predicted time to recompute `num_tokens` tokens of KV."""
        return self._prefill_token_s * num_tokens

    def capacity_tps(self, batch_size: int) -> float:
        """Tokens/s generated when decoding `batch_size` streams (at current contexts)."""
        batch_size = max(batch_size, 1)
        return batch_size / self.decode_time_s(batch_size)
