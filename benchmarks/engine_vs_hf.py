"""Our executor vs. transformers `generate` on the embedded SmolLM2-135M GGUF, same process.

Decode tokens/s at several batch sizes (greedy, and sampled at temperature 1.0) and prefill
tokens/s, ours driven directly with hand-built StepPlans (contiguous block tables), HF with
`generate` and a fixed output length.  Both models come from the same GGUF: ours with
`--weights` (auto: 4-bit packed weights, bfloat16 activations on CPU) and `--dtype`, HF
dequantized in `--hf-dtype` (its best here; float32 by default).

    .venv/bin/python benchmarks/engine_vs_hf.py            # table
    .venv/bin/python benchmarks/engine_vs_hf.py --json     # [{metric, batch, ours_tps, ...}]

`--paths` compares the default (the kernels the engine measured and chose on this machine)
against each explicit path and transformers instead: prefill of one 64- and one 256-token
prompt, decode at 1 / 8 / 32 streams, the paths interleaved A B .. B A in every round.  Run it
natively and under `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` (an AVX2-only CPU's
dispatch); the target is the default within 1.1x of the best path in every cell:

    .venv/bin/python benchmarks/engine_vs_hf.py --paths --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks.lib.rounds import count_arg, interleaved  # noqa: E402
from tokenflow.core.plan import ScheduledChunk, StepPlan  # noqa: E402
from tokenflow.core.request import SamplingParams  # noqa: E402
from tokenflow.engine import ModelExecutor  # noqa: E402
from tokenflow.engine.engine_args import SERIAL_BELOW_TOKENS  # noqa: E402
from tokenflow.model import TieredKVCache, default_model_path, load_model  # noqa: E402
from tokenflow.model.kernels import ProbeSettings  # noqa: E402

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Row:
    metric: str  # "decode" or "prefill"
    temperature: float
    batch: int
    ours_tps: float
    hf_tps: float

    @property
    def ratio(self) -> float:
        return self.ours_tps / self.hf_tps


def make_prompts(batch: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random ordinary tokens (ids past the special ones), equal lengths: no HF padding."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, vocab_size, (batch, length), generator=generator)
    return ids.tolist()


@dataclass(frozen=True)
class Timing:
    """One generation: seconds to the first token, and the duration of every later token."""

    prefill_s: float
    step_s: tuple[float, ...]


class OurRunner:
    """Drives ModelExecutor with hand-built plans; request i owns a contiguous block range."""

    def __init__(self, executor: ModelExecutor, max_len: int, temperature: float = 0.0) -> None:
        self.executor = executor
        self.blocks_per_seq = -(-max_len // BLOCK_SIZE)
        self.step = 0
        self.params = SamplingParams(max_tokens=4096, temperature=temperature)

    def _execute(self, chunks: list[ScheduledChunk]) -> list[int]:
        self.step += 1
        plan = StepPlan(
            step_index=self.step,
            chunks=tuple(chunks),
            device_to_host=(),
            host_to_device=(),
            released_request_ids=(),
        )
        result = self.executor.execute(plan)
        return [s.token_id for s in result.sampled]

    def _table(self, index: int) -> tuple[int, ...]:
        first = index * self.blocks_per_seq
        return tuple(range(first, first + self.blocks_per_seq))

    def _chunk(
        self, index: int, token_ids: tuple[int, ...], start: int, num_out: int
    ) -> ScheduledChunk:
        """Request `index`'s chunk at `start`, with its whole block table again each step (the
        executor replaces its copy); built by field name, so a changed plan type fails here."""
        return ScheduledChunk(
            request_id=f"r{index}",
            token_ids=token_ids,
            start_position=start,
            new_block_ids=self._table(index),
            block_table_start=0,
            samples_token=True,
            sampling_params=self.params,
            num_output_tokens=num_out,
        )

    def generate(self, prompts: list[list[int]], new_tokens: int) -> Timing:
        """Generate `new_tokens` per prompt, timing the prefill and every decode step."""
        stamps = [time.perf_counter()]
        last = self._execute([self._chunk(i, tuple(p), 0, 0) for i, p in enumerate(prompts)])
        stamps.append(time.perf_counter())
        for step in range(1, new_tokens):
            last = self._execute(
                [self._chunk(i, (last[i],), len(p) + step - 1, step) for i, p in enumerate(prompts)]
            )
            stamps.append(time.perf_counter())
        return _timing(stamps)


class HFRunner:
    """transformers `generate`, stamped after every token by a stopping criterion."""

    def __init__(self, model: torch.nn.Module, temperature: float = 0.0) -> None:
        self.model = model
        self.temperature = temperature

    def generate(self, prompts: list[list[int]], new_tokens: int) -> Timing:
        """Generate exactly `new_tokens` per prompt (EOS masked by min_new_tokens)."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        stamps: list[float] = []

        class Stamp(StoppingCriteria):
            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw: object):
                stamps.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        ids = torch.tensor(prompts)
        sampling: dict[str, object] = {"do_sample": False}
        if self.temperature > 0:  # plain sampling, as ours: no top-k / top-p
            sampling = {"do_sample": True, "temperature": self.temperature, "top_k": 0}
            sampling["top_p"] = 1.0
        stamps.append(time.perf_counter())
        with torch.inference_mode():
            self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                **sampling,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
                stopping_criteria=StoppingCriteriaList([Stamp()]),
            )
        return _timing(stamps)


