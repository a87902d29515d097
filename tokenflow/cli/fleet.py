"""`tokenflow simulate --replicas N --router R` (or `--routers a,b,c`, or `--setup fleet-...`):
a fleet of simulated engines behind each router on the identical workload, one table."""

from __future__ import annotations

import argparse
import sys

from tokenflow.cli.sim_deployment import paper_deployment
from tokenflow.cli.workload import workload_spec_from_args
from tokenflow.core.routing import ROUTER_NAMES, parse_router_names
from tokenflow.eval.report import format_table, write_json
from tokenflow.eval.workload import generate
from tokenflow.sim.fleet import (
    FleetConfig,
    FleetResult,
    fleet_replicas,
    fleet_setups,
    get_fleet_setup,
    run_fleet,
)


def add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    """The fleet options of `tokenflow simulate`."""
    fleet = parser.add_argument_group(
        f"fleet (presets: {', '.join(fleet_setups())}; docs/replicas.md)"
    )
    fleet.add_argument("--replicas", type=int, default=1, help="simulated engines (default 1)")
    fleet.add_argument("--router", default=None, help=f"one of {', '.join(ROUTER_NAMES)}")
    fleet.add_argument("--routers", default=None, help="comma-separated, side by side")
    fleet.add_argument(
        "--report-period-s",
        type=float,
        default=1.0,
        help="replicas report their load this often; the router reads reports this old",
    )
    fleet.add_argument("--replica-policy", default="tokenflow", help="every replica's policy")


def is_fleet(args: argparse.Namespace) -> bool:
    """Whether the arguments ask for a fleet rather than a single engine."""
    setup = args.setup or ""
    return args.replicas > 1 or bool(args.router or args.routers) or setup.startswith("fleet-")


def run_fleet_simulate(args: argparse.Namespace) -> int:
    """The fleet form of `tokenflow simulate`; returns the exit code."""

    try:
        routers = parse_router_names(args.routers or args.router or ",".join(ROUTER_NAMES))
        if args.setup and args.setup.startswith("fleet-"):
            setup = get_fleet_setup(args.setup, seed=args.seed)
            base_args = argparse.Namespace(**{**vars(args), "setup": None, "workload": "burst"})
            _, base = paper_deployment(base_args)
            replicas = fleet_replicas(setup, base)
            spec = setup.workload if args.workload is None else workload_spec_from_args(args)
            workload, title = generate(spec), f"{setup.name} ({setup.description})"
        else:
            workload, base = paper_deployment(args)
            replicas = (base,) * max(args.replicas, 1)
            title = f"{args.setup or 'custom'} on {len(replicas)} x {base.gpu}"
        config = FleetConfig(replicas, args.replica_policy, args.report_period_s)
        results = [run_fleet(workload, name, config) for name in routers]
    except (ValueError, OSError) as exc:
        print(f"tokenflow simulate: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    _report(args, title, len(workload), results)
    return 0


def _report(
    args: argparse.Namespace, title: str, num_requests: int, results: list[FleetResult]
) -> None:
    summaries = {r.router: r.summary for r in results}
    print(f"{title}: {num_requests} requests, reports every {args.report_period_s:g} s")
    print(format_table(summaries).replace("policy", "router", 1))
    for r in results:
        p99s = " ".join(f"{t:.1f}" for t in r.ttft_p99_by_replica_s)
        print(
            f"  {r.router}: requests per replica {list(r.num_requests_by_replica)}, "
            f"P99 TTFT per replica {p99s} s, simulated in {r.wall_s:.1f} s"
        )
    if args.json:
        write_json(args.json, summaries)
