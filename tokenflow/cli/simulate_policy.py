"""`tokenflow simulate`'s policy options and ablations."""

from __future__ import annotations

import argparse
from dataclasses import replace

from tokenflow.core.config import TokenFlowConfig

# The policy's knobs as `serve` names them: option -> TokenFlowConfig field.  The same names
# as serve's options, so a config file from `tokenflow tune` reads the same here.
POLICY_OPTIONS = {
    "schedule_interval": "schedule_interval_s",
    "mu": "buffer_conservativeness",
    "critical_slack": "critical_slack_s",
    "new_token_ratio": "init_new_token_ratio",
    "capacity_headroom": "capacity_headroom",
    "queue_headroom": "queue_headroom",
    "max_stall_s": "max_stall_s",
}
_POLICY_HELP = {
    "schedule_interval": "seconds between TokenFlow's decisions under stress",
    "mu": "buffer conservativeness: a pause needs mu x a round trip of buffer",
    "critical_slack": "seconds of buffer that mean stress, and a pause's margin",
    "new_token_ratio": "admission reserves this share of each resident's remaining output",
    "capacity_headroom": "admit while reading rates stay <= this share of capacity",
    "queue_headroom": "admit the whole queue while its rates stay <= this share of capacity",
    "max_stall_s": "a stream stalled this long goes on the device first",
}


def add_simulate_policy_arguments(tf: argparse._ArgumentGroup) -> None:
    """TokenFlow's options and the ablations of its mechanism."""
    for dest, field_name in POLICY_OPTIONS.items():
        core_default = getattr(TokenFlowConfig(), field_name)
        tf.add_argument(
            f"--{dest.replace('_', '-')}",
            type=float,
            default=None,
            help=f"{_POLICY_HELP[dest]} (default: serve's with --profile, else the core's "
            f"{core_default:g})",
        )
    tf.add_argument("--no-offload", action="store_true", help="ablation: preempt by recompute only")
    tf.add_argument(
        "--no-write-through",
        action="store_true",
        help="ablation: write-back, the preempting step waits for its eviction",
    )
    tf.add_argument(
        "--no-load-evict-overlap",
        action="store_true",
        help="ablation: a victim's memory is reusable only once its eviction completes",
    )


def tokenflow_config(args: argparse.Namespace, base: TokenFlowConfig) -> TokenFlowConfig:
    """`base` with the policy options given on the command line."""
    given = {
        field: getattr(args, dest)
        for dest, field in POLICY_OPTIONS.items()
        if getattr(args, dest) is not None
    }
    return replace(base, **given)
