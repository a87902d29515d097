"""`tokenflow simulate --profile PROFILE.json`: the real engine's deployment, simulated.

`serve`'s deployment flags (`--device-kv-tokens`, `--host-kv-tokens`, `--max-num-seqs`,
`--max-prefill-tokens`, `--step-target-ms`) and the policy knobs shape it as they shape a
server; what is not given is the profiled engine's (`serve`'s defaults when it was taken).
`--endpoint` says which prompt mapping applies (the bench client's, `chat` by default).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from tokenflow.calibrate.profile_file import Profile, load_profile
from tokenflow.cli.policy_options import policy_config
from tokenflow.cli.simulate.policy import prefix_caching_from_args
from tokenflow.cli.workload import workload_spec_from_args
from tokenflow.eval.workload import WorkloadRequest, generate
from tokenflow.sim.profiled import ProfiledDeployment, build_profiled_engine
from tokenflow.sim.runner import SimConfig, SimResult, run_engine
from tokenflow.sim.setups import ProfiledSetup, get_profiled_setup

# Deployment options of `serve` that a profiled simulation takes: option -> type.
DEPLOYMENT_OPTIONS = {
    "device_kv_tokens": int,
    "host_kv_tokens": int,
    "max_num_seqs": int,
    "max_prefill_tokens": int,
    "step_target_ms": float,
}
# Options of the GPU roofline that mean nothing for a profiled engine.
_ROOFLINE_OPTIONS = (
    "gpu", "model", "memory_fraction", "host_memory_gib", "pcie_gbps",
    "copy_latency_us", "copy_pieces_per_block", "no_offload", "no_load_evict_overlap",
)  # fmt: skip


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    """--profile and the deployment options of `serve` it takes."""
    group = parser.add_argument_group(
        "a profiled real engine (tokenflow profile; defaults: the profiled engine's)"
    )
    group.add_argument(
        "--profile", default=None, metavar="FILE", help="simulate the engine this profile timed"
    )
    for name, kind in DEPLOYMENT_OPTIONS.items():
        group.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None)
    group.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        default="chat",
        help="the bench endpoint whose prompts are replayed (the chat template adds tokens)",
    )


def check_profile_options(args: argparse.Namespace) -> None:
    """ValueError when options of one kind of simulation are given to the other."""
    if args.profile is None:
        given = [n for n in DEPLOYMENT_OPTIONS if getattr(args, n) is not None]
        if given:
            flags = ", ".join(f"--{n.replace('_', '-')}" for n in given)
            raise ValueError(f"{flags} apply with --profile only")
        return
    given = [n for n in _ROOFLINE_OPTIONS if getattr(args, n, None) not in (None, False)]
    if given:
        flags = ", ".join(f"--{n.replace('_', '-')}" for n in given)
        raise ValueError(f"{flags} describe a GPU roofline and do not apply with --profile")
    if args.workload is None and args.setup is None:
        raise ValueError(
            "--profile needs a --workload (e.g. --workload trace --trace FILE) or --setup cpu-chat"
        )
    if args.setup is not None:
        get_profiled_setup(args.setup)  # (ValueError unless a setup for a profiled engine)


@dataclass(frozen=True)
class ProfiledRun:
    """The deployment a profiled simulation ran, for its report."""

    profile: Profile
    deployment: ProfiledDeployment


def deployment_from_args(args: argparse.Namespace) -> ProfiledRun:
    """The profiled deployment the options describe: the profile's policy with the policy
    options over it, and the `--setup` preset's device KV tier and prefix caching unless the
    options give them."""
    profile = load_profile(args.profile)
    setup = _setup(args)
    deployment_options = {name: getattr(args, name) for name in DEPLOYMENT_OPTIONS}
    if setup is not None and args.device_kv_tokens is None:
        deployment_options["device_kv_tokens"] = setup.device_kv_tokens
    caching = prefix_caching_from_args(args, setup.prefix_caching if setup else False)
    deployment = ProfiledDeployment(
        profile=profile,
        tokenflow=policy_config(args, profile.tokenflow),
        endpoint=args.endpoint,
        prefix_caching=caching.prefix_caching,
        prefix_retention=caching.prefix_retention,
        **deployment_options,  # type: ignore[arg-type]
    )
    return ProfiledRun(profile, deployment)


def profiled_workload(args: argparse.Namespace) -> list[WorkloadRequest]:
    """The workload options' requests, else (no `--workload`) the `--setup` preset's."""
    setup = _setup(args)
    use_preset = setup is not None and args.workload is None
    return generate(setup.workload if use_preset else workload_spec_from_args(args))


def _setup(args: argparse.Namespace) -> ProfiledSetup | None:
    return get_profiled_setup(args.setup, seed=args.seed) if args.setup else None


def simulate_profiled(
    workload: list[WorkloadRequest], policy: str, run: ProfiledRun, progress: bool = False
) -> SimResult:
    """One policy on the profiled deployment."""
    engine = build_profiled_engine(run.deployment, policy)
    return run_engine(workload, policy, engine, SimConfig(), progress=progress)


def describe(run: ProfiledRun, num_requests: int) -> str:
    """The report's first line."""
    d, model = run.deployment, run.profile.model
    return (
        f"profile: {num_requests} requests, {model.get('name')} on "
        f"{run.profile.machine.get('cpu_model')} ({run.profile.machine.get('device')}), "
        f"device KV {d.value('device_kv_tokens')} tokens, host KV {d.value('host_kv_tokens')}"
    )
