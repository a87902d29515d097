"""The simulated deployment a `tokenflow simulate` command line describes (one engine on a
GPU cost model; `--replicas` makes a fleet of them, tokenflow/cli/simulate/fleet.py)."""

from __future__ import annotations

import argparse
from dataclasses import replace

from tokenflow.cli.policy_options import policy_config
from tokenflow.cli.simulate.policy import prefix_caching_from_args
from tokenflow.cli.workload import workload_spec_from_args
from tokenflow.core.config import tokenflow_defaults
from tokenflow.eval.workload import WorkloadRequest, generate
from tokenflow.sim.cost_model import CostModelConfig
from tokenflow.sim.overhead import SchedulerOverhead
from tokenflow.sim.runner import SimConfig
from tokenflow.sim.setups import get_setup


def paper_deployment(args: argparse.Namespace) -> tuple[list[WorkloadRequest], SimConfig]:
    """The workload and the simulated deployment `simulate`'s options (without `--profile`)
    describe: the `--setup` preset's, with every option given on the command line over it."""
    setup = get_setup(args.setup, seed=args.seed) if args.setup else None
    if args.workload is not None or setup is None:
        if args.workload is None:
            raise ValueError("give --setup NAME or a --workload")
        workload = generate(workload_spec_from_args(args))
    else:
        workload = generate(setup.workload)
    tokenflow = policy_config(args, tokenflow_defaults("cuda"))  # (a simulated GPU)
    caching = prefix_caching_from_args(args, setup.prefix_caching if setup else False)
    config = SimConfig(
        gpu=args.gpu or (setup.gpu if setup else "h200"),
        model=args.model or (setup.model if setup else "llama3-8b"),
        memory_fraction=args.memory_fraction or (setup.memory_fraction if setup else 0.3),
        host_memory_gib=args.host_memory_gib or (setup.host_memory_gib if setup else 128.0),
        offload=not args.no_offload,
        write_through=not args.no_write_through,
        overlap_load_evict=not args.no_load_evict_overlap,
        prefix_caching=caching.prefix_caching,
        prefix_retention=caching.prefix_retention,
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
