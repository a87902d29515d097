"""Readers, eager streams and batch requests together on the real server: TokenFlow against
FCFS, and the readers of the mix against the same workload played by readers only.

One burst (prompt and output lengths, arrivals and reading rates drawn once) is played twice per
policy and round: as a mix (`--classes`, default 60% readers at 4-8 tok/s, 30% eager streams,
10% non-streamed requests) and with every request a reader.  Rounds alternate the order
(A B B A).  Printed per class, medians over the rounds: the readers' P99 TTFT, mean stall and
QoE; the eager and batch requests' mean end-to-end latency, TokenFlow against FCFS.

    .venv/bin/python -m benchmarks.class_mix --rounds 2 --json class-mix.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from benchmarks.lib.rounds import count_arg, interleaved
from tokenflow.eval.client import ClientConfig, run_workload
from tokenflow.eval.local_server import local_server
from tokenflow.eval.metrics import summarize_by_class
from tokenflow.eval.workload import ClassMix, LengthDist, RateMix, WorkloadSpec, generate

POLICIES = ("tokenflow", "fcfs")
READER_METRICS = ("ttft_p99_s", "rebuffer_mean_s", "qoe_mean")
OTHER_METRICS = ("e2e_mean_s", "ttft_mean_s")


def workload(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(
        kind="burst",
        num_requests=args.num_requests,
        prompt=LengthDist.parse(args.prompt_len, minimum=8),
        output=LengthDist.parse(args.output_len, minimum=8),
        rates=RateMix.parse(args.rates),
        classes=ClassMix.parse(args.classes),
        seed=args.seed,
    )


def one_run(policy: str, requests: list, args: argparse.Namespace) -> dict[str, dict]:
    """Per-class summaries of one run through a fresh server."""
    serve_args = ["--device-kv-tokens", str(args.device_kv_tokens)]
    with local_server(policy, serve_args) as url:
        config = ClientConfig(url=url, show_progress=False, timeout_s=1800.0)
        run = asyncio.run(run_workload(requests, config, name=policy))
    if run.num_failed:
        raise SystemExit(f"{policy}: {run.num_failed} requests failed")
    return {cls: s.to_dict() for cls, s in summarize_by_class(run.traces).items()}


def measure(args: argparse.Namespace) -> list[dict]:
    mixed = generate(workload(args))
    readers_only = [replace(r, consumption="reader") for r in mixed]
    runs = []
    for index, policy in interleaved(POLICIES, args.rounds):
        for name, requests in (("mixed", mixed), ("readers-only", readers_only)):
            by_class = one_run(policy, requests, args)
            runs.append({"round": index, "policy": policy, "workload": name, **by_class})
            print(json.dumps(runs[-1]["reader"]), file=sys.stderr, flush=True)
    return runs


def median(runs: list[dict], policy: str, workload: str, cls: str, metric: str) -> float:
    values = [r[cls][metric] for r in runs if (r["policy"], r["workload"]) == (policy, workload)]
    return statistics.median(values)


def report(runs: list[dict]) -> list[str]:
    lines = [f"{'workload':13s} {'class':7s} {'metric':16s} {'tokenflow':>10s} {'fcfs':>10s}"]
    classes = [c for c in ("reader", "eager", "batch") if c in runs[0]]
    for workload_name in ("mixed", "readers-only"):
        for cls in classes if workload_name == "mixed" else ["reader"]:
            for metric in READER_METRICS if cls == "reader" else OTHER_METRICS:
                tf, fcfs = (median(runs, p, workload_name, cls, metric) for p in POLICIES)
                lines.append(f"{workload_name:13s} {cls:7s} {metric:16s} {tf:10.3f} {fcfs:10.3f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=count_arg, default=2)
    parser.add_argument("--num-requests", type=int, default=20)
    parser.add_argument("--prompt-len", default="96:0")
    parser.add_argument("--output-len", default="160:0")
    parser.add_argument("--rates", default="4:0.5,8:0.5")
    parser.add_argument("--classes", default="reader:0.6,eager:0.3,batch:0.1")
    parser.add_argument("--device-kv-tokens", type=int, default=1664)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    runs = measure(args)
    print("\n".join(report(runs)))
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
