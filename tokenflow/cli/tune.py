"""`tokenflow tune --profile PROFILE.json --workload FILE [--objective qoe|p99-ttft|stall]`:
search the TokenFlow policy's knobs by simulation and write a config `serve --config` loads.

Every candidate runs on the profiled deployment (`simulate --profile`, with the same deployment
flags) over `--seeds` variants of the workload, on every core (one process per core).  A
generated workload is drawn again with each seed; a trace is replayed as recorded (seed 0) and
as bootstrap resamples of its requests on its arrival times (seeds 1, 2, ...), so a point is not
chosen for one lucky arrival of long answers.

Candidates: serve's defaults, each knob alone over its values, then random combinations up to
`--budget` points (seeded, so a run repeats).  The objectives, each against the defaults so
that a knob never buys one number with another the reader feels as much:

- `qoe`: the highest mean QoE (Andes'; it already charges waiting and stalls);
- `p99-ttft`: the lowest P99 TTFT with mean stall at most 0.5 s over the defaults' and QoE at
  most 0.02 below;
- `stall`: the lowest mean stall with P99 TTFT at most 10% over the defaults'.

It prints the frontier (no other point is better on P99 TTFT, mean stall and QoE at once) and
writes the chosen point, with the deployment flags given, as `serve` options.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import shlex
import sys
from dataclasses import dataclass, replace

from tokenflow.calibrate.profile_file import load_profile
from tokenflow.cli.config_file import write_config
from tokenflow.cli.simulate.profile import DEPLOYMENT_OPTIONS
from tokenflow.cli.workload import add_workload_arguments, workload_spec_from_args
from tokenflow.core.config import POLICY_KNOBS, with_knobs
from tokenflow.eval.workload import WorkloadRequest, generate
from tokenflow.sim.profiled import ProfiledDeployment, build_profiled_engine
from tokenflow.sim.runner import SimConfig, run_engine

# serve option -> the values tried (serve's defaults are among them).
KNOB_VALUES: dict[str, tuple[float, ...]] = {
    "schedule_interval": (0.25, 0.5, 1.0),
    "mu": (1.0, 1.5, 2.0, 4.0),
    "capacity_headroom": (0.8, 0.9, 1.0, 1.1),
    "queue_headroom": (1.0, 1.15),
    "max_stall_s": (0.5, 1.0, 2.0),
    "prefill_stall_s": (0.1, 0.25, 0.5, 1.0),
    "critical_slack": (0.5, 1.0, 2.0),
}
OBJECTIVES = ("qoe", "p99-ttft", "stall")
_STALL_ALLOWANCE_S = 0.5
_QOE_ALLOWANCE = 0.02
_TTFT_ALLOWANCE = 1.10


@dataclass(frozen=True)
class Score:
    """One point's simulated outcome, means over the seeds."""

    knobs: dict[str, float]  # serve option -> value
    qoe: float
    ttft_p99_s: float
    ttft_mean_s: float
    stall_mean_s: float
    effective_tps: float

    def dominates(self, other: Score) -> bool:
        """At least as good on P99 TTFT, mean stall and QoE, and better on one."""
        mine = (-self.ttft_p99_s, -self.stall_mean_s, self.qoe)
        theirs = (-other.ttft_p99_s, -other.stall_mean_s, other.qoe)
        return all(a >= b for a, b in zip(mine, theirs, strict=True)) and mine != theirs


def add_tune_arguments(parser: argparse.ArgumentParser) -> None:
    """The `tokenflow tune` options."""
    parser.add_argument("--profile", required=True, metavar="FILE", help="from tokenflow profile")
    parser.add_argument("--objective", choices=OBJECTIVES, default="qoe")
    parser.add_argument("--out", required=True, metavar="FILE", help="the config to write (TOML)")
    parser.add_argument("--seeds", type=int, default=3, help="workload variants per point")
    parser.add_argument("--budget", type=int, default=40, help="points to simulate, at most")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: cores)")
    parser.add_argument("--search-seed", type=int, default=0, help="seeds the random points")
    parser.add_argument("--json", default=None, metavar="FILE", help="every point's scores")
    deploy = parser.add_argument_group("deployment (serve's flags; default: the profile's)")
    for name, kind in DEPLOYMENT_OPTIONS.items():
        deploy.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None)
    deploy.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    add_workload_arguments(parser, default_kind=None)


