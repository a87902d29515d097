"""Engine step time with 1 vs. 2 torch threads, alternated step by step in one process.

SmolLM2-135M (default weights), decode steps at several batch sizes (all sequences at the same
context, scattered block tables) and one prefill; torch's intra-op thread count is switched
between steps, so background load hits both settings.  Prints the median step and the ratio.

    .venv/bin/python benchmarks/threads.py
    .venv/bin/python benchmarks/threads.py --batches 1 8 32 --context 256 --repeats 15
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from tokenflow.core.plan import ScheduledChunk, StepPlan  # noqa: E402
from tokenflow.core.request import SamplingParams  # noqa: E402
from tokenflow.engine import ModelExecutor, TieredKVCache, load_model  # noqa: E402

BLOCK_SIZE = 16


def _plan(batch: int, context: int, num_tokens: int) -> StepPlan:
    """`batch` chunks of `num_tokens` tokens after `context` cached positions."""
    blocks_per_seq = -(-(context + num_tokens) // BLOCK_SIZE)
    order = torch.randperm(batch * blocks_per_seq, generator=torch.Generator().manual_seed(0))
    tables = order.view(batch, blocks_per_seq).tolist()
    params = SamplingParams(max_tokens=4096, temperature=0.0)
    chunks = tuple(
        ScheduledChunk(f"r{i}", (7,) * num_tokens, context, tuple(tables[i]), 0, True, params, 1)
        for i in range(batch)
    )
    return StepPlan(1, chunks, (), (), ())


def measure(executor: ModelExecutor, plan: StepPlan, repeats: int) -> dict[int, float]:
    """Median seconds per step with 1 and 2 threads, after a warm-up of each."""
    times: dict[int, list[float]] = {1: [], 2: []}
    for index in range(repeats + 1):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            start = time.perf_counter()
            executor.execute(plan)
            if index > 0:
                times[threads].append(time.perf_counter() - start)
    return {threads: statistics.median(values) for threads, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--prefill-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    model, config, _ = load_model(None, "cpu", None)
    max_batch = max(args.batches)
    num_blocks = max_batch * -(-(max(args.context + 1, args.prefill_len)) // BLOCK_SIZE)
    kv_cache = TieredKVCache(config, num_blocks, 1, BLOCK_SIZE, "cpu", model.dtype)
    executor = ModelExecutor(model, config, kv_cache, "cpu")
    print(f"SmolLM2-135M, {model.dtype}; median step, tokens/s with 1 and 2 torch threads")
    print(f"{'step':>18} {'1 thread':>9} {'2 threads':>9} {'2 vs 1':>7}")
    rows = [(f"decode b={b} c={args.context}", _plan(b, args.context, 1), b) for b in args.batches]
    rows.append((f"prefill {args.prefill_len}", _plan(1, 0, args.prefill_len), args.prefill_len))
    for name, plan, num_tokens in rows:
        step_s = measure(executor, plan, args.repeats)
        one, two = num_tokens / step_s[1], num_tokens / step_s[2]
        print(f"{name:>18} {one:>9.1f} {two:>9.1f} {two / one:>6.2f}x", flush=True)


if __name__ == "__main__":
    main()
