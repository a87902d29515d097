"""How well `tokenflow simulate --profile` predicts the real server: five CPU workloads, FCFS and
TokenFlow, real runs interleaved over rounds against predictions from profiles taken in the run.

Each round takes a profile (`tokenflow profile`, the serving-path probe included), then runs
every workload against a fresh `tokenflow serve` per policy through the bench client, exactly
as `tokenflow bench --compare fcfs,tokenflow --serve-args "--device-kv-tokens N" --workload
trace --trace FILE` does (no warm-up), the order of workloads and policies alternating between
rounds.  Beside each real run: the CPU steal and busy shares of the VM while it ran
(`/proc/stat`), the 1-minute load before it, and the server's preemption counter (`/metrics`).
With `--max-load L` a run waits (up to `--max-wait-s`) until the load average is below L.

Predictions: the same traces through `simulate --profile`.  A shared CPU's speed drifts by tens
of percent within minutes, so each real run is predicted from the moments nearest it: the
profile taken just before it (`--profile-every round` or `workload`; its sweep scaled by the
serving probe that ended it) and the sweep of the profile taken next, averaged; a workload and
policy's prediction is the median over its runs, metric by metric (`--pooled`: every profile
fitted together instead).  The error of a metric is
|predicted - median of the real runs| / median, mean stall also as an absolute difference (the
target allows 0.5 s).  The policy order holds on a workload when, on P99 TTFT, mean TTFT,
effective throughput and QoE, the simulator and the real runs' medians rank the two policies
the same way (a real difference within the real runs' own spread counts as a tie).

    .venv/bin/python -m benchmarks.fidelity predict --rounds 2 --out-dir fidelity-run \
        --doc docs/fidelity.md --plot docs/results/fidelity.png

`--ablations` predicts again with each of the simulator's charges taken out (ABLATIONS below).

`tuned`: `tokenflow tune`'s config against serve's defaults on the real engine. For each chosen
workload: tune on a profile taken here (or `--profile FILE`), then run TokenFlow on a fresh
server with the defaults and with `--config tuned.toml`, rounds A B B A, beside the CPU steal of
each run; prints, per workload, the headline metrics' medians for both and what the simulator
predicted for both.

    .venv/bin/python -m benchmarks.fidelity tuned --workloads burst-overload mixed-rates \
        --objective qoe --rounds 2 --out-dir tuned-run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from benchmarks.lib.fidelity_doc import write_doc, write_plot
from benchmarks.lib.rounds import count_arg, round_order
from tokenflow.calibrate.costs import fit_compute, point_medians
from tokenflow.calibrate.machine import cpu_use, read_cpu_times
from tokenflow.calibrate.profile_file import Profile, PromptTokens, load_profile, pool_profiles
from tokenflow.eval.client import ClientConfig, run_workload
from tokenflow.eval.fidelity import WORKLOADS, Workload, analyse
from tokenflow.eval.local_server import local_server
from tokenflow.eval.metrics import summarize
from tokenflow.eval.workload import WorkloadSpec, generate, save_trace
from tokenflow.sim.profiled import ProfiledDeployment, build_profiled_engine
from tokenflow.sim.runner import SimConfig, run_engine

POLICIES = ("fcfs", "tokenflow")
# What each thing the profiled simulator charges is worth: the predictions again with one taken
# out (`--ablations`), and the median errors that result.
ABLATIONS = {
    "template": "prompts as the client's word counts (no chat template tokens)",
    "serving": "no engine or serving-path time per step or request (forward pass, scheduler)",
    "threads": "one line for every step (no one-thread regime for small steps)",
    "chunking": "whole prompts in one step (no chunk budget from --step-target-ms)",
    "anchoring": "each run on the profile before it only, as swept (no bracketing in time)",
}
# Deployment overrides an ablation needs (ProfiledDeployment fields).
DEPLOYMENT = {"chunking": {"step_target_ms": 1e9}}
OBJECTIVE_KEY = {"qoe": "qoe_mean", "p99-ttft": "ttft_p99_s", "stall": "rebuffer_mean_s"}
HEADLINE = ("qoe_mean", "ttft_mean_s", "ttft_p99_s", "rebuffer_mean_s", "effective_throughput_tps")


def wait_for_quiet(max_load: float | None, max_wait_s: float) -> float:
    """Wait until the 1-minute load average is below `max_load` (or `max_wait_s` passed)."""
    deadline = time.monotonic() + max_wait_s
    while max_load is not None and os.getloadavg()[0] >= max_load and time.monotonic() < deadline:
        time.sleep(5.0)
    return os.getloadavg()[0]


def take_profile(path: Path, args: argparse.Namespace) -> None:
    wait_for_quiet(args.max_load, args.max_wait_s)
    command = [str(Path(sys.executable).parent / "tokenflow"), "profile", "--out", str(path),
               "--rounds", "1", "--repeats", "2", "--no-progress"]  # fmt: skip
    subprocess.run(command, check=True)


def real_run(
    workload: Workload,
    policy: str,
    trace: Path,
    args: argparse.Namespace,
    extra_serve_args: tuple[str, ...] = (),
) -> dict:
    """One real run through a fresh server; its summary and what the machine did meanwhile."""
    load = wait_for_quiet(args.max_load, args.max_wait_s)
    requests = generate(WorkloadSpec(kind="trace", trace_path=str(trace)))
    serve_args = ["--device-kv-tokens", str(workload.device_kv_tokens), *extra_serve_args]
    with local_server(policy, serve_args) as url:
        before, started = read_cpu_times(), time.perf_counter()
        config = ClientConfig(url=url, show_progress=False, timeout_s=1800.0)
        run = asyncio.run(run_workload(requests, config, name=policy))
        use = cpu_use(before, read_cpu_times())
        summary = summarize(run.traces).to_dict()
        # The server is fresh, so what it counted during the run is all it ever counted.
        summary["num_preemptions"] = run.num_preemptions
    return {
        "workload": workload.name,
        "policy": policy,
        "summary": summary,
        "num_failed": run.num_failed,
        "wall_s": time.perf_counter() - started,
        "load_before": load,
        **(use.to_dict() if use else {}),
    }


def measure_round(index: int, out_dir: Path, args: argparse.Namespace) -> list[dict]:
    """Every workload and policy once, in this round's order, after a profile (one for the
    round, or one before each workload with `--profile-every workload`)."""
    workloads = round_order([w for w in WORKLOADS if not args.only or w.name in args.only], index)
    runs = []
    for position, w in enumerate(workloads):
        if position == 0 or args.profile_every == "workload":
            profile = out_dir / f"profile-{index}-{position}.json"  # ROUND-POSITION: the order
            take_profile(profile, args)
        for policy in round_order(POLICIES, index):
            run = real_run(w, policy, out_dir / f"{w.name}.jsonl", args)
            run |= {"round": index, "profile": profile.name}
            print(f"round {index} {w.name} {policy}: {_headline(run)}", file=sys.stderr)
            runs.append(run)
    return runs


def ablated(profile: Profile, name: str | None) -> Profile:
    """`profile` without what `name` takes out (unchanged for None and deployment ablations)."""
    if name == "template":
        words = PromptTokens(fixed_tokens=0.0, per_word=1.0)
        return replace(profile, prompt={k: words for k in profile.prompt})
    if name == "serving":
        served = {"server_step_s": 0.0, "server_per_chunk_s": 0.0, "request_path_s": 0.0}
        return replace(profile, costs=replace(profile.costs, **served))
    if name == "threads":
        compute = [s for s in point_medians(profile.samples) if s.num_tokens]
        one = fit_compute(compute)
        return replace(profile, costs=replace(profile.costs, serial=one, parallel=one))
    if name == "anchoring":
        as_swept = replace(profile.costs, speed_factor=1.0, prefill_speed_factor=1.0)
        return replace(profile, costs=as_swept)
    return profile


def simulate_run(
    profile_path: Path, workload: Workload, policy: str, out_dir: Path, ablation: str | None = None
) -> dict:
    """The summary `simulate --profile` predicts for one real run (its workload's trace), with
    one of the simulator's charges taken out if `ablation` names it (ABLATIONS)."""
    profile = ablated(load_profile(profile_path), ablation)
    trace = out_dir / f"{workload.name}.jsonl"
    requests = generate(WorkloadSpec(kind="trace", trace_path=str(trace)))
    deployment = ProfiledDeployment(
        profile, device_kv_tokens=workload.device_kv_tokens, **DEPLOYMENT.get(ablation or "", {})
    )
    engine = build_profiled_engine(deployment, policy)
    return run_engine(requests, policy, engine, SimConfig()).summary.to_dict()


def profile_order(out_dir: Path) -> list[str]:
    """The profiles of a run in the order they were taken (profile-ROUND-POSITION.json)."""
    paths = out_dir.glob("profile-[0-9]*-[0-9]*.json")
    return [p.name for p in sorted(paths, key=lambda p: tuple(map(int, p.stem.split("-")[1:])))]


def bracketed_prediction(
    run: dict, order: list[str], workload: Workload, out_dir: Path, ablation: str | None = None
) -> dict:
    """A real run's prediction from the moments nearest it: the profile before it as of its end
    (its sweep scaled by the probe that ended it), and the sweep of the profile after it (taken
    right after the run, unscaled); the mean of the two, metric by metric."""
    index = order.index(run["profile"])
    policy = run["policy"]
    summaries = [simulate_run(out_dir / order[index], workload, policy, out_dir, ablation)]
    if index + 1 < len(order) and ablation != "anchoring":
        after = load_profile(out_dir / order[index + 1])
        unscaled = out_dir / f"unscaled-{order[index + 1]}"
        as_swept = replace(after.costs, speed_factor=1.0, prefill_speed_factor=1.0)
        replace(after, costs=as_swept).save(unscaled)
        summaries.append(simulate_run(unscaled, workload, policy, out_dir, ablation))
    return {k: statistics.fmean(s[k] for s in summaries) for k in summaries[0]}


def predict(
    runs: list[dict], out_dir: Path, pooled: bool, ablation: str | None = None
) -> list[dict]:
    """Per workload and policy: the median, metric by metric, of the predictions for its real
    runs (each bracketed by the profiles before and after it; or all from the pooled profile)."""
    by_name = {w.name: w for w in WORKLOADS}
    order = profile_order(out_dir)
    if pooled:
        pool_profiles([load_profile(out_dir / p) for p in order]).save(
            out_dir / "profile-pooled.json"
        )
    predictions = []
    for name, policy in dict.fromkeys((r["workload"], r["policy"]) for r in runs):
        mine = [r for r in runs if (r["workload"], r["policy"]) == (name, policy)]
        if pooled:
            summaries = [simulate_run(out_dir / "profile-pooled.json", by_name[name], policy,
                                      out_dir)]  # fmt: skip
        else:
            summaries = [
                bracketed_prediction(r, order, by_name[name], out_dir, ablation) for r in mine
            ]
        median = {k: statistics.median(s[k] for s in summaries) for k in summaries[0]}
        predictions.append({"workload": name, "policy": policy, "summary": median,
                            "per_run": summaries})  # fmt: skip
    return predictions


def _headline(run: dict) -> str:
    s = run["summary"]
    return (
        f"{s['throughput_tps']:.1f} tok/s, TTFT mean {s['ttft_mean_s']:.2f} p99 "
        f"{s['ttft_p99_s']:.2f} s, stall {s['rebuffer_mean_s']:.2f} s, QoE {s['qoe_mean']:.3f}, "
        f"steal {run.get('steal_fraction', 0):.1%}, busy {run.get('busy_fraction', 0):.0%}"
    )


def doc_command(args: argparse.Namespace) -> str:
    """The shell line that regenerates docs/fidelity.md's block as this run did."""
    flags = f"--rounds {args.rounds} --out-dir {args.out_dir}"
    if args.max_load is not None:
        flags += f" --max-load {args.max_load:g}"
    if args.ablations:
        flags += " --ablations"
    return (
        f".venv/bin/python -m benchmarks.fidelity predict {flags} \\\n"
        "    --doc docs/fidelity.md --plot docs/results/fidelity.png"
    )


def run_predict(args: argparse.Namespace) -> int:
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    real_path = out_dir / "real.json"
    if not args.predict_only:
        for w in WORKLOADS:
            save_trace(out_dir / f"{w.name}.jsonl", generate(w.spec))
        runs = [run for i in range(args.rounds) for run in measure_round(i, out_dir, args)]
        real_path.write_text(json.dumps(runs, indent=1))
        take_profile(out_dir / f"profile-{args.rounds}-0.json", args)  # brackets the last runs
    runs = json.loads(real_path.read_text())
    predictions = predict(runs, out_dir, args.pooled)
    (out_dir / "predicted.json").write_text(json.dumps(predictions, indent=1))
    names = [w.name for w in WORKLOADS]
    result = analyse(runs, predictions, names)
    if args.ablations:
        result = replace(result, ablations={
            a: analyse(runs, predict(runs, out_dir, args.pooled, a), names).median_error
            for a in ABLATIONS
        })  # fmt: skip
    (out_dir / "fidelity.json").write_text(json.dumps(asdict(result), indent=1))
    print(result.text)
    if args.plot:
        write_plot(args.plot, result)
    if args.doc:
        write_doc(args.doc, result, WORKLOADS, doc_command(args), args.plot, ABLATIONS)
    return 0


# -- tuned: `tokenflow tune`'s config against the defaults ---------------------------------------
def tune(workload: Workload, profile: Path, out_dir: Path, args: argparse.Namespace) -> Path:
    config = out_dir / f"tuned-{workload.name}.toml"
    command = [
        str(Path(sys.executable).parent / "tokenflow"), "tune", "--profile", str(profile),
        "--workload", str(out_dir / f"{workload.name}.jsonl"), "--device-kv-tokens",
        str(workload.device_kv_tokens), "--objective", args.objective, "--budget",
        str(args.budget), "--out", str(config),
    ]  # fmt: skip
    subprocess.run(command, check=True)
    return config


def compare_tuned(
    workload: Workload, config: Path, out_dir: Path, args: argparse.Namespace
) -> list[dict]:
    """TokenFlow with the defaults and with the tuned config, rounds A B B A."""
    runs = []
    trace = out_dir / f"{workload.name}.jsonl"
    for index in range(args.rounds):
        for variant in round_order(("default", "tuned"), index):
            extra = ("--config", str(config)) if variant == "tuned" else ()
            run = real_run(workload, "tokenflow", trace, args, extra)
            run |= {"variant": variant, "round": index}
            s = run["summary"]
            print(f"{workload.name} {variant} round {index}: QoE {s['qoe_mean']:.3f}, P99 TTFT "
                  f"{s['ttft_p99_s']:.2f} s, stall {s['rebuffer_mean_s']:.2f} s, steal "
                  f"{run.get('steal_fraction', 0):.1%}", file=sys.stderr)  # fmt: skip
            runs.append(run)
    return runs


def tuned_report(
    workload: Workload, runs: list[dict], predicted: dict, objective: str
) -> list[str]:
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


def predicted_tuned(
    workload: Workload, profile: Path, config: Path, out_dir: Path
) -> dict[str, dict]:
    """The simulator's summaries for the defaults and for the tuned config."""
    import tomllib

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


def run_tuned(args: argparse.Namespace) -> int:
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    profile = Path(args.profile) if args.profile else out_dir / "profile-0.json"
    if not args.profile:
        take_profile(profile, args)
    lines, everything = [], []
    for workload in (w for w in WORKLOADS if w.name in args.workloads):
        save_trace(out_dir / f"{workload.name}.jsonl", generate(workload.spec))
        config = tune(workload, profile, out_dir, args)
        runs = compare_tuned(workload, config, out_dir, args)
        predicted = predicted_tuned(workload, profile, config, out_dir)
        everything += runs
        lines += tuned_report(workload, runs, predicted, args.objective)
    (out_dir / "runs.json").write_text(json.dumps(everything, indent=1))
    print("\n".join(lines))
    return 0


# -- arguments -----------------------------------------------------------------------------------
def add_predict_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--rounds", type=count_arg, default=2)
    add("--out-dir", default="fidelity-run")
    add("--only", nargs="*", default=[], help="workload names (default: all)")
    add(
        "--profile-every",
        choices=("round", "workload"),
        default="round",
        help="re-take the profile once a round, or before every workload's pair of runs",
    )
    add("--pooled", action="store_true", help="predict from all profiles pooled into one fit")
    add("--predict-only", action="store_true", help="reuse OUT_DIR's real runs")
    add("--ablations", action="store_true", help="also predict with each charge taken out")
    add("--doc", default=None, help="write the report (markdown) here")
    add("--plot", default=None, help="write the predicted-vs-measured PNG here")  # fmt: skip


def add_tuned_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--workloads",
        nargs="+",
        default=["burst-overload", "mixed-rates"],
        choices=[w.name for w in WORKLOADS],
    )
    add("--objective", choices=sorted(OBJECTIVE_KEY), default="qoe")
    add("--rounds", type=count_arg, default=2)
    add("--budget", type=int, default=40)
    add("--profile", default=None, help="an existing profile (default: take one)")
    add("--out-dir", default="tuned-run")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, add_arguments, run, summary in (
        ("predict", add_predict_arguments, run_predict,
         "real runs against `simulate --profile`'s predictions: every metric's error"),
        ("tuned", add_tuned_arguments, run_tuned,
         "`tokenflow tune`'s config against the defaults on the real engine"),
    ):  # fmt: skip
        sub = commands.add_parser(name, allow_abbrev=False, help=summary, description=summary)
        add_arguments(sub)
        sub.add_argument("--max-load", type=float, default=None, help="wait for a quieter CPU")
        sub.add_argument("--max-wait-s", type=float, default=600.0)
        sub.set_defaults(run=run)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
