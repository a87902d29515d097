"""`tokenflow tune`'s config against serve's defaults on the real engine, interleaved in one run.

For each chosen fidelity workload (benchmarks/fidelity.py): tune on a profile taken here (or
`--profile FILE`), then run TokenFlow on a fresh server with the defaults and with
`--config tuned.toml`, alternating which goes first, `--rounds` times, beside the CPU steal of
each run.  Prints, per workload, the objective's median for both, the other headline metrics,
and what the simulator predicted for both.

    .venv/bin/python -m benchmarks.tuned_vs_default --workloads burst-overload mixed-rates \
        --objective qoe --rounds 2 --out-dir tuned-run
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.fidelity import WORKLOADS, real_run, simulate_run, take_profile
from tokenflow.eval.workload import generate, save_trace

OBJECTIVE_KEY = {"qoe": "qoe_mean", "p99-ttft": "ttft_p99_s", "stall": "rebuffer_mean_s"}
HEADLINE = ("qoe_mean", "ttft_mean_s", "ttft_p99_s", "rebuffer_mean_s", "effective_throughput_tps")


def tune(workload, profile: Path, out_dir: Path, args: argparse.Namespace) -> Path:
    config = out_dir / f"tuned-{workload.name}.toml"
    command = [
        str(Path(sys.executable).parent / "tokenflow"), "tune", "--profile", str(profile),
        "--workload", str(out_dir / f"{workload.name}.jsonl"), "--device-kv-tokens",
        str(workload.device_kv_tokens), "--objective", args.objective, "--budget",
        str(args.budget), "--out", str(config),
    ]  # fmt: skip
    subprocess.run(command, check=True)
    return config


def compare(workload, config: Path, out_dir: Path, args: argparse.Namespace) -> list[dict]:
    runs = []
    trace = out_dir / f"{workload.name}.jsonl"
    for index in range(args.rounds):
        order = ("default", "tuned") if index % 2 == 0 else ("tuned", "default")
        for variant in order:
            extra = ("--config", str(config)) if variant == "tuned" else ()
            run = real_run(workload, "tokenflow", trace, args, extra) | {
                "variant": variant,
                "round": index,
            }
            s = run["summary"]
            print(f"{workload.name} {variant} round {index}: QoE {s['qoe_mean']:.3f}, P99 TTFT "
                  f"{s['ttft_p99_s']:.2f} s, stall {s['rebuffer_mean_s']:.2f} s, steal "
                  f"{run.get('steal_fraction', 0):.1%}", file=sys.stderr)  # fmt: skip
            runs.append(run)
    return runs


def report(workload, runs: list[dict], predicted: dict, objective: str) -> list[str]:
    key = OBJECTIVE_KEY[objective]
    lines = [f"**{workload.name}** (objective {objective}: `{key}`)", "",
             "| metric | defaults (real) | tuned (real) | defaults (sim) | tuned (sim) |",
             "|---|---|---|---|---|"]  # fmt: skip
    for metric in HEADLINE:
        cells = []
        for variant in ("default", "tuned"):
            values = [r["summary"][metric] for r in runs if r["variant"] == variant]
            cells.append(f"{statistics.median(values):.3g} [{min(values):.3g}-{max(values):.3g}]")
        cells += [f"{predicted[v][metric]:.3g}" for v in ("default", "tuned")]
        lines.append(f"| {metric} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["burst-overload", "mixed-rates"])
    parser.add_argument("--objective", choices=sorted(OBJECTIVE_KEY), default="qoe")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budget", type=int, default=40)
    parser.add_argument("--profile", default=None, help="an existing profile (default: take one)")
    parser.add_argument("--out-dir", default="tuned-run")
    parser.add_argument("--max-load", type=float, default=None)
    parser.add_argument("--max-wait-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    profile = Path(args.profile) if args.profile else out_dir / "profile-0.json"
    if not args.profile:
        take_profile(profile, args)
    lines, everything = [], []
    for workload in (w for w in WORKLOADS if w.name in args.workloads):
        save_trace(out_dir / f"{workload.name}.jsonl", generate(workload.spec))
        config = tune(workload, profile, out_dir, args)
        runs = compare(workload, config, out_dir, args)
        predicted = _predicted(workload, profile, config, out_dir)
        everything += runs
        lines += report(workload, runs, predicted, args.objective)
    (out_dir / "runs.json").write_text(json.dumps(everything, indent=1))
    print("\n".join(lines))
    return 0


def _predicted(workload, profile: Path, config: Path, out_dir: Path) -> dict[str, dict]:
    """The simulator's summaries for the defaults and for the tuned config."""
    import tomllib
    from dataclasses import replace

    from tokenflow.calibrate.profile_file import load_profile
    from tokenflow.core.config import POLICY_KNOBS, with_knobs

    knobs = tomllib.loads(config.read_text())
    base = load_profile(profile)
    tuned_config = with_knobs(
        base.tokenflow, {name: knobs.get(name.replace("_", "-")) for name in POLICY_KNOBS}
    )
    tuned_profile = out_dir / f"profile-tuned-{workload.name}.json"
    replace(base, tokenflow=tuned_config).save(tuned_profile)
    return {
        "default": simulate_run(profile, workload, "tokenflow", out_dir),
        "tuned": simulate_run(tuned_profile, workload, "tokenflow", out_dir),
    }


if __name__ == "__main__":
    raise SystemExit(main())