def candidate_points(budget: int, seed: int) -> list[dict[str, float]]:
    """serve's defaults ({}), each knob alone over its values, then random combinations."""
    points: list[dict[str, float]] = [{}]
    points += [{knob: v} for knob, values in KNOB_VALUES.items() for v in values]
    rng = random.Random(f"tokenflow.tune/{seed}")  # (a fixed name: the seed)
    tries = 0
    while len(points) < budget and tries < 50 * budget:
        tries += 1
        point = {knob: rng.choice(values) for knob, values in KNOB_VALUES.items()}
        if point not in points:
            points.append(point)
    return points[: max(budget, 1)]


def workload_variants(args: argparse.Namespace, num_seeds: int) -> list[list[WorkloadRequest]]:
    """The workload once per seed (see the module docstring)."""
    spec = workload_spec_from_args(args)
    if spec.kind != "trace":
        return [generate(replace(spec, seed=spec.seed + k)) for k in range(num_seeds)]
    recorded = generate(spec)
    variants = [recorded]
    for k in range(1, num_seeds):
        rng = random.Random(f"tokenflow.tune.bootstrap/{k}")
        variants.append(
            [
                replace(rng.choice(recorded), request_id=r.request_id, arrival_s=r.arrival_s)
                for r in recorded
            ]
        )
    return variants


def _simulate(job: tuple[argparse.Namespace, dict[str, float], list[WorkloadRequest]]) -> dict:
    """One (point, workload variant): the summary of TokenFlow on the profiled deployment."""
    args, knobs, workload = job
    profile = load_profile(args.profile)
    deployment = ProfiledDeployment(
        profile=profile,
        tokenflow=with_knobs(profile.tokenflow, knobs),
        endpoint=args.endpoint,
        **{name: getattr(args, name) for name in DEPLOYMENT_OPTIONS},
    )
    engine = build_profiled_engine(deployment, "tokenflow")
    return run_engine(workload, "tokenflow", engine, SimConfig()).summary.to_dict()


def score_points(
    args: argparse.Namespace, points: list[dict[str, float]], variants: list[list]
) -> list[Score]:
    """Every point over every variant, on `--workers` processes."""
    jobs = [(args, point, workload) for point in points for workload in variants]
    workers = args.workers or os.cpu_count() or 1
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        summaries = pool.map(_simulate, jobs, chunksize=1)
    n = len(variants)
    return [_score(point, summaries[i * n : (i + 1) * n]) for i, point in enumerate(points)]


def _score(knobs: dict[str, float], summaries: list[dict]) -> Score:
    def mean(key: str) -> float:
        return sum(s[key] for s in summaries) / len(summaries)

    return Score(
        knobs=knobs,
        qoe=mean("qoe_mean"),
        ttft_p99_s=mean("ttft_p99_s"),
        ttft_mean_s=mean("ttft_mean_s"),
        stall_mean_s=mean("rebuffer_mean_s"),
        effective_tps=mean("effective_throughput_tps"),
    )


def choose(scores: list[Score], objective: str) -> Score:
    """The best point on `objective` among those within the allowances of the defaults
    (`scores[0]`, always allowed); ties go to the earlier point."""
    base = scores[0]
    if objective == "qoe":
        return max(scores, key=lambda s: s.qoe)
    if objective == "p99-ttft":
        allowed = [
            s for s in scores
            if s.stall_mean_s <= base.stall_mean_s + _STALL_ALLOWANCE_S
            and s.qoe >= base.qoe - _QOE_ALLOWANCE
        ]  # fmt: skip
        return min(allowed, key=lambda s: s.ttft_p99_s)
    allowed = [s for s in scores if s.ttft_p99_s <= base.ttft_p99_s * _TTFT_ALLOWANCE]
    return min(allowed, key=lambda s: s.stall_mean_s)


