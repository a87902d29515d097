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

    .venv/bin/python -m benchmarks.fidelity --rounds 2 --out-dir fidelity-run \
        --doc docs/fidelity.md --plot docs/results/fidelity.png
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
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx

from benchmarks.fidelity_ablations import ABLATIONS, DEPLOYMENT, ablated
from benchmarks.fidelity_report import analyse, write_doc, write_plot
from tokenflow.calibrate.machine import cpu_use, read_cpu_times
from tokenflow.calibrate.profile_file import load_profile, pool_profiles
from tokenflow.eval.client import ClientConfig, run_workload
from tokenflow.eval.compare import local_server
from tokenflow.eval.metrics import summarize
from tokenflow.eval.workload import LengthDist, RateMix, WorkloadSpec, generate, save_trace
from tokenflow.sim.profiled import ProfiledDeployment, build_profiled_engine
from tokenflow.sim.runner import SimConfig, run_engine

POLICIES = ("fcfs", "tokenflow")


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    spec: WorkloadSpec
    device_kv_tokens: int


def _spec(kind: str, n: int, prompt: str, output: str, rates: str, rate: float = 1.0):
    return WorkloadSpec(
        kind=kind,
        num_requests=n,
        request_rate=rate,
        prompt=LengthDist.parse(prompt, minimum=8),
        output=LengthDist.parse(output, minimum=8),
        rates=RateMix.parse(rates),
        seed=0,
    )


WORKLOADS = (
    Workload("burst-fits", "burst of 8 within capacity, prompt 96 / output 128, readers 2-4 tok/s",
             _spec("burst", 8, "96", "128", "2:0.5,4:0.5"), 8192),
    Workload("burst-overload", "burst of 16, prompt 128 / output 160, readers 2-4 tok/s, device KV "
             "1664 tokens", _spec("burst", 16, "128", "160", "2:0.5,4:0.5"), 1664),
    Workload("poisson", "Poisson 1 req/s x 24, prompt 96:32 / output 128:32, readers 2-4 tok/s",
             _spec("poisson", 24, "96:32", "128:32", "2:0.5,4:0.5", 1.0), 2048),
    Workload("mixed-rates", "burst of 16, prompt 64:16 / output 160:32, readers 2, 4, 8, 16 tok/s",
             _spec("burst", 16, "64:16", "160:32", "2,4,8,16"), 2048),
    Workload("long-prompts", "Poisson 0.5 req/s x 10, prompt 1024:256 / output 64:16, readers "
             "4 tok/s", _spec("poisson", 10, "1024:256", "64:16", "4", 0.5), 4096),
)  # fmt: skip


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


def preemptions(url: str) -> int:
    """The server's `tokenflow_preemptions` counter."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    for line in text.splitlines():
        if line.startswith("tokenflow_preemptions_total") or line.startswith(
            "tokenflow_preemptions "
        ):
            return int(float(line.split()[-1]))
    return 0


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
        summary["num_preemptions"] = preemptions(url)
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
    workloads = [w for w in WORKLOADS if not args.only or w.name in args.only]
    if index % 2:
        workloads.reverse()
    runs = []
    for position, w in enumerate(workloads):
        if position == 0 or args.profile_every == "workload":
            profile = out_dir / f"profile-{index}-{position}.json"  # ROUND-POSITION: the order
            take_profile(profile, args)
        policies = POLICIES if index % 2 == 0 else tuple(reversed(POLICIES))
        for policy in policies:
            run = real_run(w, policy, out_dir / f"{w.name}.jsonl", args)
            run |= {"round": index, "profile": profile.name}
            print(f"round {index} {w.name} {policy}: {_headline(run)}", file=sys.stderr)
            runs.append(run)
    return runs


def simulate_run(
    profile_path: Path, workload: Workload, policy: str, out_dir: Path, ablation: str | None = None
) -> dict:
    """The summary `simulate --profile` predicts for one real run (its workload's trace), with
    one of the simulator's charges taken out if `ablation` names it (fidelity_ablations.py)."""
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out-dir", default="fidelity-run")
    parser.add_argument("--only", nargs="*", default=[], help="workload names (default: all)")
    parser.add_argument("--max-load", type=float, default=None, help="wait for a quieter CPU")
    parser.add_argument("--max-wait-s", type=float, default=600.0)
    parser.add_argument(
        "--profile-every",
        choices=("round", "workload"),
        default="round",
        help="re-take the profile once a round, or before every workload's pair of runs",
    )
    parser.add_argument(
        "--pooled", action="store_true", help="predict from all profiles pooled into one fit"
    )
    parser.add_argument("--predict-only", action="store_true", help="reuse OUT_DIR's real runs")
    parser.add_argument(
        "--ablations", action="store_true", help="also predict with each charge taken out"
    )
    parser.add_argument("--doc", default=None, help="write the report (markdown) here")
    parser.add_argument("--plot", default=None, help="write the predicted-vs-measured PNG here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
        write_doc(args.doc, result, WORKLOADS, args, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
