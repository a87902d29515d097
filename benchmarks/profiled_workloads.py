"""TokenFlow against FCFS on the CPU suite of `tokenflow.sim.suite`: several workload seeds in
the simulator on a profile of the real engine (`tokenflow simulate --profile`), or, with
`--real`, rounds A B B A on the real engine itself (a fresh `tokenflow serve` per run).

    python -m benchmarks.profiled_workloads --profile PROFILE.json [--seeds 3]
        [--workloads burst-40,long-prompts-20] [--slowdown 1.5] [--json out.json]
        [--knob prefill_stall_s=0.25] [--markdown docs/results.md]
    python -m benchmarks.profiled_workloads --real [--rounds 2]
        [--workloads long-prompts-20,class-mix-40,readme-burst] [--serve-args '--num-threads 1']
        [--busy-loops 2] [--json out.json]

Prints per workload the readers' mean stall, P99 TTFT and QoE of both policies (medians over
the seeds), then the targets (`tokenflow.eval.report.check_targets`, runs paired by seed):
TokenFlow's stall minus FCFS's, its P99 TTFT over FCFS's, its QoE minus FCFS's and its raw
throughput over FCFS's, each median [min, max] over the seeds with its verdict.  With
`--markdown` both tables replace the block between this runner's markers in that file (not
with `--slowdown`, which scales every step and copy of the profile: another machine's speed,
nor with `--knob`, which sets a TokenFlow knob of `POLICY_KNOBS` off `serve`'s default).
A profile comes from `tokenflow profile --out PROFILE.json` (minutes; take it once); the one
docs/results.md reports is docs/results/cpu-profile.json (the 2-core development VM).  Besides
the suite's workloads both modes know `readme-burst`, the README's overload burst, and
`readme-readers`, the README's first burst (20 readers on the serve defaults).

`--real` plays each workload's seed-0 requests on the embedded model, both policies per round
in the order A B B A (`benchmarks.lib.rounds`), with the workload's device KV tier, and pairs
the runs by round for the same targets.  `--serve-args` passes more options to both servers:
'--num-threads 1' runs the engine on one core, a CPU about half as fast, where the slowed
profile's cases show.  `--busy-loops N` starts N spinning processes before the first server
and stops them after the last: a machine slower than the engine believes, because others take
its cores.  With `--busy-loops` or `--slowdown` the overload targets are printed too (stall <=
0.5x FCFS's, QoE >= FCFS's + 0.05).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from benchmarks.lib.rounds import count_arg, run_rounds
from benchmarks.paper_setups import ENGINE
from benchmarks.paper_setups import PROFILED as MARKERS
from tokenflow.calibrate.profile_file import load_profile
from tokenflow.core.config import POLICY_KNOBS, with_knobs
from tokenflow.eval.client import ClientConfig, run_workload
from tokenflow.eval.fidelity import Workload
from tokenflow.eval.local_server import local_server
from tokenflow.eval.report import (
    aggregate,
    check_targets,
    format_targets_table,
    paired_differences,
    paired_ratios,
)
from tokenflow.eval.workload import LengthDist, RateMix, WorkloadSpec, generate
from tokenflow.sim.suite import SUITE, run_suite_workload, suite_score

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
    if args.knob:  # TokenFlow's knobs other than serve's defaults (FCFS has none)
        profile = replace(profile, tokenflow=with_knobs(profile.tokenflow, dict(args.knob)))
    results: dict[str, dict[str, list[dict]]] = {}
    for name in args.workloads:
        workload = named_workload(name)
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


def _readme_burst(name: str, n: int, prompt: str, output: str, device_kv_tokens: int) -> Workload:
    """A burst of `n` readers at 2 and 4 tok/s (half each), as the README's `tokenflow bench`
    commands play them."""
    description = (
        f"burst of {n}, prompt {prompt} / output {output}, readers 2-4 tok/s, device KV "
        f"{device_kv_tokens} tokens"
    )
    spec = WorkloadSpec(
        kind="burst",
        num_requests=n,
        prompt=LengthDist.parse(prompt, minimum=8),
        output=LengthDist.parse(output, minimum=8),
        rates=RateMix.parse("2:0.5,4:0.5"),
    )
    return Workload(
        name=name, description=description, spec=spec, device_kv_tokens=device_kv_tokens
    )


# The README's overload burst (`tokenflow bench --compare fcfs,tokenflow ...` there), and its
# first burst: 20 readers on `make serve`'s defaults (an 8192-token device tier).
README_BURST = _readme_burst("readme-burst", 16, "128:0", "192:0", 1664)
README_READERS = _readme_burst("readme-readers", 20, "64:16", "200:40", 8192)
NAMED_WORKLOADS = {w.name: w for w in (*SUITE, README_BURST, README_READERS)}


def named_workload(name: str) -> Workload:
    """A workload of the suite, or one of the README's bursts (ValueError naming them all for
    any other name)."""
    if name not in NAMED_WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {list(NAMED_WORKLOADS)}")
    return NAMED_WORKLOADS[name]


@contextmanager
def busy_loops(count: int) -> Iterator[list[subprocess.Popen]]:
    """`count` processes that spin on a core each until the block ends."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield loops
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def run_real_once(workload: Workload, policy: str, extra_serve_args: Sequence[str] = ()) -> dict:
    """One run of `workload` (seed 0) on a fresh real server (`tokenflow serve` with
    `extra_serve_args` too), scored as a simulated one (`suite_score`)."""
    requests = generate(replace(workload.spec, seed=0))
    serve_args = ["--device-kv-tokens", str(workload.device_kv_tokens), *extra_serve_args]
    with local_server(policy, serve_args) as url:
        config = ClientConfig(url=url, show_progress=False, timeout_s=1800.0)
        run = asyncio.run(run_workload(requests, config, name=policy))
    if run.num_failed:
        raise SystemExit(f"{workload.name} {policy}: {run.num_failed} requests failed")
    # (the server is fresh: what it counted during the run is all it ever counted)
    return {**suite_score(run.traces), "num_preemptions": run.num_preemptions}