def frontier(scores: list[Score]) -> list[Score]:
    """The points no other point dominates, by P99 TTFT; of points with the same outcome only
    the first (knobs that did not act on this workload)."""
    front, seen = [], set()
    for s in scores:
        outcome = (s.ttft_p99_s, s.stall_mean_s, s.qoe)
        if outcome not in seen and not any(o.dominates(s) for o in scores):
            front.append(s)
            seen.add(outcome)
    return sorted(front, key=lambda s: (s.ttft_p99_s, s.stall_mean_s))


def run_tune(args: argparse.Namespace) -> int:
    """`tokenflow tune` with parsed arguments; returns the exit code."""
    try:
        if args.seeds < 1 or args.budget < 1:
            raise ValueError("--seeds and --budget must be >= 1")
        profile = load_profile(args.profile)
        variants = workload_variants(args, args.seeds)
        points = candidate_points(args.budget, args.search_seed)
        scores = score_points(args, points, variants)
        chosen = choose(scores, args.objective)
        _write(args, profile.tokenflow, chosen, scores[0])
    except (ValueError, OSError) as err:
        print(f"tokenflow tune: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    print(format_frontier(frontier(scores), chosen, scores[0]))
    if args.json:
        _write_json(args.json, scores)
    print(f"wrote {args.out}: tokenflow serve --config {args.out}")
    return 0


def served_knobs(base: object, knobs: dict[str, float]) -> dict[str, float]:
    """Every knob's value at a point: the point's, else serve's default (from the profile)."""
    return {dest: knobs.get(dest, getattr(base, POLICY_KNOBS[dest].field)) for dest in KNOB_VALUES}


def _write(args: argparse.Namespace, base: object, chosen: Score, default: Score) -> None:
    values: dict[str, object] = {"policy": "tokenflow"}
    values |= {n: getattr(args, n) for n in DEPLOYMENT_OPTIONS if getattr(args, n) is not None}
    values |= served_knobs(base, chosen.knobs)
    comments = [
        f"tokenflow tune {shlex.join(sys.argv[2:]) if sys.argv[1:2] == ['tune'] else ''}".strip(),
        f"objective {args.objective}, {args.seeds} seeds per point, simulated on {args.profile}:",
        f"  chosen:   {_line(chosen)}",
        f"  defaults: {_line(default)}",
    ]
    write_config(args.out, values, comments)


def _line(s: Score) -> str:
    return (
        f"QoE {s.qoe:.3f}, P99 TTFT {s.ttft_p99_s:.2f} s, mean TTFT {s.ttft_mean_s:.2f} s, "
        f"mean stall {s.stall_mean_s:.2f} s, effective {s.effective_tps:.1f} tok/s"
    )


def format_frontier(front: list[Score], chosen: Score, default: Score) -> str:
    """The frontier as a table, the defaults and the chosen point marked."""
    knobs = list(KNOB_VALUES)
    head = ["", "P99 TTFT s", "stall s", "QoE", "eff tok/s", *knobs]
    rows = [head]
    shown = front + [s for s in (default, chosen) if s not in front]
    for s in shown:
        mark = ("*" if s is chosen else "") + ("d" if s is default else "")
        cells = [f"{s.knobs[k]:g}" if k in s.knobs else "." for k in knobs]
        rows.append([mark, f"{s.ttft_p99_s:.2f}", f"{s.stall_mean_s:.2f}", f"{s.qoe:.3f}",
                     f"{s.effective_tps:.1f}", *cells])  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    legend = "* chosen, d serve's defaults, . the default value"
    return "frontier (P99 TTFT, mean stall, QoE):\n" + "\n".join(lines) + "\n" + legend


def _write_json(path: str, scores: list[Score]) -> None:
    import json
    from dataclasses import asdict

    with open(path, "w", encoding="utf-8") as file:
        json.dump([asdict(s) for s in scores], file, indent=1)
