"""`tokenflow simulate`'s policy options (the one table every command shares) and the
ablations of the simulated mechanism."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from tokenflow.cli.policy_options import add_policy_arguments
from tokenflow.core.config import tokenflow_defaults
from tokenflow.core.prefix_cache import RETENTIONS


def add_simulate_policy_arguments(tf: argparse._ArgumentGroup) -> None:
    """TokenFlow's options and the ablations of its mechanism."""
    add_policy_arguments(tf, _simulated_default)
    tf.add_argument("--no-offload", action="store_true", help="ablation: preempt by recompute only")
    tf.add_argument(
        "--no-load-evict-overlap",
        action="store_true",
        help="ablation: a victim's memory is reusable only once its eviction completes",
    )
    tf.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="share the KV of prompts' common leading blocks (a system prompt, a conversation's "
        "history) (default: the setup's, on for the chat setups; else off)",
    )
    tf.add_argument(
        "--prefix-retention",
        choices=RETENTIONS,
        default=None,
        help="which cached blocks no request holds are reused first: reading (by the readers' "
        "expected next turns) or lru (vLLM's) (default reading; with prefix caching)",
    )


@dataclass(frozen=True)
class PrefixCaching:
    """The prefix cache a simulated deployment runs (`KVConfig`'s fields of the same names)."""

    prefix_caching: bool
    prefix_retention: str


def prefix_caching_from_args(args: argparse.Namespace, setup_default: bool) -> PrefixCaching:
    """The prefix-cache flags over the setup's default; ValueError for a retention without
    the cache."""
    enabled = setup_default if args.enable_prefix_caching is None else args.enable_prefix_caching
    if args.prefix_retention is not None and not enabled:
        raise ValueError("--prefix-retention applies with prefix caching on")
    return PrefixCaching(enabled, args.prefix_retention or RETENTIONS[0])


def _simulated_default(field: str) -> str:
    gpu = getattr(tokenflow_defaults("cuda"), field)
    return f"the profiled engine's with --profile, else {gpu:g}"
