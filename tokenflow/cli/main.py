"""The `tokenflow` command: serve, simulate, bench, profile, tune."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

COMMANDS = {
    "serve": "serve a model over the OpenAI API (default: SmolLM2)",
    "simulate": "run the scheduling policies on a GPU cost model or a profile",
    "bench": "replay a workload of human readers against a server",
    "profile": "time the real engine's steps and fit simulator costs",
    "tune": "search the policy's knobs by simulation; write a config",
}
CONFIGURABLE = ("serve", "simulate")  # the commands that read `--config FILE`


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `tokenflow` parser with every subcommand's options (`command`: only that one's).

    Each command's options are declared next to the code that runs it, which imports what
    it runs (torch, the server, the simulator); so `main` fills in only the command asked for,
    and `tokenflow --help` or `tokenflow serve --help` answers without importing the others."""
    return _build_parsers(command)[0]


def _build_parsers(
    command: str | None = None,
) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The `tokenflow` parser and its subcommands' parsers by name, each with its options
    when it is `command` (None: all of them)."""
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="tokenflow",
        description="A buffer-aware, preemptive LLM text-streaming server.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    parsers = {}
    for name, help_text in COMMANDS.items():
        parsers[name] = sub.add_parser(name, allow_abbrev=False, help=help_text)
        if command in (None, name):
            _add_arguments(name, parsers[name])
    return parser, parsers


def _add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    """Declare `command`'s options on its parser, importing only that command's module."""
    if command == "serve":
        from tokenflow.cli.serve_options import add_serve_arguments

        add_engine_arguments(parser)
        add_serve_arguments(parser)
    elif command == "simulate":
        from tokenflow.cli.simulate import add_simulate_arguments

        add_simulate_arguments(parser)
    elif command == "bench":
        from tokenflow.cli.bench import add_bench_arguments

        add_bench_arguments(parser)
    elif command == "profile":
        from tokenflow.cli.profile import add_profile_arguments

        add_profile_arguments(parser)
    else:
        from tokenflow.cli.tune import add_tune_arguments

        add_tune_arguments(parser)
    if command in CONFIGURABLE:
        from tokenflow.cli.config_file import add_config_argument

        add_config_argument(parser)


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
    command = argv[0] if argv[:1] and argv[0] in COMMANDS else "-"
    parser, parsers = _build_parsers(command)
    if command in CONFIGURABLE:
        from tokenflow.cli.config_file import ConfigFileError, apply_config_file

        try:
            apply_config_file(parsers[command], argv[1:])
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
