"""Real replicas on Ray Serve: one workload (a burst, or conversations) per router, interleaved
over rounds, measured by the same client as `tokenflow bench` (docs/replicas.md).

    make test-ray   # (once: the Ray venv)
    PYTHONPATH=. ~/.cache/tokenflow-bench/ray-venv/bin/python -m benchmarks.ray_replicas \\
        [--rounds 2] [--routers ray-default,tokenflow] [--workload burst|chat] ...

Ray starts once; for every round, each router's application is deployed afresh (two replicas of
the embedded model, one engine thread each), the workload is replayed through Serve's HTTP proxy,
and the requests each replica answered are read from the ingress (`/replicas`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import socket
import tempfile
from pathlib import Path

import httpx
from ray import serve

from benchmarks.lib.rounds import count_arg, run_rounds
from tokenflow.cli.bench import main as bench_main
from tokenflow.eval.metrics import Summary
from tokenflow.eval.report import format_spread_table
from tokenflow.replicas.launch import APP_NAME, build_application, start_serve

# The workloads' `tokenflow bench` options: a burst of readers; conversations whose histories
# outweigh their shared system prompt (16 sessions of 3-5 turns over 2 apps, messages of ~160
# tokens, answers of 48 read at 8-16 tok/s, 2 s of thought between), sent with their session
# as `prompt_cache_key`.
WORKLOADS = {
    "burst": "--workload burst --num-requests 24 --prompt-len 64:8 --output-len 96:16"
    " --rates 4:0.5,8:0.5 --seed 0 --endpoint completions",
    "chat": "--workload conversation --num-sessions 16 --request-rate 1 --turns 3:5"
    " --num-apps 2 --system-len 256:32 --user-len 160:40 --output-len 48:8"
    " --rates 8:0.5,16:0.5 --think-s 2 --seed 0 --endpoint chat",
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_run(args: argparse.Namespace, router: str, url: str, out: Path) -> tuple[Summary, dict]:
    """Deploy `router`'s application, replay the burst, return its summary and counts."""
    serve_argv = shlex.split(args.serve_args)
    application = build_application(args.replicas, router, serve_argv, args.report_period_s)
    serve.run(application, name=APP_NAME, route_prefix="/")
    workload = shlex.split(WORKLOADS[args.workload])
    code = bench_main(
        ["--url", url, *workload, "--name", router, "--no-progress", "--json", str(out)]
    )
    if code != 0:
        raise RuntimeError(f"the bench failed for {router} ({code})")
    counts = httpx.get(f"{url}/replicas", timeout=60).json()
    serve.delete(APP_NAME)
    record = json.loads(out.read_text())[0]
    record.pop("policy")
    return Summary(**{k: record[k] for k in Summary.__dataclass_fields__}), counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=count_arg, default=2)
    parser.add_argument("--routers", default="ray-default,tokenflow")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--workload", choices=WORKLOADS, default="burst")
    parser.add_argument("--report-period-s", type=float, default=0.5)
    parser.add_argument(
        "--serve-args", default="--num-threads 1 --device-kv-tokens 2048 --host-kv-tokens 8192"
    )
    args = parser.parse_args(argv)
    port = _free_port()
    start_serve("127.0.0.1", port, num_cpus=2, object_store_mib=128)
    url, counts = f"http://127.0.0.1:{port}", []
    with tempfile.TemporaryDirectory() as tmp:

        def measure(index: int, router: str) -> Summary:
            summary, by_replica = one_run(args, router, url, Path(tmp) / f"{index}-{router}.json")
            counts.append(
                f"round {index}, {router}: {by_replica} "
                f"({summary.num_completed}/{summary.num_requests} completed)"
            )
            print(counts[-1], flush=True)
            return summary

        rounds = run_rounds(args.routers.split(","), args.rounds, measure)
    print(format_spread_table(rounds, "router"))
    print("\n".join(counts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
