"""`tokenflow simulate`'s policy options (the one table every command shares) and the
ablations of the simulated mechanism."""

from __future__ import annotations

import argparse

from tokenflow.core.config import add_policy_arguments, tokenflow_defaults


def add_simulate_policy_arguments(tf: argparse._ArgumentGroup) -> None:
    """TokenFlow's options and the ablations of its mechanism."""
    add_policy_arguments(tf, _simulated_default)
    tf.add_argument("--no-offload", action="store_true", help="ablation: preempt by recompute only")
    tf.add_argument(
        "--no-load-evict-overlap",
        action="store_true",
        help="ablation: a victim's memory is reusable only once its eviction completes",
    )


def _simulated_default(field: str) -> str:
    gpu = getattr(tokenflow_defaults("cuda"), field)
    return f"the profiled engine's with --profile, else {gpu:g}"
