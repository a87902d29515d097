"""What the scheduler's own CPU time costs TokenFlow on the paper's setups, in the simulator.

TokenFlow serves every paper setup over several seeds with three scheduler charges
(`tokenflow/sim/overhead.py`: fixed + per-active-request seconds per step):

- none: the scheduler is free (what the simulator charged before it was honest);
- now: the calibrated charge of this code (the default of every simulation);
- before: the charge calibrated the same way on the code before the hot-path work of
  issue 9 (0.387 ms + 0.794 us per active request);
- cold: this code's charge with the CPU caches cold at every step (`python -m
  benchmarks.scheduler_overhead --per-step --sizes 50,200,400,800 --steps 200 --cold-mib 64`,
  twice: 0.564 ms + 0.972 us and 0.511 + 0.666, averaged), a bound from above on a GPU, where
  the forward pass leaves more of the CPU caches to the scheduler.

Per setup it prints each charge's median [min-max] over the seeds, then the ratios of the
medians to the free scheduler: what the hot path bought on simulated GPUs, and what the
scheduler still costs.

    python -m benchmarks.scheduler_charge [--seeds 3] [--setups h200-a,h200-c] [--workers 2]
                                          [--plot docs/results/scheduler_charge.png]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
from dataclasses import dataclass

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from tqdm import tqdm

from tokenflow.metrics import Summary
from tokenflow.report import format_spread_table
from tokenflow.sim.overhead import SchedulerOverhead, default_overhead
from tokenflow.sim.runner import run_simulation, setup_config
from tokenflow.sim.setups import get_setup, paper_setups
from tokenflow.workload import generate

POLICY = "tokenflow"
CHARGES: dict[str, SchedulerOverhead | None] = {
    "none": SchedulerOverhead(0.0, 0.0),
    "now": None,  # the calibrated default
    "before": SchedulerOverhead(0.387e-3, 0.794e-6),
    "cold": SchedulerOverhead(0.538e-3, 0.819e-6),
}
RATIO_KEYS = (
    ("throughput_tps", "raw tok/s"),
    ("effective_throughput_tps", "eff tok/s"),
    ("qoe_mean", "QoE"),
)


@dataclass(frozen=True)
class Job:
    setup: str
    charge: str
    seed: int


def run_job(job: Job) -> tuple[Job, Summary]:
    """Simulate one (setup, charge, seed) in a worker process."""
    setup = get_setup(job.setup, seed=job.seed)
    config = setup_config(setup, scheduler_overhead=CHARGES[job.charge])
    return job, run_simulation(generate(setup.workload), POLICY, config).summary


def charge_text(name: str) -> str:
    overhead = CHARGES[name] or default_overhead(POLICY)
    return f"{overhead.fixed_s * 1e3:.3f} ms + {overhead.per_request_s * 1e6:.3f} us x active"


def ratio_to_free(rounds: list[dict[str, Summary]], charge: str, key: str) -> float:
    """`charge`'s median of `key` over the seeds, over the free scheduler's."""

    def median(name: str) -> float:
        return statistics.median(getattr(one[name], key) for one in rounds)

    return median(charge) / median("none")


def ratios(rounds: list[dict[str, Summary]]) -> str:
    """Each charge's medians over the seeds, as ratios to the free scheduler's."""
    cells = []
    for charge in CHARGES:
        if charge != "none":
            parts = (f"{ratio_to_free(rounds, charge, k):.3f}x {t}" for k, t in RATIO_KEYS)
            cells.append(f"{charge}: " + ", ".join(parts))
    return "  against none: " + "; ".join(cells)


def plot(path: str, by_setup: dict[str, list[dict[str, Summary]]]) -> None:
    """Per setup, each charge's median raw and effective throughput relative to the free
    scheduler's, as grouped bars (one panel per metric)."""
    figure = Figure(figsize=(12, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    charged = [c for c in CHARGES if c != "none"]
    width = 0.8 / len(charged)
    for ax, (key, title) in zip(figure.subplots(1, 2), RATIO_KEYS[:2], strict=True):
        for index, charge in enumerate(charged):
            values = [ratio_to_free(rounds, charge, key) for rounds in by_setup.values()]
            shift = (index - (len(charged) - 1) / 2) * width
            xs = [i + shift for i in range(len(by_setup))]
            ax.bar(xs, values, width, label=f"{charge}: {charge_text(charge)}", color=f"C{index}")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks(range(len(by_setup)), list(by_setup))
        ax.set_ylim(0.9, 1.06)
        ax.set(title=f"{POLICY}: {title} against a free scheduler", ylabel="ratio of medians")
        ax.legend(fontsize=8)
    figure.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--setups", default=",".join(paper_setups()))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--plot", help="also write the ratios as a PNG to this path")
    args = parser.parse_args()
    setups = args.setups.split(",")
    for name in setups:
        get_setup(name)  # (ValueError naming the valid setups)
    jobs = [Job(s, c, seed) for s in setups for c in CHARGES for seed in range(args.seeds)]
    results: dict[Job, Summary] = {}
    with multiprocessing.Pool(max(1, args.workers)) as pool:
        for job, summary in tqdm(pool.imap_unordered(run_job, jobs), total=len(jobs)):
            results[job] = summary
    for name in CHARGES:
        print(f"{name}: {charge_text(name)}")
    by_setup = {
        setup: [{c: results[Job(setup, c, seed)] for c in CHARGES} for seed in range(args.seeds)]
        for setup in setups
    }
    for setup, rounds in by_setup.items():
        print(f"\n{setup} ({POLICY}, {args.seeds} seeds, median [min-max])")
        print(format_spread_table(rounds, label="charge"))
        print(ratios(rounds))
    if args.plot:
        plot(args.plot, by_setup)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
