"""What a move between replicas costs on this CPU, on Ray Serve, and the simulator's replay of
the same runs; and what moving paused streams at a join adds to moving queued requests: the
"What a move costs" tables of docs/replicas.md.

    make test-ray   # (once: the Ray venv)
    PYTHONPATH=. ~/.cache/tokenflow-bench/ray-venv/bin/python -m benchmarks.move_cost --real
    PYTHONPATH=. ~/.cache/tokenflow-bench/ray-venv/bin/python -m benchmarks.move_cost --modes
    python -m benchmarks.move_cost   # the tables alone, from docs/results/move-cost.json

Real (`--real`, each of `--rounds` on a fresh Ray): one replica of the embedded model (the
profiled engine: its default dtype, one thread, two streams at a time) answers four prompts once,
then a burst of 16 greedy answers of 96 tokens read at 1,000 tok/s; a second replica is added at
once (`launch.scale`) and, once it reports, the fleet's board moves queued answers to it.  The
board's record of every move (planned, handed off by the source, landed on the target) and each
answer's first and last token at the client are written to --json.

Replay: each round again in the fleet simulator, on the engine's profile: the same requests
(their served prompt tokens, their arrival), one profiled replica, the second joining when the
real one first reported, the board's rule every 0.5 s, and as the move's latency the median
hand-off to landing measured over every real move.  The table sets the real and the simulated
fleet side by side: moves, how soon the first moved answer's first token followed the join, the
burst's TTFT and how long it took.

Modes (`--modes`, `--rounds` times A B B A, each run on a fresh Ray): the same fleet under
a burst of slow readers (`tokenflow bench`: 16 answers of 192 tokens read at 6 tok/s, half again
what one replica makes, so its policy queues some and pauses streams to start others), the
second replica added once the first one holds the whole burst, with `--migrate queued` and with
`--migrate paused`; the bench's summary of each run (stall, TTFT, QoE) side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import httpx

import tokenflow.replicas  # noqa: F401 - before anything imports Ray: it sets Ray's local mode
from benchmarks.lib.rounds import count_arg
from tokenflow.calibrate.profile_file import load_profile
from tokenflow.cli.workload import add_workload_arguments, workload_spec_from_args
from tokenflow.core.migration import MOVE_LATENCY_S
from tokenflow.core.rebalance import MigrateMode
from tokenflow.eval.metrics import Summary
from tokenflow.eval.report import format_spread_table, spread, write_marked_block
from tokenflow.eval.workload import WorkloadRequest, generate
from tokenflow.sim.fleet import FleetConfig, FleetResult, ReplicaJoined, run_fleet
from tokenflow.sim.profiled import ProfiledDeployment

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- move cost: begin -->", "<!-- move cost: end -->"
MODES_BEGIN, MODES_END = "<!-- join modes: begin -->", "<!-- join modes: end -->"
REPORT_PERIOD_S = 0.5
MAX_NUM_SEQS, DEVICE_KV_TOKENS, HOST_KV_TOKENS = 2, 1024, 4096
SERVE_ARGV = ["--num-threads", "1", "--device-kv-tokens", str(DEVICE_KV_TOKENS)]
SERVE_ARGV += ["--host-kv-tokens", str(HOST_KV_TOKENS), "--max-num-seqs", str(MAX_NUM_SEQS)]
SERVE_ARGV += ["--drain-timeout-s", "60"]
MAX_TOKENS = 96
NUM_COPIES = 4  # of each prompt in the burst
READ_RATE = 1000.0  # tok/s: the client reads as fast as the fleet answers
PROMPTS = [
    ("/v1/completions", {"prompt": "Once upon a time"}),
    ("/v1/completions", {"prompt": "The three largest cities of Europe are"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Write a short poem."}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "How do plants eat?"}]}),
]
TIMEOUT_S = 600.0
# The modes' burst, as `tokenflow bench` options (its prompts: 16 random words, completions).
NUM_MODES_REQUESTS = 16
MODES_WORKLOAD = ["--workload", "burst", "--num-requests", str(NUM_MODES_REQUESTS)]
MODES_WORKLOAD += ["--prompt-len", "16"]
MODES_WORKLOAD += ["--output-len", "192", "--rates", "6", "--seed", "0"]


# -- the real fleet -------------------------------------------------------------------------
def _read(url: str, path: str, body: dict, out: dict) -> None:
    """One streamed answer: when it was sent, its first and last token, its ids and usage."""
    common = {"max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS, "ignore_eos": True}
    common |= {"temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    out["sent_s"] = time.monotonic()
    body = {**body, **common, "stream_rate": READ_RATE}
    with httpx.stream("POST", url + path, json=body, timeout=TIMEOUT_S) as response:
        out["status"] = response.status_code
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            out.setdefault("id", chunk["id"])
            if chunk.get("usage"):
                out["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
                out["completion_tokens"] = chunk["usage"]["completion_tokens"]
            texts = [c.get("text") or c.get("delta", {}).get("content") for c in chunk["choices"]]
            if any(texts):
                out.setdefault("first_token_s", time.monotonic())
                out["last_token_s"] = time.monotonic()


def _read_all(url: str, answers: list[tuple[str, dict]]) -> tuple[list[dict], list]:
    results: list[dict] = [{} for _ in answers]
    threads = [
        threading.Thread(target=_read, args=(url, path, body, out), daemon=True)
        for (path, body), out in zip(answers, results, strict=True)
    ]
    for thread in threads:
        thread.start()
    return results, threads


def _fleet_of_one(migrate: str):
    """A fleet of one replica on a fresh Ray, moving by `migrate`: (its URL, its actors)."""
    from tokenflow.eval.local_server import free_port
    from tokenflow.replicas.launch import parse_options, start

    port = free_port()
    args = parse_options(
        ["--replicas", "1", "--port", str(port), "--migrate", migrate]
        + ["--report-period-s", str(REPORT_PERIOD_S), "--num-cpus", "2"]
        + ["--object-store-mib", "128"]
    )
    return f"http://127.0.0.1:{port}", start(args, SERVE_ARGV)


def real_round() -> dict:
    """One join mid-burst on a fresh Ray (module docstring); times relative to the burst."""
    import ray

    from tokenflow.replicas.launch import scale, stop_serve

    url, fleet = _fleet_of_one("queued")
    try:
        warm, threads = _read_all(url, PROMPTS)
        for thread in threads:
            thread.join(TIMEOUT_S)
        (first_id,) = ray.get(fleet.board.first_posted_s.remote())
        burst_s = time.monotonic()
        results, threads = _read_all(url, PROMPTS * NUM_COPIES)
        while not all("status" in r for r in results) and time.monotonic() - burst_s < TIMEOUT_S:
            time.sleep(0.05)
        scale(2)
        for thread in threads:
            thread.join(TIMEOUT_S)
        joined = ray.get(fleet.board.first_posted_s.remote())
        planned = ray.get(fleet.board.planned.remote())
    finally:
        stop_serve()
    if any(r.get("completion_tokens") != MAX_TOKENS for r in [*warm, *results]):
        raise RuntimeError(f"an answer did not complete: {results}")
    (joined_id,) = [r for r in joined if r != first_id]

    def since(t: float | None) -> float | None:
        return None if t is None else t - burst_s

    return {
        "joined_s": since(joined[joined_id]),
        "requests": [
            {
                "id": r["id"],
                "prompt_tokens": r["prompt_tokens"],
                "sent_s": since(r["sent_s"]),
                "first_token_s": since(r["first_token_s"]),
                "last_token_s": since(r["last_token_s"]),
            }
            for r in results
        ],
        "moves": [
            {
                "request_id": p.move.request_id,
                "source": "first" if p.move.source_id == first_id else "joined",
                "planned_s": since(p.planned_s),
                "handed_off_s": since(p.handed_off_s),
                "landed_s": since(p.landed_s),
            }
            for p in planned
        ],
    }


def mode_run(mode: str, out: Path) -> dict:
    """The slow readers' burst (module docstring) with `--migrate mode`: the bench's summary,
    and the moves the board planned by kind."""
    import ray

    from tokenflow.cli.bench import main as bench_main
    from tokenflow.replicas.launch import scale, stop_serve

    url, fleet = _fleet_of_one(mode)
    bench = ["--url", url, *MODES_WORKLOAD, "--endpoint", "completions", "--name", mode]
    bench += ["--no-progress", "--json", str(out)]
    codes: list[int] = []
    try:
        deadline_s = time.monotonic() + TIMEOUT_S
        while not (posted := ray.get(fleet.board.first_posted_s.remote())):
            if time.monotonic() > deadline_s:
                raise RuntimeError("the replica never reported to the board")
            time.sleep(0.1)
        (first_id,) = posted  # (one replica before the burst)
        started_s = time.monotonic()
        runner = threading.Thread(target=lambda: codes.append(bench_main(bench)), daemon=True)
        runner.start()
        while sum(httpx.get(f"{url}/replicas", timeout=30).json().values()) < NUM_MODES_REQUESTS:
            if time.monotonic() > deadline_s:
                raise RuntimeError("the burst never reached the replica")
            time.sleep(0.05)  # (until the first replica holds the whole burst)
        scale(2)
        runner.join(TIMEOUT_S)
        planned = ray.get(fleet.board.planned.remote())
        joined = ray.get(fleet.board.first_posted_s.remote())
    finally:
        stop_serve()
    if codes != [0]:
        raise RuntimeError(f"the bench failed with --migrate {mode}: {codes}")
    record = json.loads(out.read_text())[0]
    summary = {k: record[k] for k in Summary.__dataclass_fields__}
    (joined_s,) = [t - started_s for replica, t in joined.items() if replica != first_id]
    return {
        "mode": mode,
        "summary": summary,
        "moves": _by_kind(p.move.kind.value for p in planned),
        "joined_s": joined_s,
    }


def _by_kind(kinds: Iterable[str]) -> dict[str, int]:
    """How many moves of each kind."""
    return dict(sorted(Counter(kinds).items()))


def mode_replay(run: dict, profile_path: Path) -> FleetResult:
    """A modes run in the fleet simulator on the profile: the bench's workload, the second
    replica joining when the real one first reported."""
    parser = argparse.ArgumentParser()
    add_workload_arguments(parser, default_kind="burst")
    workload = generate(workload_spec_from_args(parser.parse_args(MODES_WORKLOAD)))
    deployment = _deployment(profile_path)
    config = FleetConfig(
        (deployment,),
        report_period_s=REPORT_PERIOD_S,
        changes=(ReplicaJoined(run["joined_s"], deployment),),
        migrate=MigrateMode(run["mode"]),
        move_latency_s=MOVE_LATENCY_S,
    )
    return run_fleet(workload, "tokenflow", config)


def modes_table(runs: list[dict], profile_path: Path) -> list[str]:
    """The markdown block of the A B B A comparison, real and replayed."""
    halves = [runs[i : i + 2] for i in range(0, len(runs), 2)]  # (A B, then B A)
    real = [{r["mode"]: Summary(**r["summary"]) for r in half} for half in halves]
    replays = {id(r): mode_replay(r, profile_path) for r in runs}
    simulated = [{r["mode"]: replays[id(r)].summary for r in half} for half in halves]
    lines = [
        f"A replica joining a burst of slow readers, `--migrate queued` against `paused`, "
        f"A B B A over {len(runs)} runs on Ray Serve, median [min-max]; then each run replayed "
        f"in the simulator on the profile (the bench's workload, the join when the real one "
        f"first reported):",
        "",
        "```",
        format_spread_table(real, "real"),
        "",
        format_spread_table(simulated, "simulated"),
        "```",
        "",
    ]
    for mode in ("queued", "paused"):
        mine = [r for r in runs if r["mode"] == mode]
        joined = ", ".join(f"{r['joined_s']:.1f}" for r in mine)
        sim_moves = [_by_kind(m.kind.value for m in replays[id(r)].moves) for r in mine]
        lines.append(
            f"- `{mode}`: moves by kind, per real run: {[r['moves'] for r in mine]} "
            f"(simulated: {sim_moves}); the new replica reported {joined} s into the burst"
        )
    return [*lines, ""]


# -- the replay -----------------------------------------------------------------------------
def move_latency_s(rounds: list[dict]) -> float:
    """The median hand-off to landing over every real move that landed: what the simulator
    charges a move beyond the target's recompute."""
    return statistics.median(
        m["landed_s"] - m["handed_off_s"]
        for r in rounds
        for m in r["moves"]
        if m["landed_s"] is not None and m["handed_off_s"] is not None
    )


