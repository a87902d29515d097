"""Step-time and capacity estimates learned from the executor's measured step durations.

Decode cost is modelled as a + b*B (B = decode streams in the step) by least squares over a
sliding window; prefill cost as a per-token mean over recent prefill steps.  Both start from
configured guesses, so decisions before the first measurements are still defined.
"""

from __future__ import annotations

from collections import deque


class StepTimeEstimator:
    """Predicts step durations and the engine's generation capacity (tokens/s)."""

    def __init__(
        self, decode_step_s: float, prefill_token_s: float, window: int = 128
    ) -> None:
        self._base_s = decode_step_s * 0.8  # guess: most of a small decode step is fixed cost
        self._per_seq_s = decode_step_s * 0.2 / 8
        self._prefill_token_s = prefill_token_s
        self._decode_obs: deque[tuple[int, float]] = deque(maxlen=window)
        self._prefill_obs: deque[float] = deque(maxlen=32)

    def observe(self, num_decode: int, num_prefill_tokens: int, duration_s: float) -> None:
        """Record one step's measured duration."""
        if duration_s <= 0:
            return
        if num_prefill_tokens == 0 and num_decode > 0:
            self._decode_obs.append((num_decode, duration_s))
            self._refit_decode()
        elif num_prefill_tokens > 0:
            rest = max(duration_s - self.decode_time_s(num_decode), 0.0)
            self._prefill_obs.append(rest / num_prefill_tokens)
            self._prefill_token_s = sum(self._prefill_obs) / len(self._prefill_obs)

    def _refit_decode(self) -> None:
        n = len(self._decode_obs)
        mean_b = sum(b for b, _ in self._decode_obs) / n
        mean_t = sum(t for _, t in self._decode_obs) / n
        var_b = sum((b - mean_b) ** 2 for b, _ in self._decode_obs)
        if var_b > 0:
            cov = sum((b - mean_b) * (t - mean_t) for b, t in self._decode_obs)
            slope = max(cov / var_b, 0.0)
            self._per_seq_s = slope
            self._base_s = max(mean_t - slope * mean_b, 0.0)
        else:  # one batch size seen: keep the slope, move the intercept
            self._base_s = max(mean_t - self._per_seq_s * mean_b, 0.0)

    def decode_time_s(self, num_decode: int) -> float:
        """Predicted duration of a decode step over `num_decode` streams."""
        return self._base_s + self._per_seq_s * num_decode

    def step_time_s(self, num_decode: int, num_prefill_tokens: int) -> float:
        """Predicted duration of a step mixing decodes and prefill tokens."""
        return self.decode_time_s(num_decode) + self._prefill_token_s * num_prefill_tokens

    def prefill_time_s(self, num_tokens: int) -> float:
        """Predicted time to recompute `num_tokens` tokens of KV."""
        return self._prefill_token_s * num_tokens

    def capacity_tps(self, batch_size: int) -> float:
        """Tokens/s the engine generates when decoding `batch_size` streams."""
        batch_size = max(batch_size, 1)
        return batch_size / self.decode_time_s(batch_size)
