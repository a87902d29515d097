"""What /v1/tokenflow/streams costs the engine loop: the same workload with and without a poller.

`tokenflow serve`'s arrangement (the step loop on the main thread, the asyncio side in another):
a fresh engine per round serves `--num-requests` eager streams at once (no reader pauses, so
the loop only computes), while, in every other round, a poller asks `AsyncEngine.streams()` for
the `--limit` most urgent streams `--poll-hz` times a second (the endpoint's own cap is four:
`serving/streams.py` shares one snapshot for 0.25 s).  A snapshot is taken between two steps, so
it can only lengthen the loop's turns: the table gives each snapshot's own time on the engine
thread, the mean turn (from one step's end to the next's, a snapshot in between included), the
whole workload's time, and their ratios, polled over not polled, as the median of the rounds.
A first, untimed round warms the kernels up for the workload's shapes (the first in a process
was several times slower).

    .venv/bin/python benchmarks/streams_endpoint_cost.py [--rounds 3] [--num-requests 64]
        [--output-len 128] [--poll-hz 4] [--limit 512] [--policy tokenflow]

A quick check that it runs: `--rounds 1 --num-requests 8 --output-len 16`.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass

# As `tokenflow serve` (tokenflow/cli/main.py): OpenMP workers that sleep between parallel regions,
# set before torch loads; spinning ones made steps many times slower beside another process.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tokenflow.core.request import SamplingParams  # noqa: E402
from tokenflow.engine.async_engine import AsyncEngine  # noqa: E402
from tokenflow.engine.engine_args import EngineArgs  # noqa: E402


@dataclass(frozen=True)
class Round:
    is_polled: bool
    wall_s: float  # first submission to last token
    mean_turn_ms: float  # between consecutive step ends
    num_steps: int
    num_snapshots: int
    mean_snapshot_ms: float  # one snapshot's time on the engine thread (0 when none)


@dataclass(frozen=True)
class Served:
    start_s: float  # the workload's first submission, on the perf counter
    end_s: float  # its last token
    num_snapshots: int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="of each kind, interleaved")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--poll-hz", type=float, default=4.0)
    parser.add_argument("--limit", type=int, default=512, help="streams in each snapshot")
    parser.add_argument("--policy", default="tokenflow")
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    return parser.parse_args(argv)


async def drive(engine: AsyncEngine, args: argparse.Namespace, is_polled: bool) -> Served:
    """Serve the workload (after one warm-up request); poll meanwhile if asked."""
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    prompt = [100 + i % 50 for i in range(args.prompt_len)]

    async def one(request_id: str, sampling: SamplingParams = params) -> None:
        async for _ in engine.generate(request_id, prompt, sampling, math.inf):
            pass

    await one("warm-up", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    done = asyncio.Event()
    num_snapshots = 0

    async def poll() -> None:
        nonlocal num_snapshots
        while not done.is_set():
            await engine.streams(args.limit)
            num_snapshots += 1
            await asyncio.sleep(1.0 / args.poll_hz)

    poller = asyncio.ensure_future(poll()) if is_polled else None
    start = time.perf_counter()
    await asyncio.gather(*(one(f"r{i}") for i in range(args.num_requests)))
    end = time.perf_counter()
    done.set()
    if poller is not None:
        await poller
    return Served(start_s=start, end_s=end, num_snapshots=num_snapshots)


def run_round(args: argparse.Namespace, is_polled: bool) -> Round:
    """One fresh engine, its loop on this thread, the workload on another."""
    engine_args = EngineArgs(
        model=args.model, policy=args.policy, max_num_requests=args.num_requests + 8
    )
    engine = AsyncEngine(engine_args, start_thread=False)
    step_ends: list[float] = []
    engine.after_step = lambda: step_ends.append(time.perf_counter())
    snapshot_s: list[float] = []
    take = engine.engine.streams

    def timed_snapshot(limit: int):  # (the engine thread calls it between two steps)
        begin = time.perf_counter()
        snapshot = take(limit)
        snapshot_s.append(time.perf_counter() - begin)
        return snapshot

    engine.engine.streams = timed_snapshot  # type: ignore[method-assign]
    result: list[Served] = []

    def workload() -> None:
        try:
            result.append(asyncio.run(drive(engine, args, is_polled)))
        finally:
            engine.stop()

    thread = threading.Thread(target=workload, name="workload")
    thread.start()
    engine.run_loop()
    thread.join()
    engine.close()
    served = result[0]
    ends = [t for t in step_ends if served.start_s <= t <= served.end_s]
    turns = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    return Round(
        is_polled=is_polled,
        wall_s=served.end_s - served.start_s,
        mean_turn_ms=1000 * statistics.fmean(turns),
        num_steps=len(turns),
        num_snapshots=served.num_snapshots,
        mean_snapshot_ms=1000 * statistics.fmean(snapshot_s) if snapshot_s else 0.0,
    )


def report(rounds: list[Round]) -> None:
    print("polled  wall s  mean turn ms  steps  snapshots  ms per snapshot")
    for r in rounds:
        print(
            f"{'yes' if r.is_polled else 'no':>6}  {r.wall_s:6.2f}  {r.mean_turn_ms:12.2f}  "
            f"{r.num_steps:5d}  {r.num_snapshots:9d}  {r.mean_snapshot_ms:15.3f}"
        )
    pairs = list(zip(rounds[::2], rounds[1::2], strict=True))
    wall = statistics.median(p.wall_s / q.wall_s for q, p in pairs)
    turn = statistics.median(p.mean_turn_ms / q.mean_turn_ms for q, p in pairs)
    print(f"polled / not polled (median of {len(pairs)} rounds): wall {wall:.3f}, turn {turn:.3f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print("warm-up round", file=sys.stderr)
    run_round(args, is_polled=False)
    rounds: list[Round] = []
    for index in range(args.rounds):
        for is_polled in (False, True):
            print(f"round {index + 1}: polled={is_polled}", file=sys.stderr)
            rounds.append(run_round(args, is_polled))
    report(rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
