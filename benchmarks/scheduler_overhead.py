"""Time per scheduling decision of each policy at 100, 400 and 1000 active requests.

The state is real: a simulated H200 (Llama3-8B, 30% memory) serves a burst under the tokenflow
policy for a few hundred steps, so requests are running, preempted (offloaded) and waiting with
real buffers.  Each policy then decides on that same frozen view, many times; the table reports
the median time of one decision.  The paper reports ~0.4 ms per TokenFlow decision (SGLang's
own scheduler: ~0.07 ms).

    python benchmarks/scheduler_overhead.py [--json] [--repeats 200]

With --per-step it instead measures what the simulator charges: the scheduler's CPU time of
whole steps (`schedule()` + `update()`, decisions included at their natural frequency, the
executor excluded) while each policy serves the burst, and fits fixed + per-active-request
seconds per step by least squares over the sizes (`tokenflow/sim/overhead.py` holds the fit).

    python benchmarks/scheduler_overhead.py --per-step [--sizes 50,200,400,800] [--steps 200]
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


def step_cpu_ms(name: str, num_active: int, warm_steps: int, steps: int) -> float:
    """Mean scheduler CPU ms per step (schedule + update) while `name` serves a burst."""
    core, executor = build_engine(SimConfig(), name)
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
    scheduler, clock = core.scheduler, core.clock
    total = 0.0
    for _ in range(steps):
        start = time.perf_counter()
        plan = scheduler.schedule(clock.now())
        middle = time.perf_counter()
        result = executor.execute(plan)
        resume = time.perf_counter()
        scheduler.update(plan, result, clock.now())
        total += (middle - start) + (time.perf_counter() - resume)
    return total / steps * 1e3


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys against xs."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var
    return mean_y - slope * mean_x, slope


def per_step(sizes: list[int], steps: int) -> int:
    """Print per-step CPU time per policy and size, and the fixed + per-request fit."""
    print(f"{'policy':10s} {'active':>6s} {'ms/step':>9s}")
    for name in POLICY_NAMES:
        ys = []
        for size in sizes:
            ms = step_cpu_ms(name, size, warm_steps=100, steps=steps)
            ys.append(ms)
            print(f"{name:10s} {size:6d} {ms:9.3f}", flush=True)
        fixed, slope = fit_line([float(s) for s in sizes], ys)
        print(f"{name:10s} fit: {fixed:.4f} ms + {slope * 1e3:.3f} us x active", flush=True)
    return 0


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
    parser.add_argument("--per-step", action="store_true", help="calibrate the simulator")
    parser.add_argument("--steps", type=int, default=200, help="measured steps (--per-step)")
    args = parser.parse_args()
    if args.per_step:
        return per_step([int(s) for s in args.sizes.split(",")], args.steps)
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
