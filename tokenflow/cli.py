"""The `tokenflow` command: serve, simulate, bench."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    from tokenflow.bench.cli import add_bench_arguments
    from tokenflow.serving.cli import add_serve_arguments
    from tokenflow.sim.cli import add_simulate_arguments

    parser = argparse.ArgumentParser(
        prog="tokenflow",
        description="A buffer-aware, preemptive LLM text-streaming server.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(
        sub.add_parser("serve", help="serve a model over the OpenAI API (default: SmolLM2)")
    )
    add_simulate_arguments(
        sub.add_parser("simulate", help="run the scheduling policies on a GPU cost model")
    )
    add_bench_arguments(
        sub.add_parser("bench", help="replay a workload of human readers against a server")
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `tokenflow` console script."""
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from tokenflow.serving.cli import run_serve

        return run_serve(args)
    if args.command == "simulate":
        from tokenflow.sim.cli import run_simulate

        return run_simulate(args)
    from tokenflow.bench.cli import run_bench

    return run_bench(args)


if __name__ == "__main__":
    raise SystemExit(main())
