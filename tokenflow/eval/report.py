"""Side-by-side reports of runs: a text table and a JSON file (the PNGs: `plots.py`).

Everything takes `dict[str, Summary]` (run or policy name -> its summary), so the simulator
reports its runs with the same code as the HTTP benchmark.  Repeated runs (seeds) are
summarised as median and min-max by `aggregate` and judged against a baseline's by
`check_targets`.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenflow.eval.metrics import (
    MetricsConfig,
    RequestTrace,
    Summary,
    summarize_by_class,
)

# (summary key, column title, format)
TABLE_COLUMNS = (
    ("throughput_tps", "tok/s", "{:.1f}"),
    ("effective_throughput_tps", "eff tok/s", "{:.1f}"),
    ("ttft_mean_s", "TTFT mean s", "{:.3f}"),
    ("ttft_p50_s", "TTFT p50 s", "{:.3f}"),
    ("ttft_p99_s", "TTFT p99 s", "{:.3f}"),
    ("tpot_mean_s", "TPOT mean s", "{:.4f}"),
    ("rebuffer_mean_s", "stall mean s", "{:.3f}"),
    ("qoe_mean", "QoE 0-1", "{:.3f}"),
    ("goodput_rps", "goodput req/s", "{:.2f}"),
    ("num_preemptions", "preemptions", "{:d}"),
)


def format_table(summaries: Mapping[str, Summary]) -> str:
    """Rows = runs, columns = headline metrics, each header with its unit."""
    header = ["policy", "done/reqs", *(title for _, title, _ in TABLE_COLUMNS)]
    rows = [header]
    for name, summary in summaries.items():
        values = summary.to_dict()
        done = f"{values['num_completed']}/{values['num_requests']}"
        cells = [fmt.format(values[key]) for key, _, fmt in TABLE_COLUMNS]
        rows.append([name, done, *cells])
    return _aligned(rows)


def goodput_note(config: MetricsConfig) -> str:
    """What the goodput column counts, under the table."""
    return (
        f"goodput: requests/s that met TTFT <= {config.slo_ttft_s:g} s and TPOT <= "
        f"{config.slo_tpot_s:g} s (`bench --goodput ttft:MS tpot:MS`)"
    )


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


def paired_ratios(
    candidate: Sequence[Mapping[str, float]], baseline: Sequence[Mapping[str, float]], key: str
) -> Spread:
    """`key`'s candidate-over-baseline ratio per pair of runs (paired by position; inf over a
    zero), median [min-max]."""
    pairs = zip(candidate, baseline, strict=True)
    return spread([c[key] / b[key] if b[key] else math.inf for c, b in pairs])


def paired_differences(
    candidate: Sequence[Mapping[str, float]], baseline: Sequence[Mapping[str, float]], key: str
) -> Spread:
    """`key`'s candidate-minus-baseline difference per pair of runs, median [min-max]."""
    return spread([c[key] - b[key] for c, b in zip(candidate, baseline, strict=True)])


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

    def ratios(key: str) -> Spread:
        return paired_ratios(candidate, baseline, key)

    allow_s = stall_allowance_s(spread([b["rebuffer_mean_s"] for b in baseline]).median)
    stall = paired_differences(candidate, baseline, "rebuffer_mean_s")
    qoe = paired_differences(candidate, baseline, "qoe_mean")
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


def write_marked_block(path: Path, begin: str, end: str, lines: list[str]) -> None:
    """Rewrite the block between the markers `begin` and `end` of the page at `path` with
    `lines` (the page is made with just the block if it does not exist); the rest is kept."""
    text = path.read_text() if path.exists() else f"{begin}\n{end}\n"
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    path.write_text(head + begin + "\n" + "\n".join(lines) + end + tail)
