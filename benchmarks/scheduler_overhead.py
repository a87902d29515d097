"""Time per scheduling decision of each policy at 100, 400 and 1000 active requests.

The state is real: a simulated H200 (Llama3-8B, 30% memory) serves a burst under the tokenflow
policy for a few hundred steps, so requests are running, preempted (offloaded) and waiting with
real buffers.  Each policy then decides on that same frozen view, many times; the table reports
the median time of one decision.  The paper reports ~0.4 ms per TokenFlow decision (SGLang's
own scheduler: ~0.07 ms).

    python benchmarks/scheduler_overhead.py [--json] [--repeats 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from tokenflow.core.config import AndesConfig, SchedulerConfig, TokenFlowConfig
from tokenflow.core.policies import POLICY_NAMES, make_policy
from tokenflow.core.policies.andes import AndesPolicy
from tokenflow.core.policies.base import Policy, SchedulingView
from tokenflow.core.policies.tokenflow import TokenFlowPolicy
from tokenflow.sim.runner import SimConfig, build_engine, make_request
from tokenflow.workload import LengthDist, RateMix, WorkloadSpec, generate


def busy_view(num_active: int, warm_steps: int = 300) -> SchedulingView:
    """A scheduler view with `num_active` requests after `warm_steps` of tokenflow service."""
    core, _ = build_engine(SimConfig(), "tokenflow")
    spec = WorkloadSpec(
        kind="burst",
        num_requests=num_active,
        prompt=LengthDist(512, 128),
        output=LengthDist(4096, 1024, minimum=16, maximum=8192),
        rates=RateMix.parse("15:0.4,20:0.6"),
    )
    for item in generate(spec):
        core.add_request(make_request(item))
    for _ in range(warm_steps):
        core.step()
    return core.scheduler.view(core.clock.now())


def decision(policy: Policy):
    """The policy's full decision (not the cheap between-interval path)."""
    if isinstance(policy, TokenFlowPolicy):
        return policy.decide
    if isinstance(policy, AndesPolicy):
        return policy.knapsack
    return policy.plan_moves


def time_decision(view: SchedulingView, name: str, repeats: int) -> float:
    config = view.config
    policy = make_policy(name, config, TokenFlowConfig(), AndesConfig())
    run = decision(policy)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(view)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,400,1000")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        view = busy_view(size)
        print(
            f"{size} active: {len(view.running)} running, {len(view.preempted)} preempted, "
            f"{len(view.waiting)} waiting",
            file=sys.stderr,
        )
        for name in POLICY_NAMES:
            ms = time_decision(view, name, args.repeats)
            rows.append({"policy": name, "num_active": size, "ms_per_decision": round(ms, 4)})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    fcfs = {r["num_active"]: r["ms_per_decision"] for r in rows if r["policy"] == "fcfs"}
    print(f"{'policy':10s} {'active':>6s} {'ms/decision':>12s} {'x fcfs':>8s}")
    for r in rows:
        ratio = r["ms_per_decision"] / max(fcfs[r["num_active"]], 1e-9)
        print(f"{r['policy']:10s} {r['num_active']:6d} {r['ms_per_decision']:12.3f} {ratio:8.1f}")
    return 0


if __name__ == "__main__":
    _ = SchedulerConfig  # the view carries the config the policies are built with
    raise SystemExit(main())
