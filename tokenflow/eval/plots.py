"""The PNGs of a report: one run set side by side (`plot_report`: `bench --plot`,
`simulate --plot`), and policies over seeds (`plot_spread`).

matplotlib's Agg canvas is used directly (no pyplot, no global backend switch), and this module
is imported only when a plot is written: matplotlib takes a second to import, and the command
line answers `--help` without it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from tokenflow.eval.metrics import RequestTrace, Summary, buffer_timeline
from tokenflow.eval.report import Spread


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
    title: str = "",
    num_timelines: int = 3,
) -> None:
    """Write a 2x3 PNG under `title` (the setup, model and runs): TTFT CDF per run, buffer
    timelines, throughput, TTFT, stall and QoE bars: the readers' side (stall, QoE) beside the
    metrics every server reports."""
    figure = Figure(figsize=(18, 9), layout="constrained")
    FigureCanvasAgg(figure)
    figure.suptitle(title or ", ".join(summaries))
    (cdf, timeline, qoe), (throughput, ttft, stall) = figure.subplots(2, 3)
    _plot_ttft_cdf(cdf, traces)
    _plot_timelines(timeline, traces, pick_timeline_requests(traces, num_timelines))
    for ax, keys, (panel, unit) in (
        (throughput, _THROUGHPUT, ("throughput", "tokens/s")),
        (ttft, _TTFT, ("time to first token", "seconds")),
        (stall, _STALL, ("reader stall per request", "seconds")),
        (qoe, _QOE, ("reader QoE (1: every token on time)", "QoE")),
    ):
        _plot_bars(ax, summaries, keys)
        ax.set(title=panel, ylabel=unit)
    figure.savefig(path, dpi=100)


# (summary key, label) of each bar panel
_THROUGHPUT = (("throughput_tps", "throughput"), ("effective_throughput_tps", "effective"))
_TTFT = (("ttft_p99_s", "P99 TTFT"), ("ttft_mean_s", "mean TTFT"))
_STALL = (("rebuffer_p99_s", "P99 stall"), ("rebuffer_mean_s", "mean stall"))
_QOE = (("qoe_mean", "mean QoE"),)


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
