"""Step costs fitted to a profile of a real engine, and the cost model the simulator charges.

The form is the step-time model the core's estimator learns online (tokenflow/core/estimator.py):
a decode step over B streams holding C context tokens takes a + b*B + c*C (the simulator
charges C as the engine's dense decode batch reads it: B x the longest context), a step that
prefills T tokens adds p0 + p1*T, plus (here only) p2 per causal attention pair of the chunk, which
matters for a chunk deep into a long prompt.  Two regimes are fitted apart, because on a CPU
a step of fewer than `serial_below_tokens` tokens runs on one thread (tokenflow/model/threads.py)
and its costs are not on the line of the larger steps.

Fits are least squares weighted by 1/t (they minimise relative residuals, so a 10 ms step
counts as much as a 500 ms one), with every coefficient kept >= 0 (a coefficient that comes
out negative is fixed at 0 and the rest refitted).  Copies: per direction, a fixed latency per
step that copies at all plus a cost per block; the real CPU executor runs a step's copies on
its own thread, device -> host then host -> device, before the forward pass (the simulator
charges them beside it: tokenflow/sim/executor.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tokenflow.calibrate.sweep import StepSample

_C_SCALE = 1e-3  # context tokens in thousands, pairs in millions: comparable column norms
_PAIRS_SCALE = 1e-6


@dataclass(frozen=True)
class ComputeFit:
    """Seconds of one forward pass: a + b*B + c*C, plus p0 + p1*T + p2*pairs if it prefills."""

    a_s: float
    b_s: float  # per decoding stream
    c_s: float  # per context token a decode attends to
    p0_s: float = 0.0  # once per step that prefills
    p1_s: float = 0.0  # per prefill token
    p2_s: float = 0.0  # per causal (query, key) pair of the prefill

    def time_s(self, num_decode: int, context_tokens: int, num_prefill: int, pairs: int) -> float:
        """Seconds of a step of that shape."""
        t = self.a_s + self.b_s * num_decode + self.c_s * context_tokens
        if num_prefill:
            t += self.p0_s + self.p1_s * num_prefill + self.p2_s * pairs
        return t


@dataclass(frozen=True)
class CopyFit:
    """Seconds to copy k blocks in one direction in one step: latency + k * block time."""

    latency_s: float
    block_s: float

    def time_s(self, num_blocks: int) -> float:
        return self.latency_s + self.block_s * num_blocks if num_blocks else 0.0


@dataclass(frozen=True)
class StepCosts:
    """Everything the profiled simulator charges for an engine step (and for a request)."""

    serial_below_tokens: int  # steps of fewer tokens ran on one thread (`serial`)
    serial: ComputeFit
    parallel: ComputeFit
    d2h: CopyFit
    h2d: CopyFit
    # The engine's own CPU time per step outside the forward pass and the scheduler's
    # decision (inputs, sampling bookkeeping, detokenizing, delivering): fixed + per chunk.
    server_step_s: float = 0.0
    server_per_chunk_s: float = 0.0
    # The forward pass and copies as fitted, times this: the machine's speed when the profile
    # ended against during its sweep (the serving probe's in-process steps against the fit's
    # prediction of them, tokenflow/calibrate/probe.py); a shared CPU's speed drifts by minutes.
    # A step's prefill terms (p0, p1, p2) take their own factor, from a lone request's prefill.
    speed_factor: float = 1.0
    prefill_speed_factor: float = 1.0
    # Once per request: its way from the client to the engine and its first token's way back
    # (HTTP, tokenizing, the template, the first delta), beyond what the steps are charged.
    request_path_s: float = 0.0

    def compute_fit(self, num_tokens: int) -> ComputeFit:
        """The regime a forward pass of `num_tokens` tokens runs in."""
        return self.serial if num_tokens < self.serial_below_tokens else self.parallel


def nonnegative_lstsq(rows: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: a negative one is fixed at 0, the rest refit
    (an active set, one column at a time, most negative first)."""
    active = list(range(rows.shape[1]))
    coef = np.zeros(rows.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(rows[:, active], targets, rcond=None)
        if solution.min() >= 0:
            coef[active] = solution
            return coef
        del active[int(np.argmin(solution))]
    return coef


def _weighted_fit(
    samples: Sequence[StepSample], features: Callable[[StepSample], list[float]]
) -> np.ndarray:
    rows = np.array([features(s) for s in samples], dtype=np.float64)
    y = np.array([s.duration_s for s in samples], dtype=np.float64)
    weights = 1.0 / np.maximum(y, 1e-6)
    return nonnegative_lstsq(rows * weights[:, None], y * weights)


def _features(s: StepSample) -> list[float]:
    has_prefill = 1.0 if s.num_prefill_tokens else 0.0
    return [
        1.0,
        float(s.num_decode_seqs),
        s.decode_context_tokens * _C_SCALE,
        has_prefill,
        float(s.num_prefill_tokens),
        s.prefill_attention_pairs * _PAIRS_SCALE,
    ]


def fit_compute(samples: Sequence[StepSample]) -> ComputeFit:
    """The compute model of steps with a forward pass (all in one regime); without any prefill
    among them the prefill terms stay 0."""
    if not samples:
        raise ValueError("no samples to fit")
    has_prefill = any(s.num_prefill_tokens for s in samples)
    width = 6 if has_prefill else 3
    a, b, c, *rest = _weighted_fit(samples, lambda s: _features(s)[:width])
    p0, p1, p2 = (*rest, 0.0, 0.0, 0.0)[:3]
    return ComputeFit(a, b, c * _C_SCALE, p0, p1, p2 * _PAIRS_SCALE)


def fit_copy(samples: Sequence[StepSample], direction: str) -> CopyFit:
    """latency + k * block time, from copy-only steps of one direction ("d2h" or "h2d")."""
    blocks = [getattr(s, f"num_{direction}_blocks") for s in samples]
    if not samples or len(set(blocks)) < 2:
        raise ValueError(f"need {direction} copies of at least two sizes")
    rows = [
        StepSample(0, 0, 0, 0, k, 0, s.duration_s) for k, s in zip(blocks, samples, strict=True)
    ]
    latency, per_block = _weighted_fit(rows, lambda s: [1.0, float(s.num_d2h_blocks)])
    return CopyFit(latency, per_block)


def point_medians(samples: Sequence[StepSample]) -> list[StepSample]:
    """One sample per shape, at the median of its timed steps: a step slowed by another
    process on a shared machine then moves no coefficient."""
    by_shape: dict[tuple[int, ...], list[float]] = {}
    for s in samples:
        key = (s.num_decode_seqs, s.decode_context_tokens, s.num_prefill_tokens,
               s.prefill_attention_pairs, s.num_d2h_blocks, s.num_h2d_blocks)  # fmt: skip
        by_shape.setdefault(key, []).append(s.duration_s)
    return [StepSample(*key, float(np.median(times))) for key, times in by_shape.items()]


def fit_step_costs(samples: Sequence[StepSample], serial_below_tokens: int) -> StepCosts:
    """Every fit of a sweep (on the medians of its points): the two compute regimes and both
    copy directions."""
    samples = point_medians(samples)
    compute = [s for s in samples if s.num_tokens]
    serial = [s for s in compute if s.num_tokens < serial_below_tokens]
    parallel = [s for s in compute if s.num_tokens >= serial_below_tokens]
    parallel_fit = fit_compute(parallel)
    serial_fit = fit_compute(serial) if len(serial) >= 3 else parallel_fit
    copies = [s for s in samples if not s.num_tokens]
    return StepCosts(
        serial_below_tokens=serial_below_tokens,
        serial=serial_fit,
        parallel=parallel_fit,
        d2h=fit_copy([s for s in copies if s.num_d2h_blocks and not s.num_h2d_blocks], "d2h"),
        h2d=fit_copy([s for s in copies if s.num_h2d_blocks and not s.num_d2h_blocks], "h2d"),
    )


def predicted_step_s(costs: StepCosts, s: StepSample) -> float:
    """What `costs` charge for the step `s` measured (compute and copies overlap)."""
    fit = costs.compute_fit(s.num_tokens)
    compute_s = (
        fit.time_s(
            s.num_decode_seqs, s.decode_context_tokens, s.num_prefill_tokens,
            s.prefill_attention_pairs,
        )
        if s.num_tokens
        else 0.0
    )  # fmt: skip
    copies_s = costs.d2h.time_s(s.num_d2h_blocks) + costs.h2d.time_s(s.num_h2d_blocks)
    return max(compute_s, copies_s)


@dataclass(frozen=True)
class Residuals:
    """Relative residuals (predicted / measured - 1) of a fit over its samples, by kind."""

    kind: str  # "decode", "prefill", "mixed", "copy" or "all"
    num_samples: int
    median_abs: float
    rms: float
    max_abs: float


def residuals(costs: StepCosts, samples: Sequence[StepSample]) -> list[Residuals]:
    """The fit's relative residuals over `samples`, per kind of step and over all."""
    groups: dict[str, list[float]] = {"decode": [], "prefill": [], "mixed": [], "copy": []}
    for s in samples:
        error = predicted_step_s(costs, s) / max(s.duration_s, 1e-9) - 1.0
        groups[_kind(s)].append(error)
    groups["all"] = [e for values in groups.values() for e in values]
    return [
        Residuals(
            kind=kind,
            num_samples=len(errors),
            median_abs=float(np.median(np.abs(errors))),
            rms=math.sqrt(sum(e * e for e in errors) / len(errors)),
            max_abs=max(abs(e) for e in errors),
        )
        for kind, errors in groups.items()
        if errors
    ]


def _kind(s: StepSample) -> str:
    if not s.num_tokens:
        return "copy"
    if s.num_prefill_tokens and s.num_decode_seqs:
        return "mixed"
    return "prefill" if s.num_prefill_tokens else "decode"


class ProfiledCostModel:
    """The simulator's cost model from a profile: the fitted step times, on the real engine's
    KV blocks (the interface of the roofline `CostModel` that `SimExecutor` reads)."""

    def __init__(self, costs: StepCosts, kv_bytes_per_token: int) -> None:
        self.costs = costs
        self.kv_bytes_per_token = kv_bytes_per_token

    def compute_time_s(
        self,
        num_prefill_tokens: int,
        prefill_attention_pairs: int,
        decode_context_tokens: int,
        num_decode_seqs: int,
        num_prefill_samples: int = 0,
        padded_decode_keys: int = 0,
    ) -> float:
        """Seconds one forward pass takes; 0 when there is nothing to compute.  The engine's
        decode batch is dense, so c is charged on the padded keys when they are given (the
        sweep's decodes share one whole-block context: there the two counts agree)."""
        num_tokens = num_prefill_tokens + num_decode_seqs
        if num_tokens == 0:
            return 0.0
        fit = self.costs.compute_fit(num_tokens)
        keys = padded_decode_keys or decode_context_tokens
        decode_s = fit.time_s(num_decode_seqs, keys, 0, 0)
        step_s = fit.time_s(num_decode_seqs, keys, num_prefill_tokens, prefill_attention_pairs)
        costs = self.costs
        return decode_s * costs.speed_factor + (step_s - decode_s) * costs.prefill_speed_factor

    def block_copy_time_s(self, block_bytes: int) -> float:
        """Seconds per block of a long copy, the slower direction (the link's rate)."""
        block_s = max(self.costs.d2h.block_s, self.costs.h2d.block_s, 1e-12)
        return block_s * self.costs.speed_factor

    def copies_time_s(self, num_d2h_blocks: int, num_h2d_blocks: int, block_bytes: int) -> float:
        """A step's copies: one worker thread, device -> host and then host -> device."""
        copies_s = self.costs.d2h.time_s(num_d2h_blocks) + self.costs.h2d.time_s(num_h2d_blocks)
        return copies_s * self.costs.speed_factor
