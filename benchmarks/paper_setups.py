"""All eight of the paper's setups in the simulator, every policy, one Markdown report.

    python benchmarks/paper_setups.py [--out docs/results] [--reuse]

For each setup it runs `tokenflow simulate --setup NAME --json ... --plot ...` (or, with
--reuse, reads the JSON already there), then writes `results.md`-ready tables: the headline
metrics per policy and tokenflow's change against fcfs in the same run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

SETUPS = ("4090-a", "4090-b", "4090-c", "4090-d", "h200-a", "h200-b", "h200-c", "h200-d")
COLUMNS = (
    ("throughput_tps", "tok/s", "{:.0f}"),
    ("effective_throughput_tps", "eff tok/s", "{:.0f}"),
    ("ttft_mean_s", "TTFT mean s", "{:.1f}"),
    ("ttft_p99_s", "TTFT P99 s", "{:.1f}"),
    ("rebuffer_mean_s", "stall mean s", "{:.1f}"),
    ("qoe_mean", "QoE", "{:.3f}"),
    ("num_preemptions", "preemptions", "{:d}"),
)


def run_setup(name: str, out: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "tokenflow.cli",
        "simulate",
        "--setup",
        name,
        "--no-progress",
        "--json",
        str(out / f"{name}.json"),
        "--plot",
        str(out / f"{name}.png"),
    ]
    subprocess.run(command, check=True)


def change(new: float, old: float) -> str:
    return "n/a" if old == 0 else f"{(new - old) / old * 100:+.1f}%"


def markdown(out: Path) -> str:
    lines = []
    summary = [
        "| setup | throughput | effective throughput | mean TTFT | P99 TTFT |",
        "|---" * 5 + "|",
    ]
    for name in SETUPS:
        records = {r["policy"]: r for r in json.loads((out / f"{name}.json").read_text())}
        lines.append(f"\n### {name}\n")
        lines.append("| policy | " + " | ".join(title for _, title, _ in COLUMNS) + " |")
        lines.append("|---" * (len(COLUMNS) + 1) + "|")
        for policy, r in records.items():
            cells = [fmt.format(r[key]) for key, _, fmt in COLUMNS]
            lines.append(f"| {policy} | " + " | ".join(cells) + " |")
        tf, fc = records["tokenflow"], records["fcfs"]
        summary.append(
            f"| {name} | {change(tf['throughput_tps'], fc['throughput_tps'])} | "
            f"{change(tf['effective_throughput_tps'], fc['effective_throughput_tps'])} | "
            f"{change(tf['ttft_mean_s'], fc['ttft_mean_s'])} | "
            f"{change(tf['ttft_p99_s'], fc['ttft_p99_s'])} |"
        )
    return "\n".join(summary) + "\n" + "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--reuse", action="store_true", help="read existing JSON, run nothing")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.reuse:
        for name in SETUPS:
            print(f"simulating {name} ...", file=sys.stderr)
            run_setup(name, out)
    (out / "tables.md").write_text(markdown(out))
    print(markdown(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
