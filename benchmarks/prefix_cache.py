"""Conversations on the real engine with the prefix cache on and off, side by side, A B B A:
the "Prefix cache" table of docs/results.md.

    python -m benchmarks.prefix_cache [--rounds 1] [--serve-args "..."] [--users 16]

Each run starts `tokenflow serve` (the embedded SmolLM2, its defaults plus --serve-args) with
`--enable-prefix-caching` or `--no-enable-prefix-caching` and measures, streaming each answer:

- **cold**: the first turn of a conversation on a system prompt of about 2,000 tokens, alone;
- **second turn**: the same conversation's next turn (its history: the system prompt, the
  first question and answer, a new question), alone, against a cold prompt of its length (the
  same history behind a changed first block, so that no block matches);
- **burst**: `--users` users arriving together, each with the shared system prompt and a
  question of their own, read at 4 tok/s (each request says so: `stream_rate`): P99 TTFT and the
  mean stall of their readers (the stall of a reader who reads at its rate from its first
  token, `tokenflow.eval.metrics`).

Every answer is 32 greedy tokens.  The ratios on/off are per round; the table gives their median
and range over the rounds.

    python -m benchmarks.prefix_cache --sim [--seeds 0,1,2] [--host-gib 16,64,512]

runs the simulator's `h200-chat` conversations instead (tokenflow/sim/setups.py): FCFS with an
LRU prefix cache (vLLM's behaviour) against TokenFlow with the reading retention, per seed; then
the retention ablation, TokenFlow with `lru` and with `reading` at each host-tier size: prefix
hit rate and P99 TTFT, medians (min-max) over the seeds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import httpx

from benchmarks.lib.rounds import count_arg
from tokenflow.eval.local_server import free_port, running_server, serve_command

SYSTEM = (
    "You are the support assistant of a company that sells garden tools. Answer politely, in "
    "short sentences, and always mention the warranty when a customer asks about a broken "
    "tool. "
)
NUM_ANSWER_TOKENS = 32
READER_RATE_TPS = 4.0


@dataclass(frozen=True)
class Answer:
    ttft_s: float
    stall_s: float  # of a reader at READER_RATE_TPS from the first token
    text: str
    cached_tokens: int


async def ask(http: httpx.AsyncClient, messages: list[dict[str, str]]) -> Answer:
    """Stream one greedy answer; its TTFT, its reader's stall, its text and cached count."""
    body = {
        "messages": messages,
        "max_tokens": NUM_ANSWER_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "stream_rate": READER_RATE_TPS,  # (the server paces for readers it is told of)
    }
    start = time.monotonic()
    times: list[float] = []
    text, cached = "", 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
            for choice in chunk["choices"]:
                piece = choice["delta"].get("content") or ""
                if piece:
                    times.append(time.monotonic())
                    text += piece
    return Answer(times[0] - start, reader_stall_s(times), text, cached)


def reader_stall_s(times: Sequence[float]) -> float:
    """Seconds a reader at READER_RATE_TPS, starting at the first piece, waits on an empty
    buffer (pieces counted as tokens)."""
    stall, consumed = 0.0, times[0]
    for arrival in times[1:]:
        due = consumed + 1 / READER_RATE_TPS
        stall += max(0.0, arrival - due)
        consumed = max(arrival, due)
    return stall


def system_prompt(num_repeats: int) -> str:
    return SYSTEM * num_repeats


async def one_run(url: str, users: int, num_repeats: int) -> dict[str, float]:
    system = {"role": "system", "content": system_prompt(num_repeats)}
    async with httpx.AsyncClient(base_url=url, timeout=900) as http:
        first = [system, {"role": "user", "content": "My rake broke. What now?"}]
        cold = await ask(http, first)
        history = [
            *first,
            {"role": "assistant", "content": cold.text},
            {"role": "user", "content": "And the shovel?"},
        ]
        second = await ask(http, history)
        # The same history behind one changed first block: no block's key matches.
        unmatched = [{**system, "content": "Note. " + system["content"]}, *history[1:]]
        cold_same_length = await ask(http, unmatched)
        questions = [f"Question {i}: is tool number {i} covered?" for i in range(users)]
        burst = await asyncio.gather(
            *(ask(http, [system, {"role": "user", "content": q}]) for q in questions)
        )
    ttfts = sorted(a.ttft_s for a in burst)
    return {
        "cold_ttft_s": cold.ttft_s,
        "second_turn_ttft_s": second.ttft_s,
        "second_turn_cached_tokens": second.cached_tokens,
        "cold_same_length_ttft_s": cold_same_length.ttft_s,
        "burst_p99_ttft_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "burst_mean_stall_s": statistics.fmean(a.stall_s for a in burst),
        "burst_cached_tokens": sum(a.cached_tokens for a in burst),
    }


