"""Decode attention over a paged KV cache: gather + SDPA (eager) vs. reading blocks in place.

One layer of SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head dim 64, block size
16), block tables scattered at random over the cache, every sequence at the given context.  The
two paths alternate call by call so background load hits both; the figure is the median call.

    .venv/bin/python benchmarks/attention_paths.py
    .venv/bin/python benchmarks/attention_paths.py --dtype float32 --contexts 128 1024
    .venv/bin/python benchmarks/attention_paths.py --steps   # whole SmolLM2 decode steps
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from tokenflow.core.plan import ScheduledChunk  # noqa: E402
from tokenflow.core.request import SamplingParams  # noqa: E402
from tokenflow.engine.attention import LayerKV, build_model_inputs, paged_attention  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def scattered_decode_chunks(
    batch: int, context: int, num_blocks: int, generator: torch.Generator
) -> list[ScheduledChunk]:
    """One greedy decode token per sequence at `context`, the block tables a random
    permutation of the `num_blocks` blocks (each sent whole: a delta from index 0)."""
    blocks_per_seq = -(-(context + 1) // BLOCK_SIZE)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    return [
        ScheduledChunk(
            f"r{i}",
            (100 + i,),
            context,
            tuple(order[i * blocks_per_seq : (i + 1) * blocks_per_seq]),
            0,
            True,
            params,
            1,
        )
        for i in range(batch)
    ]


def _case(batch: int, context: int, dtype: torch.dtype, seed: int):
    """Random cache and decode chunks; returns (query, key, value, layer_kv, chunks)."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-(context + 1) // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 8
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    layer_kv = LayerKV(
        torch.randn(shape, generator=generator).to(dtype),
        torch.randn(shape, generator=generator).to(dtype),
    )
    chunks = scattered_decode_chunks(batch, context, num_blocks, generator)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=generator).to(dtype)
    kv = torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    return query, kv, kv.clone(), layer_kv, chunks


def measure(batch: int, context: int, dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    """Median ms per call of (gather + SDPA, in place), after checking they agree."""
    query, key, value, layer_kv, chunks = _case(batch, context, dtype, seed=batch + context)
    device = torch.device("cpu")
    tables = {c.request_id: c.new_block_ids for c in chunks}
    eager = build_model_inputs(chunks, tables, BLOCK_SIZE, device, in_place_min_keys=None).attn
    in_place = build_model_inputs(chunks, tables, BLOCK_SIZE, device, in_place_min_keys=0).attn
    with torch.inference_mode():
        expected = paged_attention(query, key, value, layer_kv, eager)
        got = paged_attention(query, key, value, layer_kv, in_place)
        tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(repeats):
            for is_in_place, attn in ((False, eager), (True, in_place)):
                start = time.perf_counter()
                paged_attention(query, key, value, layer_kv, attn)
                times[is_in_place].append(time.perf_counter() - start)
    return statistics.median(times[False]) * 1e3, statistics.median(times[True]) * 1e3


def measure_steps(batch: int, context: int, repeats: int) -> tuple[float, float]:
    """Median ms per whole decode step of SmolLM2-135M (default weights), both paths alternated."""
    from tokenflow.core.plan import StepPlan
    from tokenflow.engine import ModelExecutor, TieredKVCache, load_model

    model, config, _ = load_model(None, "cpu", None)
    _, _, _, _, chunks = _case(batch, context, torch.float32, seed=batch + context)
    num_blocks = max(b for c in chunks for b in c.new_block_ids) + 1
    kv_cache = TieredKVCache(config, num_blocks, 1, BLOCK_SIZE, "cpu", model.dtype)
    executor = ModelExecutor(model, config, kv_cache, "cpu")
    plan = StepPlan(1, tuple(chunks), (), (), ())
    times: dict[bool, list[float]] = {False: [], True: []}
    for index in range(repeats + 1):
        for in_place in (False, True):
            executor.in_place_min_keys = 0 if in_place else None
            start = time.perf_counter()
            executor.execute(plan)
            if index > 0:  # the first round warms up
                times[in_place].append(time.perf_counter() - start)
    return statistics.median(times[False]) * 1e3, statistics.median(times[True]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--steps", action="store_true", help="whole SmolLM2 decode steps instead of one layer"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if args.steps:
        print(f"SmolLM2-135M decode step (default weights), {args.threads} threads; median ms")
        print(f"{'batch':>5} {'context':>7} {'gather+SDPA':>11} {'in place':>9} {'speedup':>7}")
        for context in args.contexts:
            for batch in args.batches:
                eager_ms, in_place_ms = measure_steps(batch, context, args.repeats)
                print(
                    f"{batch:>5} {context:>7} {eager_ms:>11.2f} {in_place_ms:>9.2f} "
                    f"{eager_ms / in_place_ms:>6.2f}x",
                    flush=True,
                )
        return
    print(f"one layer's decode attention, {args.dtype}, {args.threads} threads; median ms/call")
    print(f"{'batch':>5} {'context':>7} {'gather+SDPA':>11} {'in place':>9} {'speedup':>7}")
    for context in args.contexts:
        for batch in args.batches:
            eager_ms, in_place_ms = measure(batch, context, dtype, args.repeats)
            print(
                f"{batch:>5} {context:>7} {eager_ms:>11.3f} {in_place_ms:>9.3f} "
                f"{eager_ms / in_place_ms:>6.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
