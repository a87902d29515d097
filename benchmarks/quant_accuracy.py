"""How far each weight path's outputs drift from the dense float32 SmolLM2-135M.

For every path (dense-bf16: the dequantized weights in bfloat16; int4: the default 4-bit packed
weights with bfloat16 activations; int8-*: the fbgemm int8 schemes of int8_schemes.py on the
float32 model, int8-head-*: the default model with only its LM head in int8), against the
dense float32 model
(the GGUF dequantized, the transformers oracle of tests/engine/test_real_model.py):

- greedy agreement: how many leading greedy tokens equal the dense model's, per prompt, summed
  (one stream at a time, and all prompts decoded together as one batch, where a per-tensor
  activation scale is shared by the rows),
- the prompt's next-token logits: max |difference| (max and median over the prompts) and
  whether the top-1 token is the same.

    .venv/bin/python benchmarks/quant_accuracy.py --tokens 48
    .venv/bin/python benchmarks/quant_accuracy.py --schemes token-o64 --tokens 32
    .venv/bin/python benchmarks/quant_accuracy.py --schemes --llamacpp q4_1 q8_0   # llama.cpp paths
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from int8_schemes import CALIBRATION_TEXT, SCHEMES, convert  # noqa: E402

from tokenflow.core.plan import ScheduledChunk, StepPlan  # noqa: E402
from tokenflow.core.request import SamplingParams  # noqa: E402
from tokenflow.engine import ModelExecutor, TieredKVCache, load_model  # noqa: E402
from tokenflow.engine.attention import build_model_inputs  # noqa: E402

PROMPTS = (
    "The capital of France is Paris. The capital of Germany is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain why the sky is blue in two sentences.",
    "List three fruits:",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Q: How many legs does a spider have?\nA:",
    "import json\n\ndef load_config(path):",
    "To make a cup of tea, first",
)
BLOCK_SIZE = 16
GREEDY = SamplingParams(max_tokens=4096, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class LlamaCppPath:
    """llama.cpp on the GGUF as shipped (Q4_1) or rewritten as Q8_0 (--executor llama-cpp)."""

    executor: object  # a LlamaCppExecutor (llama-cpp-python is optional: imported on use)

    @classmethod
    def load(cls, weights: str, threads: int) -> LlamaCppPath:
        from tokenflow.engine.loader import read_gguf_header
        from tokenflow.integrations.llamacpp.context import ContextSpec
        from tokenflow.integrations.llamacpp.executor import LlamaCppExecutor
        from tokenflow.integrations.llamacpp.requant import as_q8_0

        path, config, _ = read_gguf_header(None)
        path = as_q8_0(path) if weights == "q8_0" else path
        spec = ContextSpec(4096, 2048, 16, threads)
        return cls(LlamaCppExecutor(path, spec, config.eos_token_ids))


@dataclass(frozen=True)
class PathAccuracy:
    """One path against the dense float32 model over all prompts."""

    agree_single_tokens: int  # leading greedy tokens equal to dense, summed over prompts
    agree_batched_tokens: int  # the same with all prompts decoded as one batch
    max_logit_diff: float  # max over prompts of max |logits - dense logits| (next token)
    median_logit_diff: float
    top1_same: int  # prompts whose next-token argmax equals dense's


def greedy(loaded, prompts: Sequence[Sequence[int]], num_new: int) -> list[list[int]]:
    """Greedy tokens of every prompt, decoded together as one batch."""
    if isinstance(loaded, LlamaCppPath):
        return greedy_on(loaded.executor, prompts, num_new, [()] * len(prompts))
    model, config = loaded.model, loaded.config
    blocks_per_seq = -(-(max(map(len, prompts)) + num_new + 1) // BLOCK_SIZE)
    kv = TieredKVCache(config, blocks_per_seq * len(prompts), 1, BLOCK_SIZE, "cpu", model.dtype)
    executor = ModelExecutor(model, config, kv, "cpu")
    tables = [
        tuple(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(len(prompts))
    ]
    return greedy_on(executor, prompts, num_new, tables)


def greedy_on(executor, prompts, num_new: int, tables) -> list[list[int]]:
    """Greedy tokens of every prompt through `executor` (released afterwards)."""
    outputs: list[list[int]] = [[] for _ in prompts]
    for step in range(num_new):
        chunks = []
        for i, prompt in enumerate(prompts):
            if step == 0:
                chunks.append(
                    ScheduledChunk(f"{i}", tuple(prompt), 0, tables[i], 0, True, GREEDY, 0)
                )
            else:
                position = len(prompt) + step - 1
                token = (outputs[i][-1],)
                chunks.append(
                    ScheduledChunk(f"{i}", token, position, tables[i], 0, True, GREEDY, step)
                )
        for sampled in executor.execute(StepPlan(step, tuple(chunks), (), (), ())).sampled:
            outputs[int(sampled.request_id)].append(sampled.token_id)
    released = tuple(str(i) for i in range(len(prompts)))
    executor.execute(StepPlan(num_new, (), (), (), released))
    return outputs


def next_logits(loaded, prompt: Sequence[int]) -> torch.Tensor:
    """float32 logits [vocab] of the token after `prompt`."""
    if isinstance(loaded, LlamaCppPath):
        context = loaded.executor.context
        n = len(prompt)
        logits = context.decode(list(prompt), list(range(n)), [0] * n, [False] * (n - 1) + [True])
        context.truncate(0, 0)
        return torch.from_numpy(logits[0])
    model, config = loaded.model, loaded.config
    num_blocks = -(-(len(prompt) + 1) // BLOCK_SIZE)
    kv = TieredKVCache(config, num_blocks, 1, BLOCK_SIZE, "cpu", model.dtype)
    chunk = ScheduledChunk("0", tuple(prompt), 0, tuple(range(num_blocks)), 0, True, GREEDY, 0)
    inputs = build_model_inputs([chunk], {"0": chunk.new_block_ids}, BLOCK_SIZE, kv.device)
    with torch.inference_mode():
        logits = model(inputs.input_ids, inputs.positions, inputs.attn, kv.device_layers)
    return logits[0].float()


def leading_agreement(tokens: Sequence[int], reference: Sequence[int]) -> int:
    """How many leading tokens are equal."""
    count = 0
    for token, expected in zip(tokens, reference, strict=True):
        if token != expected:
            break
        count += 1
    return count


def evaluate(loaded, prompts, reference_single, reference_batched, reference_logits, num_new):
    """PathAccuracy of `loaded` against the dense model's references."""
    single = [greedy(loaded, [p], num_new)[0] for p in prompts]
    batched = greedy(loaded, prompts, num_new)
    diffs = []
    top1 = 0
    for prompt, expected in zip(prompts, reference_logits, strict=True):
        logits = next_logits(loaded, prompt)
        diffs.append((logits - expected).abs().max().item())
        top1 += int(logits.argmax() == expected.argmax())
    return PathAccuracy(
        sum(map(leading_agreement, single, reference_single)),
        sum(map(leading_agreement, batched, reference_batched)),
        max(diffs),
        statistics.median(diffs),
        top1,
    )


