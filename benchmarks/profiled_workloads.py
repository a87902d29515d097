"""TokenFlow against FCFS on the profiled CPU engine: the suite of `tokenflow.sim.suite`, several
workload seeds, in the simulator (`tokenflow simulate --profile`).

    python -m benchmarks.profiled_workloads --profile PROFILE.json [--seeds 3]
        [--workloads burst-40,long-prompts-20] [--slowdown 1.5] [--json out.json]
        [--markdown docs/results.md]

Prints per workload the readers' mean stall, P99 TTFT and QoE of both policies (medians over
the seeds), then the targets (`tokenflow.eval.report.check_targets`, runs paired by seed):
TokenFlow's stall minus FCFS's, its P99 TTFT over FCFS's, its QoE minus FCFS's and its raw
throughput over FCFS's, each median [min, max] over the seeds with its verdict.  With
`--markdown` both tables replace the block between this runner's markers in that file (not
with `--slowdown`, which scales every step and copy of the profile: another machine's speed).
A profile comes from `tokenflow profile --out PROFILE.json` (minutes; take it once); the one
docs/results.md reports is docs/results/cpu-profile.json (the 2-core development VM).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.paper_setups import ENGINE
from benchmarks.paper_setups import PROFILED as MARKERS
from tokenflow.calibrate.profile_file import load_profile
from tokenflow.eval.report import aggregate, check_targets, format_targets_table
from tokenflow.sim.suite import SUITE, run_suite_workload, suite_workload

POLICIES = ("fcfs", "tokenflow")
HEADING = """## TokenFlow against FCFS on the profiled CPU engine

The suite of `tokenflow/sim/suite.py` in `simulate --profile` on a profile of the 2-core
development VM (`tokenflow profile`), readers only (the class mix's eager and batch requests
are left out of stall, TTFT and QoE). First each policy's medians [min-max] over the seeds,
then TokenFlow against FCFS on the same seed, median [min, max] over the seeds, with the
verdicts: mean stall <= fcfs's + max(0.1 s, 10%), P99 TTFT <= fcfs's, QoE >= fcfs's, raw
throughput >= 0.97x."""
ABSOLUTE = (("rebuffer_mean_s", "stall mean s", 3), ("ttft_p99_s", "TTFT P99 s", 2),
            ("qoe_mean", "QoE", 3))  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, dict[str, list[dict]]]:
    """workload -> policy -> its runs by seed."""
    profile = load_profile(args.profile)
    if args.slowdown != 1.0:  # a slower (> 1) or faster machine: every step and copy scaled
        costs = profile.costs
        profile = replace(profile, costs=replace(
            costs, speed_factor=costs.speed_factor * args.slowdown,
            prefill_speed_factor=costs.prefill_speed_factor * args.slowdown,
        ))  # fmt: skip
    results: dict[str, dict[str, list[dict]]] = {}
    for name in args.workloads:
        workload = suite_workload(name)
        results[name] = {p: [] for p in POLICIES}
        for seed in range(args.seeds):
            for policy in POLICIES:
                started = time.perf_counter()
                s = run_suite_workload(profile, workload, policy, seed)
                results[name][policy].append(s)
                took_s = time.perf_counter() - started
                print(f"{name} seed {seed} {policy}: stall {s['rebuffer_mean_s']:.3f} s, P99 TTFT "
                      f"{s['ttft_p99_s']:.2f} s, QoE {s['qoe_mean']:.3f} ({took_s:.0f} s)",
                      file=sys.stderr, flush=True)  # fmt: skip
    return results


def absolute_table(results: dict[str, dict[str, list[dict]]]) -> list[str]:
    """Markdown: per workload, each policy's medians [min-max] of the readers' headline metrics."""
    titles = [f"{title} ({p})" for _, title, _ in ABSOLUTE for p in POLICIES]
    lines = ["| workload | " + " | ".join(titles) + " |", "|---" * (len(titles) + 1) + "|"]
    for name, by_policy in results.items():
        spreads = {p: aggregate(runs) for p, runs in by_policy.items()}
        cells = [spreads[p][key].text(d) for key, _, d in ABSOLUTE for p in POLICIES]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def targets_table(results: dict[str, dict[str, list[dict]]]) -> str:
    checks = {
        name: check_targets(runs["tokenflow"], runs["fcfs"], 1.0, min_effective_ratio=None)
        for name, runs in results.items()
    }
    return format_targets_table(checks)


def write_markdown(path: Path, command: str, absolute: list[str], targets: str) -> None:
    """Replace the block between MARKERS in `path` (new: before the real engine's section)."""
    block = "\n".join([MARKERS[0], HEADING, "", "```bash", command, "```", "", *absolute, "",
                       "```", targets, "```", MARKERS[1]])  # fmt: skip
    text = path.read_text()
    if MARKERS[0] in text and MARKERS[1] in text:
        before, rest = text.split(MARKERS[0], 1)
        text = before + block + rest.split(MARKERS[1], 1)[1]
    elif ENGINE[0] in text:
        before, rest = text.split(ENGINE[0], 1)
        text = before + block + "\n\n" + ENGINE[0] + rest
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, required=True, help="a `tokenflow profile` file")
    parser.add_argument("--seeds", type=int, default=3, help="workload seeds 0 .. N-1")
    parser.add_argument("--workloads", default=",".join(w.name for w in SUITE))
    parser.add_argument(
        "--slowdown", type=float, default=1.0, help="scale the profile's step and copy times"
    )
    parser.add_argument("--json", type=Path, default=None, help="write every run's summary here")
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    results = run(args)
    absolute, targets = absolute_table(results), targets_table(results)
    print("\n".join(absolute) + "\n\n" + targets)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    if args.markdown and args.slowdown == 1.0:
        command = (
            f"python -m benchmarks.profiled_workloads --profile {args.profile} "
            f"--seeds {args.seeds} --markdown {args.markdown}"
        )
        write_markdown(args.markdown, command, absolute, targets)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
