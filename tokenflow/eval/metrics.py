"""Serving metrics shared by the simulator and the HTTP benchmark client (paper §3.2, §7.1.3).

Both producers hand over one `RequestTrace` per request, so simulated and measured runs are
scored by the same code and compare directly.

The reader model.  A stream's reader starts at the first token and consumes one token every
1/r seconds, pausing (a stall) when its buffer is empty.  With g_j the time token j was
generated (or reached the client):

    c_1 = g_1,   c_j = max(g_j, c_(j-1) + 1/r)                  consumption time of token j
    B_j = #{k < j : c_k > g_j}                                   buffer when token j is generated
    w_j = 1 if B_j <= 0.10 L;  0 if B_j >= 0.20 L;  linear between   (L = tokens of the stream)
    rebuffer = sum_(j>1) max(0, g_j - (c_(j-1) + 1/r))          seconds spent on an empty buffer

The recurrence has the closed form c_j = max_(k<=j) (g_k + (j-k)/r) (unroll it), a running
maximum that numpy computes in one pass without accumulating 1/r step by step.  Times closer
than TIME_TOLERANCE_S count as equal: a token read at the very instant another one is generated
has left the buffer, a token exactly on time is no stall, and a stream exactly on its ideal
timeline is not late, however the float rounding of a simulator's clock fell (a clock stepping
0.01 s meets a 20 tok/s reader exactly).

Which requests count where (vLLM's benchmark_serving semantics for the latency metrics):

- *completed*: at least one token and a finish reason that is not "abort"/"error".  TTFT, TPOT,
  ITL, E2E, rebuffer, QoE and goodput are taken over completed requests only; a request without
  tokens has no TTFT at all.
- throughput, effective throughput, QoS and preemptions count every token and every request,
  failed ones included: the tokens were generated and the GPU time was spent.
- makespan = first arrival (of any request) to last token (of any request).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

import numpy as np

from tokenflow.core.consumption import CLASS_NAMES

FAILED_FINISH_REASONS = frozenset({"abort", "error"})
TIME_TOLERANCE_S = 1e-9


@dataclass(frozen=True)
class RequestTrace:
    """What one request did: when it came, how fast its reader reads, when its tokens came.

    An eager or batch request (`consumption`) reads every token the moment it arrives: its
    rate is infinite, it has no buffer and no stall, and every token it gets is effective;
    stall and QoE are the readers' (see `summarize`)."""

    request_id: str
    arrival_s: float  # submission time
    rate_tps: float  # reader's consumption rate r (tokens/s), > 0 (inf unless a reader)
    num_prompt_tokens: int
    token_times_s: tuple[float, ...]  # generation (or client-arrival) time of each output token
    num_preemptions: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None
    consumption: str = "reader"  # "reader" | "eager" | "batch"

    def __post_init__(self) -> None:
        times = tuple(float(t) for t in self.token_times_s)
        object.__setattr__(self, "token_times_s", times)
        where = f"trace {self.request_id}"
        if not math.isfinite(self.arrival_s):
            raise ValueError(f"{where}: arrival_s must be finite, got {self.arrival_s!r}")
        if self.consumption not in CLASS_NAMES:
            raise ValueError(f"{where}: consumption must be one of {CLASS_NAMES}")
        if self.is_reader:
            _check_rate(self.rate_tps, where)
        else:
            object.__setattr__(self, "rate_tps", math.inf)
        if self.num_prompt_tokens < 0 or self.num_preemptions < 0:
            raise ValueError(f"{where}: token and preemption counts must be >= 0")
        _check_times(np.asarray(times, dtype=np.float64), where)
        if times and times[0] < self.arrival_s:
            raise ValueError(
                f"{where}: first token at {times[0]!r} s precedes arrival at {self.arrival_s!r} s"
            )

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times_s)

    @property
    def is_reader(self) -> bool:
        return self.consumption == "reader"

    @property
    def is_completed(self) -> bool:
        """True when the request produced tokens and did not fail (abort or error)."""
        return bool(self.token_times_s) and self.finish_reason not in FAILED_FINISH_REASONS


