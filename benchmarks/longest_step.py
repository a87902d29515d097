"""The longest engine step under a mixed burst with one near-context-length prompt.

A burst of short streams is decoding when one prompt of almost the whole context arrives.
Prefilled whole (the engine before chunking was made universal), that prompt's step freezes
every stream; chunked to a target step time, no step is much longer than the target.  Both runs
use the same engine, requests and policy; only the chunk sizing differs.

    python benchmarks/longest_step.py [--policy fcfs] [--context 2048] [--num-short 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

from tokenflow.core.request import SamplingParams
from tokenflow.engine.engine_args import EngineArgs
from tokenflow.engine.llm_engine import LLMEngine


def run(engine: LLMEngine, args: argparse.Namespace, chunked: bool) -> list[float]:
    """Step durations (s) of one burst: short streams first, the long prompt a few steps later."""
    if not chunked:  # the previous behaviour: each policy's own prefill (fcfs: whole prompts)
        engine.scheduler.policy.prefill_chunk_tokens = None
        engine._size_prefill_chunks = lambda: None  # type: ignore[method-assign]
    short = SamplingParams(max_tokens=args.short_output, temperature=0, ignore_eos=True)
    for i in range(args.num_short):
        engine.add_request(f"short-{i}", [100 + i] * 64, short, rate_tps=10)
    steps: list[float] = []
    long_prompt = [200 + (i % 1000) for i in range(args.context - 32)]
    while engine.has_work:
        if len(steps) == 3:
            engine.add_request("long", long_prompt, SamplingParams(max_tokens=16, temperature=0))
        started = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - started)
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="fcfs")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--num-short", type=int, default=8)
    parser.add_argument("--short-output", type=int, default=24)
    parser.add_argument("--step-target-ms", type=float, default=EngineArgs.step_target_ms)
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads (as `serve`)")
    args = parser.parse_args()
    print(f"policy {args.policy}, context {args.context}, {args.num_short} short streams")
    for chunked in (False, True):
        engine = LLMEngine(
            EngineArgs(
                policy=args.policy,
                device="cpu",
                max_model_len=args.context,
                device_kv_tokens=2 * args.context,
                max_prefill_tokens=args.context,
                step_target_ms=args.step_target_ms,
                num_threads=args.num_threads,
            )
        )
        steps = run(engine, args, chunked)
        engine.close()
        label = "chunked to target" if chunked else "policy's own prefill"
        print(
            f"{label:>22}: longest step {max(steps):6.2f} s, median {statistics.median(steps):.3f}"
            f" s, {len(steps)} steps, total {sum(steps):.1f} s"
        )


if __name__ == "__main__":
    main()