def run_real(args: argparse.Namespace) -> dict[str, dict[str, list[dict]]]:
    """workload -> policy -> its runs by round (A B B A)."""
    results: dict[str, dict[str, list[dict]]] = {}
    for name in args.workloads:
        workload = named_workload(name)

        def measure(round_index: int, policy: str, workload: Workload = workload) -> dict:
            started = time.perf_counter()
            s = run_real_once(workload, policy, shlex.split(args.serve_args))
            took_s = time.perf_counter() - started
            print(f"{workload.name} round {round_index} {policy}: stall "
                  f"{s['rebuffer_mean_s']:.3f} s, P99 TTFT {s['ttft_p99_s']:.2f} s, QoE "
                  f"{s['qoe_mean']:.3f}, {s['throughput_tps']:.1f} tok/s ({took_s:.0f} s)",
                  file=sys.stderr, flush=True)  # fmt: skip
            return s

        with busy_loops(args.busy_loops):
            rounds = run_rounds(POLICIES, args.rounds, measure)
        results[name] = {p: [r[p] for r in rounds] for p in POLICIES}
    return results


def knob(text: str) -> tuple[str, float]:
    """`NAME=VALUE`: a TokenFlow knob (`POLICY_KNOBS`, as `serve` spells it with underscores)."""
    name, sep, value = text.partition("=")
    if not sep or name not in POLICY_KNOBS:
        raise argparse.ArgumentTypeError(f"want NAME=VALUE, NAME one of {sorted(POLICY_KNOBS)}")
    return name, float(value)


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


def overload_table(results: dict[str, dict[str, list[dict]]]) -> str:
    """The overload targets, runs paired by position: TokenFlow's mean stall over FCFS's (at most
    0.5x) and its QoE minus FCFS's (at least +0.05), median [min, max] with the verdicts."""
    lines = ["| workload | stall ratio (<= 0.5x) | QoE difference (>= +0.05) |", "|---|---|---|"]
    for name, runs in results.items():
        stall = paired_ratios(runs["tokenflow"], runs["fcfs"], "rebuffer_mean_s")
        qoe = paired_differences(runs["tokenflow"], runs["fcfs"], "qoe_mean")
        stall_ok = "holds" if stall.median <= 0.5 else "fails"
        qoe_ok = "holds" if qoe.median >= 0.05 else "fails"
        lines.append(f"| {name} | {stall.text(2)}x {stall_ok} | {qoe.text(3)} {qoe_ok} |")
    return "\n".join(lines)


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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked before any run: `args.workloads` a list of known names."""
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, default=None, help="a `tokenflow profile` file")
    parser.add_argument("--seeds", type=count_arg, default=3, help="workload seeds 0 .. N-1")
    parser.add_argument(
        "--real", action="store_true", help="the real engine, rounds A B B A, not a profile"
    )
    parser.add_argument("--rounds", type=count_arg, default=2, help="with --real: rounds of A B")
    parser.add_argument("--workloads", default=None, help="comma-separated (default: the suite)")
    parser.add_argument(
        "--slowdown", type=float, default=1.0, help="scale the profile's step and copy times"
    )
    parser.add_argument(
        "--serve-args",
        default="",
        help="with --real: more `tokenflow serve` options for both servers (e.g. "
        "'--num-threads 1': a CPU about half as fast)",
    )
    parser.add_argument(
        "--busy-loops",
        type=int,
        default=0,
        help="with --real: spinning processes started before the servers (a slower machine)",
    )
    parser.add_argument(
        "--knob",
        type=knob,
        action="append",
        default=[],
        help="simulated TokenFlow with this knob (NAME=VALUE, repeatable): prefill_stall_s=0.25",
    )
    parser.add_argument("--json", type=Path, default=None, help="write every run's summary here")
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.real == (args.profile is not None):
        parser.error("give either --profile PROFILE.json or --real")
    if args.real and args.knob:
        parser.error("--knob is for the simulator; the real servers take --serve-args")
    default = "long-prompts-20,class-mix-40,readme-burst" if args.real else None
    names = args.workloads or default or ",".join(w.name for w in SUITE)
    args.workloads = [w for w in names.split(",") if w]
    for name in args.workloads:
        try:
            named_workload(name)
        except ValueError as error:
            parser.error(str(error))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run_real(args) if args.real else run(args)
    absolute, targets = absolute_table(results), targets_table(results)
    print("\n".join(absolute) + "\n\n" + targets)
    if args.busy_loops or args.slowdown != 1.0:
        print("\n" + overload_table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    if args.markdown and args.slowdown == 1.0 and not (args.real or args.knob):
        command = (
            f"python -m benchmarks.profiled_workloads --profile {args.profile} "
            f"--seeds {args.seeds} --markdown {args.markdown}"
        )
        write_markdown(args.markdown, command, absolute, targets)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