def _deployment(profile_path: Path) -> ProfiledDeployment:
    """The replicas' deployment (`SERVE_ARGV`) on the engine's profile."""
    return ProfiledDeployment(
        load_profile(profile_path),
        device_kv_tokens=DEVICE_KV_TOKENS,
        host_kv_tokens=HOST_KV_TOKENS,
        max_num_seqs=MAX_NUM_SEQS,
        endpoint="completions",  # (prompts in served tokens: this mapping adds none)
    )


def replay(record: dict, profile_path: Path, latency_s: float) -> FleetResult:
    """The round in the fleet simulator on the engine's profile (module docstring)."""
    deployment = _deployment(profile_path)
    workload = [
        WorkloadRequest(r["id"], max(r["sent_s"], 0.0), r["prompt_tokens"], MAX_TOKENS, READ_RATE)
        for r in record["requests"]
    ]
    config = FleetConfig(
        (deployment,),
        report_period_s=REPORT_PERIOD_S,
        changes=(ReplicaJoined(record["joined_s"], deployment),),
        migrate=MigrateMode.QUEUED,
        move_latency_s=latency_s,
    )
    return run_fleet(workload, "tokenflow", config)


def real_figures(record: dict) -> dict[str, float]:
    """A real round's figures, as `sim_figures` gives the replay's."""
    moves = [m for m in record["moves"] if m["source"] == "first"]
    first_token_s = {r["id"]: r["first_token_s"] for r in record["requests"]}
    requests = record["requests"]
    return _figures(
        joined_s=record["joined_s"],
        moves=[(m["planned_s"], m["landed_s"], first_token_s[m["request_id"]]) for m in moves],
        ttfts_s=[r["first_token_s"] - r["sent_s"] for r in requests],
        last_s=max(r["last_token_s"] for r in requests),
    )


