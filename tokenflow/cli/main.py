"""The `tokenflow` command: serve, simulate, bench, profile, tune."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    return _build_parsers()[0]


def _build_parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The `tokenflow` parser and its subcommands' parsers by name."""
    from tokenflow.cli.bench import add_bench_arguments
    from tokenflow.cli.config_file import add_config_argument
    from tokenflow.cli.serve import add_serve_arguments
    from tokenflow.cli.simulate import add_simulate_arguments

    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="tokenflow",
        description="A buffer-aware, preemptive LLM text-streaming server.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve", allow_abbrev=False, help="serve a model over the OpenAI API (default: SmolLM2)"
    )
    add_engine_arguments(serve)
    add_serve_arguments(serve)
    add_config_argument(serve)
    simulate = sub.add_parser(
        "simulate",
        allow_abbrev=False,
        help="run the scheduling policies on a GPU cost model or a profile",
    )
    add_simulate_arguments(simulate)
    add_config_argument(simulate)
    add_bench_arguments(
        sub.add_parser(
            "bench", allow_abbrev=False, help="replay a workload of human readers against a server"
        )
    )
    from tokenflow.cli.profile import add_profile_arguments

    add_profile_arguments(
        sub.add_parser(
            "profile",
            allow_abbrev=False,
            help="time the real engine's steps and fit simulator costs",
        )
    )
    from tokenflow.cli.tune import add_tune_arguments

    add_tune_arguments(
        sub.add_parser(
            "tune",
            allow_abbrev=False,
            help="search the policy's knobs by simulation; write a config",
        )
    )
    return parser, {"serve": serve, "simulate": simulate}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """`serve --engine`: our engine, or vLLM's with TokenFlow's scheduler (docs/vllm.md)."""
    group = parser.add_argument_group("engine choice")
    group.add_argument(
        "--engine",
        choices=("tokenflow", "vllm"),
        default="tokenflow",
        help="vllm: run vLLM's OpenAI server with TokenFlow's scheduler; the other options "
        "go to vLLM as given",
    )
    group.add_argument("--vllm-python", default=None, help="a Python with vLLM (default: this one)")


def _serve_vllm(argv: list[str]) -> None:
    """`tokenflow serve --engine vllm ...`: hand every other option to vLLM's server."""
    parser = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
    add_engine_arguments(parser)
    ours, rest = parser.parse_known_args(argv)
    if ours.engine != "vllm":
        return
    from tokenflow.integrations.vllm.serve import launch

    launch(rest, ours.vllm_python)  # never returns


def _runs_llamacpp(argv: list[str]) -> bool:
    """Whether a `serve` command line picks the llama-cpp executor."""
    pairs = zip(argv, [*argv[1:], ""], strict=True)
    picks = {("--executor", "llama-cpp")}
    return any(a == "--executor=llama-cpp" or (a, b) in picks for a, b in pairs)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `tokenflow` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["serve"], ["profile"]) and not _runs_llamacpp(argv):
        # OpenMP workers that sleep instead of spinning between parallel regions: with two
        # threads on a shared 2-core CPU, spinning made decode steps up to 20x slower whenever
        # another process held a core (docs/design.md).  Read when torch loads, so set
        # before any import of it; a value in the environment wins.  Not for llama.cpp: its
        # OpenMP build syncs every graph node at a barrier, and passive waits made its batch-1
        # step 2.9x slower (7.5 -> 21.7 ms).
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if argv[:1] == ["serve"] and "-h" not in argv and "--help" not in argv:
        _serve_vllm(argv[1:])
    parser, configurable = _build_parsers()
    if argv[:1] and argv[0] in configurable:
        from tokenflow.cli.config_file import ConfigFileError, apply_config_file

        try:
            apply_config_file(configurable[argv[0]], argv[1:])
        except ConfigFileError as err:
            print(f"tokenflow {argv[0]}: error: {' '.join(str(err).split())}", file=sys.stderr)
            return 2
    args = parser.parse_args(argv)
    if args.command == "serve":
        from tokenflow.cli.serve import run_serve

        return run_serve(args)
    if args.command == "simulate":
        from tokenflow.cli.simulate import run_simulate

        return run_simulate(args)
    if args.command == "profile":
        from tokenflow.cli.profile import run_profile

        return run_profile(args)
    if args.command == "tune":
        from tokenflow.cli.tune import run_tune

        return run_tune(args)
    from tokenflow.cli.bench import run_bench

    return run_bench(args)


if __name__ == "__main__":
    raise SystemExit(main())
