"""The TokenFlow policy's options on a command line: one table (`POLICY_KNOBS`) for every
command that runs the policy (`serve`, `simulate`, `profile`), and the config they build."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import replace

from tokenflow.core.config import POLICY_KNOBS, TokenFlowConfig, with_knobs


def add_policy_arguments(
    group: argparse._ArgumentGroup, default_text: Callable[[str], str]
) -> None:
    """The policy's knobs and `--no-write-through`; `default_text(field)` says a knob's
    default in its help (each command knows where its defaults come from)."""
    for name, knob in POLICY_KNOBS.items():
        group.add_argument(
            f"--{name.replace('_', '-')}",
            type=float,
            default=None,
            help=f"{knob.help} (default {default_text(knob.field)})",
        )
    group.add_argument(
        "--no-write-through",
        action="store_true",
        help="write-back (an ablation): nothing is copied to the host ahead, so a preemption "
        "waits for its eviction",
    )


def has_policy_options(args: argparse.Namespace) -> bool:
    """Whether the command line gave any of the policy's options."""
    return args.no_write_through or any(getattr(args, n) is not None for n in POLICY_KNOBS)


def policy_config(args: argparse.Namespace, base: TokenFlowConfig) -> TokenFlowConfig:
    """`base` with the policy options of the command line over it."""
    config = with_knobs(base, {name: getattr(args, name) for name in POLICY_KNOBS})
    return replace(config, write_through=False) if args.no_write_through else config
