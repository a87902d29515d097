"""The headline metrics of a reading burst, ours against other servers: the ratio table of one
round and the spread of the ratios over rounds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tokenflow.eval.metrics import Summary
from tokenflow.eval.report import spread

# (label, attribute of Summary, True when higher is better)
HEADLINE = (
    ("P99 TTFT (s)", "ttft_p99_s", False),
    ("mean TTFT (s)", "ttft_mean_s", False),
    ("mean stall (s)", "rebuffer_mean_s", False),
    ("P99 stall (s)", "rebuffer_p99_s", False),
    ("effective throughput (tok/s)", "effective_throughput_tps", True),
    ("raw throughput (tok/s)", "throughput_tps", True),
    ("QoE (mean)", "qoe_mean", True),
)


def format_ratios(summaries: Mapping[str, Summary], ours: str, bases: Sequence[str]) -> str:
    """Each headline metric of every base and of `ours`, then ours / each base."""
    names = [*bases, ours]
    width = max(12, *(len(n) + 2 for n in names))
    head = "".join(f"{n:>{width}}" for n in names) + "".join(f"{'vs ' + b:>{width}}" for b in bases)
    lines = [f"{'metric':<30}{head}"]
    for label, attr, _ in HEADLINE:
        values = [getattr(summaries[n], attr) for n in names]
        ratios = [
            _ratio(getattr(summaries[ours], attr), getattr(summaries[b], attr)) for b in bases
        ]
        lines.append(
            f"{label:<30}"
            + "".join(f"{v:>{width}.3f}" for v in values)
            + "".join(f"{r:>{width}}" for r in ratios)
        )
    return "\n".join(lines)


def ratio_spreads(rounds: Sequence[Mapping[str, Summary]], ours: str, base: str) -> str:
    """`ours` / `base` for each headline metric: median [min-max] over the rounds."""
    lines = [f"{ours} / {base}, median [min-max] over {len(rounds)} rounds:"]
    for label, attr, _ in HEADLINE:
        ratios = [getattr(r[ours], attr) / getattr(r[base], attr) for r in rounds]
        lines.append(f"  {label:<30}{spread(ratios).text(2)}")
    return "\n".join(lines)


def _ratio(ours: float, base: float) -> str:
    return f"{ours / base:.2f}x" if base else "n/a"
