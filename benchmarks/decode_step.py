"""Whole SmolLM2-135M decode steps (default weights) through three paths, alternated step by step.

- before: the eager model with the LM head as the plain [H, V] GEMM (the layout used until now),
- eager: the eager model as it is now (the LM head as nn.Linear's [V, H] GEMM),
- compiled: decode-only steps through compiled graphs (`ModelExecutor(compile_decode=True)`).

Each is one `ModelExecutor.execute` of a decode plan (inputs, forward, greedy sampling), every
sequence at `context` tokens with a scattered block table.  The paths share one model and take
turns, so background load hits all three; the figure is the median step.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/decode_step.py
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/decode_step.py --batches 8 --contexts 1024
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/decode_step.py --profile  # eager's ops

With `--int8 SCHEME`, instead: the eager default model against the float32 model whose
projections and LM head run an int8 scheme of int8_schemes.py (fbgemm), alternated step by
step, and the ratio default/int8 (above 1: int8 is faster).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/decode_step.py --int8 token-o64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from attention_paths import scattered_decode_chunks  # noqa: E402
from int8_schemes import CALIBRATION_TEXT, SCHEMES, convert  # noqa: E402

from tokenflow.core.plan import StepPlan  # noqa: E402
from tokenflow.engine import ModelExecutor, TieredKVCache, load_model  # noqa: E402

BLOCK_SIZE = 16
PATHS = ("before", "eager", "compiled")


def decode_plan(batch: int, context: int, num_blocks: int, seed: int) -> StepPlan:
    """One decode token per sequence at `context`, block tables drawn at random."""
    generator = torch.Generator().manual_seed(seed)
    chunks = tuple(scattered_decode_chunks(batch, context, num_blocks, generator))
    return StepPlan(1, chunks, (), (), ())


class _PlainHead(torch.nn.Module):
    """The LM head as it was: x [T, H] @ weight_t [H, V], a plain (NN) GEMM."""

    def __init__(self, head: torch.nn.Module) -> None:
        super().__init__()
        self.weight = head.weight  # [V, H], for the tied embedding
        self.weight_t = head.weight.t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, self.weight_t)


def measure(batches: list[int], contexts: list[int], repeats: int) -> None:
    """Print the median ms per step of every path, and eager's and compiled's speed-ups."""
    model, config, _ = load_model(None, "cpu", None)
    num_blocks = max(batches) * (-(-(max(contexts) + 1) // BLOCK_SIZE)) + 8
    kv_cache = TieredKVCache(config, num_blocks, 1, BLOCK_SIZE, "cpu", model.dtype)
    start = time.perf_counter()
    compiled = ModelExecutor(model, config, kv_cache, "cpu", compile_decode=True)
    print(f"compiled decoder ready in {time.perf_counter() - start:.1f} s", flush=True)
    eager = ModelExecutor(model, config, kv_cache, "cpu")
    heads = {"before": _PlainHead(model.lm_head), "new": model.lm_head}
    print(
        f"{'batch':>5} {'context':>7} "
        + " ".join(f"{p + ' ms':>11}" for p in PATHS)
        + "  eager/before  compiled/before"
    )
    for context in contexts:
        for batch in batches:
            plan = decode_plan(batch, context, num_blocks, seed=batch + context)
            times: dict[str, list[float]] = {path: [] for path in PATHS}
            for index in range(repeats + 1):
                for path in PATHS:
                    model.lm_head = heads["before" if path == "before" else "new"]
                    executor = compiled if path == "compiled" else eager
                    begin = time.perf_counter()
                    executor.execute(plan)
                    if index > 0:  # the first round warms up
                        times[path].append(time.perf_counter() - begin)
            model.lm_head = heads["new"]
            ms = {path: statistics.median(times[path]) * 1e3 for path in PATHS}
            cells = " ".join(f"{ms[p]:>11.2f}" for p in PATHS)
            print(
                f"{batch:>5} {context:>7} {cells}  {ms['before'] / ms['eager']:>11.2f}x"
                f"  {ms['before'] / ms['compiled']:>14.2f}x",
                flush=True,
            )


def measure_int8(batches: list[int], contexts: list[int], repeats: int, scheme: str) -> None:
    """Median ms per step of the default model and of the int8 `scheme` model, alternated."""
    default = load_model(None, "cpu", None)
    head_only = scheme.startswith("head-")  # the default model with an int8 LM head
    int8 = load_model(
        None, "cpu", None if head_only else torch.float32, "dense" if not head_only else "auto"
    )
    convert(int8.model, int8.config, scheme, int8.tokenizer.encode(CALIBRATION_TEXT))
    num_blocks = max(batches) * (-(-(max(contexts) + 1) // BLOCK_SIZE)) + 8
    executors = {}
    for name, loaded in (("default", default), ("int8", int8)):
        kv = TieredKVCache(loaded.config, num_blocks, 1, BLOCK_SIZE, "cpu", loaded.model.dtype)
        executors[name] = ModelExecutor(loaded.model, loaded.config, kv, "cpu")
    print(f"{'batch':>5} {'context':>7} {'default ms':>11} {'int8 ms':>11}  default/int8")
    for context in contexts:
        for batch in batches:
            plan = decode_plan(batch, context, num_blocks, seed=batch + context)
            times: dict[str, list[float]] = {name: [] for name in executors}
            for index in range(repeats + 1):
                for name, executor in executors.items():
                    begin = time.perf_counter()
                    executor.execute(plan)
                    if index > 0:  # the first round warms up
                        times[name].append(time.perf_counter() - begin)
            ms = {name: statistics.median(times[name]) * 1e3 for name in executors}
            print(
                f"{batch:>5} {context:>7} {ms['default']:>11.2f} {ms['int8']:>11.2f}"
                f"  {ms['default'] / ms['int8']:>11.2f}x",
                flush=True,
            )


def profile(batches: list[int], context: int, num_steps: int = 5) -> None:
    """Where the eager path's time goes: torch.profiler's top ops over `num_steps` steps."""
    from torch.profiler import profile as torch_profile

    model, config, _ = load_model(None, "cpu", None)
    num_blocks = max(batches) * (-(-(context + 1) // BLOCK_SIZE)) + 8
    kv_cache = TieredKVCache(config, num_blocks, 1, BLOCK_SIZE, "cpu", model.dtype)
    executor = ModelExecutor(model, config, kv_cache, "cpu")
    for batch in batches:
        plan = decode_plan(batch, context, num_blocks, seed=batch + context)
        for _ in range(3):
            executor.execute(plan)
        with torch_profile() as prof:
            for _ in range(num_steps):
                executor.execute(plan)
        print(f"batch {batch}, context {context}: self CPU time over {num_steps} steps")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[96])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--profile", action="store_true", help="profile the eager path at the first context"
    )
    parser.add_argument("--int8", choices=SCHEMES, help="compare the default with this scheme")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.int8:
        print(f"SmolLM2-135M decode steps, default vs int8 {args.int8}, {args.threads} threads")
        measure_int8(args.batches, args.contexts, args.repeats, args.int8)
        return
    if args.profile:
        profile(args.batches, args.contexts[0])
        return
    print(f"SmolLM2-135M decode steps, default weights, {args.threads} threads; median ms")
    measure(args.batches, args.contexts, args.repeats)


if __name__ == "__main__":
    main()