def _timing(stamps: list[float]) -> Timing:
    steps = tuple(b - a for a, b in zip(stamps[1:], stamps[2:], strict=False))
    return Timing(stamps[1] - stamps[0], steps)


def compare(
    ours: Callable[[], Timing], hf: Callable[[], Timing], repeats: int
) -> tuple[list[Timing], list[Timing]]:
    """Ours and HF runs A B B A (after one warm-up each), so background load hits both."""
    runs = {"ours": ours, "hf": hf}
    timings: dict[str, list[Timing]] = {name: [] for name in runs}
    for name in runs:
        runs[name]()
    for _, name in interleaved(list(runs), repeats):
        timings[name].append(runs[name]())
    return timings["ours"], timings["hf"]


def decode_tps(timings: list[Timing], batch: int) -> float:
    """Tokens/s from the median decode step over all runs (robust to bursts of other load)."""
    return batch / statistics.median(s for t in timings for s in t.step_s)


def prefill_tps(timings: list[Timing], num_tokens: int) -> float:
    return num_tokens / min(t.prefill_s for t in timings)


def load_hf(dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    path = Path(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    return model.eval()


def run(args: argparse.Namespace) -> list[Row]:
    """Load both models and measure every row."""
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    model, config, _ = load_model(None, "cpu", dtype, weights=args.weights)
    max_len = max(args.decode_prompt_len + args.decode_tokens, args.prefill_len) + 1
    max_batch = max(*args.batches, args.prefill_batch)
    blocks = max_batch * -(-max_len // BLOCK_SIZE)
    kv_cache = TieredKVCache(config, blocks, 1, BLOCK_SIZE, "cpu", model.dtype)
    executor = ModelExecutor(model, config, kv_cache, "cpu")
    hf_model = load_hf(getattr(torch, args.hf_dtype))
    rows = []
    for temperature in args.temperatures:
        ours = OurRunner(executor, max_len, temperature)
        hf = HFRunner(hf_model, temperature)
        for batch in args.batches:
            prompts = make_prompts(batch, args.decode_prompt_len, config.vocab_size, seed=batch)
            steps = args.decode_tokens
            ours_t, hf_t = compare(
                lambda p=prompts, n=steps, r=ours: r.generate(p, n),
                lambda p=prompts, n=steps, r=hf: r.generate(p, n),
                args.repeats,
            )
            ours_tps, hf_tps = decode_tps(ours_t, batch), decode_tps(hf_t, batch)
            rows.append(Row("decode", temperature, batch, ours_tps, hf_tps))
            _progress(rows[-1], args)
    ours, hf = OurRunner(executor, max_len), HFRunner(hf_model)
    prompts = make_prompts(args.prefill_batch, args.prefill_len, config.vocab_size, seed=0)
    ours_t, hf_t = compare(
        lambda: ours.generate(prompts, 1), lambda: hf.generate(prompts, 1), args.prefill_repeats
    )
    num_tokens = args.prefill_batch * args.prefill_len
    rows.append(
        Row(
            "prefill",
            0.0,
            args.prefill_batch,
            prefill_tps(ours_t, num_tokens),
            prefill_tps(hf_t, num_tokens),
        )
    )
    _progress(rows[-1], args)
    return rows


def _progress(row: Row, args: argparse.Namespace) -> None:
    if not args.json:
        print(
            f"  measured {row.metric} T={row.temperature} batch {row.batch}: "
            f"{row.ours_tps:.1f} vs {row.hf_tps:.1f} tok/s",
            file=sys.stderr,
            flush=True,
        )


def print_table(rows: list[Row], args: argparse.Namespace) -> None:
    print(
        f"SmolLM2-135M (GGUF Q4_1): ours weights={args.weights} dtype={args.dtype or 'auto'}, "
        f"HF dequantized {args.hf_dtype}; {args.threads} threads; decode: "
        f"{args.decode_prompt_len}-token prompts, {args.decode_tokens} new tokens; prefill: "
        f"{args.prefill_batch} x {args.prefill_len} tokens; interleaved runs: {args.repeats} "
        f"decode (median step), {args.prefill_repeats} prefill (best run)"
    )
    print(
        f"{'metric':<8} {'temp':>4} {'batch':>5} {'ours tok/s':>11} {'HF tok/s':>10} {'ours/HF':>8}"
    )
    for row in rows:
        print(
            f"{row.metric:<8} {row.temperature:>4.1f} {row.batch:>5} {row.ours_tps:>11.1f} "
            f"{row.hf_tps:>10.1f} "
            f"{row.ratio:>7.2f}x"
        )


# name -> (dtype, weights) as `serve --dtype --weights` take them; None, "auto": the default
PATHS = {
    "default": (None, "auto"),
    "int4+bf16": ("bfloat16", "int4"),
    "dense-fp32": ("float32", "dense"),
    "dense-bf16": ("bfloat16", "dense"),
}
CELLS = (("prefill", 64), ("prefill", 256), ("decode", 1), ("decode", 8), ("decode", 32))


def build_path_runners(args: argparse.Namespace) -> tuple[dict[str, object], str]:
    """Our executor under each path (the engine's one-thread rule for small steps), and HF;
    plus the default's kernel choice in one line (probed afresh: no cache)."""
    runners: dict[str, object] = {}
    max_len = 256 + args.decode_tokens + 64 + 1
    choice = ""
    for name, (dtype, weights) in PATHS.items():
        if name not in args.path_names:
            continue
        torch_dtype = getattr(torch, dtype) if dtype else None
        probe = ProbeSettings(SERIAL_BELOW_TOKENS, use_cache=False)
        model, config, _ = load_model(None, "cpu", torch_dtype, weights, probe)
        if name == "default":
            choice = model.kernel_choice.describe()
        blocks = 32 * -(-max_len // BLOCK_SIZE)
        kv_cache = TieredKVCache(config, blocks, 1, BLOCK_SIZE, "cpu", model.dtype)
        executor = ModelExecutor(
            model, config, kv_cache, "cpu", serial_below_tokens=SERIAL_BELOW_TOKENS
        )
        runners[name] = OurRunner(executor, max_len)
    runners["transformers"] = HFRunner(load_hf(torch.float32))
    return runners, choice


def measure_cell(runners: dict[str, object], cell: tuple[str, int], args: argparse.Namespace):
    """tok/s of every runner in one cell, runs ordered A B .. B A each round."""
    metric, size = cell
    vocab = 49152
    if metric == "prefill":
        prompts, new_tokens = make_prompts(1, size, vocab, seed=size), 1
    else:
        prompts, new_tokens = make_prompts(size, 64, vocab, seed=size), args.decode_tokens
    names = list(runners)
    timings: dict[str, list[Timing]] = {name: [] for name in names}
    for name in names:  # warm-up
        runners[name].generate(prompts, min(new_tokens, 2))
    for _, name in interleaved(names, 2 * args.rounds):  # A B .. B A in every round
        timings[name].append(runners[name].generate(prompts, new_tokens))
    if metric == "prefill":
        return {n: prefill_tps(t, size) for n, t in timings.items()}
    return {n: decode_tps(t, size) for n, t in timings.items()}


def run_paths(args: argparse.Namespace) -> dict[str, object]:
    torch.set_num_threads(args.threads)
    runners, choice = build_path_runners(args)
    print(choice, file=sys.stderr, flush=True)
    cells = []
    for cell in [c for c in CELLS if f"{c[0]}:{c[1]}" in args.cells]:
        tps = measure_cell(runners, cell, args)
        cells.append({"metric": cell[0], "size": cell[1], "tok_s": tps})
        print(f"  measured {cell[0]} {cell[1]}: {tps}", file=sys.stderr, flush=True)
    return {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "kernels": choice,
        "threads": args.threads,
        "rounds": args.rounds,
        "cells": cells,
    }


def print_paths(result: dict[str, object]) -> None:
    names = list(result["cells"][0]["tok_s"])
    print(
        f"torch CPU capability {result['capability']}, {result['threads']} threads, "
        f"{result['rounds']} round(s) A B .. B A; {result['kernels']}"
    )
    header = "| cell | " + " | ".join(names) + " | default / best |"
    print(header)
    print("|" + "---|" * (len(names) + 2))
    for cell in result["cells"]:
        tps = cell["tok_s"]
        ours = {n: v for n, v in tps.items() if n != "transformers"}  # the default among them
        best = max(ours.values())
        unit = "prompt tok/s" if cell["metric"] == "prefill" else "tok/s"
        label = f"{cell['metric']} {cell['size']} ({unit})"
        values = " | ".join(f"{tps[n]:.1f}" for n in names)
        print(f"| {label} | {values} | {tps['default'] / best:.2f} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows")
    parser.add_argument("--paths", action="store_true", help="default vs each explicit path")
    parser.add_argument("--rounds", type=count_arg, default=2, help="--paths: A B .. B A rounds")
    parser.add_argument(
        "--path-names",
        type=lambda s: s.split(","),
        default=list(PATHS),
        help="--paths: which of " + ",".join(PATHS),
    )
    parser.add_argument(
        "--cells",
        type=lambda s: s.split(","),
        default=[f"{m}:{n}" for m, n in CELLS],
        help="--paths: which of " + ",".join(f"{m}:{n}" for m, n in CELLS),
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--decode-prompt-len", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--prefill-batch", type=int, default=4)
    parser.add_argument("--prefill-len", type=int, default=256)
    parser.add_argument("--repeats", type=count_arg, default=5, help="interleaved decode runs")
    parser.add_argument(
        "--prefill-repeats", type=count_arg, default=5, help="interleaved prefill runs"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--weights", default="auto", choices=["auto", "int4", "dense"])
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    parser.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16"])
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.paths:
        result = run_paths(args)
        if args.json:
            print(json.dumps(result, indent=1))
        else:
            print_paths(result)
        return
    rows = run(args)
    if args.json:
        print(json.dumps([{**asdict(r), "ratio": r.ratio} for r in rows], indent=2))
    else:
        print_table(rows, args)


if __name__ == "__main__":
    main()