def sim_figures(record: dict, result: FleetResult) -> dict[str, float]:
    moves = [m for m in result.moves if m.source_id == "replica-0"]
    first_token_s = {t.request_id: t.token_times_s[0] for t in result.traces}
    return _figures(
        joined_s=record["joined_s"],
        moves=[(m.planned_s, m.landed_s, first_token_s[m.request_id]) for m in moves],
        ttfts_s=[t.token_times_s[0] - t.arrival_s for t in result.traces],
        last_s=max(t.token_times_s[-1] for t in result.traces),
    )


def _figures(
    joined_s: float,
    moves: list[tuple[float, float, float]],
    ttfts_s: list[float],
    last_s: float,
) -> dict[str, float]:
    """From the moves off the first replica (planned, landed, first token) and every answer."""
    planned_s, landed_s, first_token_s = min(moves, key=lambda m: m[2])
    return {
        "queued answers moved to the new replica": len(moves),
        "first move planned after the join (s)": min(m[0] for m in moves) - joined_s,
        "first moved token after its plan (s)": first_token_s - planned_s,
        "... after its landing (s)": first_token_s - landed_s,
        "TTFT mean (s)": statistics.fmean(ttfts_s),
        "TTFT max (s)": max(ttfts_s),
        "last token of the burst (s)": last_s,
    }