def run(caching: bool, serve_args: Sequence[str], users: int, num_repeats: int) -> dict:
    flag = "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"
    port = free_port()
    with running_server(serve_command(port, [flag, *serve_args]), port, name="tokenflow") as s:
        return asyncio.run(one_run(s.url, users, num_repeats))


def abba(rounds: int) -> Iterator[bool]:
    """On, off, off, on per round: each setting runs early and late as often."""
    for _ in range(rounds):
        yield from (True, False, False, True)


def simulate_chat(seeds: Sequence[int], host_sizes_gib: Sequence[float]) -> None:
    """`h200-chat`: FCFS + LRU against TokenFlow + reading, then the retention ablation."""
    from tokenflow.core.config import tokenflow_defaults
    from tokenflow.eval.workload import generate
    from tokenflow.sim.runner import run_simulation, setup_config
    from tokenflow.sim.setups import chat_setup

    rows: dict[str, list[dict]] = {}
    runs = [("fcfs", "lru", None), ("tokenflow", "reading", None)]
    runs += [("tokenflow", r, gib) for gib in host_sizes_gib for r in ("lru", "reading")]
    for seed in seeds:
        setup = chat_setup(seed)
        workload = generate(setup.workload)
        base = setup_config(setup, prefix_caching=True, tokenflow=tokenflow_defaults("cuda"))
        for policy, retention, gib in runs:
            config = replace(base, prefix_retention=retention)
            if gib is not None:
                config = replace(config, host_memory_gib=gib)
            result = run_simulation(workload, policy, config)
            s = result.summary
            label = f"{policy} {retention}" + ("" if gib is None else f" host {gib:g} GiB")
            rows.setdefault(label, []).append(
                {
                    "p99_ttft_s": s.ttft_p99_s,
                    "mean_stall_s": s.rebuffer_mean_s,
                    "qoe": s.qoe_mean,
                    "effective_tps": s.effective_throughput_tps,
                    "prefix_hit_rate": result.prefix_hit_rate,
                }
            )
            print(f"seed {seed} {label}: {rows[label][-1]}", flush=True)
    keys = list(next(iter(rows.values()))[0])
    print("| run | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for label, values in rows.items():
        cells = [spread([v[k] for v in values]) for k in keys]
        print(f"| {label} | " + " | ".join(cells) + " |")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sim", action="store_true", help="the simulator's h200-chat instead")
    parser.add_argument("--seeds", default="0,1,2", help="--sim: workload seeds")
    parser.add_argument("--host-gib", default="16,64,512", help="--sim: host tier sizes")
    parser.add_argument("--rounds", type=count_arg, default=1, help="A B B A rounds")
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=56, help="of the system text (~2k tok)")
    parser.add_argument("--serve-args", default="", help="more `tokenflow serve` options")
    parser.add_argument("--json", default=None, help="write every run's figures here")
    args = parser.parse_args(argv)
    if args.sim:
        seeds = [int(x) for x in args.seeds.split(",")]
        simulate_chat(seeds, [float(x) for x in args.host_gib.split(",")])
        return
    serve_args = shlex.split(args.serve_args)
    runs = [
        {"caching": caching, **run(caching, serve_args, args.users, args.repeats)}
        for caching in abba(args.rounds)
    ]
    if args.json:
        with open(args.json, "w") as out:
            json.dump(runs, out, indent=1)
    print(table(runs))


def table(runs: list[dict]) -> str:
    """Medians (min-max) of each figure with caching on and off, and on/off."""
    keys = [k for k in runs[0] if k != "caching"]
    lines = ["| figure | on | off | on/off |", "|---|---|---|---|"]
    for key in keys:
        on = [r[key] for r in runs if r["caching"]]
        off = [r[key] for r in runs if not r["caching"]]
        ratio = statistics.median(on) / statistics.median(off) if statistics.median(off) else 0
        lines.append(f"| {key} | {spread(on)} | {spread(off)} | {ratio:.2f} |")
    return "\n".join(lines)


def spread(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


if __name__ == "__main__":
    main()
