"""Time per scheduling decision of each policy at 100, 400 and 1000 active requests.

The state is real: a simulated H200 (Llama3-8B, 30% memory) serves a burst under the tokenflow
policy for a few hundred steps, so requests are running, preempted (offloaded) and waiting with
real buffers.  Each policy then decides on that same frozen view, many times; the table reports
the median time of one decision.  The paper reports ~0.4 ms per TokenFlow decision (SGLang's
own scheduler: ~0.07 ms).

    python benchmarks/scheduler_overhead.py [--json] [--repeats 200]

With --in-run it times TokenFlow's decisions as they come while it keeps serving (the states
vary; memory is often short later in a run):

    python -m benchmarks.scheduler_overhead --in-run --sizes 400,1000 --steps 2500

With --cold-mib N the per-step figures (table and --per-step) read an N MiB array between
timed steps, as a forward pass on the CPU would, so the scheduler runs with cold CPU caches
(64 MiB exceeds this machine's 32 MiB L3):

    python -m benchmarks.scheduler_overhead --sizes 400 --cold-mib 64

With --per-step it instead measures what the simulator charges: the scheduler's CPU time of
whole steps (`schedule()` + `update()`, decisions included at their natural frequency, the
executor excluded) while each policy serves the burst, and fits fixed + per-active-request
seconds per step by least squares over the sizes (`tokenflow/sim/overhead.py` holds the fit).

    python benchmarks/scheduler_overhead.py --per-step [--sizes 50,200,400,800] [--steps 200]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import numpy as np

from tokenflow.core.config import AndesConfig, TokenFlowConfig
from tokenflow.core.policies import POLICY_NAMES, make_policy
from tokenflow.core.policies.andes import AndesPolicy
from tokenflow.core.policies.base import Policy, SchedulingView
from tokenflow.core.policies.tokenflow import TokenFlowPolicy
from tokenflow.core.scheduler import Scheduler
from tokenflow.eval.workload import LengthDist, RateMix, WorkloadSpec, generate
from tokenflow.sim.runner import SimConfig, build_engine, make_request

WAITING_SHARE = 0.11  # of the active requests that arrive after the warm-up (never started)
WARM_STEPS = 500  # steps of service before timing: at 400 active ~256 running, ~50 preempted


def _burst(num_requests: int, first_id: int = 0, arrival_s: float = 0.0) -> list:
    spec = WorkloadSpec(
        kind="burst",
        num_requests=num_requests,
        prompt=LengthDist(512, 128),
        output=LengthDist(4096, 1024, minimum=16, maximum=8192),
        rates=RateMix.parse("15:0.4,20:0.6"),
        seed=first_id,
    )
    items = generate(spec)
    return [
        replace(item, request_id=f"r{first_id + i}", arrival_s=arrival_s)
        for i, item in enumerate(items)
    ]


def busy_core(policy: str, num_active: int, warm_steps: int):
    """A simulated H200 (Llama3-8B, 30% memory) after `policy` served a burst for `warm_steps`,
    with WAITING_SHARE of `num_active` arriving just now: running, preempted and waiting
    requests with real buffers and KV."""
    core, executor = build_engine(SimConfig(), policy)
    num_waiting = round(WAITING_SHARE * num_active)
    for item in _burst(num_active - num_waiting):
        core.add_request(make_request(item))
    for _ in range(warm_steps):
        core.step()
    for item in _burst(num_waiting, first_id=num_active, arrival_s=core.clock.now()):
        core.add_request(make_request(item))
    return core, executor


def composition(state: Scheduler | SchedulingView) -> str:
    """Running / preempted / waiting counts of a scheduler or a view."""
    return (
        f"{len(state.running)} running, {len(state.preempted)} preempted, "
        f"{len(state.waiting)} waiting"
    )


def busy_view(num_active: int, warm_steps: int = WARM_STEPS) -> SchedulingView:
    """The view `busy_core` leaves under tokenflow: every policy decides on this same state."""
    core, _ = busy_core("tokenflow", num_active, warm_steps)
    return core.scheduler.view(core.clock.now())


def _one_step_ms(core, executor) -> float:
    """One step of `core`: the scheduler's CPU ms (schedule + update, the executor excluded)."""
    scheduler, clock = core.scheduler, core.clock
    start = time.perf_counter()
    plan = scheduler.schedule(clock.now())
    middle = time.perf_counter()
    result = executor.execute(plan)
    resume = time.perf_counter()
    scheduler.update(plan, result, clock.now())
    return ((middle - start) + (time.perf_counter() - resume)) * 1e3