@dataclass(frozen=True)
class MetricsConfig:
    """Thresholds and weights of the metrics; defaults follow the paper and vLLM."""

    effective_full_fraction: float = 0.10  # weight 1 while buffer <= 0.10 * L
    effective_zero_fraction: float = 0.20  # weight 0 from 0.20 * L on, linear in between
    ttft_target_s: float = 1.0  # Andes QoE: ideal consumption of token j at arrival+target+(j-1)/r
    qos_ttft_weight: float = 1.0  # lambda in the paper's QoS (Eq. 2)
    qos_rebuffer_weight: float = 1.0  # mu in the paper's QoS (Eq. 2)
    slo_ttft_s: float = 2.0  # goodput SLOs: a request is good if it meets all of them
    slo_tpot_s: float = 0.2

    def __post_init__(self) -> None:
        full, zero = self.effective_full_fraction, self.effective_zero_fraction
        if not (math.isfinite(full) and math.isfinite(zero) and 0 <= full < zero):
            raise ValueError(
                f"effective fractions must satisfy 0 <= full < zero, got full={full!r}, "
                f"zero={zero!r}"
            )
        for name in ("ttft_target_s", "slo_ttft_s", "slo_tpot_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        for name in ("qos_ttft_weight", "qos_rebuffer_weight"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class Summary:
    """One run's numbers.  Times in seconds, rates per second; see the module docstring."""

    num_requests: int
    num_completed: int
    makespan_s: float
    total_output_tokens: int
    throughput_tps: float
    effective_throughput_tps: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_mean_s: float
    tpot_p99_s: float
    itl_p99_s: float
    e2e_mean_s: float
    e2e_p99_s: float
    rebuffer_mean_s: float
    rebuffer_p99_s: float
    qoe_mean: float
    qos: float
    goodput_rps: float
    num_preemptions: int

    def to_dict(self) -> dict[str, float | int]:
        """A plain JSON-able dict keyed by the field names (Python ints and floats only)."""
        return {
            key: (int(v) if isinstance(v, int) else float(v)) for key, v in asdict(self).items()
        }


# -- the numpy kernels (inputs already validated) -----------------------------------------------
def _consumption(times: np.ndarray, rate_tps: float) -> np.ndarray:
    """Consumption times c (shape [n]) via the closed form c_j = max_(k<=j) (g_k + (j-k)/r)."""
    steps = np.arange(times.size, dtype=np.float64) / rate_tps
    consumed = steps + np.maximum.accumulate(times - steps)
    # Invariant c_j >= g_j; the running maximum can lose it by one rounding.
    return np.maximum(consumed, times)


def _buffer(times: np.ndarray, consumed: np.ndarray) -> np.ndarray:
    """B_j = #{k < j : c_k > g_j}, shape [n].

    c is non-decreasing, so {k : c_k <= g_j} is a prefix of length p and #{k < j : c_k <= g_j}
    is min(p, j - 1).
    """
    index = np.arange(times.size)
    num_read = np.searchsorted(consumed, times + TIME_TOLERANCE_S, side="right")
    return index - np.minimum(num_read, index)


def _weights(buffer: np.ndarray, config: MetricsConfig) -> np.ndarray:
    """Effective weight of each token from its buffer, relative to the stream length L."""
    length = buffer.size
    full = config.effective_full_fraction * length
    zero = config.effective_zero_fraction * length
    return np.clip((zero - buffer) / (zero - full), 0.0, 1.0)


def _rebuffer(times: np.ndarray, consumed: np.ndarray, rate_tps: float) -> float:
    """Total stall seconds: sum over j > 1 of max(0, g_j - (c_(j-1) + 1/r))."""
    if times.size < 2:
        return 0.0
    stalls = times[1:] - (consumed[:-1] + 1.0 / rate_tps)
    return float(np.sum(stalls[stalls > TIME_TOLERANCE_S]))


def _qoe(arrival_s: float, consumed: np.ndarray, rate_tps: float, ttft_target_s: float) -> float:
    """Andes QoE from actual consumption times c (see `andes_qoe`)."""
    if consumed.size == 0:
        return 0.0
    ideal = arrival_s + ttft_target_s + np.arange(consumed.size, dtype=np.float64) / rate_tps
    late_s = consumed - ideal
    delay_area = float(np.sum(late_s[late_s > TIME_TOLERANCE_S]))
    if delay_area <= 0.0:
        return 1.0
    # c_j - e_j never decreases (c steps >= 1/r, e steps = 1/r), so a late stream also ends late:
    # T = max(e_L, c_L) = c_L, and S_whole >= S_delay > 0 because every c_j <= c_L.
    whole_area = float(np.sum(consumed[-1] - ideal))
    return 1.0 - delay_area / whole_area


# -- public per-stream functions ----------------------------------------------------------------
def consumption_times_s(token_times_s: Sequence[float], rate_tps: float) -> list[float]:
    """Reader's consumption time of each token: c_1 = g_1, c_j = max(g_j, c_(j-1) + 1/r)."""
    times = _validated(token_times_s, rate_tps)
    return _consumption(times, rate_tps).tolist()


def buffer_at_generation(token_times_s: Sequence[float], rate_tps: float) -> list[int]:
    """Buffer B_j when token j is generated: earlier tokens not yet consumed, #{k<j : c_k > g_j}."""
    times = _validated(token_times_s, rate_tps)
    return _buffer(times, _consumption(times, rate_tps)).tolist()


def effective_weights(
    token_times_s: Sequence[float], rate_tps: float, config: MetricsConfig = MetricsConfig()
) -> list[float]:
    """Weight of each token for effective throughput, with L = len(token_times_s).

    1 while B_j <= full*L, 0 from zero*L on, linear in between (full/zero from `config`).
    """
    times = _validated(token_times_s, rate_tps)
    return _weights(_buffer(times, _consumption(times, rate_tps)), config).tolist()


def rebuffer_time_s(token_times_s: Sequence[float], rate_tps: float) -> float:
    """Seconds the reader waits on an empty buffer: sum_(j>1) max(0, g_j - (c_(j-1) + 1/r))."""
    times = _validated(token_times_s, rate_tps)
    return _rebuffer(times, _consumption(times, rate_tps), rate_tps)


def andes_qoe(
    arrival_s: float, token_times_s: Sequence[float], rate_tps: float, ttft_target_s: float
) -> float:
    """Andes' QoE = 1 - S_delay / S_whole, in [0, 1], computed exactly.

    Ideal consumption of token j is e_j = arrival + target + (j-1)/r; actual consumption is c_j of
    the reader model.  With the step curves N_e(t) = #{j : e_j <= t} and N_c(t) = #{j : c_j <= t}
    over [arrival, T], T = max(e_L, c_L) (the later of the ideal and the actual end):

        S_whole = integral of N_e = sum_j (T - e_j)
        S_delay = integral of max(0, N_e - N_c) = sum_j max(0, c_j - e_j)

    (the second by counting, for each j, the time during which the ideal reader has token j and
    the actual one does not).  Tokens read ahead of the ideal timeline earn nothing extra, so a
    stream delivered at or ahead of it scores 1; a stream without tokens scores 0.
    """
    times = _validated(token_times_s, rate_tps)
    if not (math.isfinite(ttft_target_s) and ttft_target_s > 0):
        raise ValueError(f"ttft_target_s must be a finite number > 0, got {ttft_target_s!r}")
    return _qoe(arrival_s, _consumption(times, rate_tps), rate_tps, ttft_target_s)


def buffer_timeline(trace: RequestTrace, times_s: Sequence[float]) -> list[int]:
    """Reader's buffer (tokens generated by t minus tokens consumed by t) at each t, for plots.

    A token leaves the buffer at the instant it is consumed; before the first token it is 0.
    """
    times = np.asarray(trace.token_times_s, dtype=np.float64)
    consumed = _consumption(times, trace.rate_tps)
    at = np.asarray(times_s, dtype=np.float64)
    generated = np.searchsorted(times, at, side="right")
    return (generated - np.searchsorted(consumed, at, side="right")).tolist()


def _check_rate(rate_tps: float, where: str) -> None:
    if not (math.isfinite(rate_tps) and rate_tps > 0):
        raise ValueError(f"{where}: rate_tps must be a finite number > 0, got {rate_tps!r}")


def _check_times(times: np.ndarray, where: str) -> None:
    if times.ndim != 1 or not np.all(np.isfinite(times)):
        raise ValueError(f"{where}: token times must be a flat sequence of finite numbers")
    if times.size > 1 and np.any(np.diff(times) < 0):
        raise ValueError(f"{where}: token times must be non-decreasing")


def _validated(token_times_s: Sequence[float], rate_tps: float) -> np.ndarray:
    times = np.asarray(token_times_s, dtype=np.float64)
    _check_rate(rate_tps, "stream")
    _check_times(times, "stream")
    return times


# -- the run summary ----------------------------------------------------------------------------
@dataclass(frozen=True)
class _StreamStats:
    """Per-request numbers that feed the summary (latencies None when undefined)."""

    is_completed: bool
    weight_sum: float
    ttft_s: float | None  # None without tokens
    e2e_s: float | None
    tpot_s: float | None  # None with fewer than 2 tokens (vLLM leaves those out of TPOT stats)
    itls_s: np.ndarray  # shape [n - 1]
    rebuffer_s: float  # 0 unless a reader
    qoe: float
    is_reader: bool


def _stream_stats(trace: RequestTrace, config: MetricsConfig) -> _StreamStats:
    times = np.asarray(trace.token_times_s, dtype=np.float64)
    if times.size == 0:
        return _StreamStats(False, 0.0, None, None, None, times, 0.0, 0.0, trace.is_reader)
    consumed = _consumption(times, trace.rate_tps)
    ttft_s = float(times[0]) - trace.arrival_s
    e2e_s = float(times[-1]) - trace.arrival_s
    tpot_s = (e2e_s - ttft_s) / (times.size - 1) if times.size > 1 else None
    return _StreamStats(
        is_completed=trace.is_completed,
        weight_sum=float(np.sum(_weights(_buffer(times, consumed), config))),
        ttft_s=ttft_s,
        e2e_s=e2e_s,
        tpot_s=tpot_s,
        itls_s=np.diff(times),
        rebuffer_s=_rebuffer(times, consumed, trace.rate_tps) if trace.is_reader else 0.0,
        qoe=_qoe(trace.arrival_s, consumed, trace.rate_tps, config.ttft_target_s),
        is_reader=trace.is_reader,
    )


def _mean(values: Sequence[float] | np.ndarray) -> float:
    return float(np.mean(values)) if len(values) else 0.0


def _percentile(values: Sequence[float] | np.ndarray, q: float) -> float:
    """numpy's default (linear) percentile; 0 for no values, as vLLM's `np.percentile(x or 0)`."""
    return float(np.percentile(values, q)) if len(values) else 0.0


def _is_good(stats: _StreamStats, config: MetricsConfig) -> bool:
    """vLLM --goodput: every SLO met; a one-token request counts as TPOT 0."""
    tpot_s = stats.tpot_s if stats.tpot_s is not None else 0.0
    return (
        stats.is_completed
        and stats.ttft_s is not None
        and stats.ttft_s <= config.slo_ttft_s
        and tpot_s <= config.slo_tpot_s
    )


def _qos(
    traces: Sequence[RequestTrace], stats: list[_StreamStats], end_s: float, config: MetricsConfig
) -> float:
    """Sum over requests of (sum_j w_j - lambda*TTFT - mu*rebuffer), before dividing by T.

    A request that never got a token is charged TTFT = run end - arrival, a lower bound on it,
    so that starving a request can never raise QoS.
    """
    total = 0.0
    for trace, s in zip(traces, stats, strict=True):
        ttft_s = s.ttft_s if s.ttft_s is not None else max(end_s - trace.arrival_s, 0.0)
        total += s.weight_sum - config.qos_ttft_weight * ttft_s
        total -= config.qos_rebuffer_weight * s.rebuffer_s
    return total


def _zero_summary() -> Summary:
    return Summary(**{f.name: (0 if f.type == "int" else 0.0) for f in fields(Summary)})


def summarize(traces: Sequence[RequestTrace], config: MetricsConfig = MetricsConfig()) -> Summary:
    """Score a run: throughput, effective throughput, vLLM latency metrics, QoE, QoS, goodput.

    See the module docstring for which requests each metric covers.  Requests without tokens
    count in `num_requests` but not in `num_completed`, and are left out of TTFT (undefined for
    them).  Stall (rebuffer) and QoE are over completed readers only (0 without one).  Rates are
    0 when the makespan is 0; no input gives a Summary of zeros.
    """
    if not traces:
        return _zero_summary()
    stats = [_stream_stats(t, config) for t in traces]
    last_token_s = [t.token_times_s[-1] for t in traces if t.token_times_s]
    start_s = min(t.arrival_s for t in traces)
    end_s = max(last_token_s) if last_token_s else start_s
    makespan_s = end_s - start_s
    per_s = 1.0 / makespan_s if makespan_s > 0 else 0.0
    done = [s for s in stats if s.is_completed]
    ttfts = [s.ttft_s for s in done]
    tpots = [s.tpot_s for s in done if s.tpot_s is not None]
    e2es = [s.e2e_s for s in done]
    readers = [s for s in done if s.is_reader]
    rebuffers = [s.rebuffer_s for s in readers]
    itls = np.concatenate([s.itls_s for s in done]) if done else np.empty(0)
    total_tokens = sum(t.num_output_tokens for t in traces)
    return Summary(
        num_requests=len(traces),
        num_completed=len(done),
        makespan_s=float(makespan_s),
        total_output_tokens=total_tokens,
        throughput_tps=total_tokens * per_s,
        effective_throughput_tps=sum(s.weight_sum for s in stats) * per_s,
        ttft_mean_s=_mean(ttfts),
        ttft_p50_s=_percentile(ttfts, 50),
        ttft_p99_s=_percentile(ttfts, 99),
        tpot_mean_s=_mean(tpots),
        tpot_p99_s=_percentile(tpots, 99),
        itl_p99_s=_percentile(itls, 99),
        e2e_mean_s=_mean(e2es),
        e2e_p99_s=_percentile(e2es, 99),
        rebuffer_mean_s=_mean(rebuffers),
        rebuffer_p99_s=_percentile(rebuffers, 99),
        qoe_mean=_mean([s.qoe for s in readers]),
        qos=_qos(traces, stats, end_s, config) * per_s,
        goodput_rps=sum(_is_good(s, config) for s in stats) * per_s,
        num_preemptions=sum(t.num_preemptions for t in traces),
    )


def summarize_by_class(
    traces: Sequence[RequestTrace], config: MetricsConfig = MetricsConfig()
) -> dict[str, Summary]:
    """`summarize` of each consumption class present, in `CLASS_NAMES` order."""
    present = {t.consumption for t in traces}
    return {
        name: summarize([t for t in traces if t.consumption == name], config)
        for name in CLASS_NAMES
        if name in present
    }
