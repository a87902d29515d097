"""Side-by-side reports of runs: a text table, a JSON file and a PNG of plots.

Everything takes `dict[str, Summary]` (run or policy name -> its summary) and, for plots, the
runs' `RequestTrace`s, so the simulator reports its runs with the same code as the HTTP
benchmark.  Plots use matplotlib's Agg canvas directly (no pyplot, no global backend switch).
Repeated runs (seeds) are summarised as median and min-max by `aggregate`, plotted by
`plot_spread`, and judged against a baseline's by `check_targets`.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from tokenflow.eval.metrics import (
    MetricsConfig,
    RequestTrace,
    Summary,
    buffer_timeline,
    summarize_by_class,
)

# (summary key, column title, format)
TABLE_COLUMNS = (
    ("throughput_tps", "tok/s", "{:.1f}"),
    ("effective_throughput_tps", "eff tok/s", "{:.1f}"),
    ("ttft_mean_s", "TTFT mean", "{:.3f}"),
    ("ttft_p50_s", "TTFT p50", "{:.3f}"),
    ("ttft_p99_s", "TTFT p99", "{:.3f}"),
    ("tpot_mean_s", "TPOT mean", "{:.4f}"),
    ("rebuffer_mean_s", "stall mean", "{:.3f}"),
    ("qoe_mean", "QoE", "{:.3f}"),
    ("goodput_rps", "goodput", "{:.2f}"),
    ("num_preemptions", "preempt", "{:d}"),
)


def format_table(summaries: Mapping[str, Summary]) -> str:
    """Rows = runs, columns = headline metrics (times in seconds)."""
    header = ["policy", "done/reqs", *(title for _, title, _ in TABLE_COLUMNS)]
    rows = [header]
    for name, summary in summaries.items():
        values = summary.to_dict()
        done = f"{values['num_completed']}/{values['num_requests']}"
        cells = [fmt.format(values[key]) for key, _, fmt in TABLE_COLUMNS]
        rows.append([name, done, *cells])
    return _aligned(rows)


def class_summaries(
    runs: Mapping[str, Sequence[RequestTrace]], config: MetricsConfig
) -> dict[str, Summary]:
    """Each run's consumption classes apart ("tokenflow reader", ...) when some run mixes
    classes; empty when every run has one class (the main table says it all)."""
    by_class = {
        f"{name} {cls}": summary
        for name, traces in runs.items()
        for cls, summary in summarize_by_class(traces, config).items()
    }
    return by_class if len(by_class) > len(runs) else {}


def _aligned(rows: list[list[str]]) -> str:
    """The rows as text: the first column left-aligned, the others right-aligned, a rule
    under the header row."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for index, row in enumerate(rows):
        first = row[0].ljust(widths[0])
        rest = (cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True))
        lines.append("  ".join([first, *rest]))
        if index == 0:
            lines.append("  ".join("-" * width for width in widths))
    return "\n".join(lines)


def report_records(
    summaries: Mapping[str, Summary],
    extra: Mapping[str, Mapping[str, float | int]] | None = None,
) -> list[dict[str, object]]:
    """One JSON-able object per run: `{"policy": name, **summary.to_dict()}`, then the run's
    `extra` numbers, if given (e.g. a simulated run's prefix hit rate)."""
    extra = extra or {}
    return [
        {"policy": name, **summary.to_dict(), **extra.get(name, {})}
        for name, summary in summaries.items()
    ]


def write_json(
    path: str | os.PathLike[str],
    summaries: Mapping[str, Summary],
    extra: Mapping[str, Mapping[str, float | int]] | None = None,
) -> None:
    """Write `report_records(summaries, extra)` as indented JSON."""
    with open(path, "w", encoding="utf-8") as file:
        json.dump(report_records(summaries, extra), file, indent=2)
        file.write("\n")


# -- plots --------------------------------------------------------------------------------------
def _ttfts_s(traces: Sequence[RequestTrace]) -> np.ndarray:
    return np.sort([t.token_times_s[0] - t.arrival_s for t in traces if t.token_times_s])