def step_cpu_ms(
    name: str, num_active: int, warm_steps: int, steps: int, cold_mib: int = 0
) -> tuple[list[float], str]:
    """Scheduler CPU ms of each of `steps` steps (schedule + update, the executor excluded)
    while `name` serves from `busy_core`, and the state's composition when timing starts.
    With `cold_mib`, an array that large is read between steps (untimed), as a forward pass
    on the CPU would, so the scheduler runs with the CPU caches cold."""
    core, executor = busy_core(name, num_active, warm_steps)
    state = composition(core.scheduler)
    flush = np.ones(cold_mib * 2**20 // 8) if cold_mib else None
    gc.collect()  # the earlier runs' garbage, so that no collection of it lands in a timed step
    samples = []
    for _ in range(steps):
        if flush is not None:
            flush.sum()
        samples.append(_one_step_ms(core, executor))
    return samples, state


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys against xs."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var
    return mean_y - slope * mean_x, slope


def per_step(sizes: list[int], steps: int, cold_mib: int) -> int:
    """Print mean per-step CPU time per policy and size, and the fixed + per-request fit."""
    print(f"{'policy':10s} {'active':>6s} {'ms/step':>9s}  state")
    for name in POLICY_NAMES:
        ys = []
        for size in sizes:
            samples, state = step_cpu_ms(name, size, WARM_STEPS, steps, cold_mib)
            ys.append(statistics.fmean(samples))
            print(f"{name:10s} {size:6d} {ys[-1]:9.3f}  {state}", flush=True)
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


def interleaved_medians_us(runs: list[Callable[[], object]], repeats: int) -> list[float]:
    """Median microseconds of each of `runs`, timed in turn within every repeat (so that a
    change of the machine's speed during the measurement moves all of them alike)."""
    samples: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for run, times in zip(runs, samples, strict=True):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
    return [statistics.median(times) * 1e6 for times in samples]


def in_run(sizes: list[int], steps: int) -> int:
    """TokenFlow's full decisions as they come while it serves the burst for `steps` steps
    after the warm-up: how many, and their mean, median and 90th percentile time (the frozen
    state of the other modes is one moment; memory is often short later in a run)."""
    print(f"{'active':>6s} {'decisions':>9s} {'mean ms':>8s} {'median ms':>9s} {'p90 ms':>7s}")
    for size in sizes:
        core, _ = busy_core("tokenflow", size, WARM_STEPS)
        policy = core.scheduler.policy
        decide, samples = policy.decide, []

        def timed(view: SchedulingView, decide=decide, samples=samples):
            start = time.perf_counter()
            moves = decide(view)
            samples.append((time.perf_counter() - start) * 1e3)
            return moves

        policy.decide = timed
        for _ in range(steps):
            core.step()
        samples.sort()
        p90 = samples[int(0.9 * len(samples))]
        mean, median = statistics.fmean(samples), statistics.median(samples)
        print(f"{size:6d} {len(samples):9d} {mean:8.3f} {median:9.3f} {p90:7.3f}", flush=True)
    return 0


def side_by_side(sizes: list[int], repeats: int, steps: int, cold_mib: int) -> list[dict]:
    """Decision and per-step medians of every policy at every size, one policy after the
    other, as the targets were set (timed in turn, the policies evict each other's data
    from the CPU caches: every figure read ~20-30% higher in a trial)."""
    rows = []
    for size in sizes:
        view = busy_view(size)
        print(f"{size} active, decision state: {composition(view)}", file=sys.stderr)
        for name in POLICY_NAMES:
            policy = make_policy(name, view.config, TokenFlowConfig(), AndesConfig())
            decision_us = interleaved_medians_us([partial(decision(policy), view)], repeats)[0]
            step_samples, state = step_cpu_ms(name, size, WARM_STEPS, steps, cold_mib)
            rows.append(
                {
                    "policy": name,
                    "num_active": size,
                    "ms_per_decision": round(decision_us / 1e3, 4),
                    "ms_per_step": round(statistics.median(step_samples), 4),
                    "step_state": state,
                }
            )
    return rows


def print_table(rows: list[dict]) -> None:
    base = {r["num_active"]: r for r in rows if r["policy"] == "fcfs"}
    print(
        f"{'policy':10s} {'active':>6s} {'ms/decision':>12s} {'x fcfs':>7s} "
        f"{'ms/step':>8s} {'x fcfs':>7s}  per-step state"
    )
    for r in rows:
        fcfs = base[r["num_active"]]
        decision_ratio = r["ms_per_decision"] / max(fcfs["ms_per_decision"], 1e-9)
        step_ratio = r["ms_per_step"] / max(fcfs["ms_per_step"], 1e-9)
        print(
            f"{r['policy']:10s} {r['num_active']:6d} {r['ms_per_decision']:12.3f} "
            f"{decision_ratio:7.1f} {r['ms_per_step']:8.3f} {step_ratio:7.2f}  {r['step_state']}"
        )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,400,1000")
    parser.add_argument("--repeats", type=int, default=200, help="timed decisions per policy")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per policy and size")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--per-step", action="store_true", help="calibrate the simulator")
    parser.add_argument(
        "--in-run",
        action="store_true",
        help="time TokenFlow's decisions as they come over --steps steps of serving",
    )
    parser.add_argument(
        "--cold-mib",
        type=int,
        default=0,
        help="read an array of this many MiB between timed steps (caches cold, as after a "
        "forward pass on the CPU); 0: warm",
    )
    return parser


def main() -> int:
    args = _parser().parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.per_step:
        return per_step(sizes, args.steps, args.cold_mib)
    if args.in_run:
        return in_run(sizes, args.steps)
    rows = side_by_side(sizes, args.repeats, args.steps, args.cold_mib)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
