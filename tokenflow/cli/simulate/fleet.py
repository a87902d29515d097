"""`tokenflow simulate --replicas N --router R` (or `--routers a,b,c`, or `--setup fleet-...`):
a fleet of simulated engines behind each router on the identical workload, one table.
`--join`, `--leave` and `--restart` change the fleet during the run; `--migrate` moves
requests between replicas (tokenflow/core/rebalance.py)."""

from __future__ import annotations

import argparse
import sys

from tokenflow.cli.simulate.deployment import paper_deployment
from tokenflow.cli.simulate.profile import (
    check_profile_options,
    deployment_from_args,
    profiled_workload,
)
from tokenflow.cli.workload import workload_spec_from_args
from tokenflow.core.migration import MOVE_LATENCY_S
from tokenflow.core.rebalance import MigrateMode
from tokenflow.core.routing import ROUTER_NAMES, parse_router_names
from tokenflow.eval.report import format_table, write_json
from tokenflow.eval.workload import generate
from tokenflow.sim.fleet import (
    FleetConfig,
    FleetResult,
    ReplicaJoined,
    ReplicaLeft,
    ReplicaSpec,
    run_fleet,
)
from tokenflow.sim.fleet_setups import fleet_changes, fleet_replicas, fleet_setups, get_fleet_setup
from tokenflow.sim.runner import extra_record


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
    fleet.add_argument(
        "--migrate",
        choices=[m.value for m in MigrateMode],
        default=MigrateMode.OFF.value,
        help="what moves between replicas: nothing, queued requests, or queued requests and "
        "paused streams (and a leaving replica's running ones); default off",
    )
    fleet.add_argument(
        "--move-latency-s",
        type=float,
        default=MOVE_LATENCY_S,
        help="what a move takes beyond the target's recompute (default: measured on Ray "
        f"Serve, {MOVE_LATENCY_S:g} s)",
    )
    fleet.add_argument(
        "--join", default=None, help="replicas joining: T[xN],... (N copies of the first at T s)"
    )
    fleet.add_argument(
        "--leave", default=None, help="replicas told to stop: T:I,... (replica-I at T s)"
    )
    fleet.add_argument(
        "--restart",
        default=None,
        help="replicas restarted: T:I,... (replica-I leaves at T s, a fresh copy joins)",
    )


def is_fleet(args: argparse.Namespace) -> bool:
    """Whether the arguments ask for a fleet rather than a single engine."""
    setup = args.setup or ""
    return args.replicas > 1 or bool(args.router or args.routers) or setup.startswith("fleet-")


def run_fleet_simulate(args: argparse.Namespace) -> int:
    """The fleet form of `tokenflow simulate`; returns the exit code."""

    try:
        routers = parse_router_names(args.routers or args.router or ",".join(ROUTER_NAMES))
        check_profile_options(args)
        replicas: tuple[ReplicaSpec, ...]
        if args.profile is not None:
            run = deployment_from_args(args)
            workload = profiled_workload(args)
            replicas = (run.deployment,) * max(args.replicas, 1)
            preset_changes = ()
            title = f"profile {args.profile} on {len(replicas)} replicas"
        elif args.setup and args.setup.startswith("fleet-"):
            setup = get_fleet_setup(args.setup, seed=args.seed)
            base_args = argparse.Namespace(**{**vars(args), "setup": None, "workload": "burst"})
            _, base = paper_deployment(base_args)
            replicas = fleet_replicas(setup, base)
            preset_changes = fleet_changes(setup, base)
            spec = setup.workload if args.workload is None else workload_spec_from_args(args)
            workload, title = generate(spec), f"{setup.name} ({setup.description})"
        else:
            workload, base = paper_deployment(args)
            replicas = (base,) * max(args.replicas, 1)
            preset_changes = ()
            title = f"{args.setup or 'custom'} on {len(replicas)} x {base.gpu}"
        changes = parse_changes(args, replicas) or preset_changes
        config = FleetConfig(
            replicas,
            args.replica_policy,
            args.report_period_s,
            changes=changes,
            migrate=MigrateMode(args.migrate),
            move_latency_s=args.move_latency_s,
        )
        results = [run_fleet(workload, name, config) for name in routers]
    except (ValueError, OSError) as exc:
        print(f"tokenflow simulate: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    _report(args, title, len(workload), results)
    return 0


def parse_changes(
    args: argparse.Namespace, replicas: tuple[ReplicaSpec, ...]
) -> tuple[ReplicaJoined | ReplicaLeft, ...]:
    """The fleet changes `--join`, `--leave` and `--restart` give (a joining replica is a
    copy of the first; a restarted one, of itself); ValueError naming the bad option."""
    changes: list[ReplicaJoined | ReplicaLeft] = []
    for item in _items(args.join):
        at, _, count = item.partition("x")
        at_s, num = _number("--join", item, at), int(_number("--join", item, count or "1"))
        changes += [ReplicaJoined(at_s, replicas[0])] * num
    for option, text in (("--leave", args.leave), ("--restart", args.restart)):
        for item in _items(text):
            at, sep, index = item.partition(":")
            at_s, i = _number(option, item, at), int(_number(option, item, index))
            if not sep or not 0 <= i < len(replicas):
                raise ValueError(f"{option} {item!r}: give T:I with I in [0, {len(replicas)})")
            changes.append(ReplicaLeft(at_s, f"replica-{i}"))
            if option == "--restart":
                changes.append(ReplicaJoined(at_s, replicas[i]))
    return tuple(changes)


def _items(text: str | None) -> list[str]:
    return [item.strip() for item in (text or "").split(",") if item.strip()]


def _number(option: str, item: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{option} {item!r}: {text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{option} {item!r}: {text!r} must be a finite number >= 0")
    return value


def _report(
    args: argparse.Namespace, title: str, num_requests: int, results: list[FleetResult]
) -> None:
    summaries = {r.router: r.summary for r in results}
    print(f"{title}: {num_requests} requests, reports every {args.report_period_s:g} s")
    print(format_table(summaries).replace("policy", "router", 1))
    for r in results:
        p99s = " ".join(f"{t:.1f}" for t in r.ttft_p99_by_replica_s)
        moves = f", {r.num_moved} moved, {r.num_cut} cut" if r.num_moved or r.num_cut else ""
        print(
            f"  {r.router}: requests per replica {list(r.num_requests_by_replica)}, "
            f"P99 TTFT per replica {p99s} s{moves}, simulated in {r.wall_s:.1f} s"
        )
    if args.json:
        extra = {r.router: extra_record(r.prefix_cache, r.sessions) for r in results}
        write_json(args.json, summaries, extra)
        print(f"wrote {args.json}", file=sys.stderr)