def _plot_ttft_cdf(ax: Axes, traces: Mapping[str, Sequence[RequestTrace]]) -> None:
    for name, run in traces.items():
        ttfts = _ttfts_s(run)
        if ttfts.size:
            ax.step(ttfts, np.arange(1, ttfts.size + 1) / ttfts.size, where="post", label=name)
    ax.set(title="TTFT CDF", xlabel="time to first token (s)", ylabel="fraction of requests")
    ax.grid(alpha=0.3)
    if ax.get_lines():
        ax.legend(fontsize="small")


def pick_timeline_requests(traces: Mapping[str, Sequence[RequestTrace]], count: int) -> list[str]:
    """`count` request ids present in every run, spread over arrival order (deterministic)."""
    runs = list(traces.values())
    if not runs:
        return []
    common = set.intersection(*({t.request_id for t in run if t.token_times_s} for run in runs))
    ordered = [t.request_id for t in sorted(runs[0], key=lambda t: (t.arrival_s, t.request_id))]
    candidates = [rid for rid in ordered if rid in common]
    if len(candidates) <= count:
        return candidates
    step = (len(candidates) - 1) / max(count - 1, 1)
    return [candidates[round(i * step)] for i in range(count)]


def _plot_timelines(
    ax: Axes, traces: Mapping[str, Sequence[RequestTrace]], request_ids: Sequence[str]
) -> None:
    styles = ("-", "--", ":", "-.")
    for run_index, (name, run) in enumerate(traces.items()):
        by_id = {t.request_id: t for t in run}
        for line_index, request_id in enumerate(request_ids):
            trace = by_id[request_id]
            start, end = trace.arrival_s, trace.token_times_s[-1]
            end += trace.num_output_tokens / trace.rate_tps  # until the reader is done
            times = np.linspace(start, end, 400)
            ax.plot(
                times,
                buffer_timeline(trace, times),
                color=f"C{run_index}",
                linestyle=styles[line_index % len(styles)],
                label=f"{name} {request_id}",
            )
    ax.set(title="reader buffer of a few requests", xlabel="time (s)", ylabel="tokens buffered")
    ax.grid(alpha=0.3)
    if request_ids:
        ax.legend(fontsize="x-small")


def _plot_bars(ax: Axes, summaries: Mapping[str, Summary], keys: Sequence[tuple[str, str]]) -> None:
    names = list(summaries)
    positions = np.arange(len(names))
    width = 0.8 / max(len(keys), 1)
    for index, (key, label) in enumerate(keys):
        values = [summaries[name].to_dict()[key] for name in names]
        ax.bar(positions + index * width, values, width, label=label)
    ax.set_xticks(positions + width * (len(keys) - 1) / 2, names)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize="small")


def plot_report(
    path: str | os.PathLike[str],
    summaries: Mapping[str, Summary],
    traces: Mapping[str, Sequence[RequestTrace]],
    *,
    num_timelines: int = 3,
) -> None:
    """Write a 2x2 PNG: TTFT CDF per run, buffer timelines, throughput bars, P99 TTFT bars."""
    figure = Figure(figsize=(13, 9), layout="constrained")
    FigureCanvasAgg(figure)
    (cdf, timeline), (throughput, ttft) = figure.subplots(2, 2)
    _plot_ttft_cdf(cdf, traces)
    _plot_timelines(timeline, traces, pick_timeline_requests(traces, num_timelines))
    _plot_bars(
        throughput,
        summaries,
        [("throughput_tps", "throughput"), ("effective_throughput_tps", "effective throughput")],
    )
    throughput.set(title="throughput", ylabel="tokens/s")
    _plot_bars(ttft, summaries, [("ttft_p99_s", "P99 TTFT"), ("ttft_mean_s", "mean TTFT")])
    ttft.set(title="time to first token", ylabel="seconds")
    figure.savefig(path, dpi=100)


# -- spread over seeds --------------------------------------------------------------------------
# The metrics every multi-seed report gives as median and min-max.
SPREAD_KEYS = (
    "ttft_mean_s",
    "ttft_p99_s",
    "rebuffer_mean_s",
    "rebuffer_p99_s",
    "qoe_mean",
    "effective_throughput_tps",
    "throughput_tps",
    "makespan_s",
)


