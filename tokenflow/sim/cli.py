"""`tokenflow simulate`: the paper's experiments on a cost model of real GPUs.

Every policy serves the identical workload on the same simulated deployment; one table (and
optionally JSON and a PNG) reports them side by side.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

from tokenflow.core.config import TokenFlowConfig
from tokenflow.core.policies import POLICY_NAMES, parse_policy_names
from tokenflow.metrics import MetricsConfig
from tokenflow.report import class_summaries, format_table, plot_report, write_json
from tokenflow.sim.cost_model import CostModelConfig
from tokenflow.sim.fleet_cli import add_fleet_arguments, is_fleet, run_fleet_simulate
from tokenflow.sim.overhead import SchedulerOverhead
from tokenflow.sim.profile_cli import (
    add_profile_arguments,
    check_profile_options,
    deployment_from_args,
    describe,
    simulate_profiled,
)
from tokenflow.sim.runner import SimConfig, SimResult, run_simulation
from tokenflow.sim.setups import get_setup, paper_setups
from tokenflow.workload import WorkloadRequest, generate
from tokenflow.workload_cli import add_workload_arguments, workload_spec_from_args


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    """The `tokenflow simulate` options."""
    parser.add_argument(
        "--setup",
        default=None,
        help=f"paper preset: {', '.join(paper_setups())} (workload options override it)",
    )
    parser.add_argument("--policies", default=",".join(POLICY_NAMES), help="comma-separated")
    hw = parser.add_argument_group("deployment (defaults: the setup's, else h200 / llama3-8b)")
    hw.add_argument("--gpu", default=None, help="h200, h100, a100, a6000, rtx4090")
    hw.add_argument("--model", default=None, help="llama3-8b, qwen2-7b, qwen2.5-32b")
    hw.add_argument("--memory-fraction", type=float, default=None, help="GPU memory for weights+KV")
    hw.add_argument("--host-memory-gib", type=float, default=None, help="host KV tier size")
    add_profile_arguments(parser)
    _add_policy_arguments(parser.add_argument_group("tokenflow policy and ablations"))
    _add_cost_arguments(
        parser.add_argument_group("costs (defaults: the GPU preset's, see docs/results.md)")
    )
    add_workload_arguments(parser, default_kind=None)
    out = parser.add_argument_group("output")
    out.add_argument("--json", default=None, help="write one object per policy to this file")
    out.add_argument("--plot", default=None, help="write headline bars and timelines (PNG)")
    out.add_argument("--no-progress", action="store_true")
    add_fleet_arguments(parser)


# The policy's knobs as `serve` names them: option -> TokenFlowConfig field.  The same names
# as serve's options, so a config file from `tokenflow tune` reads the same here.
POLICY_OPTIONS = {
    "schedule_interval": "schedule_interval_s",
    "mu": "buffer_conservativeness",
    "critical_slack": "critical_slack_s",
    "new_token_ratio": "init_new_token_ratio",
    "capacity_headroom": "capacity_headroom",
    "queue_headroom": "queue_headroom",
    "max_stall_s": "max_stall_s",
}
_POLICY_HELP = {
    "schedule_interval": "seconds between TokenFlow's decisions under stress",
    "mu": "buffer conservativeness: a pause needs mu x a round trip of buffer",
    "critical_slack": "seconds of buffer that mean stress, and a pause's margin",
    "new_token_ratio": "admission reserves this share of each resident's remaining output",
    "capacity_headroom": "admit while reading rates stay <= this share of capacity",
    "queue_headroom": "admit the whole queue while its rates stay <= this share of capacity",
    "max_stall_s": "a stream stalled this long goes on the device first",
}


def _add_policy_arguments(tf: argparse._ArgumentGroup) -> None:
    """TokenFlow's options and the ablations of its mechanism."""
    for dest, field_name in POLICY_OPTIONS.items():
        core_default = getattr(TokenFlowConfig(), field_name)
        tf.add_argument(
            f"--{dest.replace('_', '-')}",
            type=float,
            default=None,
            help=f"{_POLICY_HELP[dest]} (default: serve's with --profile, else the core's "
            f"{core_default:g})",
        )
    tf.add_argument("--no-offload", action="store_true", help="ablation: preempt by recompute only")
    tf.add_argument(
        "--no-write-through",
        action="store_true",
        help="ablation: write-back, the preempting step waits for its eviction",
    )
    tf.add_argument(
        "--no-load-evict-overlap",
        action="store_true",
        help="ablation: a victim's memory is reusable only once its eviction completes",
    )


def tokenflow_config(args: argparse.Namespace, base: TokenFlowConfig) -> TokenFlowConfig:
    """`base` with the policy options given on the command line."""
    given = {
        field: getattr(args, dest)
        for dest, field in POLICY_OPTIONS.items()
        if getattr(args, dest) is not None
    }
    return replace(base, **given)


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


def _deployment(args: argparse.Namespace) -> tuple[list[WorkloadRequest], SimConfig]:
    setup = get_setup(args.setup, seed=args.seed) if args.setup else None
    if args.workload is not None or setup is None:
        if args.workload is None:
            raise ValueError("give --setup NAME or a --workload")
        workload = generate(workload_spec_from_args(args))
    else:
        workload = generate(setup.workload)
    tokenflow = tokenflow_config(args, TokenFlowConfig())
    config = SimConfig(
        gpu=args.gpu or (setup.gpu if setup else "h200"),
        model=args.model or (setup.model if setup else "llama3-8b"),
        memory_fraction=args.memory_fraction or (setup.memory_fraction if setup else 0.3),
        host_memory_gib=args.host_memory_gib or (setup.host_memory_gib if setup else 128.0),
        offload=not args.no_offload,
        write_through=not args.no_write_through,
        overlap_load_evict=not args.no_load_evict_overlap,
        cost=CostModelConfig(
            pcie_bytes_per_s=args.pcie_gbps * 1e9 if args.pcie_gbps else None,
            copy_latency_s=None if args.copy_latency_us is None else args.copy_latency_us * 1e-6,
            copy_pieces_per_block=args.copy_pieces_per_block,
        ),
        scheduler_overhead=_overhead(args),
    )
    return workload, replace(config, tokenflow=tokenflow)


def _overhead(args: argparse.Namespace) -> SchedulerOverhead | None:
    if args.sched_overhead_ms is None and args.sched_overhead_us_per_request is None:
        return None
    return SchedulerOverhead(
        fixed_s=(args.sched_overhead_ms or 0.0) * 1e-3,
        per_request_s=(args.sched_overhead_us_per_request or 0.0) * 1e-6,
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
            workload = generate(workload_spec_from_args(args))
            run = deployment_from_args(args, tokenflow_config)
            results = [simulate_profiled(workload, p, run, progress) for p in policies]
            title = describe(run, len(workload))
        else:
            workload, config = _deployment(args)
            results = [run_simulation(workload, p, config, progress=progress) for p in policies]
            title = (
                f"{args.setup or 'custom'}: {len(workload)} requests, {config.model} on "
                f"{config.gpu}, memory fraction {config.memory_fraction:g}"
            )
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
    if args.json:
        write_json(args.json, summaries)
    if args.plot:
        plot_report(args.plot, summaries, {r.policy: r.traces for r in results})
