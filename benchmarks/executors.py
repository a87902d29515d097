"""Decode and prefill speed of the engine's executors, side by side in one process.

Each executor (ours in PyTorch with the default 4-bit weights; llama.cpp on the GGUF as shipped,
Q4_1; llama.cpp on it rewritten as Q8_0) runs the same plans through a whole `LLMEngine`
(scheduler included, FCFS, no reading-rate pacing): B requests with a 32-token prompt, then
`--tokens` decode steps.  The executors take turns per batch size and repeat, so the machine's
load drifts over all of them alike; the best round counts.  Prints tokens/s and the ratio to
ours.  Needs the llamacpp extra (`make install-llamacpp`).

    .venv/bin/python benchmarks/executors.py --batches 1 8 32 --repeats 2

Run it as is: `tokenflow serve` sets OMP_WAIT_POLICY=PASSIVE for the PyTorch engine only
(llama.cpp's OpenMP barriers need active waits), so neither is set here.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from tokenflow.core.request import SamplingParams  # noqa: E402
from tokenflow.engine.engine_args import EngineArgs  # noqa: E402
from tokenflow.engine.llm_engine import LLMEngine  # noqa: E402

EXECUTORS = {
    "torch int4": dict(executor="torch"),
    "llama.cpp q4_1": dict(executor="llama-cpp"),
    "llama.cpp q8_0": dict(executor="llama-cpp", weights="q8_0"),
}
PROMPT = list(range(100, 132))


def run_round(engine: LLMEngine, batch: int, tokens: int, round_index: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) of one batch."""
    params = SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{round_index}-{i}", PROMPT, params, 1000.0)
    start = time.perf_counter()
    engine.step()  # every prompt in one step (32 x 32 tokens fit the prefill budget)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
    return batch * len(PROMPT) / prefill_s, batch * steps / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, default=64, help="decode steps per round")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    engines = {
        name: LLMEngine(
            EngineArgs(device="cpu", policy="fcfs", num_threads=args.threads, **options)
        )
        for name, options in EXECUTORS.items()
    }
    best: dict[tuple[str, int], tuple[float, float]] = {}
    round_index = 0
    for _ in range(args.repeats):
        for batch in args.batches:
            for name, engine in engines.items():
                prefill, decode = run_round(engine, batch, args.tokens, round_index)
                round_index += 1
                old = best.get((name, batch), (0.0, 0.0))
                best[name, batch] = (max(old[0], prefill), max(old[1], decode))
    print(f"best of {args.repeats}, {args.threads} threads, 32-token prompts, tok/s")
    print(f"{'executor':>16} {'batch':>5} {'prefill':>8} {'decode':>8} {'decode / torch':>15}")
    for batch in args.batches:
        base = best["torch int4", batch][1]
        for name in engines:
            prefill, decode = best[name, batch]
            print(f"{name:>16} {batch:>5} {prefill:>8.1f} {decode:>8.1f} {decode / base:>14.2f}x")
    for engine in engines.values():
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