@dataclass(frozen=True)
class Spread:
    """Median and range of one metric over repeated runs (e.g. workload seeds)."""

    median: float
    minimum: float
    maximum: float

    def to_dict(self) -> dict[str, float]:
        """{"median": ..., "min": ..., "max": ...}"""
        return {"median": self.median, "min": self.minimum, "max": self.maximum}

    def text(self, digits: int) -> str:
        """ "median [min-max]" with `digits` decimals."""
        return f"{self.median:.{digits}f} [{self.minimum:.{digits}f}-{self.maximum:.{digits}f}]"


def spread(values: Sequence[float]) -> Spread:
    """Median (the mean of the middle two for an even count), minimum and maximum."""
    if not values:
        raise ValueError("spread of no values")
    ordered = sorted(float(v) for v in values)
    return Spread(statistics.median(ordered), ordered[0], ordered[-1])


def aggregate(
    runs: Sequence[Mapping[str, float | int]], keys: Sequence[str] = SPREAD_KEYS
) -> dict[str, Spread]:
    """Per metric, the spread over `runs` (each a `Summary.to_dict()` or a JSON record)."""
    return {key: spread([run[key] for run in runs]) for key in keys}


# -- targets against a baseline ------------------------------------------------------------------
@dataclass(frozen=True)
class TargetCheck:
    """One target judged on the median over seeds of a paired comparison (the candidate's run
    against the baseline's on the same workload seed): a ratio, or a difference."""

    compared: Spread  # the per-seed ratios or differences, median [min-max]
    passed: bool
    target: str  # the bound as text, e.g. "<= 0.3x"

    @property
    def value(self) -> float:
        """The median over seeds."""
        return self.compared.median

    def to_dict(self) -> dict[str, object]:
        """{"value": median, "min": ..., "max": ..., "pass": ..., "target": ...}"""
        c = self.compared
        return {"value": c.median, "min": c.minimum, "max": c.maximum, "pass": self.passed,
                "target": self.target}  # fmt: skip


def stall_allowance_s(baseline_stall_s: float) -> float:
    """How much longer than the baseline's the mean stall may be: max(0.1 s, 10%)."""
    return max(0.1, 0.1 * baseline_stall_s)


def check_targets(
    candidate: Sequence[Mapping[str, float]],
    baseline: Sequence[Mapping[str, float]],
    p99_ttft_bound: float,
    min_effective_ratio: float | None = 1.3,
) -> dict[str, TargetCheck]:
    """The targets a policy is held to against a baseline (TokenFlow against FCFS): runs are
    summaries paired by position (the same workload seed).  Mean stall at most the baseline's +
    `stall_allowance_s`; P99 TTFT at most `p99_ttft_bound` x; QoE at least the baseline's; raw
    throughput >= 0.97x; effective throughput >= `min_effective_ratio` x (None: not a target)."""
    if len(candidate) != len(baseline) or not candidate:
        raise ValueError("check_targets needs the same number (> 0) of runs on both sides")
    pairs = list(zip(candidate, baseline, strict=True))

    def ratios(key: str) -> Spread:
        return spread([c[key] / b[key] if b[key] else math.inf for c, b in pairs])

    def differences(key: str) -> Spread:
        return spread([c[key] - b[key] for c, b in pairs])

    allow_s = stall_allowance_s(spread([b["rebuffer_mean_s"] for b in baseline]).median)
    stall, qoe = differences("rebuffer_mean_s"), differences("qoe_mean")
    p99, raw = ratios("ttft_p99_s"), ratios("throughput_tps")
    checks = {
        "mean_stall_s": TargetCheck(stall, stall.median <= allow_s, f"<= +{allow_s:.2f} s"),
        "p99_ttft": TargetCheck(p99, p99.median <= p99_ttft_bound, f"<= {p99_ttft_bound}x"),
        "qoe": TargetCheck(qoe, qoe.median >= 0.0, ">= +0"),
        "raw_tps": TargetCheck(raw, raw.median >= 0.97, ">= 0.97x"),
    }
    if min_effective_ratio is not None:
        eff = ratios("effective_throughput_tps")
        passed = eff.median >= min_effective_ratio
        checks["effective_tps"] = TargetCheck(eff, passed, f">= {min_effective_ratio}x")
    return checks


