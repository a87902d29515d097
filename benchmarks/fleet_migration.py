"""Streams that move between replicas, in the simulator: the migration tables of
docs/replicas.md.

    python -m benchmarks.fleet_migration [--seeds 3] [--workers 2]

Each run is the same as

    tokenflow simulate --setup SETUP --router tokenflow --migrate MODE --seed SEED --json OUT

on `fleet-h200-scaleout` (a burst onto 4 H200s, 4 more joining at 60 s) and
`fleet-h200-rolling` (8 H200s at 40 req/s, restarted one at a time), every `--migrate` mode,
and, as the fleet that is never restarted, `fleet-h200-poisson-40` (the same replicas and the
same workload, no restart).  Runs are cached as JSON under --cache-dir (keyed by setup, mode
and seed; give --fresh after a change to the code).  Then it rewrites the block between the
markers of docs/replicas.md: median [min-max] over the seeds, the moves and cuts, and the
targets (scale-out: P99 TTFT with migration <= 0.6x without, mean stall and QoE no worse;
rolling: no stream cut, P99 TTFT and mean stall within 5% of the fleet never restarted).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
from pathlib import Path

from benchmarks.lib.rounds import count_arg
from tokenflow.core.rebalance import MigrateMode
from tokenflow.eval.metrics import Summary
from tokenflow.eval.report import aggregate, format_spread_table, write_marked_block
from tokenflow.eval.workload import generate
from tokenflow.sim.fleet import FleetConfig, run_fleet
from tokenflow.sim.fleet_setups import fleet_changes, fleet_replicas, fleet_setups
from tokenflow.sim.runner import SimConfig

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- migration tables: begin -->", "<!-- migration tables: end -->"
ROUTER = "tokenflow"
SCALEOUT, ROLLING, STEADY = "fleet-h200-scaleout", "fleet-h200-rolling", "fleet-h200-poisson-40"
COMPARED = ("ttft_p99_s", "rebuffer_mean_s", "qoe_mean")


def run_job(job: tuple[str, str, int, str]) -> dict:
    """One (setup, migrate mode, seed) run, cached."""
    setup_name, mode, seed, cache_dir = job
    path = Path(cache_dir) / f"{setup_name}-{mode}-{seed}.json"
    if path.exists():
        return json.loads(path.read_text())
    setup = fleet_setups(seed)[setup_name]
    base = SimConfig()
    config = FleetConfig(
        fleet_replicas(setup, base),
        changes=fleet_changes(setup, base),
        migrate=MigrateMode(mode),
    )
    result = run_fleet(generate(setup.workload), ROUTER, config)
    record = {
        "setup": setup_name,
        "mode": mode,
        "seed": seed,
        "summary": result.summary.to_dict(),
        "num_moved": result.num_moved,
        "num_cut": result.num_cut,
        "wall_s": result.wall_s,
    }
    path.write_text(json.dumps(record, indent=1))
    return record


def _label(setup: str, mode: str) -> str:
    return "never restarted" if setup == STEADY else f"migrate {mode}"


def section(title: str, runs: dict[str, list[dict]], command: str) -> list[str]:
    """One table: a row per label, median [min-max] over the seeds, then moves and cuts."""
    num_seeds = max(len(v) for v in runs.values())
    rounds = [
        {label: Summary(**records[i]["summary"]) for label, records in runs.items()}
        for i in range(num_seeds)
    ]
    lines = [f"### {title}", "", "```", format_spread_table(rounds, "fleet"), ""]
    for label, records in runs.items():
        moved = statistics.median(r["num_moved"] for r in records)
        cut = [r["num_cut"] for r in records]
        lines.append(f"{label}: moves (median) {moved:g}, streams cut per seed {cut}")
    return [*lines, "```", "", f"One seed: `{command}`.", ""]


def _median(records: list[dict], key: str) -> float:
    return aggregate([r["summary"] for r in records], COMPARED)[key].median


def scaleout_verdict(runs: dict[str, list[dict]]) -> str:
    """Migration (paused) against none, on the same router."""
    on, off = runs["migrate paused"], runs["migrate off"]
    ratio = _median(on, "ttft_p99_s") / _median(off, "ttft_p99_s")
    stall_on, stall_off = _median(on, "rebuffer_mean_s"), _median(off, "rebuffer_mean_s")
    qoe_on, qoe_off = _median(on, "qoe_mean"), _median(off, "qoe_mean")
    passed = ratio <= 0.6 and stall_on <= stall_off and qoe_on >= qoe_off
    return (
        f"Migration (paused) vs none: P99 TTFT {ratio:.2f}x (<= 0.6x), mean stall "
        f"{stall_on:.2f} s vs {stall_off:.2f} s, QoE {qoe_on:.3f} vs {qoe_off:.3f}: "
        f"{'pass' if passed else 'FAIL'}"
    )


def rolling_verdict(runs: dict[str, list[dict]]) -> str:
    """Restarted with migration (paused) against never restarted."""
    on, steady = runs["migrate paused"], runs["never restarted"]
    num_cut = max(r["num_cut"] for r in on)
    ttft = _median(on, "ttft_p99_s") / _median(steady, "ttft_p99_s")
    stall_on, stall_steady = _median(on, "rebuffer_mean_s"), _median(steady, "rebuffer_mean_s")
    stall = stall_on / stall_steady if stall_steady else (1.0 if not stall_on else float("inf"))
    passed = num_cut == 0 and ttft <= 1.05 and stall <= 1.05
    return (
        f"Restarted with migration (paused) vs never restarted: streams cut {num_cut}, P99 TTFT "
        f"{ttft:.2f}x (<= 1.05x), mean stall {stall_on:.3f} s vs {stall_steady:.3f} s "
        f"({stall:.2f}x, <= 1.05x): {'pass' if passed else 'FAIL'}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=count_arg, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache/tokenflow-bench/migrate"))
    parser.add_argument("--fresh", action="store_true", help="ignore the cache")
    parser.add_argument("--markdown", default=str(ROOT / "docs" / "replicas.md"))
    args = parser.parse_args(argv)
    Path(args.cache_dir).mkdir(parents=True, exist_ok=True)
    if args.fresh:
        for old in Path(args.cache_dir).glob("*.json"):
            old.unlink()
    modes = [m.value for m in MigrateMode]
    plan = [(SCALEOUT, m) for m in modes] + [(STEADY, "off")] + [(ROLLING, m) for m in modes]
    jobs = [(s, m, seed, args.cache_dir) for seed in range(args.seeds) for s, m in plan]
    with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
        records = pool.map(run_job, jobs, chunksize=1)

    def runs(setups: tuple[str, ...]) -> dict[str, list[dict]]:
        chosen = [(s, m) for s, m in plan if s in setups]
        return {
            _label(s, m): sorted(
                (r for r in records if r["setup"] == s and r["mode"] == m),
                key=lambda r: r["seed"],
            )
            for s, m in chosen
        }

    setups = fleet_setups()
    command = "tokenflow simulate --setup {} --router tokenflow --migrate MODE --seed S --json OUT"
    scaleout = runs((SCALEOUT,))
    rolling = runs((STEADY, ROLLING))
    sections = section(
        f"{SCALEOUT}: {setups[SCALEOUT].description}", scaleout, command.format(SCALEOUT)
    )
    sections += [scaleout_verdict(scaleout), ""]
    steady = f"`; never restarted: `tokenflow simulate --setup {STEADY} --router tokenflow --seed S"
    sections += section(
        f"{ROLLING}: {setups[ROLLING].description}", rolling, command.format(ROLLING) + steady
    )
    sections += [rolling_verdict(rolling), ""]
    print("\n".join(sections), flush=True)
    write_marked_block(Path(args.markdown), BEGIN, END, sections)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
