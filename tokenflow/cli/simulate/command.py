"""`tokenflow simulate`: the paper's experiments on a cost model of real GPUs.

Every policy serves the identical workload on the same simulated deployment; one table (and
optionally JSON and a PNG) reports them side by side.
"""

from __future__ import annotations

import argparse
import os
import sys

from tokenflow.cli.simulate.deployment import paper_deployment
from tokenflow.cli.simulate.fleet import add_fleet_arguments, is_fleet, run_fleet_simulate
from tokenflow.cli.simulate.policy import add_simulate_policy_arguments
from tokenflow.cli.simulate.profile import (
    add_profile_arguments,
    check_profile_options,
    deployment_from_args,
    describe,
    profiled_workload,
    simulate_profiled,
)
from tokenflow.cli.workload import add_workload_arguments
from tokenflow.core.policies import POLICY_NAMES, parse_policy_names
from tokenflow.eval.metrics import MetricsConfig
from tokenflow.eval.report import class_summaries, format_table, write_json
from tokenflow.sim.runner import SimResult, extra_record, run_simulation
from tokenflow.sim.setups import setup_names


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    """The `tokenflow simulate` options."""
    parser.add_argument(
        "--setup",
        default=None,
        help=f"preset: {', '.join(setup_names())} (cpu-chat with --profile; workload "
        "options override it)",
    )
    parser.add_argument("--policies", default=",".join(POLICY_NAMES), help="comma-separated")
    hw = parser.add_argument_group("deployment (defaults: the setup's, else h200 / llama3-8b)")
    hw.add_argument("--gpu", default=None, help="h200, h100, a100, a6000, rtx4090")
    hw.add_argument("--model", default=None, help="llama3-8b, qwen2-7b, qwen2.5-32b")
    hw.add_argument("--memory-fraction", type=float, default=None, help="GPU memory for weights+KV")
    hw.add_argument("--host-memory-gib", type=float, default=None, help="host KV tier size")
    add_profile_arguments(parser)
    add_simulate_policy_arguments(parser.add_argument_group("tokenflow policy and ablations"))
    _add_cost_arguments(
        parser.add_argument_group("costs (defaults: the GPU preset's, see docs/results.md)")
    )
    add_workload_arguments(parser, default_kind=None)
    out = parser.add_argument_group("output")
    out.add_argument("--json", default=None, help="write one object per policy to this file")
    out.add_argument("--plot", default=None, help="write headline bars and timelines (PNG)")
    out.add_argument("--no-progress", action="store_true")
    add_fleet_arguments(parser)


def _add_cost_arguments(cost: argparse._ArgumentGroup) -> None:
    """Overrides of the GPU preset's copy and scheduler costs."""
    cost.add_argument("--pcie-gbps", type=float, default=None, help="effective GB/s per direction")
    cost.add_argument("--copy-latency-us", type=float, default=None, help="per copy operation")
    cost.add_argument(
        "--copy-pieces-per-block",
        type=int,
        default=None,
        help="copy operations per KV block (default 2 x layers; 1: block-contiguous layout)",
    )
    cost.add_argument(
        "--sched-overhead-ms",
        type=float,
        default=None,
        help="scheduler CPU ms per step, fixed part (default: the policy's calibrated one)",
    )
    cost.add_argument(
        "--sched-overhead-us-per-request",
        type=float,
        default=None,
        help="scheduler CPU us per step per unfinished request (with --sched-overhead-ms)",
    )


def run_simulate(args: argparse.Namespace) -> int:
    """`tokenflow simulate` with parsed arguments; returns the exit code."""
    if is_fleet(args):
        return run_fleet_simulate(args)
    progress = not args.no_progress
    try:
        policies = parse_policy_names(args.policies)
        for path in (args.json, args.plot):
            if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
                raise ValueError(f"cannot write {path}: its directory does not exist")
        check_profile_options(args)
        if args.profile is not None:
            workload = profiled_workload(args)
            run = deployment_from_args(args)
            results = [simulate_profiled(workload, p, run, progress) for p in policies]
            title = describe(run, len(workload))
        else:
            workload, config = paper_deployment(args)
            results = [run_simulation(workload, p, config, progress=progress) for p in policies]
            title = (
                f"{args.setup or 'custom'}: {len(workload)} requests, {config.model} on "
                f"{config.gpu}, memory fraction {config.memory_fraction:g}, host "
                f"{config.host_memory_gib:g} GiB"
            )
            if config.prefix_caching:
                title += f", prefix caching ({config.prefix_retention})"
    except (ValueError, OSError) as exc:
        print(f"tokenflow simulate: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    _report(args, results, title)
    return 0


def _report(args: argparse.Namespace, results: list[SimResult], title: str) -> None:
    summaries = {r.policy: r.summary for r in results}
    print(title)
    print(format_table(summaries))
    by_class = class_summaries({r.policy: r.traces for r in results}, MetricsConfig())
    if by_class:
        print(format_table(by_class))
    for r in results:
        print(
            f"  {r.policy}: {r.num_steps} steps, {r.num_loads} loads, {r.num_recomputes} "
            f"recomputes, {r.d2h_gib:.0f} GiB to host, {r.h2d_gib:.0f} GiB to device, "
            f"{r.scheduler_cpu_s:.1f} s scheduler CPU, simulated in {r.wall_s:.1f} s"
        )
        if r.prefix_cache is not None:
            print(f"    prefix hit rate {r.prefix_hit_rate:.1%} of the prompt tokens looked up")
        if r.sessions is not None and r.sessions.num_turns_unsent:
            print(
                f"    {r.sessions.num_sessions_ended} of {r.sessions.num_sessions} sessions "
                f"ended by a failed turn, {r.sessions.num_turns_unsent} turns not sent"
            )
    if args.json:
        extra = {r.policy: extra_record(r.prefix_cache, r.sessions) for r in results}
        write_json(args.json, summaries, extra)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        from tokenflow.eval.plots import plot_report

        plot_report(args.plot, summaries, {r.policy: r.traces for r in results}, title=title)
        print(f"wrote {args.plot}", file=sys.stderr)