def format_targets_table(rows: Mapping[str, Mapping[str, TargetCheck]]) -> str:
    """Rows = workloads, columns = the targets: median [min-max] over seeds, bound, verdict."""
    names = [n for n in TARGET_COLUMNS if any(n in checks for checks in rows.values())]
    header = ["workload", *(TARGET_COLUMNS[n][0] for n in names)]
    table = [header]
    for workload, checks in rows.items():
        cells = [
            _target_cell(checks[n], TARGET_COLUMNS[n][1]) if n in checks else "" for n in names
        ]
        table.append([workload, *cells])
    return _aligned(table)


# target name -> (column title, format of its per-seed values)
TARGET_COLUMNS = {
    "mean_stall_s": ("stall - fcfs (s)", "+.3f"),
    "p99_ttft": ("P99 TTFT / fcfs", ".2f"),
    "qoe": ("QoE - fcfs", "+.3f"),
    "effective_tps": ("eff tok/s / fcfs", ".2f"),
    "raw_tps": ("tok/s / fcfs", ".2f"),
}


def _target_cell(check: TargetCheck, fmt: str) -> str:
    """ "median [min, max] ok" (or FAIL) over seeds."""
    c = check.compared
    verdict = "ok" if check.passed else "FAIL"
    return f"{c.median:{fmt}} [{c.minimum:{fmt}}, {c.maximum:{fmt}}] {verdict}"


# (summary key, column title, decimals) of the table over repeated runs
SPREAD_COLUMNS = (
    ("throughput_tps", "tok/s", 1),
    ("effective_throughput_tps", "eff tok/s", 1),
    ("ttft_mean_s", "TTFT mean", 2),
    ("ttft_p99_s", "TTFT p99", 2),
    ("rebuffer_mean_s", "stall mean", 2),
    ("rebuffer_p99_s", "stall p99", 2),
    ("qoe_mean", "QoE", 3),
)


def format_spread_table(rounds: Sequence[Mapping[str, Summary]], label: str = "policy") -> str:
    """Rows = the runs of the first round (servers, policies, settings: titled `label`),
    columns = headline metrics as "median [min-max]" over `rounds`, repeated runs of the same
    runs."""
    header = [label, "runs", *(title for _, title, _ in SPREAD_COLUMNS)]
    rows = [header]
    for name in rounds[0]:
        records = [one[name].to_dict() for one in rounds if name in one]
        spreads = aggregate(records, [key for key, _, _ in SPREAD_COLUMNS])
        cells = [spreads[key].text(digits) for key, _, digits in SPREAD_COLUMNS]
        rows.append([name, str(len(records)), *cells])
    return _aligned(rows)


def plot_spread(
    path: str | os.PathLike[str], title: str, spreads: Mapping[str, Mapping[str, Spread]]
) -> None:
    """TTFT against stall per policy: medians as points, min-max as error bars (two panels:
    means, and P99s).  `spreads` maps policy -> `aggregate()` of its runs."""
    figure = Figure(figsize=(12, 5), layout="constrained")
    FigureCanvasAgg(figure)
    panels = figure.subplots(1, 2)
    for ax, (ttft_key, stall_key, label) in zip(
        panels,
        (("ttft_mean_s", "rebuffer_mean_s", "mean"), ("ttft_p99_s", "rebuffer_p99_s", "P99")),
        strict=True,
    ):
        for index, (policy, metrics) in enumerate(spreads.items()):
            x, y = metrics[ttft_key], metrics[stall_key]
            ax.errorbar(
                [x.median],
                [y.median],
                xerr=[[x.median - x.minimum], [x.maximum - x.median]],
                yerr=[[y.median - y.minimum], [y.maximum - y.median]],
                fmt="o",
                capsize=4,
                color=f"C{index}",
                label=policy,
            )
        ax.set(
            title=f"{title}: {label} TTFT vs {label} stall",
            xlabel=f"{label} TTFT (s)",
            ylabel=f"{label} stall per request (s)",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    figure.savefig(path, dpi=100)


def write_marked_block(path: Path, begin: str, end: str, lines: list[str]) -> None:
    """Rewrite the block between the markers `begin` and `end` of the page at `path` with
    `lines` (the page is made with just the block if it does not exist); the rest is kept."""
    text = path.read_text() if path.exists() else f"{begin}\n{end}\n"
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    path.write_text(head + begin + "\n" + "\n".join(lines) + end + tail)
