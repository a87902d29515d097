"""How well the profiled simulator predicts the real server: the fidelity workloads, and the
analysis of real runs against predictions (errors against the real runs' medians, the policy
order, the predicted-vs-measured plot). `benchmarks/fidelity.py` runs them; the page it writes
is `benchmarks/lib/fidelity_doc.py`'s."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenflow.eval.workload import LengthDist, RateMix, WorkloadSpec

METRICS = (
    ("ttft_mean_s", "TTFT mean s"),
    ("ttft_p99_s", "TTFT P99 s"),
    ("rebuffer_mean_s", "stall mean s"),
    ("rebuffer_p99_s", "stall P99 s"),
    ("effective_throughput_tps", "eff tok/s"),
    ("throughput_tps", "tok/s"),
    ("qoe_mean", "QoE"),
    ("makespan_s", "makespan s"),
    ("num_preemptions", "preemptions"),
)
# The targets: median relative error at most 10% (mean stall: 20% or 0.5 s).
TARGETS = {
    "ttft_mean_s": 0.10,
    "ttft_p99_s": 0.10,
    "effective_throughput_tps": 0.10,
    "throughput_tps": 0.10,
    "makespan_s": 0.10,
    "rebuffer_mean_s": 0.20,
}
STALL_ABS_TARGET_S = 0.5
# Lower is better for these; higher for the rest of ORDER_METRICS.
ORDER_METRICS = ("ttft_p99_s", "ttft_mean_s", "effective_throughput_tps", "qoe_mean")


@dataclass(frozen=True)
class Workload:
    """One fidelity workload: its trace's spec and the device KV tier it is served with."""

    name: str
    description: str
    spec: WorkloadSpec
    device_kv_tokens: int


def _spec(kind: str, n: int, prompt: str, output: str, rates: str, rate: float = 1.0):
    return WorkloadSpec(
        kind=kind,
        num_requests=n,
        request_rate=rate,
        prompt=LengthDist.parse(prompt, minimum=8),
        output=LengthDist.parse(output, minimum=8),
        rates=RateMix.parse(rates),
        seed=0,
    )


WORKLOADS = (
    Workload("burst-fits", "burst of 8 within capacity, prompt 96 / output 128, readers 2-4 tok/s",
             _spec("burst", 8, "96", "128", "2:0.5,4:0.5"), 8192),
    Workload("burst-overload", "burst of 16, prompt 128 / output 160, readers 2-4 tok/s, device KV "
             "1664 tokens", _spec("burst", 16, "128", "160", "2:0.5,4:0.5"), 1664),
    Workload("poisson", "Poisson 1 req/s x 24, prompt 96:32 / output 128:32, readers 2-4 tok/s",
             _spec("poisson", 24, "96:32", "128:32", "2:0.5,4:0.5", 1.0), 2048),
    Workload("mixed-rates", "burst of 16, prompt 64:16 / output 160:32, readers 2, 4, 8, 16 tok/s",
             _spec("burst", 16, "64:16", "160:32", "2,4,8,16"), 2048),
    Workload("long-prompts", "Poisson 0.5 req/s x 10, prompt 1024:256 / output 64:16, readers "
             "4 tok/s", _spec("poisson", 10, "1024:256", "64:16", "4", 0.5), 4096),
)  # fmt: skip


@dataclass(frozen=True)
class Row:
    workload: str
    policy: str
    metric: str
    measured: list[float]  # every real run
    median: float
    predicted: float

    @property
    def error(self) -> float:
        """|predicted - median| / |median| (0 when both are 0)."""
        if self.median == 0:
            return 0.0 if self.predicted == 0 else float("inf")
        return abs(self.predicted - self.median) / abs(self.median)

    @property
    def abs_error(self) -> float:
        return abs(self.predicted - self.median)


@dataclass(frozen=True)
class FidelityResult:
    rows: list[Row]
    median_error: dict[str, float]  # metric -> median relative error over workloads x policies
    stall_abs_median_s: float
    order: dict[str, list[str]]  # workload -> the order metrics the simulator got wrong
    runs: list[dict]
    text: str
    ablations: dict[str, dict[str, float]] = field(default_factory=dict)  # name -> median errors


def analyse(runs: list[dict], predictions: list[dict], workloads: Sequence[str]) -> FidelityResult:
    """Rows per (workload, policy, metric), the median errors and the policy order."""
    rows = []
    for p in predictions:
        real = [r for r in runs if r["workload"] == p["workload"] and r["policy"] == p["policy"]]
        for metric, _ in METRICS:
            values = [float(r["summary"][metric]) for r in real]
            if values:
                median, predicted = statistics.median(values), float(p["summary"][metric])
                rows.append(Row(p["workload"], p["policy"], metric, values, median, predicted))
    median_error = {
        m: statistics.median(r.error for r in rows if r.metric == m)
        for m, _ in METRICS
        if any(r.metric == m for r in rows)
    }
    stall_rows = [r for r in rows if r.metric == "rebuffer_mean_s"]
    stall_abs = statistics.median(r.abs_error for r in stall_rows) if stall_rows else 0.0
    names = [w for w in workloads if any(r.workload == w for r in rows)]
    order = {w: order_misses([r for r in rows if r.workload == w]) for w in names}
    result = FidelityResult(rows, median_error, stall_abs, order, runs, "")
    return FidelityResult(rows, median_error, stall_abs, order, runs, summary_text(result))


def order_misses(rows: list[Row]) -> list[str]:
    """The order metrics on which the simulator ranks fcfs and tokenflow unlike the real runs;
    a real difference within the two policies' ranges of runs is a tie and never a miss."""
    misses = []
    for metric in ORDER_METRICS:
        by_policy = {r.policy: r for r in rows if r.metric == metric}
        if set(by_policy) != {"fcfs", "tokenflow"}:
            continue
        f, t = by_policy["fcfs"], by_policy["tokenflow"]
        overlap = min(max(f.measured), max(t.measured)) >= max(min(f.measured), min(t.measured))
        if overlap:
            continue
        real = t.median > f.median
        simulated = t.predicted > f.predicted
        if real != simulated:
            misses.append(metric)
    return misses


def holds(result: FidelityResult, metric: str) -> bool:
    error = result.median_error.get(metric, float("inf"))
    if metric == "rebuffer_mean_s":
        return error <= TARGETS[metric] or result.stall_abs_median_s <= STALL_ABS_TARGET_S
    return error <= TARGETS.get(metric, float("inf"))


def summary_text(result: FidelityResult) -> str:
    lines = ["median relative error over workloads x policies:"]
    for metric, label in METRICS:
        if metric in result.median_error:
            target = TARGETS.get(metric)
            verdict = "" if target is None else ("  holds" if holds(result, metric) else "  MISS")
            lines.append(f"  {label:14s} {result.median_error[metric]:7.1%}{verdict}")
    lines.append(f"  stall mean, absolute: {result.stall_abs_median_s:.2f} s")
    for workload, misses in result.order.items():
        verdict = "preserved" if not misses else "MISSED " + ", ".join(misses)
        lines.append(f"  order on {workload}: {verdict}")
    return "\n".join(lines)
