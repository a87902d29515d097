"""`tokenflow simulate`'s policy options and ablations."""

from __future__ import annotations

import argparse

from tokenflow.core.config import POLICY_KNOBS, TokenFlowConfig, tokenflow_defaults, with_knobs


def add_simulate_policy_arguments(tf: argparse._ArgumentGroup) -> None:
    """TokenFlow's options and the ablations of its mechanism."""
    gpu = tokenflow_defaults("cuda")
    for name, knob in POLICY_KNOBS.items():
        tf.add_argument(
            f"--{name.replace('_', '-')}",
            type=float,
            default=None,
            help=f"{knob.help} (default: the profiled engine's with --profile, else "
            f"{getattr(gpu, knob.field):g})",
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
    """`base` with the policy knobs given on the command line."""
    return with_knobs(base, {name: getattr(args, name) for name in POLICY_KNOBS})
