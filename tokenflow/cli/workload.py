"""Workload options shared by `tokenflow bench` and `tokenflow simulate`."""

from __future__ import annotations

import argparse
import os

from tokenflow.eval.workload import (
    KINDS,
    ClassMix,
    LengthDist,
    RateMix,
    WorkloadError,
    WorkloadRequest,
    WorkloadSpec,
    generate,
)


def add_workload_arguments(parser: argparse.ArgumentParser, default_kind: str | None) -> None:
    """The workload option group; `default_kind=None` lets a caller fall back to a preset."""
    load = parser.add_argument_group("workload")
    load.add_argument(
        "--workload",
        default=default_kind,
        metavar="KIND|FILE",
        help=f"{', '.join(KINDS)}, or a trace FILE (short for `trace --trace FILE`)",
    )
    load.add_argument("--num-requests", type=int, default=100)
    load.add_argument("--request-rate", type=float, default=1.0, help="req/s (poisson, gamma)")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson)")
    load.add_argument("--prompt-len", default="512:128", help="MEAN[:STD] prompt tokens")
    load.add_argument("--output-len", default="1024:256", help="MEAN[:STD] output tokens")
    load.add_argument(
        "--rates", default="15:0.4,20:0.6", help="reader rates tok/s, RATE[:WEIGHT],..."
    )
    load.add_argument(
        "--classes",
        default="reader",
        help="consumption classes CLASS[:WEIGHT],..., e.g. reader:0.6,eager:0.3,batch:0.1 "
        "(eager: streams read at once; batch: stream false)",
    )
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--trace", default=None, help="JSONL trace file (--workload trace)")


def workload_kind(args: argparse.Namespace) -> tuple[str, str | None]:
    """(kind, trace path) of `--workload KIND|FILE` and `--trace`."""
    if args.workload in KINDS:
        return args.workload, args.trace
    if args.workload is not None and os.path.isfile(args.workload):
        if args.trace is not None and args.trace != args.workload:
            raise WorkloadError("give the trace once: --workload FILE or --trace FILE")
        return "trace", args.workload
    raise WorkloadError(
        f"unknown workload {args.workload!r}: choose one of {', '.join(KINDS)}, or give a "
        "trace file that exists"
    )


def workload_spec_from_args(args: argparse.Namespace) -> WorkloadSpec:
    """Raises WorkloadError (a ValueError) with a one-line message for bad values."""
    kind, trace_path = workload_kind(args)
    return WorkloadSpec(
        kind=kind,
        num_requests=args.num_requests,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        prompt=LengthDist.parse(args.prompt_len),
        output=LengthDist.parse(args.output_len),
        rates=RateMix.parse(args.rates),
        classes=ClassMix.parse(args.classes),
        seed=args.seed,
        trace_path=trace_path,
    )


def workload_from_args(args: argparse.Namespace) -> list[WorkloadRequest]:
    """The requests the workload options describe."""
    return generate(workload_spec_from_args(args))
