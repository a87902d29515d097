"""Workload options shared by `tokenflow bench` and `tokenflow simulate`."""

from __future__ import annotations

import argparse
import os

from tokenflow.eval.conversation import SESSION_ARRIVALS, ConversationSpec
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
    chat = parser.add_argument_group(
        "conversation workload (--workload conversation: --request-rate is sessions/s, "
        "--output-len each answer)"
    )
    chat.add_argument("--num-sessions", type=int, default=100)
    chat.add_argument("--turns", default="3:8", metavar="MIN:MAX", help="turns per session")
    chat.add_argument("--num-apps", type=int, default=1, help="apps, each its system prompt")
    chat.add_argument("--system-len", default="2000", help="MEAN[:STD] system prompt tokens")
    chat.add_argument("--user-len", default="200:50", help="MEAN[:STD] user message tokens")
    chat.add_argument(
        "--think-s", type=float, default=15.0, help="mean think time before a next turn (s)"
    )
    chat.add_argument(
        "--session-arrivals",
        choices=SESSION_ARRIVALS,
        default="poisson",
        help="sessions arrive as a Poisson process at --request-rate, or all at once",
    )


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
    min_turns, max_turns = _turns(args.turns)
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
        conversation=ConversationSpec(
            num_sessions=args.num_sessions,
            min_turns=min_turns,
            max_turns=max_turns,
            num_apps=args.num_apps,
            system_prompt=LengthDist.parse(args.system_len),
            user_message=LengthDist.parse(args.user_len),
            think_mean_s=args.think_s,
            session_arrivals=args.session_arrivals,
        ),
    )


def _turns(text: str) -> tuple[int, int]:
    """(min, max) turns of "MIN:MAX" (or "N": always N)."""
    parts = text.split(":")
    try:
        numbers = [int(part) for part in parts]
    except ValueError:
        numbers = []
    if len(numbers) not in (1, 2):
        raise WorkloadError(f"invalid turns {text!r}: expected MIN:MAX or N, e.g. 3:8")
    return numbers[0], numbers[-1]


def workload_from_args(args: argparse.Namespace) -> list[WorkloadRequest]:
    """The requests the workload options describe."""
    return generate(workload_spec_from_args(args))
