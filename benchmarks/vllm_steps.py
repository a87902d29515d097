"""The burst of `vllm_burst.py`, in-process, counted in engine steps rather than seconds.

On a shared machine the wall-clock ratios of `vllm_burst.py` drift with other jobs' load (the
same decode step took 0.05 s or 1.4 s minutes apart).  Engine steps and batch sizes barely
depend on it: this script runs the same burst (24 prompts of 32 tokens, 32 output tokens,
readers at 0.15 or 0.25 tok/s, a 17-block pool of 32 tokens) through an in-process vLLM with its
default scheduler, then with TokenFlow's (with the host KV connector unless `--no-host-kv`), and
prints per engine: steps, steps at each batch size, and the step at which the last request got
its first token.  Fewer steps for the same 768 tokens means larger batches (raw throughput);
the last first-token step is the P99 TTFT in steps.

Run with the vLLM venv and this checkout on the path:
`PYTHONPATH=. VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/vllm_steps.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler in this process
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

MODEL_DIR = Path("~/.cache/tokenflow-bench/smollm2-hf").expanduser()
SCHEDULER_CLS = "tokenflow.integrations.vllm.TokenFlowScheduler"


@dataclass(frozen=True)
class StepCount:
    """One engine's run of the burst, in steps."""

    num_steps: int
    num_steps_by_batch: dict[int, int]  # running streams after the step -> steps
    last_first_token_step: int  # the step at which the last request got its first token
    num_offloads: int
    num_recompute_pauses: int


def make_llm(args: argparse.Namespace, tokenflow: bool):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from tokenflow.integrations.vllm.serve import host_kv_transfer_config

    kwargs = dict(
        model=str(args.model_dir), dtype=args.dtype, enforce_eager=True,
        num_gpu_blocks_override=args.num_gpu_blocks, block_size=32,
        max_model_len=args.max_model_len,
        max_num_seqs=32, seed=0, kv_cache_memory_bytes=256 << 20,
    )  # fmt: skip
    if tokenflow:
        settings = json.loads(args.tokenflow_settings or "{}")
        kwargs.update(scheduler_cls=SCHEDULER_CLS, additional_config={"tokenflow": settings})
        if not args.no_host_kv:
            kwargs.update(kv_transfer_config=KVTransferConfig(**host_kv_transfer_config()))
    return LLM(**kwargs)


def run_burst(llm, args: argparse.Namespace) -> StepCount:
    """Submit the burst at once and step the engine until it drains (`timeline`: print one
    line per step: its wall time, the running and waiting counts, first tokens so far)."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    tokenizer = llm.get_tokenizer()
    story = "tell me a long story about the sea " * (args.prompt_len // 4 + 1)
    for i in range(args.num_requests):
        prompt = tokenizer.encode(f"[{i}] " + story)[: args.prompt_len]
        params = SamplingParams(
            temperature=0.0, max_tokens=args.output_len, min_tokens=args.output_len,
            ignore_eos=True, extra_args={"stream_rate": args.rates[i % len(args.rates)]},
        )  # fmt: skip
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    batches: Counter[int] = Counter()
    started: set[str] = set()
    num_steps = last_first = 0
    while engine.has_unfinished_requests():
        began = time.perf_counter()
        outputs = engine.step()
        num_steps += 1
        if args.timeline:
            print(
                f"step {num_steps:3d}: {time.perf_counter() - began:6.3f} s, running "
                f"{len(scheduler.running):2d}, waiting {len(scheduler.waiting):2d}, "
                f"started {len(started):2d}",
                flush=True,
            )
        batches[len(scheduler.running)] += 1
        for output in outputs:
            if output.request_id not in started and output.outputs[0].token_ids:
                started.add(output.request_id)
                last_first = num_steps
    bridge = getattr(scheduler, "bridge", None)
    return StepCount(
        num_steps=num_steps,
        num_steps_by_batch=dict(sorted(batches.items())),
        last_first_token_step=last_first,
        num_offloads=bridge.num_offloads if bridge else 0,
        num_recompute_pauses=bridge.num_offloads_as_recompute if bridge else 0,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--num-gpu-blocks", type=int, default=17)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.15, 0.25], help="alternate")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    parser.add_argument("--no-host-kv", action="store_true", help="ours pauses by recompute")
    parser.add_argument("--tokenflow-settings", default=None, metavar="JSON")
    parser.add_argument("--timeline", action="store_true", help="print every step")
    parser.add_argument("--only", choices=["vllm-default", "tokenflow-in-vllm"], default=None)
    args = parser.parse_args(argv)
    for name, tokenflow in (("vllm-default", False), ("tokenflow-in-vllm", True)):
        if args.only not in (None, name):
            continue
        llm = make_llm(args, tokenflow)
        count = run_burst(llm, args)
        llm.llm_engine.engine_core.shutdown()
        del llm
        print(f"{name}: {count}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