def table(rounds: list[dict], profile_path: Path) -> list[str]:
    """The markdown block: the measured move, and the real and simulated fleets side by side."""
    latency_s = move_latency_s(rounds)
    moves = [m for r in rounds for m in r["moves"] if m["landed_s"] is not None]
    parts = {
        "plan to hand-off (source: its step, its export)": ("planned_s", "handed_off_s"),
        "hand-off to landing (ingress, call to the target)": ("handed_off_s", "landed_s"),
    }
    lines = [
        f"Moves measured on Ray Serve: {len(moves)} over {len(rounds)} rounds, median [min-max]:",
        "",
        "| part of the move | seconds |",
        "|---|---|",
    ]
    for name, (begin, end) in parts.items():
        lines.append(f"| {name} | {spread([m[end] - m[begin] for m in moves]).text(3)} |")
    real = [real_figures(r) for r in rounds]
    sim = [sim_figures(r, replay(r, profile_path, latency_s)) for r in rounds]
    lines += [
        "",
        f"The same rounds, replayed in the simulator on the profile with a move latency of "
        f"{latency_s:.3f} s; median [min-max] over {len(rounds)} rounds:",
        "",
        "| | real (Ray Serve) | simulated | simulated / real (median of rounds) |",
        "|---|---|---|---|",
    ]
    for key in real[0]:
        digits = 0 if key.startswith("queued") else 2
        ratios = [s[key] / r[key] for r, s in zip(real, sim, strict=True) if r[key]]
        ratio = f"{statistics.median(ratios):.2f}x" if ratios else "-"
        lines.append(
            f"| {key} | {spread([r[key] for r in real]).text(digits)} | "
            f"{spread([s[key] for s in sim]).text(digits)} | {ratio} |"
        )
    return [*lines, ""]


