"""The fleet presets in the simulator, every router, several seeds: the tables of
docs/replicas.md.

    python -m benchmarks.fleet_routers [--seeds 3] [--setups fleet-h200-burst,...]
                                      [--routers ...] [--report-period-s 1] [--workers 2]

Each (setup, router, seed) run is the same as

    tokenflow simulate --setup SETUP --routers ROUTER --seed SEED --report-period-s P --json OUT

and is cached as JSON under --cache-dir (keyed by the setup, router, seed and period; clear it,
or give --fresh, after a change to the code), so an interrupted run resumes.  Then it rewrites
each setup's block of docs/replicas.md (the others are kept): each router's median [min-max]
over the seeds, the requests per replica, and the TokenFlow rule against least-outstanding on
the targets (P99 TTFT <= 0.7x, QoE >= 1.0x, mean stall <= max(1 s, its) for bursts; for
Poisson no metric worse by more than 5%).  A preset with prefix caching (fleet-h200-chat) runs
prefix-affinity too, gives each router's prefix hit rate, and is judged against the better of
least-outstanding and prefix-affinity (by P99 TTFT): P99 TTFT <= 0.7x, mean stall <= its + 0.1
s, QoE >= its.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
from pathlib import Path
from statistics import median

from benchmarks.lib.rounds import count_arg
from tokenflow.core.routing import ROUTER_NAMES
from tokenflow.eval.metrics import Summary
from tokenflow.eval.report import aggregate, format_spread_table, write_marked_block
from tokenflow.eval.workload import generate
from tokenflow.sim.fleet import FleetConfig, run_fleet
from tokenflow.sim.fleet_setups import fleet_changes, fleet_replicas, fleet_setups
from tokenflow.sim.runner import SimConfig

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- fleet tables: begin -->", "<!-- fleet tables: end -->"
HIGHER_IS_BETTER = ("qoe_mean", "effective_throughput_tps", "throughput_tps")
COMPARED = ("ttft_mean_s", "ttft_p99_s", "rebuffer_mean_s", "rebuffer_p99_s", *HIGHER_IS_BETTER)


def run_job(job: tuple[str, str, int, float, str]) -> dict:
    """One (setup, router, seed, period) run, cached."""
    setup_name, router, seed, period_s, cache_dir = job
    path = Path(cache_dir) / f"{setup_name}-{router}-{seed}-{period_s:g}.json"
    if path.exists():
        return json.loads(path.read_text())
    setup = fleet_setups(seed)[setup_name]
    base = SimConfig()
    config = FleetConfig(
        fleet_replicas(setup, base), report_period_s=period_s, changes=fleet_changes(setup, base)
    )
    result = run_fleet(generate(setup.workload), router, config)
    record = {
        "setup": setup_name,
        "router": router,
        "seed": seed,
        "summary": result.summary.to_dict(),
        "requests_by_replica": list(result.num_requests_by_replica),
        "prefix_hit_rate": result.prefix_cache.hit_rate if result.prefix_cache else None,
        "wall_s": result.wall_s,
    }
    path.write_text(json.dumps(record, indent=1))
    return record


def routers_of(setup: str, routers: list[str]) -> list[str]:
    """The routers a preset runs: prefix-affinity only where the replicas cache prefixes
    (elsewhere it is least-outstanding)."""
    cached = fleet_setups()[setup].prefix_caching
    return [r for r in routers if cached or r != "prefix-affinity"]


def chat_verdict(runs: dict[str, list[dict]]) -> str:
    """The TokenFlow rule against the better of least-outstanding and prefix-affinity (by
    median P99 TTFT), on medians over the seeds."""
    peers = [r for r in ("least-outstanding", "prefix-affinity") if r in runs]
    if "tokenflow" not in runs or not peers:
        return ""
    medians = {r: aggregate([x["summary"] for x in runs[r]], COMPARED) for r in runs}
    best = min(peers, key=lambda r: medians[r]["ttft_p99_s"].median)
    tf, base = medians["tokenflow"], medians[best]
    p99 = tf["ttft_p99_s"].median / base["ttft_p99_s"].median
    stall, stall_bound = tf["rebuffer_mean_s"].median, base["rebuffer_mean_s"].median + 0.1
    qoe, qoe_bound = tf["qoe_mean"].median, base["qoe_mean"].median
    passed = p99 <= 0.7 and stall <= stall_bound and qoe >= qoe_bound
    hits = ", ".join(f"{r} {median([x['prefix_hit_rate'] for x in runs[r]]):.1%}" for r in runs)
    return (
        f"TokenFlow rule vs {best}: P99 TTFT {p99:.2f}x (<= 0.7x), mean stall {stall:.2f} s "
        f"(<= {stall_bound:.2f} s), QoE {qoe:.3f} (>= {qoe_bound:.3f}): "
        f"{'pass' if passed else 'FAIL'}.  Prefix hit rate (median): {hits}"
    )


def verdict(setup: str, runs: dict[str, list[dict]]) -> str:
    """The TokenFlow rule against least-outstanding, on medians over the seeds."""
    if fleet_setups()[setup].prefix_caching:
        return chat_verdict(runs)
    if "tokenflow" not in runs or "least-outstanding" not in runs:
        return ""
    tf = aggregate([r["summary"] for r in runs["tokenflow"]], COMPARED)
    lo = aggregate([r["summary"] for r in runs["least-outstanding"]], COMPARED)

    def ratio(key: str) -> float:
        base = lo[key].median
        return tf[key].median / base if base else (1.0 if not tf[key].median else float("inf"))

    if "burst" in setup:
        stall_bound = max(1.0, lo["rebuffer_mean_s"].median)
        checks = [
            f"P99 TTFT {ratio('ttft_p99_s'):.2f}x (<= 0.7x)",
            f"QoE {ratio('qoe_mean'):.3f}x (>= 1.0x)",
            f"mean stall {tf['rebuffer_mean_s'].median:.2f} s (<= {stall_bound:.2f} s)",
        ]
        passed = (
            ratio("ttft_p99_s") <= 0.7
            and ratio("qoe_mean") >= 1.0
            and tf["rebuffer_mean_s"].median <= stall_bound
        )
    else:
        worse = {
            key: (1 / ratio(key) if key in HIGHER_IS_BETTER else ratio(key))
            for key in COMPARED
            if lo[key].median and tf[key].median
        }
        worst = max(worse, key=worse.get)
        stall_keys = [k for k in COMPARED if k.startswith("rebuffer")]
        checks = [f"worst ratio {worse[worst]:.3f}x ({worst})"]
        checks += [f"{k} {tf[k].median:.2f} s vs {lo[k].median:.2f} s" for k in stall_keys]
        passed = all(v <= 1.05 for v in worse.values()) and all(
            tf[k].median <= 1.05 * lo[k].median + 0.05 for k in stall_keys
        )
    return (
        f"TokenFlow rule vs least-outstanding: {', '.join(checks)}: {'pass' if passed else 'FAIL'}"
    )


def setup_section(setup: str, runs: dict[str, list[dict]], period_s: float) -> list[str]:
    rounds = []
    num_seeds = max(len(v) for v in runs.values())
    for index in range(num_seeds):
        rounds.append(
            {
                router: Summary(**records[index]["summary"])
                for router, records in runs.items()
                if index < len(records)
            }
        )
    spec = fleet_setups()[setup]
    lines = [f"### {setup}: {spec.description}", "", "```", format_spread_table(rounds, "router")]
    lines.append("")
    for router, records in runs.items():
        lines.append(f"{router}: requests per replica (seed 0) {records[0]['requests_by_replica']}")
    lines += ["```", "", verdict(setup, runs), ""]
    command = (
        f"tokenflow simulate --setup {setup} --routers {','.join(runs)} --seed S "
        f"--report-period-s {period_s:g} --json OUT"
    )
    return [*lines, f"One seed: `{command}`.", ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=count_arg, default=3)
    # (the presets whose replicas join or leave are benchmarks.fleet_migration's)
    steady = [n for n, s in fleet_setups().items() if not (s.joins_at_s or s.restarts_at_s)]
    parser.add_argument("--setups", default=",".join(steady))
    parser.add_argument("--routers", default=",".join(ROUTER_NAMES))
    parser.add_argument("--report-period-s", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache/tokenflow-bench/fleet"))
    parser.add_argument("--fresh", action="store_true", help="ignore the cache")
    parser.add_argument("--markdown", default=str(ROOT / "docs" / "replicas.md"))
    args = parser.parse_args(argv)
    Path(args.cache_dir).mkdir(parents=True, exist_ok=True)
    if args.fresh:
        for old in Path(args.cache_dir).glob("*.json"):
            old.unlink()
    setups, routers = args.setups.split(","), args.routers.split(",")
    jobs = [
        (s, r, seed, args.report_period_s, args.cache_dir)
        for s in setups
        for seed in range(args.seeds)
        for r in routers_of(s, routers)
    ]
    with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
        records = pool.map(run_job, jobs, chunksize=1)
    for setup in setups:
        runs = {
            r: sorted(
                (x for x in records if x["setup"] == setup and x["router"] == r),
                key=lambda x: x["seed"],
            )
            for r in routers_of(setup, routers)
        }
        section = setup_section(setup, runs, args.report_period_s)
        print("\n".join(section), flush=True)
        write_setup_block(Path(args.markdown), setup, section)
    return 0


def write_setup_block(path: Path, setup: str, lines: list[str]) -> None:
    """Rewrite `setup`'s own block of the tables at `path`, the other presets' kept (a preset
    new to the page gets a block at the tables' end)."""
    begin, end = f"<!-- fleet table {setup}: begin -->", f"<!-- fleet table {setup}: end -->"
    text = path.read_text() if path.exists() else f"{BEGIN}\n{END}\n"
    if begin not in text:
        path.write_text(text.replace(END, f"{begin}\n{end}\n{END}", 1))
    write_marked_block(path, begin, end, lines)


if __name__ == "__main__":
    raise SystemExit(main())
