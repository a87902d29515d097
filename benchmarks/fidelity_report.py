"""benchmarks/fidelity.py's analysis: errors against the real runs' medians, the policy order,
the predicted-vs-measured plot and docs/fidelity.md."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

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


def write_plot(path: str, result: FidelityResult) -> None:
    """Predicted against measured (the median, the runs' range as a bar), one panel a metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [m for m in METRICS if m[0] in result.median_error]
    cols, num_rows = 3, -(-len(shown) // 3)
    fig, axes = plt.subplots(num_rows, cols, figsize=(12, 3.6 * num_rows))
    for ax, (metric, label) in zip(axes.flat, shown, strict=False):
        for policy, color in (("fcfs", "tab:blue"), ("tokenflow", "tab:orange")):
            rows = [r for r in result.rows if r.metric == metric and r.policy == policy]
            x = [r.median for r in rows]
            lo = [r.median - min(r.measured) for r in rows]
            hi = [max(r.measured) - r.median for r in rows]
            ax.errorbar(x, [r.predicted for r in rows], xerr=[lo, hi], fmt="o", color=color,
                        label=policy, capsize=2)  # fmt: skip
        values = [v for r in result.rows if r.metric == metric for v in (*r.measured, r.predicted)]
        top = max(values + [1e-9]) * 1.1
        ax.plot([0, top], [0, top], color="gray", lw=0.8)
        ax.fill_between([0, top], [0, top * 0.9], [0, top * 1.1], color="gray", alpha=0.15)
        ax.set_title(f"{label} (median error {result.median_error[metric]:.0%})", fontsize=9)
        ax.set_xlabel("measured", fontsize=8)
        ax.set_ylabel("predicted", fontsize=8)
    for ax in list(axes.flat)[len(shown) :]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_doc(path: str, result: FidelityResult, workloads: Sequence, args: argparse.Namespace,
              plot: str | None) -> None:  # fmt: skip
    """docs/fidelity.md: how to reproduce, the figures, the table, the machine."""
    import os

    from benchmarks.fidelity_doc import render

    existing = None
    if os.path.exists(path):
        with open(path, encoding="utf-8") as file:
            existing = file.read()
    with open(path, "w", encoding="utf-8") as file:
        file.write(render(result, workloads, args, plot, existing))