def _isolated(run: str) -> dict:
    """One run (`--one join`: `real_round`; `--one MODE`: `mode_run`) in a process of its own,
    on a Ray started afresh: a driver that started Ray twice has found the previous fleet's
    second replica in its new one."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        command = [sys.executable, "-m", "benchmarks.move_cost", "--one", run, "--out", str(out)]
        subprocess.run(command, check=True, cwd=ROOT)
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true", help="run the rounds on Ray Serve first")
    parser.add_argument(
        "--modes", action="store_true", help="run queued against paused moves on Ray Serve first"
    )
    parser.add_argument("--rounds", type=count_arg, default=3)
    parser.add_argument("--json", default=str(ROOT / "docs" / "results" / "move-cost.json"))
    parser.add_argument("--modes-json", default=str(ROOT / "docs" / "results" / "join-modes.json"))
    parser.add_argument("--profile", default=str(ROOT / "docs" / "results" / "cpu-profile.json"))
    parser.add_argument("--markdown", default=str(ROOT / "docs" / "replicas.md"))
    parser.add_argument("--one", choices=("join", "queued", "paused"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:  # (one run, in the process `_isolated` started)
        with tempfile.TemporaryDirectory() as tmp:
            bench_out = Path(tmp) / "bench.json"
            run = real_round() if args.one == "join" else mode_run(args.one, bench_out)
        Path(args.out).write_text(json.dumps(run))
        return 0
    if args.real:
        rounds = []
        for index in range(args.rounds):
            rounds.append(_isolated("join"))
            print(f"round {index}: {len(rounds[-1]['moves'])} moves", flush=True)
        Path(args.json).write_text(json.dumps(rounds, indent=1) + "\n")
    if args.modes:
        runs = []
        for index in range(args.rounds):
            for mode in ("queued", "paused", "paused", "queued"):  # A B B A
                runs.append(_isolated(mode))
                print(f"pair {index}, {mode}: moves {runs[-1]['moves']}", flush=True)
        Path(args.modes_json).write_text(json.dumps(runs, indent=1) + "\n")
    rounds = json.loads(Path(args.json).read_text())
    lines = table(rounds, Path(args.profile))
    print("\n".join(lines))
    write_marked_block(Path(args.markdown), BEGIN, END, lines)
    if Path(args.modes_json).exists():
        lines = modes_table(json.loads(Path(args.modes_json).read_text()), Path(args.profile))
        print("\n".join(lines))
        write_marked_block(Path(args.markdown), MODES_BEGIN, MODES_END, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
