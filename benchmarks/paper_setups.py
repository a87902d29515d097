"""The paper's eight setups in the simulator, every policy, several seeds: docs/results.md.

    python -m benchmarks.paper_setups [--seeds 3] [--setups 4090-a,h200-b] [--policies ...]
                                     [--no-ablations] [--workers 2] [--report-only]

Every (setup, policy, seed, variant) run is cached as JSON under --cache-dir, keyed by a hash of
the `tokenflow` sources, so an interrupted run resumes and a run after a code change starts
over.  Runs go to at most two worker processes.  Then it writes, from the cache:

- docs/results/<setup>.json: per policy, every seed's summary and the median / min / max;
- docs/results/<setup>.png: TTFT against stall per policy (medians, min-max error bars);
- docs/results/summary.json: tokenflow / fcfs ratios against the targets
  (`tokenflow.eval.report.check_targets`), and the ablations;
- docs/results.md: all of it as tables, keeping its hand-written blocks (the notes on the
  simulator, and the real engine's section after the tables) and the block of
  `benchmarks/profiled_workloads.py`.

The ablations run tokenflow on 4090-b and h200-b with each KV mechanism switched off (the
paper's §5-6; its completion times: 66.00 s full, 127.28 s without offload, 82.76 s without
write-through, 74.43 s without load-evict overlap).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from benchmarks.lib.rounds import count_arg
from tokenflow.core.config import TokenFlowConfig
from tokenflow.eval.plots import plot_spread
from tokenflow.eval.report import (
    Spread,
    TargetCheck,
    aggregate,
    check_targets,
    format_targets_table,
)
from tokenflow.eval.workload import generate
from tokenflow.sim.runner import run_simulation, setup_config
from tokenflow.sim.setups import get_setup, paper_setups

ROOT = Path(__file__).resolve().parent.parent
SETUPS = tuple(paper_setups())
POLICIES = ("fcfs", "chunked", "andes", "tokenflow")
VARIANTS = {
    "full": {},
    "no-offload": {"offload": False},
    "no-write-through": {"write_through": False},
    "no-load-evict-overlap": {"overlap_load_evict": False},
}
PAPER_ABLATION_S = {
    "full": 66.00,
    "no-offload": 127.28,
    "no-write-through": 82.76,
    "no-load-evict-overlap": 74.43,
}
ABLATION_SETUPS = ("4090-b", "h200-b")
# P99 TTFT bound (x fcfs) on the bursts that fit; 1.0 elsewhere
TIGHT_TTFT_BOUNDS = {"h200-b": 0.2, "h200-c": 0.3, "4090-a": 0.3}
# The hand-written blocks of docs/results.md, kept when it is regenerated: (begin, end) markers.
NOTES = ("<!-- notes: kept when regenerated -->", "<!-- /notes -->")
ENGINE = ("<!-- real engine: kept when regenerated -->", "<!-- /real engine -->")
RUNNERS = ("<!-- benchmarks: kept when regenerated -->", "<!-- /benchmarks -->")
# The block `benchmarks/profiled_workloads.py` writes (kept here, before the real engine's).
PROFILED = (
    "<!-- profiled workloads: written by benchmarks/profiled_workloads.py -->",
    "<!-- /profiled workloads -->",
)


@dataclass(frozen=True)
class Job:
    setup: str
    policy: str
    seed: int
    variant: str = "full"

    @property
    def key(self) -> str:
        return f"{self.setup}.{self.policy}.{self.variant}.s{self.seed}"


def code_version() -> str:
    """Hash of every tokenflow source file: a cached run is reused only for the same code."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "tokenflow").rglob("*.py")):
        digest.update(str(path.relative_to(ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def git_commit() -> str:
    """Short commit of the checkout, '+changes' when the tokenflow sources differ from it."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+changes" if git("status", "--porcelain", "tokenflow") else "")


def run_job(job: Job) -> tuple[Job, dict]:
    """Simulate one job (in a worker process)."""
    setup = get_setup(job.setup, seed=job.seed)
    config = setup_config(setup, **VARIANTS[job.variant])
    result = run_simulation(generate(setup.workload), job.policy, config)
    record = {
        "seed": job.seed,
        "summary": result.summary.to_dict(),
        "num_steps": result.num_steps,
        "num_loads": result.num_loads,
        "num_recomputes": result.num_recomputes,
        "d2h_gib": round(result.d2h_gib, 3),
        "h2d_gib": round(result.h2d_gib, 3),
        "scheduler_cpu_s": round(result.scheduler_cpu_s, 3),
        "wall_s": round(result.wall_s, 2),
    }
    return job, record


def run_all(jobs: list[Job], cache: Path, workers: int) -> tuple[dict[Job, dict], float]:
    """Results of `jobs`, from the cache or simulated now; and the wall time spent simulating."""
    results: dict[Job, dict] = {}
    todo = []
    for job in jobs:
        path = cache / f"{job.key}.json"
        if path.exists():
            results[job] = json.loads(path.read_text())
        else:
            todo.append(job)
    started = time.perf_counter()
    if todo:
        # Longest first (H200, tokenflow) so the two workers finish together.
        todo.sort(key=lambda j: (not j.setup.startswith("h200"), j.policy != "tokenflow"))
        cache.mkdir(parents=True, exist_ok=True)
        with multiprocessing.Pool(max(1, min(workers, 2))) as pool:
            for job, record in tqdm(
                pool.imap_unordered(run_job, todo), total=len(todo), desc="simulations"
            ):
                (cache / f"{job.key}.json").write_text(json.dumps(record, indent=1))
                results[job] = record
    return results, time.perf_counter() - started


def record_invocation(cache: Path, wall_s: float, num_simulated: int, workers: int) -> list[dict]:
    """Append this invocation's simulation time to the cache's log (when it simulated
    anything) and return the log: the report states the wall time of all runs of this code."""
    log = cache / "_invocations.json"
    invocations = json.loads(log.read_text()) if log.exists() else []
    if num_simulated:
        invocations.append(
            {"wall_s": round(wall_s, 1), "num_simulated": num_simulated, "workers": workers}
        )
        cache.mkdir(parents=True, exist_ok=True)
        log.write_text(json.dumps(invocations, indent=1))
    return invocations


# -- aggregation ----------------------------------------------------------------------------------
def spreads_of(results: dict[Job, dict], setup: str, policy: str, variant: str = "full"):
    runs = [
        r["summary"]
        for j, r in results.items()
        if (j.setup, j.policy, j.variant)
        == (
            setup,
            policy,
            variant,
        )
    ]
    return aggregate(runs) if runs else None


def targets(setup: str, tf: list[dict], fcfs: list[dict]) -> dict[str, TargetCheck]:
    """TokenFlow's targets against FCFS on `setup` (`check_targets`; runs paired by seed)."""
    bound = TIGHT_TTFT_BOUNDS.get(setup, 1.0)
    return check_targets([r["summary"] for r in tf], [r["summary"] for r in fcfs], bound)


# -- writing ---------------------------------------------------------------------------------------
COLUMNS = (
    ("throughput_tps", "tok/s", 0),
    ("effective_throughput_tps", "eff tok/s", 0),
    ("ttft_mean_s", "TTFT mean s", 1),
    ("ttft_p99_s", "TTFT P99 s", 1),
    ("rebuffer_mean_s", "stall mean s", 1),
    ("rebuffer_p99_s", "stall P99 s", 1),
    ("qoe_mean", "QoE", 3),
)


def setup_section(setup: str, per_policy: dict[str, dict[str, Spread]], extra: dict) -> list[str]:
    desc = paper_setups()[setup].description
    lines = [f"\n#### {setup} ({desc})\n", f"![{setup}](results/{setup}.png)\n"]
    lines.append("| policy | " + " | ".join(t for _, t, _ in COLUMNS) + " | preemptions |")
    lines.append("|---" * (len(COLUMNS) + 2) + "|")
    for policy, spreads in per_policy.items():
        cells = [spreads[k].text(d) for k, _, d in COLUMNS]
        lines.append(f"| {policy} | " + " | ".join(cells) + f" | {extra[policy]} |")
    return lines


def targets_table(all_targets: dict[str, dict[str, TargetCheck]]) -> list[str]:
    names = ("mean_stall_s", "p99_ttft", "qoe", "effective_tps", "raw_tps")
    titles = ("mean stall - fcfs", "P99 TTFT / fcfs", "QoE - fcfs", "eff. throughput / fcfs",
              "raw throughput / fcfs")  # fmt: skip
    lines = ["| setup | " + " | ".join(titles) + " |", "|---" * (len(names) + 1) + "|"]
    for setup, checks in all_targets.items():
        cells = []
        for name in names:
            c = checks[name].compared
            unit, fmt = (" s", "+.2f") if name == "mean_stall_s" else ("x", ".2f")
            if name == "qoe":
                unit, fmt = "", "+.3f"
            verdict = "pass" if checks[name].passed else "**FAIL**"
            cells.append(f"{c.median:{fmt}}{unit} [{c.minimum:{fmt}}, {c.maximum:{fmt}}] "
                         f"({checks[name].target}) {verdict}")  # fmt: skip
        lines.append(f"| {setup} | " + " | ".join(cells) + " |")
    return lines


def ablation_table(ablations: dict[str, dict[str, Spread]]) -> list[str]:
    lines = [
        "| setup | " + " | ".join(VARIANTS) + " |",
        "|---" * (len(VARIANTS) + 1) + "|",
    ]
    paper = [f"{PAPER_ABLATION_S[v]:.2f} s" for v in VARIANTS]
    for v_index, variant in enumerate(VARIANTS):
        if variant != "full":
            paper[v_index] += f" ({PAPER_ABLATION_S[variant] / PAPER_ABLATION_S['full'] - 1:+.1%})"
    lines.append("| paper | " + " | ".join(paper) + " |")
    for setup, by_variant in ablations.items():
        full = by_variant.get("full")
        cells = []
        for variant in VARIANTS:
            s = by_variant.get(variant)
            if s is None:
                cells.append("n/a")
                continue
            cell = f"{s.text(1)} s"
            if variant != "full" and full is not None:
                cell += f" ({s.median / full.median - 1:+.1%})"
            cells.append(cell)
        lines.append(f"| {setup} | " + " | ".join(cells) + " |")
    return lines


def kept_block(path: Path, markers: tuple[str, str]) -> str:
    """The hand-written block between `markers` in `path` (empty markers if none)."""
    begin, end = markers
    text = path.read_text() if path.exists() else ""
    if begin in text and end in text:
        return text[text.index(begin) : text.index(end) + len(end)]
    return f"{begin}\n{end}"


def header(meta: dict) -> list[str]:
    """The title, the command and what the simulator's tables were produced with."""
    tf_config = ", ".join(f"{k}={v}" for k, v in asdict(TokenFlowConfig()).items())
    return [
        "# Results",
        "",
        "The paper's eight setups in the simulator, then the real engine on a 2-core CPU. Each "
        "table comes with the command that regenerates it; the simulator's section is written by "
        "`benchmarks/paper_setups.py` (its tables are not edited by hand).",
        "",
        "## The paper's setups in the simulator",
        "",
        "```bash",
        f"python -m benchmarks.paper_setups --seeds {len(meta['seeds'])}",
        "```",
        "",
        f"- code: commit `{meta['commit']}`, tokenflow sources hash `{meta['code_version']}`",
        f"- tokenflow policy defaults: {tf_config}",
        f"- seeds {meta['seeds']}: each cell is the median [min-max] over them",
        f"- {meta['num_runs']} runs simulated in {meta['wall_s'] / 60:.1f} min wall on "
        f"{meta['workers']} worker processes ({meta['sum_run_s'] / 60:.1f} min summed over the "
        "runs)",
    ]


def write_report(args: argparse.Namespace, results: dict[Job, dict], meta: dict) -> None:
    """Per setup a JSON file and a plot under `args.out`, a summary.json, and the markdown."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    all_targets, per_setup_lines = {}, []
    for setup in args.setups:
        per_policy = {p: s for p in args.policies if (s := spreads_of(results, setup, p))}
        if not per_policy:
            continue
        runs = _full_runs(results, setup, per_policy)
        _write_setup(out, setup, per_policy, runs, meta)
        if "tokenflow" in per_policy and "fcfs" in per_policy:
            all_targets[setup] = targets(setup, runs["tokenflow"], runs["fcfs"])
        preemptions = {
            p: int(sorted(r["summary"]["num_preemptions"] for r in runs[p])[len(runs[p]) // 2])
            for p in per_policy
        }
        per_setup_lines += setup_section(setup, per_policy, preemptions)
    ablations = {
        setup: {
            v: s["makespan_s"]
            for v in VARIANTS
            if (s := spreads_of(results, setup, "tokenflow", v))
        }
        for setup in ABLATION_SETUPS
        if not args.no_ablations
    }
    summary = {
        **meta,
        "targets": {
            setup: {name: c.to_dict() for name, c in checks.items()}
            for setup, checks in all_targets.items()
        },
        "ablations": {
            setup: {v: s.to_dict() for v, s in by_v.items()} for setup, by_v in ablations.items()
        },
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if all_targets:
        print(format_targets_table(all_targets))
    _write_markdown(Path(args.markdown), meta, all_targets, ablations, per_setup_lines)


def _full_runs(results: dict[Job, dict], setup: str, policies: Iterable[str]) -> dict[str, list]:
    """Each policy's runs of the full system on `setup`, by seed."""
    return {
        p: [
            r
            for j, r in sorted(results.items(), key=lambda x: x[0].seed)
            if (j.setup, j.policy, j.variant) == (setup, p, "full")
        ]
        for p in policies
    }


def _write_setup(
    out: Path, setup: str, per_policy: dict[str, dict], runs: dict[str, list], meta: dict
) -> None:
    """`<setup>.json` (spreads and runs of every policy) and `<setup>.png`."""
    setup_json = {
        "setup": setup,
        "description": paper_setups()[setup].description,
        **meta,
        "policies": {
            p: {"spread": {k: v.to_dict() for k, v in per_policy[p].items()}, "runs": runs[p]}
            for p in per_policy
        },
    }
    (out / f"{setup}.json").write_text(json.dumps(setup_json, indent=1) + "\n")
    plot_spread(out / f"{setup}.png", setup, per_policy)


def _write_markdown(
    md: Path, meta: dict, all_targets: dict, ablations: dict, per_setup_lines: list[str]
) -> None:
    """docs/results.md: the header, the kept notes, the targets, the ablations, every setup,
    and the kept sections on the profiled workloads, the real engine and the benchmark runners."""
    tight = ", ".join(f"{b}x on {s}" for s, b in TIGHT_TTFT_BOUNDS.items())
    lines = header(meta) + ["", kept_block(md, NOTES), ""]
    lines += ["### TokenFlow against FCFS: the targets", ""]
    lines.append(
        "Each run of tokenflow against fcfs's on the same seed: median [min, max] over the seeds "
        f"(the verdict on the median). Targets: P99 TTFT <= fcfs everywhere ({tight}: the "
        "bursts that fit); mean stall <= fcfs's + max(0.1 s, 10%); QoE >= fcfs; effective "
        "throughput >= 1.3x; raw throughput >= 0.97x."
    )
    lines += ["", *targets_table(all_targets)]
    if ablations:
        lines += ["", "### Ablations of the KV mechanisms (paper §5-6): completion time", ""]
        lines += ablation_table(ablations)
    lines += ["", "### Per setup, every policy", *per_setup_lines, ""]
    lines += [kept_block(md, PROFILED), "", kept_block(md, ENGINE), ""]
    lines += [kept_block(md, RUNNERS), ""]
    md.write_text("\n".join(lines))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=count_arg, default=3, help="workload seeds 0 .. N-1")
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--no-ablations", action="store_true")
    parser.add_argument("--workers", type=int, default=2, help="processes (at most 2)")
    parser.add_argument("--cache-dir", default=str(ROOT / "build" / "paper_setups"))
    parser.add_argument("--out", default=str(ROOT / "docs" / "results"))
    parser.add_argument("--markdown", default=str(ROOT / "docs" / "results.md"))
    parser.add_argument("--report-only", action="store_true", help="simulate nothing new")
    args = parser.parse_args(argv)
    args.setups = [s for s in args.setups.split(",") if s]
    args.policies = [p for p in args.policies.split(",") if p]
    for name in args.setups:
        get_setup(name)
    unknown = set(args.policies) - set(POLICIES)
    if unknown or args.seeds < 1:
        parser.error(f"unknown policies {sorted(unknown)} or --seeds < 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    seeds = list(range(args.seeds))
    jobs = [Job(s, p, seed) for s in args.setups for p in args.policies for seed in seeds]
    if not args.no_ablations and "tokenflow" in args.policies:
        jobs += [
            Job(s, "tokenflow", seed, v)
            for s in ABLATION_SETUPS
            if s in args.setups
            for v in VARIANTS
            if v != "full"
            for seed in seeds
        ]
    version = code_version()
    cache = Path(args.cache_dir) / version
    if args.report_only:
        jobs = [j for j in jobs if (cache / f"{j.key}.json").exists()]
    num_cached = sum((cache / f"{j.key}.json").exists() for j in jobs)
    results, wall_s = run_all(jobs, cache, args.workers)
    invocations = record_invocation(cache, wall_s, len(jobs) - num_cached, args.workers)
    meta = {
        "commit": git_commit(),
        "code_version": version,
        "seeds": seeds,
        "workers": min(args.workers, 2),
        "wall_s": sum(i["wall_s"] for i in invocations),
        "num_invocations": len(invocations),
        "num_runs": len(jobs),
        "sum_run_s": sum(r["wall_s"] for r in results.values()),
    }
    write_report(args, results, meta)
    print(
        f"{len(jobs)} runs ({len(jobs) - num_cached} simulated) in {wall_s:.0f} s wall; "
        f"wrote {args.markdown}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