def load_path(path: str, threads: int, calibration_ids: list[int]):
    """The model of one path of the table: a baseline, llama.cpp, or an int8 conversion."""
    if path == "dense-bf16":
        return load_model(None, "cpu", torch.bfloat16, weights="dense")
    if path == "int4":
        return load_model(None, "cpu", None, weights="int4")  # the default: bf16
    if path.startswith("llamacpp-"):
        return LlamaCppPath.load(path.removeprefix("llamacpp-"), threads)
    if path.startswith("int8-head-"):  # the default model with an int8 LM head
        loaded = load_model(None, "cpu", None, weights="int4")
    else:
        loaded = load_model(None, "cpu", torch.float32, weights="dense")
    convert(loaded.model, loaded.config, path.removeprefix("int8-"), calibration_ids)
    return loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--schemes", nargs="*", default=list(SCHEMES), choices=SCHEMES)
    parser.add_argument("--no-baselines", action="store_true", help="skip dense-bf16 and int4")
    parser.add_argument(
        "--llamacpp",
        nargs="*",
        default=[],
        choices=["q4_1", "q8_0"],
        help="also llama.cpp on the GGUF as shipped (q4_1) or rewritten as Q8_0",
    )
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dense = load_model(None, "cpu", torch.float32, weights="dense")
    prompts = [dense.tokenizer.encode(text) for text in PROMPTS]
    ref_single = [greedy(dense, [p], args.tokens)[0] for p in prompts]
    ref_batched = greedy(dense, prompts, args.tokens)
    ref_logits = [next_logits(dense, p) for p in prompts]
    calibration_ids = dense.tokenizer.encode(CALIBRATION_TEXT)
    total = args.tokens * len(prompts)
    print(f"{len(prompts)} prompts x {args.tokens} greedy tokens vs the dense float32 model")
    print(
        f"{'path':>16} {'agree 1-stream':>15} {'agree batched':>14} {'max|dlogit|':>12}"
        f" {'median':>7} {'top1':>5} {'s':>5}"
    )
    baselines = [] if args.no_baselines else ["dense-bf16", "int4"]
    paths = [*baselines, *[f"int8-{scheme}" for scheme in args.schemes]]
    paths += [f"llamacpp-{weights}" for weights in args.llamacpp]
    for path in paths:
        start = time.perf_counter()
        loaded = load_path(path, args.threads, calibration_ids)
        acc = evaluate(loaded, prompts, ref_single, ref_batched, ref_logits, args.tokens)
        print(
            f"{path:>16} {acc.agree_single_tokens:>8}/{total:<6} {acc.agree_batched_tokens:>7}/"
            f"{total:<6} {acc.max_logit_diff:>12.3f} {acc.median_logit_diff:>7.3f}"
            f" {acc.top1_same:>2}/{len(prompts):<2} {time.perf_counter() - start:>5.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
